# 47: where the deterministic mode loses at 64 streams (and 1). Random SmolLM2-shaped bf16 weights
# (no staging), figure 6's cost shape: prompts 64..2048 tokens, 256 greedy tokens, ignore_eos.
# Per mode: tok/s of one stream (4 prompts) and a burst of 64, prefill-only time (max_tokens=1),
# and the kernel table of one profiled burst (and of its prefill alone).
# usage: python3 bench/experiments/det64.py OUT   [env TOKENS=256 STREAMS=64 MAXLEN=2048 SPEC=0]
# MODES "name:det:SETTING=value,,SETTING=value;...": settings of engine.ops.invariant, plus
# layer_tiles=glu_whole() (whole-K gate_up) and invariant_linear=gemv_for('qkv', ...) (those
# projections on the default's GEMV tiles at <= 16 rows: where the one-stream gap goes).
# invariant_linear=tiles_for(qkv=(16, 16, 1024, 4), gate_up="gemv", ...): other tiles per kind.
# The one-stream attribution still to run (an H100, ~3 min):
#   STREAMS=4 MAXLEN=512 TOKENS=128 MODES="default:0:;det:1:;det_qkv:1:invariant_linear=gemv_for('qkv');
#   det_o:1:invariant_linear=gemv_for('o');det_gu:1:invariant_linear=gemv_for('gate_up');
#   det_down:1:invariant_linear=gemv_for('down');det_all:1:invariant_linear=gemv_for('qkv','o','gate_up','down')"
# then, for the kinds that carry the gap, tile sweeps in place (tiles_for), each candidate's
# bits checked after by tests/engine/test_invariant_row_tiles.py-style GPU cases.
import argparse, json, os, sys, time
sys.path.insert(0, os.getcwd())
import bench.suite as S
import bench.common as C
from engine.testing import llama8b_shape, smol_shape
out = sys.argv[1]; os.makedirs(out, exist_ok=True)
p = argparse.ArgumentParser(); S.add_arguments(p)
args = p.parse_args([])
args.device, args.dtype = os.environ.get("DEV", "cuda"), os.environ.get("DT", "bfloat16")
import torch
from torch.profiler import ProfilerActivity, profile
from engine import SamplingParams
N, MANY = int(os.environ.get("TOKENS", 256)), int(os.environ.get("STREAMS", 64))
g = torch.Generator().manual_seed(7)
lens = [round(64 + i * (int(os.environ.get("MAXLEN", 2048)) - 64) / (MANY - 1)) for i in range(MANY)]
prompts = [torch.randint(100, 49000, (n,), generator=g).tolist() for n in lens]
ones = [prompts[i] for i in (0, MANY // 3, 2 * MANY // 3, MANY - 1)]
SHAPE = os.environ.get('SHAPE', 'smol')  # or llama8b
base = C.random_engine(args, llama8b_shape() if SHAPE == 'llama8b' else smol_shape(), num_blocks=16)
res = {"shape": SHAPE, "gpu": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "date": time.ctime(), "tokens": N, "streams": MANY,
       "prompt_lens": lens, "modes": {}}


def sync():
    if args.device == "cuda":
        torch.cuda.synchronize()


def kernels(fn):
    cuda = args.device == "cuda"
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        fn(); sync()
    attr = "self_device_time_total" if cuda else "self_cpu_time_total"
    ks = [(e.key[:90], e.count, round(getattr(e, attr), 1)) for e in prof.key_averages()
          if getattr(e, attr, 0) > 0]
    ks.sort(key=lambda x: -x[2])
    return {"gpu_us": round(sum(k[2] for k in ks), 1), "kernels": ks[:25]}


def timed(fn, reps=2):
    ts = []
    for _ in range(reps):
        sync(); t0 = time.perf_counter(); fn(); sync(); ts.append(time.perf_counter() - t0)
    return min(ts)


from engine.ops import invariant
# MODES: "name:det:SETTING=value,SETTING=value;..." (settings of engine.ops.invariant)
MODES = os.environ.get("MODES", "default:0:;deterministic:1:")
saved = {k: getattr(invariant, k) for k in dir(invariant) if k.isupper()}
from engine.ops import gemv as _gemv
from engine.attention import triton_backend as _tb
MODS = {"gemv": _gemv, "tb": _tb}
saved_mods = {(m, k): getattr(mod, k) for m, mod in MODS.items() for k in dir(mod) if k.isupper()}
ORIG_LT = invariant.layer_tiles
from engine import ops
from engine.ops import prologue
ORIG_IL = ops.invariant_linear
KINDS = {(960, 576): "qkv", (576, 576): "o", (3072, 576): "gate_up", (576, 1536): "down"}


HITS = {}


def tiles_for(**kinds):
    """invariant_linear with these projection kinds (qkv, o, gate_up, down) at <= 16 rows on
    other tiles: "gemv" the default's (`linear_tiles`), or (BLOCK_M, BLOCK_N, BLOCK_K, warps).
    Timing only: a row's bits may then depend on the row count."""
    def il(x, weight, bias=None, *, norm_weight=None, eps=0.0, residual=None, silu=False,
           glu=False, head=False):
        n, k = weight.shape
        kind = KINDS.get((n, k))
        if x.shape[0] <= 16 and kind in kinds and not silu:
            HITS[kind] = HITS.get(kind, 0) + 1
            t = kinds[kind]
            tiles = prologue.linear_tiles(x.shape[0], n // 2 if glu else n, k) \
                if t == "gemv" else t
            return ops.prologue_linear(x, weight, bias, norm_weight=norm_weight, eps=eps,
                                       residual=residual, glu=glu, tiles=tiles)
        return ORIG_IL(x, weight, bias, norm_weight=norm_weight, eps=eps, residual=residual,
                       silu=silu, glu=glu, head=head)
    return il


def gemv_for(*kinds):  # those projections on the default's GEMV tiles at <= 16 rows
    return tiles_for(**{k: "gemv" for k in kinds})


def glu_whole(bn=16, warps=8):  # gate_up at rows below PREFILL_ROWS: whole K in one tile
    def lt(n, k, glu=False):
        if glu and k <= invariant.WHOLE_K:
            return bn, invariant.next_pow2(k, 16), warps
        return ORIG_LT(n, k, glu)
    return lt
for spec in MODES.split(";"):
    name, det, sets = spec.split(":", 2)
    det = det == "1"
    for k, v in saved.items():
        setattr(invariant, k, v)
    invariant.layer_tiles = ORIG_LT
    ops.invariant_linear = ORIG_IL
    invariant._tiles_at.cache_clear()
    for (m_, k_), v_ in saved_mods.items():
        setattr(MODS[m_], k_, v_)
    for item in filter(None, sets.split(",,")):
        k, v = item.split("=", 1)
        if "." in k:
            m_, k_ = k.split("."); setattr(MODS[m_], k_, eval(v)); continue
        setattr(ops if k == "invariant_linear" else invariant, k, eval(v))
    t0 = time.perf_counter()
    eng = C.variant(base, None, det, num_blocks=sum(-(-(n + N + 8) // 16) for n in lens) + 64)
    note = C.precapture(eng, (1, MANY))
    r = {"gemv_hits": dict(HITS), "settings": sets, "ready_s": round(time.perf_counter() - t0, 1), "precapture": note}
    sp, sp1 = (SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (N, 1))
    one = lambda s: [eng.generate([q], s) for q in ones]
    burst = lambda s: eng.generate(prompts, s)
    o1 = [c[0].token_ids for c in one(sp)]; ob = burst(sp)  # compiles outside the timing
    ib = [ob[i].token_ids for i in (0, MANY // 3, 2 * MANY // 3, MANY - 1)]
    r["one_vs_burst_identical"] = sum(a == b for a, b in zip(o1, ib))
    r["tokens_hash"] = hash(tuple(map(tuple, ib))) % 10**8
    r["one_s"], r["one_prefill_s"] = timed(lambda: one(sp)), timed(lambda: one(sp1))
    r["burst_s"], r["burst_prefill_s"] = timed(lambda: burst(sp)), timed(lambda: burst(sp1))
    r["one_tok_s"] = round(len(ones) * N / r["one_s"], 1)
    r["burst_tok_s"] = round(MANY * N / r["burst_s"], 1)
    r["burst_decode_ms_per_step"] = round((r["burst_s"] - r["burst_prefill_s"]) / (N - 1) * 1e3, 3)
    r["one_decode_ms_per_token"] = round((r["one_s"] - r["one_prefill_s"]) / (len(ones) * (N - 1)) * 1e3, 4)
    r["burst_kernels"] = kernels(lambda: burst(sp))
    r["burst_prefill_kernels"] = kernels(lambda: burst(sp1))
    r["one_kernels"] = kernels(lambda: one(sp))
    if int(os.environ.get("SPEC", 0)):  # EAGLE-3 (shipped head) at fixed K: verify rows' cost
        from engine.config import SpecConfig
        eng = None; C.free_memory()
        eng = C.variant(base, None, det, spec=SpecConfig(num_tokens=int(os.environ["SPEC"]), dynamic=False,
                        context_drafts=False), num_blocks=sum(-(-(n + N + 16) // 16) for n in lens) + 64)
        r["spec_precapture"] = C.precapture(eng, (1, MANY))
        one(sp); burst(sp)
        r["spec_one_s"], r["spec_burst_s"] = timed(lambda: one(sp)), timed(lambda: burst(sp))
        r["spec_one_tok_s"] = round(len(ones) * N / r["spec_one_s"], 1)
        r["spec_burst_tok_s"] = round(MANY * N / r["spec_burst_s"], 1)
        r["spec_burst_kernels"] = kernels(lambda: burst(sp))
        r["spec_one_kernels"] = kernels(lambda: one(sp))
    res["modes"][name] = r
    print(name, {k: v for k, v in r.items() if "kernels" not in k}, flush=True)
    print(" burst top", r["burst_kernels"]["gpu_us"], r["burst_kernels"]["kernels"][:8], flush=True)
    print(" prefill top", r["burst_prefill_kernels"]["gpu_us"], r["burst_prefill_kernels"]["kernels"][:6], flush=True)
    json.dump(res, open(os.path.join(out, "det64.json"), "w"), indent=1)
    eng = None; C.free_memory()
f = res["modes"].get("default")
for name, d in res["modes"].items():
    if f and name != "default":
        res.setdefault("over_default", {})[name] = {k: round(f[k] / d[k], 3) for k in ("one_s", "burst_s", "one_prefill_s", "burst_prefill_s", "spec_one_s", "spec_burst_s") if k in d and k in f}
        print(name, "over default (speed)", res["over_default"][name], flush=True)
json.dump(res, open(os.path.join(out, "det64.json"), "w"), indent=1)
