"""Figure 5: inter-token latency of running decodes while long prompts arrive, one engine
(colocated) against disaggregated: the prefill engine in its own process with the KV over
UCX, and both engines in this process with an in-process copy. The workload and the prefill
process live in `bench.fig5_process`; the runs and the figure here."""

from __future__ import annotations

import argparse
import sys
import time

from bench import fig5_process as proc  # its timeouts read at call time (--set changes them)
from bench.common import free_memory, is_cuda, lazy_torch, log, random_engine, ratio, rnd
from bench.fig5_process import (
    FIG5_SMOKE,
    PrefillProcess,
    UcxLoop,
    Workload,
    fig5_blocks,
    fig5_devices,
    fig5_model,
    fig5_ucx_problem,
    kv_checksum,
    start_background,
    transfer_summary,
    warm_engine,
    weights_fingerprint,
)


def run_colocated(eng, w: Workload, step_limit: int, deadline_s: float) -> dict:
    steps = start_background(eng, w)
    while not w.finished() and steps < step_limit and time.perf_counter() - w.t0 < deadline_s:
        for rid, p in w.due(time.perf_counter()):
            eng.add_request(p, w.long_params, request_id=rid)
        w.record(eng.step(), time.perf_counter())
        steps += 1
    t_end = time.perf_counter()
    for rid in list(eng.seqs):
        eng.abort(rid)
    out = w.summary(t_end)
    out["steps"] = steps
    out["complete"] = w.finished()
    return out


def run_disaggregated(args, pre, dec, w: Workload, step_limit: int,
                      deadline_s: float) -> dict:
    """Both engines in this process (sharing its GIL): the prefill engine in this thread, the
    decode engine on its own thread (own GPU). Long prompts prefill on `pre` (hold=True),
    their KV blocks are copied into blocks reserved on `dec`, and `dec` admits them; the
    background streams decode on `dec` throughout."""
    import concurrent.futures
    import queue
    import threading

    torch = lazy_torch()
    ctrl: queue.SimpleQueue = queue.SimpleQueue()
    stop = threading.Event()
    failure: list[BaseException] = []
    counter = {"steps": 0}
    dec_dev = torch.device(dec.config.device)
    block_bytes = dec.kv_cache[:, :, 0].numel() * dec.kv_cache.element_size()

    def decode_loop():
        try:
            if dec_dev.type == "cuda":
                torch.cuda.set_device(dec_dev)
            while not stop.is_set():
                while True:
                    try:
                        fn, fut = ctrl.get_nowait()
                    except queue.Empty:
                        break
                    try:
                        fut.set_result(fn(dec))
                    except Exception as e:  # noqa: BLE001
                        fut.set_exception(e)
                if dec.has_unfinished() and counter["steps"] < step_limit:
                    w.record(dec.step(), time.perf_counter())
                    counter["steps"] += 1
                else:
                    time.sleep(0.0002)
        except BaseException as e:  # noqa: BLE001
            failure.append(e)

    def on_decode(fn, wait: bool = True):
        fut: concurrent.futures.Future = concurrent.futures.Future()
        ctrl.put((fn, fut))
        return fut.result(timeout=120) if wait else fut

    side = torch.cuda.Stream(device=dec_dev) if dec_dev.type == "cuda" else None
    copies, admits = [], []

    def hand_off(rid: str) -> None:
        h = pre.export_handoff(rid)
        src = pre.held_blocks(rid)
        dst = on_decode(lambda e: e.reserve(rid, h.num_computed))
        t0 = time.perf_counter()
        copy_kv(pre.kv_cache, dec.kv_cache, src[: len(dst)], dst, side)
        secs = time.perf_counter() - t0
        same = (kv_checksum(pre.kv_cache, src[: len(dst)]) == kv_checksum(dec.kv_cache, dst)
                if w.check_kv else None)
        copies.append({"request_id": rid, "blocks": len(dst), "bytes": len(dst) * block_bytes,
                       "seconds": rnd(secs, 5),
                       "gb_s": rnd(len(dst) * block_bytes / max(secs, 1e-9) / 1e9, 2),
                       "kv_identical": same})
        pre.release(rid)
        admits.append(on_decode(lambda e: e.admit(h), wait=False))

    for i, p in enumerate(w.short):
        dec.add_request(p, w.bg_params, request_id=f"bg{i}")
    old = sys.getswitchinterval()
    sys.setswitchinterval(0.0005)  # two busy Python threads: hand the GIL over quickly
    th = threading.Thread(target=decode_loop, name="bench-decode", daemon=True)
    th.start()
    try:
        while not (w.warm() and counter["steps"] >= 32):
            if failure or not th.is_alive():
                raise RuntimeError("decode thread died") from (failure[0] if failure else None)
            time.sleep(0.001)
        w.t0 = time.perf_counter()
        while (not w.finished() and counter["steps"] < step_limit
               and time.perf_counter() - w.t0 < deadline_s):
            if failure:
                raise RuntimeError("decode thread failed") from failure[0]
            for rid, p in w.due(time.perf_counter()):
                pre.add_request(p, w.long_params, request_id=rid, hold=True)
            if pre.has_unfinished():
                outs = pre.step()
                t = time.perf_counter()
                for o in outs:
                    w.tokens.setdefault(o.request_id, []).extend(o.token_ids)
                    if o.token_ids and o.request_id not in w.first:
                        w.first[o.request_id] = t
                    if o.handoff:
                        hand_off(o.request_id)
                    elif o.finished:  # finished at its first token: nothing to hand off
                        w.done[o.request_id] = t
            else:
                time.sleep(0.0005)
        t_end = time.perf_counter()
    finally:
        stop.set()
        th.join(timeout=60)
        sys.setswitchinterval(old)
    for f in admits:
        if f.done():
            f.result()  # an admit that raised
    if failure:
        raise RuntimeError("decode thread failed") from failure[0]
    for rid in list(dec.seqs) + list(dec.reserved):
        dec.abort(rid)
    for rid in list(pre.seqs) + list(pre.held):
        pre.abort(rid)
    out = w.summary(t_end)
    out["decode_steps"] = counter["steps"]
    out["complete"] = w.finished()
    out["kv_transfers"] = transfer_summary(copies)
    out["kv_transfer_rows"] = copies
    out["path"] = "in-process"
    return out


