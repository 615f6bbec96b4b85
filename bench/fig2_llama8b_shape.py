"""Figure 2: a random-weight Llama-3.1-8B-shaped engine against the HBM floor: decode step,
verify cost (K+1 tokens against 1), decode at batch 1..64."""

from __future__ import annotations

import statistics
import time

from bench.common import (
    free_memory,
    is_cuda,
    lazy_torch,
    log,
    random_engine,
    ratio,
    rnd,
)
from engine.testing import llama8b_shape


def timed_ms(fn, reps: int, warmup: int = 3) -> list[float]:
    """Milliseconds per call of fn, one CUDA-event pair per call; the host never waits between
    calls, so this is device time (host overhead shows only where it starves the GPU)."""
    torch = lazy_torch()
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
          for _ in range(reps)]
    for a, b in ev:
        a.record()
        fn()
        b.record()
    torch.cuda.synchronize()
    return [a.elapsed_time(b) for a, b in ev]


def hbm_bandwidth(gib: float, reps: int = 10) -> dict:
    """Device-to-device copy of `gib` GiB: bytes read + bytes written over the copy time."""
    torch = lazy_torch()
    nbytes = int(gib * (1 << 30))
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = timed_ms(lambda: dst.copy_(src), reps, warmup=2)
    src = dst = None
    free_memory()
    med = statistics.median(ms)
    return {"bytes_copied": nbytes, "reps": reps, "median_ms": rnd(med, 3),
            "ms": [rnd(x, 3) for x in ms],
            "bandwidth_gb_s": rnd(2 * nbytes / (med / 1e3) / 1e9, 1),
            "method": "torch copy_ of a uint8 tensor on the same GPU; bandwidth = 2*bytes/time"}


