"""Figure 4: KV movement between two GPUs: peer copy, the in-process transport and UCX, and
the transfer's share of the prefill that made the KV."""

from __future__ import annotations

import statistics
import time
import traceback

from bench.common import free_memory, lazy_torch, log, random_engine, ratio, rnd
from engine.testing import llama8b_shape


def sync_devices(*devices) -> None:
    torch = lazy_torch()
    for d in devices:
        if torch.device(d).type == "cuda":
            torch.cuda.synchronize(d)


def peer_copy(src_dev, dst_dev, sizes, reps: int) -> list[dict]:
    """Plain tensor copy src_dev -> dst_dev (peer-to-peer between GPUs), wall time with both
    devices synchronized, median of reps after 2 warm-ups (`kvtransfer.bench.copy_seconds`)."""
    from kvtransfer.bench import copy_seconds

    rows = []
    for nbytes in sizes:
        med = copy_seconds(src_dev, dst_dev, nbytes, reps)
        rows.append({"bytes": nbytes, "median_ms": rnd(med * 1e3, 3),
                     "gb_s": rnd(nbytes / med / 1e9, 1)})
        log(f"fig 4: peer copy {nbytes / 2**20:.0f} MiB: {rows[-1]['gb_s']} GB/s")
    return rows


def local_transport(layout, src_dev, dst_dev, block_counts, reps: int) -> list[dict]:
    """The engine's in-process path (kvtransfer.local): gather blocks on the source device,
    copy, scatter on the destination; `send_blocks` time, median of reps after 2 warm-ups."""
    import asyncio

    from kvtransfer.local import LocalTransport

    torch = lazy_torch()
    nblk = max(block_counts)
    kv0 = torch.randn(layout.kv_shape(nblk), device=src_dev).to(layout.torch_dtype)
    kv1 = torch.zeros(layout.kv_shape(nblk), dtype=layout.torch_dtype, device=dst_dev)
    rows = []

    async def go():
        rx = LocalTransport(layout, kv1)
        await rx.start()
        conn = await LocalTransport(layout).connect(rx.address)
        for nb in block_counts:
            ids = list(range(nb))
            secs = []
            for i in range(reps + 2):
                sync_devices(src_dev)
                st = await conn.send_blocks(f"b{nb}-{i}", kv0, ids, ids)
                await rx.recv_blocks(f"b{nb}-{i}", timeout=30)
                if i >= 2:
                    secs.append(st.seconds)
            med = statistics.median(secs)
            rows.append({"blocks": nb, "bytes": nb * layout.block_bytes,
                         "median_ms": rnd(med * 1e3, 3),
                         "gb_s": rnd(nb * layout.block_bytes / med / 1e9, 1)})
            log(f"fig 4: local transport {nb} blocks: {rows[-1]['gb_s']} GB/s")
        await conn.close()
        await rx.close()

    asyncio.run(go())
    return rows


