"""Experiment (copy to the repo root for a device call): where a cold EAGLE-3 engine's first
`generate` spends the time no-spec's does not. Run once per variant in a fresh process with an
empty TRITON_CACHE_DIR:  python3 cold_profile.py MODEL none|eagle3 [concurrency]"""

import cProfile
import io
import pstats
import sys
import time

import torch

from bench.common import held_out_messages
from engine import Engine, SamplingParams
from engine.config import SpecConfig

model, variant = sys.argv[1], sys.argv[2]
c = int(sys.argv[3]) if len(sys.argv) > 3 else 1
eng = Engine.from_pretrained(model, device="cuda", dtype=torch.bfloat16, num_blocks=8192,
                             enable_prefix_caching=False,
                             spec=SpecConfig() if variant == "eagle3" else None)
batch = [eng.encode_prompt(m) for m in held_out_messages(c)]
params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
torch.cuda.synchronize()
prof = cProfile.Profile()
t = time.perf_counter()
prof.enable()
eng.generate(batch, params)
torch.cuda.synchronize()
prof.disable()
wall = time.perf_counter() - t
print(f"{variant} c={c}: first pass {wall:.3f} s, ready {eng.ready}")
for key in ("cumulative", "tottime"):
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats(key).print_stats(35)
    print(s.getvalue()[-9000:])
