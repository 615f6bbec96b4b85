"""Figure 5's workload and measures: background decode streams, long prompts arriving on a
clock, the inter-token latency summary; shared by its colocated, in-process and
separate-process runs."""

from __future__ import annotations

import statistics
import time

from bench.common import is_cuda, lazy_torch, precapture, rnd
from engine.testing import llama8b_shape


def pct(xs: list[float], q: float):
    """Nearest-rank percentile (q in 0..100)."""
    import math

    if not xs:
        return None
    ys = sorted(xs)
    return ys[max(0, math.ceil(q / 100 * len(ys)) - 1)]


def itl_summary(gaps_s: list[float]) -> dict:
    ms = [g * 1e3 for g in gaps_s]
    return {"count": len(ms), "p50_ms": rnd(pct(ms, 50)), "p90_ms": rnd(pct(ms, 90)),
            "p99_ms": rnd(pct(ms, 99)), "max_ms": rnd(max(ms) if ms else None),
            "mean_ms": rnd(statistics.mean(ms) if ms else None)}


class Workload:
    """Background decode streams that keep running, and long prompts arriving on a clock.
    Records when each background stream got each token (host time after the step)."""

    def __init__(self, args, vocab: int):
        import random

        from engine import SamplingParams

        rng = random.Random(0)
        self.streams, self.arrivals = args.fig5_streams, args.fig5_arrivals
        self.interval = args.fig5_interval_ms / 1e3
        self.short = [[rng.randrange(vocab) for _ in range(args.fig5_short_len)]
                      for _ in range(self.streams)]
        self.long = [[rng.randrange(vocab) for _ in range(args.fig5_prompt_len)]
                     for _ in range(self.arrivals)]
        self.bg_params = SamplingParams(temperature=0, max_tokens=args.fig5_max_steps,
                                        ignore_eos=True)
        self.long_params = SamplingParams(temperature=0, max_tokens=args.fig5_long_tokens,
                                          ignore_eos=True)
        self.stamps: dict[str, list[float]] = {f"bg{i}": [] for i in range(self.streams)}
        self.arrived: dict[str, float] = {}
        self.first: dict[str, float] = {}  # long request -> time of its first token
        self.done: dict[str, float] = {}  # long request -> time it finished decoding
        self.tokens: dict[str, list[int]] = {}  # long request -> its output tokens
        self.t0 = None
        self.check_kv = bool(getattr(args, "fig5_check_kv", False))

    def record(self, outs, t: float) -> None:
        for o in outs:
            rid = o.request_id
            if rid in self.stamps and o.token_ids:
                self.stamps[rid].append(t)
            elif rid in self.arrived:
                self.tokens.setdefault(rid, []).extend(o.token_ids)
                if rid not in self.first and o.token_ids:
                    self.first[rid] = t
                if o.finished:
                    self.done[rid] = t

    def warm(self) -> bool:
        return all(len(v) >= 8 for v in self.stamps.values())

    def due(self, now: float) -> list[tuple[str, list[int]]]:
        """Long prompts whose arrival time has come and that were not added yet."""
        out = []
        for i in range(len(self.arrived), self.arrivals):
            rid = f"long{i}"
            if now < self.t0 + i * self.interval:
                break
            self.arrived[rid] = now
            out.append((rid, self.long[i]))
        return out

    def finished(self) -> bool:
        return len(self.done) == self.arrivals

    def summary(self, t_end: float) -> dict:
        quiet, busy = [], []
        for ts in self.stamps.values():
            for a, b in zip(ts, ts[1:]):
                (busy if self.t0 <= b <= t_end else quiet if b < self.t0 else []).append(b - a)
        ttft = [self.first[r] - self.arrived[r] for r in self.first]
        return {"itl_while_prompts_arrive": itl_summary(busy),
                "itl_before_arrivals": itl_summary(quiet),
                "window_s": rnd(t_end - self.t0),
                "long_ttft_ms": {"p50": rnd(pct([x * 1e3 for x in ttft], 50)),
                                 "max": rnd(max(ttft) * 1e3 if ttft else None),
                                 "all": [rnd(x * 1e3, 1) for x in ttft]},
                "background_tokens_in_window": len(busy),
                "background_tokens_per_stream": {r: len(ts) for r, ts in self.stamps.items()}}


FIG5_SMOKE = {"fig5_model": "tiny", "fig5_streams": 2, "fig5_short_len": 32,
              "fig5_arrivals": 2, "fig5_prompt_len": 128, "fig5_interval_ms": 50.0,
              "fig5_long_tokens": 8, "fig5_max_steps": 400, "fig5_step_limit": 2000,
              "fig5_check_kv": True}