def copy_kv(src_kv, dst_kv, src_ids, dst_ids, stream=None) -> None:
    """Blocks src_ids of src_kv into blocks dst_ids of dst_kv (all layers, K and V), on a side
    stream of the destination GPU so the decode engine's own stream never waits on it."""
    import contextlib

    torch = lazy_torch()
    ctx = torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
    with ctx:
        data = src_kv.index_select(2, torch.tensor(src_ids, device=src_kv.device))
        data = data.to(dst_kv.device, non_blocking=True)
        dst_kv.index_copy_(2, torch.tensor(dst_ids, device=dst_kv.device), data)
    if stream is not None:
        stream.synchronize()


def run_disaggregated_process(args, pp: PrefillProcess, ucx: UcxLoop, rx, dec, w: Workload,
                              step_limit: int, deadline_s: float) -> dict:
    """This process is the decode node and the router's clock: each arrival reserves blocks on
    `dec` and asks the prefill process to fill them over UCX; `dec` admits it once `rx` says
    the blocks landed. Background streams decode on `dec` throughout; this loop is measured."""
    plen = args.fig5_prompt_len
    pending: dict = {}  # rid -> (future of rx.recv_blocks, Handoff, transfer stats)
    reserved: dict[str, list[int]] = {}
    transfers: list[dict] = []

    def handle(msg) -> None:
        kind, rid = msg[0], msg[1]
        if kind == "out":  # the long request's first token, straight from prefill
            _, _, toks, t, finished = msg
            w.tokens.setdefault(rid, []).extend(toks)
            if toks and rid not in w.first:
                w.first[rid] = t
            if finished:  # done at its first token: nothing will arrive
                w.done[rid] = t
                dec.release(rid)
        elif kind == "handoff":
            _, _, h, st = msg
            pending[rid] = (ucx.submit(rx.recv_blocks(rid, proc.FIG5_UCX_TIMEOUT_S)), h, st)
        else:
            raise RuntimeError(f"unexpected message from the prefill process: {msg[:2]}")

    steps = start_background(dec, w)
    while not w.finished() and steps < step_limit and time.perf_counter() - w.t0 < deadline_s:
        for rid, _ in w.due(time.perf_counter()):
            reserved[rid] = dec.reserve(rid, plen)
            pp.send(("prefill", rid, int(rid.removeprefix("long")), reserved[rid]))
        for msg in pp.messages():
            handle(msg)
        for rid, (fut, h, st) in list(pending.items()):
            if fut.done():
                del pending[rid]
                fut.result()  # a transfer the receiver failed fails the figure
                same = None
                if w.check_kv:  # before admit: decoding appends to the last block
                    blocks = reserved[rid][: st["blocks"]]
                    same = kv_checksum(dec.kv_cache, blocks) == st["src_checksum"]
                dec.admit(h)
                t = time.perf_counter()
                transfers.append({"request_id": rid, "blocks": st["blocks"],
                                  "bytes": st["bytes"], "seconds": rnd(st["seconds"], 5),
                                  "gb_s": rnd(st["bytes"] / max(st["seconds"], 1e-9) / 1e9, 2),
                                  "first_token_to_admit_ms": rnd(
                                      (t - st["first_token_at"]) * 1e3),
                                  "kv_identical": same, "path": st.get("path")})
        if dec.has_unfinished():
            w.record(dec.step(), time.perf_counter())
            steps += 1
        else:
            time.sleep(0.0002)
    t_end = time.perf_counter()
    for rid in list(dec.seqs) + list(dec.reserved):
        dec.abort(rid)
    for rid, (fut, _, _) in pending.items():
        fut.cancel()
        rx.inbox.discard(rid)
    out = w.summary(t_end)
    out["decode_steps"] = steps
    out["complete"] = w.finished()
    out["kv_transfers"] = transfer_summary(transfers)
    out["kv_transfer_rows"] = transfers
    return out