def fig_llama8b_shape(args, res: dict) -> None:
    torch = lazy_torch()
    if not is_cuda(args):
        res["skipped"] = "needs CUDA"
        return
    from engine import SamplingParams
    from engine.graphs import pack

    ctx, reps = args.fig2_context, args.fig2_reps
    batches = [b for b in (1, 2, 4, 8, 16, 32, 64) if b <= args.fig2_max_batch]
    qlens = list(range(1, 9))
    per_seq = -(-(ctx + max(qlens) + 1) // 16)
    num_blocks = max(args.fig2_blocks, max(batches) * per_seq + 1)
    res["config"] = {"context_tokens": ctx, "reps": reps, "batches": batches,
                     "query_lens": qlens, "num_blocks": num_blocks, "block_size": 16,
                     "dtype": args.dtype, "weights": "random, N(0, 0.02); norms 1"}
    log("fig 2: HBM bandwidth")
    res["hbm"] = bw = hbm_bandwidth(args.hbm_gib)
    log(f"fig 2: HBM copy bandwidth {bw['bandwidth_gb_s']} GB/s")
    log("fig 2: building the random Llama-3.1-8B-shaped engine")
    eng = random_engine(args, llama8b_shape(), num_blocks)
    cfg = eng.config
    m = cfg.model
    res["config"].update(attention_backend=cfg.backend_name, cuda_graphs=cfg.use_cuda_graphs,
                         model=m.name)
    params = {id(p): p for p in eng.model.parameters()}.values()
    total = sum(p.numel() * p.element_size() for p in params)
    embed = eng.model.embed_tokens.weight
    embed_bytes = embed.numel() * embed.element_size()
    # A decode step reads every weight but the embedding table (one row of it).
    weight_read = total - embed_bytes + embed.shape[1] * embed.element_size()
    kv_per_token = m.num_layers * 2 * m.num_kv_heads * m.head_dim * embed.element_size()
    kv_read = kv_per_token * (ctx + 1)
    gbps = bw["bandwidth_gb_s"] * 1e9
    floor_ms = (weight_read + kv_read) / gbps * 1e3
    res["floor"] = {"param_bytes": total, "embedding_bytes": embed_bytes,
                    "weight_bytes_read_per_step": weight_read,
                    "kv_bytes_read_per_step_at_context": kv_read,
                    "floor_ms": rnd(floor_ms, 4),
                    "floor_weights_only_ms": rnd(weight_read / gbps * 1e3, 4),
                    "definition": "(weights read + KV read at the context) / measured HBM "
                                  "copy bandwidth"}
    log(f"fig 2: params {total / 2**30:.2f} GiB, floor {floor_ms:.3f} ms")
    if cfg.use_cuda_graphs:
        eng.runner.enable_graphs(max(batches), qlens, ())
    # Which kernel each large projection takes at one row and at several (GEMV / 16-row
    # tensor-core tiles or cuBLAS), as timed on this GPU at graph set-up, with the timings.
    res["large_linears"] = eng.model.large_linear_tuning
    runner = eng.runner

    def tables(b: int) -> list[list[int]]:
        return [list(range(1 + i * per_seq, 1 + (i + 1) * per_seq)) for i in range(b)]

    def fwd(b: int, q: int):
        ids = [(7 * i + 11) % m.vocab_size for i in range(b * q)]
        pos = [ctx + j for _ in range(b) for j in range(q)]
        inp = pack(ids, pos, tables(b), [q] * b, cfg.block_size)
        rows = list(range(b * q))
        return lambda: runner.forward_packed(inp, rows)

    verify = []
    with torch.inference_mode():
        for q in qlens:
            ms = timed_ms(fwd(1, q), reps)
            verify.append({"tokens": q, "median_ms": rnd(statistics.median(ms), 4),
                           "min_ms": rnd(min(ms), 4)})
            log(f"fig 2: batch 1, {q} tokens/forward: {verify[-1]['median_ms']} ms")
        one = verify[0]["median_ms"]
        for v in verify:
            v["vs_1_token"] = ratio(v["median_ms"], one)
        batch = []
        for b in batches:
            ms = timed_ms(fwd(b, 1), reps)
            med = statistics.median(ms)
            batch.append({"batch": b, "median_ms": rnd(med, 4), "min_ms": rnd(min(ms), 4),
                          "tokens_per_s": rnd(b / med * 1e3, 1)})
            log(f"fig 2: batch {b} decode step: {batch[-1]['median_ms']} ms")
        for r in batch:
            r["step_vs_batch_1"] = ratio(r["median_ms"], batch[0]["median_ms"])
            r["throughput_vs_batch_1"] = ratio(r["tokens_per_s"], batch[0]["tokens_per_s"])
    res["verify_cost"] = verify
    res["batch_decode"] = batch
    res["forward_timing"] = ("runner.forward_packed (graph replay when captured, plus the LM "
                             "head), CUDA events per call, host never waits between calls")
    # The engine step as users see it: schedule, forward, sample, one host sync per step.
    log("fig 2: engine.step() at batch 1")
    n = args.fig2_decode_tokens
    prompt = [(13 * i + 5) % m.vocab_size for i in range(ctx)]
    eng.generate([prompt[:64]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    rid = eng.add_request(prompt, SamplingParams(temperature=0, max_tokens=n + 1,
                                                 ignore_eos=True))
    stamps, done = [], False
    while not done:
        outs = eng.step()
        stamps.append(time.perf_counter())
        done = any(o.request_id == rid and o.finished for o in outs)
    steps = [b - a for a, b in zip(stamps, stamps[1:])]  # the decode steps after prefill
    step_ms = statistics.median(steps) * 1e3
    res["engine_step_batch1"] = {
        "decode_steps": len(steps), "median_ms": rnd(step_ms, 4),
        "mean_ms": rnd(statistics.mean(steps) * 1e3, 4),
        "tokens_per_s": rnd(1e3 / step_ms, 1)}
    fwd_ms = verify[0]["median_ms"]
    six = next(v["vs_1_token"] for v in verify if v["tokens"] == 6)
    res["pct_of_floor"] = {
        "definition": "100 * floor_ms / step_ms (100 = moves bytes at the measured copy "
                      "bandwidth)",
        "forward_device_time": rnd(100 * floor_ms / fwd_ms, 1),
        "engine_step": rnd(100 * floor_ms / step_ms, 1)}
    res["goals"] = {
        "engine_step_at_least_85pct_of_floor": 100 * floor_ms / step_ms >= 85,
        "forward_at_least_85pct_of_floor": 100 * floor_ms / fwd_ms >= 85,
        "verify_6_tokens_at_most_1.10x": six <= 1.10, "verify_6_tokens_vs_1": six}
    log(f"fig 2: engine step {step_ms:.3f} ms = {100 * floor_ms / step_ms:.1f}% of floor; "
        f"forward {fwd_ms:.3f} ms; 6-token verify {six}x")


def plot_llama8b(plt, res):
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    v = res["verify_cost"]
    a.plot([r["tokens"] for r in v], [r["vs_1_token"] for r in v], "o-")
    a.axhline(1.10, ls="--", c="gray")
    a.set_xlabel("tokens per forward (K+1)")
    a.set_ylabel("time vs 1-token step")
    a.set_title("verify cost, batch 1")
    bd = res["batch_decode"]
    b.plot([r["batch"] for r in bd], [r["median_ms"] for r in bd], "o-", label="step")
    b.axhline(res["floor"]["floor_ms"], ls="--", c="gray", label="floor (batch 1)")
    b.set_xscale("log", base=2)
    b.set_xlabel("batch")
    b.set_ylabel("decode step ms")
    b.legend()
    b.set_title("Llama-3.1-8B shape, bf16")
    return fig
