# 47: deterministic attention's tile (rows, keys per step, warps) and split size. Do a row's bits
# depend on BLOCK_M / warps (if not, a launch may pick its tile)? What does each cost against the
# default mode at a 64-sequence decode (contexts 300..2300), a lone decode and a verify of 8?
# SmolLM2's attention shape (9 heads, 3 KV heads, dim 64, pages of 16, tables 512 pages wide).
# usage: python3 .gj/attn_tiles.py OUT   (DEV=cpu + TRITON_INTERPRET=1 with SMALL=1: a CPU check)
import json, os, sys, time
sys.path.insert(0, os.getcwd())
import torch
from engine.attention import TritonAttention
from engine.attention import triton_backend as tb
from engine.attention.base import AttentionMetadata
out = sys.argv[1]; os.makedirs(out, exist_ok=True)
DEV = os.environ.get("DEV", "cuda")
SMALL = bool(os.environ.get("SMALL"))
H, KVH, D, BS = 9, 3, 64, 16
WIDTH = 32 if SMALL else 512  # pages per block table (the engine's max_blocks_per_seq)
NSEQ = 4 if SMALL else 64
DT = torch.float16 if SMALL else torch.bfloat16
g = torch.Generator().manual_seed(0)
ctxs = [round((40 if SMALL else 300) + i * ((300 if SMALL else 2300) - (40 if SMALL else 300)) / max(1, NSEQ - 1))
        for i in range(NSEQ)]
nblocks = sum(-(-c // BS) + 2 for c in ctxs) + 8
cache = torch.randn(2, nblocks, BS, KVH, D, generator=g).to(DT).to(DEV)
perm = torch.randperm(nblocks, generator=g).tolist()
tables = []
for c in ctxs:
    tables.append([perm.pop() for _ in range(-(-(c + 8) // BS))])


def meta(seqs):
    """seqs: (index, context, queries) per sequence."""
    starts, lens, tabs = [0], [], []
    for i, c, q in seqs:
        starts.append(starts[-1] + q); lens.append(c); tabs.append(tables[i] + [0] * (WIDTH - len(tables[i])))
    t = lambda x, dt: torch.tensor(x, dtype=dt, device=DEV)
    return AttentionMetadata(slot_mapping=t([0] * starts[-1], torch.int64),
                             query_start=t(starts, torch.int32), seq_lens=t(lens, torch.int32),
                             block_tables=t(tabs, torch.int32), max_query_len=max(q for _, _, q in seqs),
                             max_seq_len=max(lens), query_start_cpu=starts, seq_lens_cpu=lens)


CASES = {"decode64": [(i, c, 1) for i, c in enumerate(ctxs)],
         "decode1_long": [(NSEQ - 1, ctxs[-1], 1)],
         "decode1_short": [(0, ctxs[0], 1)],
         "verify8x8": [(i, ctxs[i] + 7, 8) for i in range(0, NSEQ, max(1, NSEQ // 8))][:8],
         "mixed": [(i, ctxs[i], 1) for i in range(NSEQ - 1)] + [(NSEQ - 1, ctxs[-1], 96 if not SMALL else 24)]}
QB = [torch.randn(c + 8, H, D, generator=g).to(DT).to(DEV) for c in ctxs]  # a query per position
Q = {k: torch.cat([QB[i][c - q: c] for i, c, q in v]) for k, v in CASES.items()}
M = {k: meta(v) for k, v in CASES.items()}
# the rows of a case, by (sequence, position), to compare across cases
ROWKEYS = {k: [(i, c - q + j) for i, c, q in v for j in range(q)] for k, v in CASES.items()}
TILES = [(64, 64, 8), (32, 64, 4), (16, 64, 4), (32, 64, 8), (64, 64, 4), (16, 64, 2), (64, 32, 8), (32, 32, 4)]
SPLITS = [None, 256, 512] if not SMALL else [None, 128]
if SMALL:
    TILES = TILES[:4]


def run(be, case):
    return be.attend(Q[case], cache, M[case])


def timed(be, case, reps=20, layers=30):
    if DEV != "cuda":
        return None
    for _ in range(2):
        run(be, case)
    torch.cuda.synchronize()
    gr = torch.cuda.CUDAGraph()
    with torch.cuda.graph(gr):
        for _ in range(layers):
            run(be, case)
    gr.replay(); torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        gr.replay()
    torch.cuda.synchronize()
    return round((time.perf_counter() - t0) / reps / layers * 1e6, 2)


res = {"gpu": torch.cuda.get_device_name() if DEV == "cuda" else "cpu", "date": time.ctime(),
       "ctxs": ctxs, "results": {}}
default = TritonAttention(H, KVH, D, BS)
res["results"]["default"] = {c: timed(default, c) for c in CASES}
print("default", res["results"]["default"], flush=True)
orig = tb.DETERMINISTIC_TILE
ref = None
for split in SPLITS:
    for tile in TILES:
        tb.DETERMINISTIC_TILE = tile
        be = TritonAttention(H, KVH, D, BS, split_keys=split, deterministic=True)
        name = f"split{split or tb.DETERMINISTIC_SPLIT_KEYS}_tile{'_'.join(map(str, tile))}"
        try:
            outs = {c: run(be, c) for c in CASES}
            rows = {c: dict(zip(ROWKEYS[c], outs[c])) for c in CASES}
            # within this config: every row equal wherever it is computed
            same = all(torch.equal(rows[c][k], rows["decode64"][k]) for c in CASES for k in rows[c] if k in rows["decode64"])
            same_v = all(torch.equal(rows["verify8x8"][k], rows["mixed"][k]) for k in rows["verify8x8"] if k in rows["mixed"])
            r = {"rows_invariant": same, "verify_vs_mixed": same_v}
            if split is None and ref is None:
                ref = outs
            if split is None:  # the bits against the shipped tile's, case by case
                r["equals_shipped_tile"] = {c: torch.equal(outs[c], ref[c]) for c in CASES}
            r["us_per_layer"] = {c: timed(be, c) for c in CASES}
        except Exception as e:  # noqa: BLE001
            r = f"failed {type(e).__name__}: {str(e)[:200]}"
        res["results"][name] = r
        print(name, r, flush=True)
        json.dump(res, open(os.path.join(out, "attn_tiles.json"), "w"), indent=1)
tb.DETERMINISTIC_TILE = orig
