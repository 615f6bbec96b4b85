"""Experiment (not kept): where a single-stream speculative step's time goes on the GPU.

For one stream, after a real generate at a short and a long context: GPU microseconds per
replay of the plain decode graph (no-spec engine), the fused EAGLE-3 step graph at each draft
level and verify width, the runner's verify graphs and the head's chain graphs; beside them
the wall time per step of the same generate (host included). JSON to $OUT/spec_step.json."""

import json
import os
import sys
import time

import torch

from bench.common import held_out_messages
from engine import Engine, SamplingParams
from engine.config import SpecConfig
from engine.graphs import replay_us


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(eng, prompt, n):
    p = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    eng.generate([prompt], p)  # the same request once before: every graph of it captured
    sync()
    steps0 = eng.stats.steps
    t = time.perf_counter()
    eng.generate([prompt], p)
    sync()
    wall = time.perf_counter() - t
    return {"wall_ms": round(wall * 1e3, 3), "steps": eng.stats.steps - steps0,
            "ms_per_step": round(wall * 1e3 / max(1, eng.stats.steps - steps0), 4),
            "tok_s": round(n / wall, 1)}


def replays(gs, b=1, iters=100):
    out = {}
    if gs is None:
        return out
    for (bb, q, long), (g, _) in sorted(gs.graphs.items()):
        if bb == b and g is not None:
            out[f"q{q}{'_long' if long else ''}"] = round(replay_us(g, iters), 2)
    return out


def main():
    model, dev = sys.argv[1] or None, sys.argv[2] if len(sys.argv) > 2 else "cuda"
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    spec = Engine.from_pretrained(model, device=dev, dtype=dtype, spec=SpecConfig())
    plain = spec.with_config(spec=None)
    for e in (spec, plain):
        e.prepare_to_serve()
    base = held_out_messages(1)[0]
    long_msg = [{"role": "user", "content": " ".join([base[0]["content"]] * 20)}]
    res = {"gpu": torch.cuda.get_device_name() if dev == "cuda" else "cpu",
           "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    n_short, n_long = (64, 256) if dev == "cuda" else (4, 4)
    for name, msg, n in (("short", base, n_short), ("long", long_msg, n_long)):
        prompt = spec.encode_prompt(msg)
        row = {"prompt_tokens": len(prompt)}
        row["plain_generate"] = timed(plain, prompt, n)
        row["plain_graph_us"] = replays(plain.runner.graphs)
        st = spec.spec.stats
        e0, v0 = st.emitted, st.verify_steps
        row["spec_generate"] = timed(spec, prompt, n)
        row["spec_acceptance"] = round((st.emitted - e0) / max(1, st.verify_steps - v0), 3)
        row["verify_graph_us"] = replays(spec.runner.graphs)
        fused = spec.spec.fused
        row["fused_graph_us"] = {} if fused is None else {
            f"d{d}": replays(s) for d, s in zip(fused.draft_levels, fused.all_sets())}
        row["chain_graph_us"] = {f"s{s}": replays(g) for s, g in
                                 spec.spec.drafter.chain_graphs.items()}
        res[name] = row
        print(name, json.dumps(row)[:2000], flush=True)
    out = os.environ.get("OUT", "/tmp")
    with open(os.path.join(out, "spec_step.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