def fig5_process_row(args, res: dict, dec, w: Workload, pp: PrefillProcess, dev_prefill: str,
                     batches) -> tuple[dict, Workload]:
    """Start the UCX receiver on `dec`'s cache, let the prefill process build and connect,
    warm the link with one transfer, then measure. Everything it started is closed here."""
    from kvtransfer.factory import make_transport
    from kvtransfer.layout import BlockLayout

    torch = lazy_torch()
    layout = BlockLayout.from_engine_config(dec.config)
    ucx = UcxLoop()
    rx = make_transport("ucx", layout, dec.kv_cache)
    started = False
    try:
        ucx.run(rx.start())
        started = True
        pp.send(("go", rx.address))  # the child builds its engine while we warm ours
        res["graphs"]["decode"] = warm_engine(dec, w, batches)
        ready = pp.expect("ready", proc.FIG5_CHILD_TIMEOUT_S)[1]
        res["graphs"]["prefill"] = ready["graphs"]
        same = ready.pop("fingerprint") == weights_fingerprint(dec)
        res["prefill_process"] = {**ready, "weights_identical_to_decode": same}
        log(f"fig 5: prefill process {ready['pid']} ready on {dev_prefill} "
            f"({ready['build_and_warm_s']} s); same weights: {same}")
        blocks = dec.reserve("warm", args.fig5_prompt_len)
        pp.send(("warm", blocks))
        warm = pp.expect("warmed", proc.FIG5_UCX_TIMEOUT_S)[1]
        ucx.run(rx.recv_blocks("warm", proc.FIG5_UCX_TIMEOUT_S))
        dec.release("warm")
        res["prefill_process"]["warmup_transfer"] = {
            "blocks": warm["blocks"], "bytes": warm["bytes"],
            "ms": rnd(warm["seconds"] * 1e3)}
        if torch.device(dec.config.device).type == "cuda":
            torch.cuda.synchronize(dec.config.device)
        log("fig 5: disaggregated (separate processes, UCX)")
        w2 = Workload(args, dec.config.model.vocab_size)
        row = run_disaggregated_process(args, pp, ucx, rx, dec, w2, args.fig5_step_limit,
                                        args.fig5_deadline_s)
        row["path"] = "processes+ucx"
        return row, w2
    finally:
        exitcode = pp.close()
        res.setdefault("prefill_process", {}).update(exit_code=exitcode, bye=pp.bye)
        if started:
            try:
                ucx.run(rx.close(), 15)
            except Exception as e:  # noqa: BLE001
                res["prefill_process"]["receiver_close"] = f"{type(e).__name__}: {e}"
        ucx.close()


