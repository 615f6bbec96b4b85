"""Registers and spills of the prologue GEMV (`ops._prologue_linear_kernel`) as ptxas builds
it for a GPU architecture, without a GPU: each SmolLM2 projection's variant with the engine's
own tiles (`ops.prologue_tiles`), with and without the dead-row check (`live`), compiled by the
installed Triton for `cuda:<arch>` with 16-byte-divisible pointers and strides (what the
launches specialize on) and read back with the wheel's `cuobjdump -res-usage`.

    python -m bench.kernel_regs [--arch 90] [--out FILE]

A GEMV program's registers decide how many programs an SM holds (65536 / (registers x 128
threads) at 4 warps): 96 registers hold five, 153 three. At 8 verify rows the gate_up GEMV
runs 1536 programs, so that is the difference between three waves and four
(bench/results/profile/live_rows_c05e680/). ptxas's allocation depends on the Triton version:
the H200 machine runs Triton 3.6, whose counts a side install reproduces
(`pip install --no-deps --target DIR triton==3.6.0`, then `PYTHONPATH=DIR`, this machine's
torch kept); Triton 3.9 allocates differently (the o projection: 80 against 158).
Writes JSON with the command, Triton version and date when --out is given."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SMOL = {"qkv": (960, 576, "norm"), "o": (576, 576, "plain"),
        "gate_up": (3072, 576, "norm"), "down": (576, 1536, "silu")}
POINTERS = ("X", "R", "NW", "W", "B", "Y", "RES_OUT", "LIVE")
INTS = ("M", "stride_x", "stride_r", "stride_w", "stride_y")


def _cuobjdump() -> str:
    import triton

    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                        "cuobjdump")
    if not os.path.exists(path):
        raise RuntimeError(f"no cuobjdump in this Triton wheel ({path})")
    return path


def resources(cubin: bytes) -> dict:
    """{'registers', 'stack', 'shared'} of a cubin's one kernel (`cuobjdump -res-usage`)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
        name = f.name
    try:
        out = subprocess.run([_cuobjdump(), "-res-usage", name], capture_output=True,
                             text=True, check=True).stdout
    finally:
        os.unlink(name)
    got = {key: re.search(rf"{tag}:(\d+)", out) for key, tag in
           (("registers", "REG"), ("stack", "STACK"), ("shared", "SHARED"))}
    if got["registers"] is None:
        raise RuntimeError(f"cuobjdump reported no registers:\n{out}")
    return {k: int(m.group(1)) if m else 0 for k, m in got.items()}


def compile_variant(n: int, k: int, prologue: str, live: bool, arch: int = 90,
                    rows: int = 1) -> dict:
    """Compile the prologue GEMV for one [n, k] weight as `ops.prologue_linear` launches it
    at `rows` rows (bf16, PDL on), for cuda:arch; its resources and tiles."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from engine import ops

    kern = ops._prologue_linear_kernel
    if not hasattr(kern, "arg_names"):
        raise RuntimeError("the kernel is interpreted here (TRITON_INTERPRET=1): unset it")
    bm, bn, bk, warps, k_main, tail = ops.prologue_tiles(rows, n, k)
    pro = {"plain": 0, "norm": 1, "silu": 2}[prologue]
    consts = dict(N=n, K=k, PRO=pro, HAS_RES=pro == 1, HAS_BIAS=False,
                  HAS_LIVE=live and bm == 1, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, PREC="tf32",
                  ROWS_FIRST=ops.ROWS_FIRST, USE_PDL=True, ASM_EXIT=True, K_MAIN=k_main,
                  TAIL=tail, ONE_LOAD=ops.ONE_LOAD and pro == 1 and not k_main and k <= bk,
                  ARGMAX=False)
    sig = {name: "*bf16" for name in POINTERS}
    sig["LIVE"] = sig["KEYS"] = "*i64"
    sig.update({name: "i32" for name in INTS}, eps="fp32")
    sig.update({name: "constexpr" for name in consts})
    index = kern.arg_names.index
    attrs = {(index(a),): [["tt.divisibility", 16]] for a in POINTERS + INTS if a != "M"}
    src = ASTSource(fn=kern, signature=sig, attrs=attrs,
                    constexprs={(index(a),): v for a, v in consts.items()})
    compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32),
                              options={"num_warps": warps})
    res = resources(compiled.asm["cubin"])
    per_sm = 65536 // max(1, res["registers"] * 32 * warps)
    return {"tiles": [bm, bn, bk, warps], "k_main": k_main, "tail": tail, "live": live, **res,
            "programs_per_sm_by_registers": per_sm}


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 90 (H200)")
    p.add_argument("--projections", default=",".join(SMOL))
    p.add_argument("--exact-k", nargs="?", const="on", default="",
                   help="K as power-of-two tiles plus a tail tile (engine.ops.EXACT_K); "
                        "'match': with warps = BLOCK_K / 256 where K is split")
    p.add_argument("--out", default="")
    args = p.parse_args(argv)
    import triton

    from bench.common import save_json
    from engine import ops

    ops.EXACT_K = {"": False, "on": True, "match": "match"}[args.exact_k]

    rows = []
    for name in args.projections.split(","):
        n, k, prologue = SMOL[name]
        for live in (False, True):
            r = {"projection": name, "n": n, "k": k, "prologue": prologue,
                 **compile_variant(n, k, prologue, live, args.arch)}
            rows.append(r)
            print(f"[kernel_regs] {name:8s} live={live!s:5s} tiles {r['tiles']} "
                  f"tail {r['tail']}: "
                  f"{r['registers']} registers, {r['stack']} B stack, "
                  f"{r['programs_per_sm_by_registers']} programs an SM", flush=True)
    if args.out:
        save_json(args.out, {"command": " ".join(["python", "-m", "bench.kernel_regs"]
                                                 + (argv if argv is not None else sys.argv[1:])),
                             "triton": triton.__version__, "arch": args.arch,
                             "exact_k": ops.EXACT_K,
                             "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "kernels": rows})
    return rows


if __name__ == "__main__":
    main()