def fig_kv_transfer(args, res: dict) -> None:
    torch = lazy_torch()
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        res["skipped"] = "needs 2 GPUs"
        return
    from kvtransfer.layout import BlockLayout

    sizes = [16 << 20, 64 << 20, 256 << 20, 1 << 30]
    res["config"] = {"sizes_bytes": sizes, "reps": args.fig4_reps,
                     "ucx_progress": args.fig4_progress,
                     "peer_access_0_to_1": torch.cuda.can_device_access_peer(0, 1)}
    res["peer_copy"] = peer = peer_copy("cuda:0", "cuda:1", sizes, args.fig4_reps)
    # Llama-3.1-8B layout: 2 MiB per 16-token block in bf16.
    layout = BlockLayout("llama8b-shape", "bfloat16", 16, 32, 8, 128, 0)
    counts = sorted({max(1, s // layout.block_bytes) for s in sizes})
    local = local_transport(layout, "cuda:0", "cuda:1", counts, args.fig4_reps)
    res["local_transport"] = {"layout": layout.to_dict(), "block_bytes": layout.block_bytes,
                              "rows": local}
    free_memory()
    res["ucx"] = ucx_transfer(args, sizes)
    by = {r["bytes"]: r["gb_s"] for r in peer}
    ucx_rows = res["ucx"].get("rows")
    if ucx_rows:
        res["ucx_vs_peer_copy"] = {str(r["bytes"]): ratio(r["gb_s"], by.get(r["bytes"]))
                                   for r in ucx_rows}
        res["ucx_messages_vs_peer_copy"] = {
            str(r["bytes"]): ratio(r["messages_gb_s"], by.get(r["bytes"])) for r in ucx_rows}
    res["local_transport_vs_peer_copy"] = {
        str(r["bytes"]): ratio(r["gb_s"], by.get(r["bytes"])) for r in local}
    if ucx_rows:
        landed = {r["bytes"]: r["bytes"] / r["landed_ms"] / 1e6 for r in ucx_rows
                  if r.get("landed_ms")}
        res["ucx_landed_vs_peer_copy"] = {str(b): ratio(rnd(g, 2), by.get(b))
                                          for b, g in landed.items()}
    free_memory()
    # Transfer time as a share of prefill: the prompt whose KV is that many bytes, prefilled
    # by the random 8B-shaped engine on GPU 0 (the same layout: 128 KiB of KV per token).
    tokens = {b: b // layout.block_bytes * layout.block_size for b in sizes}
    res["prefill"] = pre = prefill_times(args, sorted(set(tokens.values())), args.fig4_reps)
    pre_ms = {r["tokens"]: r["median_ms"] for r in pre}
    res["transfer_share_of_prefill"] = {
        str(r["bytes"]): rnd(r["median_ms"] / pre_ms[tokens[r["bytes"]]], 4)
        for r in ucx_rows or local if tokens.get(r["bytes"]) in pre_ms}


def prefill_times(args, counts: list[int], reps: int) -> list[dict]:
    """Wall time to the first token (prefill, chunked as the engine schedules it, then one
    sampled token) of a random prompt of each length on the random 8B-shaped engine."""
    from engine import SamplingParams

    torch = lazy_torch()
    eng = random_engine(args, llama8b_shape(max(counts) + 64), max(counts) // 16 + 8,
                        device="cuda:0")
    sp = SamplingParams(max_tokens=1, temperature=0.0)
    gen = torch.Generator().manual_seed(0)
    rows = []
    for n in counts:
        prompt = torch.randint(0, 128000, (n,), generator=gen).tolist()
        eng.generate(prompt, sp)  # compiles what this length needs
        secs = []
        for _ in range(reps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            eng.generate(prompt, sp)
            torch.cuda.synchronize()
            secs.append(time.perf_counter() - t0)
        rows.append({"tokens": n, "median_ms": rnd(statistics.median(secs) * 1e3, 3),
                     "max_num_batched_tokens": eng.config.max_num_batched_tokens})
        log(f"fig 4: prefill of {n} tokens: {rows[-1]['median_ms']} ms")
    del eng
    free_memory()
    return rows


def ucx_transfer(args, sizes, devices: tuple[str, str] = ("cuda:0", "cuda:1")) -> dict:
    """UCX from GPU 0 (this process) to a receiver process with its cache on GPU 1. Per size,
    blocks 0..n-1 move by the push path, the pull path, and as UCX messages (direct, and staged
    whole and in 8 layer chunks); the headline is the path the transport picks by itself,
    `messages_gb_s` the message path. The largest size also moves scattered ids each way, and
    across two GPUs the pull is measured with either GPU's copy engines (`pull_gb_s`).
    `args.fig4_progress`: ucxx's process-wide progress mode. `devices`: (sender, receiver);
    host ones check the plumbing on any machine."""
    try:
        import ucxx  # noqa: F401
    except Exception as e:  # noqa: BLE001
        return {"skipped": f"ucxx not importable ({type(e).__name__}: {e})"}
    try:
        import asyncio
        import random
        from types import SimpleNamespace

        from kvtransfer import bench as kvb
        from kvtransfer import ipc, wire
        from kvtransfer.layout import BlockLayout

        progress = getattr(args, "fig4_progress", "thread")
        default_engine = ipc.DEFAULT_ENGINE
        engines = [default_engine] + ([e for e in ipc.ENGINES if e != default_engine]
                                      if devices[0] != devices[1] else [])
        rows, scattered = [], None
        loop = asyncio.new_event_loop()  # ucxx binds to the first loop that uses it: keep one
        layout = BlockLayout("bench", "bfloat16", 16, 32, 8, 128, 0)
        layer_block = layout.block_bytes // (2 * layout.num_layers)
        for nbytes in sizes:
            blocks = max(1, nbytes // layout.block_bytes)
            proc, pipe, address = kvb.spawn_receiver(layout, blocks, "worker",
                                                     device=devices[1], progress=progress)
            try:
                ns = SimpleNamespace(blocks=blocks, chunks=[1, 8], direct=[True, False],
                                     checksum=False, progress=progress, reps=args.fig4_reps,
                                     device=devices[0], trace=True, ipc=False)
                got = loop.run_until_complete(kvb.measure(ns, layout, address))
                ids = list(range(blocks))
                auto = wire.plan_direct(ids, ids, layout.num_layers, layer_block, None,
                                        wire.direct_min_bytes(devices[0]))
                messages = next(r for r in got if r["went_direct"] == (auto is not None))
                # The transport's own pick (push where the receiver offers its cache), then
                # the pull on each copy engine (the sender declining the push).
                ns.ipc, ns.direct, ns.chunks, ns.push = None, [None], [1], None
                own = len(got)
                got += loop.run_until_complete(kvb.measure(ns, layout, address))
                ns.push = False
                for engine in engines if got[own]["path"] in ("push", "pull") else []:
                    if got[own]["path"] == "pull" and engine == default_engine:
                        continue  # no push offered: the pick was this pull already
                    ns.pull_engine = engine
                    got += loop.run_until_complete(kvb.measure(ns, layout, address))
                    if got[-1]["path"] != "pull":
                        break  # no pull offered: once is enough
                pick = got[own] if got[own]["path"] in ("push", "pull") else messages
                ns.pull_engine, ns.push = default_engine, None
                best = max(got, key=lambda r: r["median_gb_s"])
                rows.append({"bytes": blocks * layout.block_bytes, "gb_s": pick["median_gb_s"],
                             "median_ms": pick["median_ms"], "landed_ms": pick.get("landed_ms"),
                             "path": _path_label(pick), "best_gb_s": best["median_gb_s"],
                             "messages_gb_s": messages["median_gb_s"],
                             "messages_path": _path_label(messages),
                             "pull_gb_s": {r["pull_engine"]: r["median_gb_s"]
                                           for r in got if r["path"] == "pull"},
                             "push_gb_s": next((r["median_gb_s"] for r in got
                                                if r["path"] == "push"), None),
                             "raw": [{k: v for k, v in r.items() if k != "traces"}
                                     for r in got],
                             "traces": {_path_label(r): r["traces"][:3] for r in got}})
                if nbytes == max(sizes):
                    rng = random.Random(0)
                    ns.ids = (rng.sample(ids, blocks), rng.sample(ids, blocks))
                    got = []
                    for offer in (False, None):
                        ns.ipc = offer
                        got += loop.run_until_complete(kvb.measure(ns, layout, address))
                    pick = got[-1]
                    scattered = {"bytes": pick["bytes"], "gb_s": pick["median_gb_s"],
                                 "median_ms": pick["median_ms"], "path": _path_label(pick),
                                 "messages_gb_s": got[0]["median_gb_s"],
                                 "raw": [{k: v for k, v in r.items() if k != "traces"}
                                         for r in got]}
            finally:
                kvb.stop_receiver(proc, pipe, layout)
            log(f"fig 4: UCX {nbytes >> 20} MiB: {rows[-1]['gb_s']} GB/s ({rows[-1]['path']}); "
                f"as messages {rows[-1]['messages_gb_s']} ({rows[-1]['messages_path']})")
        return {"rows": rows, "scattered_ids": scattered, "sender": devices[0],
                "receiver": f"{devices[1]} (separate process)",
                "direct_min_bytes": wire.direct_min_bytes(devices[0]),
                "progress": progress, "pull_engine": default_engine}
    except Exception:  # noqa: BLE001
        return {"error": traceback.format_exc()}


def _path_label(row: dict) -> str:
    """How a `kvtransfer.bench.measure` row's payload travelled, in the figure's words."""
    if row["path"] == "staged":
        return f"staged, {row['chunks']} chunk(s)"
    if row["path"] == "pull" and row.get("pull_engine", "dst") != "dst":
        return f"pull ({row['pull_engine']} engine)"
    return row["path"]


def plot_kv(plt, res):
    fig, ax = plt.subplots(figsize=(6, 4))
    for key, rows in (("peer copy", res.get("peer_copy")),
                      ("local transport", (res.get("local_transport") or {}).get("rows")),
                      ("UCX link (its own pick)", (res.get("ucx") or {}).get("rows"))):
        if rows:
            ax.plot([r["bytes"] / 2**20 for r in rows], [r["gb_s"] for r in rows], "o-",
                    label=key)
    ucx_rows = (res.get("ucx") or {}).get("rows") or []
    if any("messages_gb_s" in r for r in ucx_rows):
        ax.plot([r["bytes"] / 2**20 for r in ucx_rows], [r["messages_gb_s"] for r in ucx_rows],
                "o--", label="UCX messages only")
    for engine in ("dst", "src"):  # the pull, where the pick was the push
        pts = [(r["bytes"] / 2**20, r["pull_gb_s"][engine]) for r in ucx_rows
               if engine in (r.get("pull_gb_s") or {}) and not r["path"].startswith("pull")]
        if pts:
            ax.plot(*zip(*pts), "x:", label=f"pull ({engine} copy engines)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("MiB per transfer")
    ax.set_ylabel("GB/s")
    ax.legend()
    ax.set_title("KV transfer GPU 0 -> GPU 1")
    return fig