def fig5_in_process_row(args, res: dict, dec, w: Workload, dev_prefill: str, batches):
    """The one-process variant: a prefill engine on `dev_prefill` built here with `dec`'s
    weights, the decode engine on its own thread of this process."""
    import contextlib

    torch = lazy_torch()
    on_dev = (torch.cuda.device(dev_prefill) if dev_prefill.startswith("cuda")
              else contextlib.nullcontext())
    with on_dev, torch.no_grad():
        pre = random_engine(args, dec.config.model, dec.num_blocks, device=dev_prefill)
        for a, b in zip(pre.model.parameters(), dec.model.parameters()):
            a.copy_(b)  # the same weights as the decode (and colocated) engine
        res["graphs"]["in_process_prefill"] = warm_engine(pre, w, (1,))
    res["graphs"]["in_process_decode"] = warm_engine(dec, w, batches)
    log("fig 5: disaggregated (one process, in-process copy)")
    w2 = Workload(args, dec.config.model.vocab_size)
    row = run_disaggregated(args, pre, dec, w2, args.fig5_step_limit, args.fig5_deadline_s)
    return row, w2


FIG5_PATHS = {
    "processes+ucx":
        "separate processes: the prefill engine in a spawned process on {prefill}, the decode "
        "engine in this one on {decode}; on each arrival this process reserves blocks on the "
        "decode engine (Engine.reserve), the prefill process prefills (hold=True), ships the "
        "request's KV blocks into them over UCX (kvtransfer UcxTransport, worker address, as "
        "prefill_node/decode_node do), releases its copy on the receiver's ack and sends the "
        "Handoff; the decode engine admits it once its receiver says the blocks landed. The "
        "link is warmed by one transfer before timing",
    "in-process":
        "one process (engines share the GIL): the prefill engine on {prefill} in the main "
        "thread, the decode engine on {decode} on its own thread; KV by an in-process copy "
        "(index_select, device copy, index_copy on a side stream of the decode device), no "
        "UCX, no second process",
}


