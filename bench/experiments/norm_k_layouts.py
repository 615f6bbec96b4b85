"""47: with NORM_K=128, the layout along K of the norm's row-sum reduce in
`_prologue_linear_kernel`, compiled offline for sm_90 (Triton on the CPU, no GPU): for SmolLM2's
qkv and gate_up and Qwen2.5-1.5B's qkv, per candidate tile, the reduce operand's blocked layout
and the shared memory the kernel takes. Writes JSON to argv[1]."""

import json
import re
import sys
import time

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from engine.ops import prologue

KERNEL = prologue._prologue_linear_kernel
NAMES = KERNEL.arg_names
PTRS = {"X", "R", "NW", "W", "B", "Y", "RES_OUT", "KEYS", "WS", "CNT"}
TYPES = {"KEYS": "*i64", "WS": "*fp32", "CNT": "*i32"}
CANDIDATES = [(16, 32, 1024, 4), (16, 32, 1024, 8), (16, 32, 128, 4), (16, 32, 128, 8),
              (16, 32, 256, 4), (16, 16, 512, 8), (32, 128, 1024, 8), (64, 64, 64, 4),
              (64, 64, 64, 8), (128, 64, 64, 8), (64, 128, 64, 8), (128, 64, 128, 8),
              (32, 128, 128, 8)]
SHAPES = {"qkv": (960, 576, False), "gate_up": (1536, 576, True),
          "qwen_qkv": (2048, 1536, False)}


def compile_one(n, k, glu, bm, bn, bk, warps, norm_k=128):
    sig = {a: TYPES.get(a, "*bf16") for a in NAMES if a in PTRS}
    sig.update({a: "i32" for a in ("M", "stride_x", "stride_r", "stride_w", "stride_y")})
    sig["eps"] = "fp32"
    consts = dict(N=n, K=k, PRO=1, HAS_RES=True, HAS_BIAS=False, BLOCK_M=bm, BLOCK_N=bn,
                  BLOCK_K=bk, PREC="tf32", ONE_LOAD=k <= bk and not norm_k, ARGMAX=False,
                  USE_PDL=True, GLU=glu, SPLITS=1, SPLIT_K=0, NORM_K=norm_k)
    sig.update({c: "constexpr" for c in consts})
    sig = {a: sig[a] for a in NAMES}
    attrs = {(NAMES.index(a),): [["tt.divisibility", 16]] for a in NAMES
             if a in PTRS or a.startswith("stride")}
    src = ASTSource(fn=KERNEL, signature=sig, attrs=attrs,
                    constexprs={(NAMES.index(c),): v for c, v in consts.items()})
    cc = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps))
    ttgir = cc.asm["ttgir"]
    layouts = dict(re.findall(r"^(#\w+) = (#ttg\.blocked<\{[^}]*\}>)", ttgir, re.M))
    reduces = []
    for operand in re.findall(r'"tt.reduce"\((%[\w#]+)\).*axis = 1', ttgir):
        typed = re.search(rf"\s{re.escape(operand)} = .*: tensor<([^>]*), (#\w+)>", ttgir)
        if typed:
            reduces.append((typed.group(1), layouts.get(typed.group(2), typed.group(2))))
    return {"shared": cc.metadata.shared, "reduces": reduces}


out = {"command": "python bench/experiments/norm_k_layouts.py " + " ".join(sys.argv[1:]),
       "date": time.ctime(), "triton": triton.__version__, "target": "cuda sm_90",
       "tiles": {}}
for name, (n, k, glu) in SHAPES.items():
    for tiles in CANDIDATES:
        key = f"{name} {tiles}"
        try:
            out["tiles"][key] = compile_one(n, k, glu, *tiles)
        except Exception as e:  # noqa: BLE001 - a tile Triton cannot build is a result
            out["tiles"][key] = {"error": repr(e)[:150]}
        print(key, out["tiles"][key], flush=True)
json.dump(out, open(sys.argv[1], "w"), indent=1)