def fig5_model(args, prompt_len: int):
    from engine.config import tiny_config

    need = max(prompt_len + args.fig5_long_tokens, args.fig5_short_len + args.fig5_max_steps)
    max_pos = -(-(need + 64) // 256) * 256
    if args.fig5_model == "tiny":
        return tiny_config(max_position=max_pos, vocab_size=256, name="tiny (random)")
    return llama8b_shape(max_position=max_pos)


def fig5_blocks(args) -> int:
    per_bg = -(-(args.fig5_short_len + args.fig5_max_steps + 16) // 16)
    per_long = -(-(args.fig5_prompt_len + args.fig5_long_tokens + 16) // 16)
    # + one long prompt's worth: the transport warm-up transfer lands in reserved blocks
    return args.fig5_streams * per_bg + (args.fig5_arrivals + 1) * per_long + 64


def fig5_devices(args) -> tuple[str, str]:
    """(decode, prefill): the decode engine (and the colocated one) on GPU 0, the prefill
    engine on GPU 1; on a CPU both are the CPU (a smoke test of the mechanics)."""
    return ("cuda:0", "cuda:1") if is_cuda(args) else (args.device, args.device)


def weights_fingerprint(eng) -> list[float]:
    """A strided sample of every weight, summed per tensor: equal lists mean the two engines
    (built in two processes from the same seed) hold the same random weights."""
    torch = lazy_torch()
    with torch.no_grad():
        return [float(p.detach().reshape(-1)[::4099].double().sum())
                for p in eng.model.parameters()]


def kv_checksum(kv, ids) -> int:
    """Exact, order-sensitive fingerprint of blocks `ids` of a KV tensor (all layers, K and
    V): the raw bits as 16-bit integers, summed per block, weighted by the block's position.
    (Random tiny models decode nearly the same tokens from any context: equal outputs alone
    would not show that the right KV arrived.)"""
    torch = lazy_torch()
    idx = torch.tensor(list(ids), dtype=torch.long, device=kv.device)
    bits = kv.index_select(2, idx).view(torch.int16).to(torch.int64)
    per_block = bits.sum(dim=(0, 1, 3, 4, 5))
    weight = torch.arange(1, len(ids) + 1, dtype=torch.int64, device=kv.device)
    return int((per_block * weight).sum())


def warm_engine(eng, w: Workload, batch_sizes) -> str:
    """Capture the decode graphs and JIT the prefill kernels once, outside the measurement."""
    note = precapture(eng, batch_sizes)  # with the split-KV variants: 8k contexts
    eng.generate([w.long[0]], w.long_params)
    return note


def start_background(eng, w: Workload) -> int:
    """Start the background decode streams and step them until warm (32 steps at least);
    the measured window starts now. Returns the steps taken."""
    for i, p in enumerate(w.short):
        eng.add_request(p, w.bg_params, request_id=f"bg{i}")
    steps = 0
    while not w.warm() or steps < 32:
        w.record(eng.step(), time.perf_counter())
        steps += 1
    w.t0 = time.perf_counter()
    return steps


def transfer_summary(rows: list[dict]) -> dict:
    if not rows:
        return {"count": 0}
    secs = [r["seconds"] for r in rows]
    total_b, total_s = sum(r["bytes"] for r in rows), sum(secs)
    out = {"count": len(rows), "bytes_total": total_b, "seconds_total": rnd(total_s, 4),
           "median_ms": rnd(statistics.median(secs) * 1e3),
           "max_ms": rnd(max(secs) * 1e3),
           "gb_s_overall": rnd(total_b / total_s / 1e9, 2) if total_s else None}
    paths = [r["path"] for r in rows if r.get("path")]
    if paths:  # how the blocks travelled (kvtransfer's pull, direct or staged path)
        out["paths"] = {p: paths.count(p) for p in sorted(set(paths))}
    checked = [r["kv_identical"] for r in rows if r.get("kv_identical") is not None]
    out["kv_identical"] = f"{sum(checked)}/{len(checked)}" if checked else "not checked"
    if rows[0].get("first_token_to_admit_ms") is not None:
        lat = [r["first_token_to_admit_ms"] for r in rows]
        out["first_token_to_admit_ms"] = {"p50": rnd(pct(lat, 50)), "max": rnd(max(lat))}
    return out