def fig_itl_disagg(args, res: dict) -> None:
    torch = lazy_torch()
    if getattr(args, "fig5_smoke", False):
        args = argparse.Namespace(**{**vars(args), **FIG5_SMOKE})
    if is_cuda(args) and torch.cuda.device_count() < 2:
        res["skipped"] = "needs 2 GPUs"
        return
    dev_dec, dev_pre = fig5_devices(args)  # CPU: a smoke test of the mechanics
    why_not_ucx = fig5_ucx_problem(args.fig5_transport)
    if why_not_ucx and args.fig5_transport == "ucx":
        raise RuntimeError(f"--fig5-transport ucx: {why_not_ucx}")
    main_path = "in-process" if why_not_ucx else "processes+ucx"
    mcfg = fig5_model(args, args.fig5_prompt_len)
    nb = fig5_blocks(args)
    limit = args.fig5_step_limit
    batches = list(range(1, args.fig5_streams + args.fig5_arrivals + 1))
    res["config"] = {
        "smoke": bool(getattr(args, "fig5_smoke", False)),
        "model": mcfg.name, "dtype": args.dtype, "background_streams": args.fig5_streams,
        "background_prompt_tokens": args.fig5_short_len, "long_prompts": args.fig5_arrivals,
        "long_prompt_tokens": args.fig5_prompt_len, "long_max_tokens": args.fig5_long_tokens,
        "arrival_interval_ms": args.fig5_interval_ms, "num_blocks": nb,
        "step_limit": limit, "deadline_s": args.fig5_deadline_s,
        "kv_checksums": bool(args.fig5_check_kv),
        "speculation": "none",
        "devices": {"colocated": dev_dec, "prefill": dev_pre, "decode": dev_dec},
        "itl": "gaps between successive tokens of the background streams (host time after "
               "each decode step), for gaps ending between the first arrival and the last long "
               "request's finish",
        "disaggregated_path": main_path,
        "transport": FIG5_PATHS[main_path].format(prefill=dev_pre, decode=dev_dec),
        "ucx_unavailable": why_not_ucx}
    if main_path == "processes+ucx":
        res["config"]["clock"] = ("TTFT and transfer latencies mix timestamps of the two "
                                  "processes: time.perf_counter, one system-wide monotonic "
                                  "clock on Linux")
        extra = args.fig5_in_process_row
        res["config"]["in_process_row"] = FIG5_PATHS["in-process"].format(
            prefill=dev_pre, decode=dev_dec) if extra else "skipped (--no-fig5-in-process-row)"
    # Spawned now: it imports while the colocated run goes, and waits for "go" to build.
    pp = PrefillProcess(args, dev_pre) if main_path == "processes+ucx" else None
    try:
        log(f"fig 5: building engines ({mcfg.name}, {nb} blocks each)")
        base = random_engine(args, mcfg, nb, device=dev_dec)
        res["config"]["max_num_batched_tokens"] = base.config.max_num_batched_tokens
        res["config"]["attention_backend"] = base.config.backend_name
        w = Workload(args, mcfg.vocab_size)
        res["graphs"] = {"colocated": warm_engine(base, w, batches)}
        log("fig 5: colocated")
        res["colocated"] = co = run_colocated(base, w, limit, args.fig5_deadline_s)
        log(f"fig 5: colocated ITL {co['itl_while_prompts_arrive']}")
        dec = base.with_config()  # same weights, fresh KV cache and queues
        base = None
        free_memory()
        rows = {}
        if pp is not None:
            rows["disaggregated"] = fig5_process_row(args, res, dec, w, pp, dev_pre, batches)
            pp = None
            if args.fig5_in_process_row:
                dec = dec.with_config()
                free_memory()
                rows["disaggregated_in_process"] = fig5_in_process_row(
                    args, res, dec, w, dev_pre, batches)
        else:
            rows["disaggregated"] = fig5_in_process_row(args, res, dec, w, dev_pre, batches)
            rows["disaggregated"][0]["path"] = f"in-process (fallback: {why_not_ucx})"
    finally:
        if pp is not None:  # an error before the process row took it over
            pp.close(timeout=5)
    dec = None
    free_memory()
    for key, (row, _) in rows.items():
        res[key] = row
    c = co["itl_while_prompts_arrive"]
    res["ratios"] = {"colocated_p99_over_idle_p99": ratio(
        c["p99_ms"], co["itl_before_arrivals"]["p99_ms"])}
    for key, (row, w2) in rows.items():
        d = row["itl_while_prompts_arrive"]
        log(f"fig 5: {key} ({row['path']}) ITL {d}; KV {row['kv_transfers']}")
        same = [w.tokens.get(r) == w2.tokens.get(r) for r in w.tokens]
        row["long_outputs_identical_to_colocated"] = f"{sum(same)}/{len(same)}"
        row["long_tokens_per_request"] = {r: len(t) for r, t in sorted(w2.tokens.items())}
        row["p99_over_idle_p99"] = ratio(d["p99_ms"], row["itl_before_arrivals"]["p99_ms"])
        res["ratios"][f"p99_itl_colocated_over_{key}"] = ratio(c["p99_ms"], d["p99_ms"])
        res["ratios"][f"p50_itl_colocated_over_{key}"] = ratio(c["p50_ms"], d["p50_ms"])
        res["ratios"][f"long_ttft_p50_{key}_over_colocated"] = ratio(
            row["long_ttft_ms"]["p50"], co["long_ttft_ms"]["p50"])
    main = res["disaggregated"]
    res["long_outputs_identical_colocated_vs_disaggregated"] = \
        main["long_outputs_identical_to_colocated"]
    res["goals"] = {"disaggregated_path": main["path"],
                    "disaggregated_p99_over_idle_p99": main["p99_over_idle_p99"],
                    "disaggregated_p99_at_most_1.2x_idle": (
                        None if main["p99_over_idle_p99"] is None
                        else main["p99_over_idle_p99"] <= 1.2)}
    if not all(r[0]["complete"] for r in rows.values()) or not co["complete"]:
        res["warning"] = ("a run hit --fig5-step-limit or --fig5-deadline-s before every long "
                          "request finished")


def plot_itl(plt, res):
    fig, ax = plt.subplots(figsize=(7, 4))
    names = [n for n in ("colocated", "disaggregated", "disaggregated_in_process") if n in res]
    labels = {"colocated": "colocated", "disaggregated": res["disaggregated"]["path"],
              "disaggregated_in_process": "in-process"}
    for i, key in enumerate(("p50_ms", "p99_ms")):
        vals = [res[n]["itl_while_prompts_arrive"][key] or 0 for n in names]
        ax.bar([j + 0.4 * i for j in range(len(names))], vals, width=0.4,
               label=key.replace("_ms", ""))
    ax.set_xticks([j + 0.2 for j in range(len(names))], [labels[n] for n in names])
    ax.set_yscale("log")
    ax.set_ylabel("inter-token latency, ms")
    ax.legend()
    ax.set_title(f"fig 5: {res['config']['long_prompts']} x "
                 f"{res['config']['long_prompt_tokens']}-token prompts arriving")
    return fig
