"""The training loop: AdamW over the unrolled chain's losses, a warm-up then cosine schedule,
an optional time budget that shortens the schedule, held-out evaluations and checkpoints, and
a state to continue from in another run (`cluster/eagle3/resume.py`)."""

from __future__ import annotations

import json
import math
import time

import torch
from tqdm import tqdm

from cluster.eagle3.records import Record, on_device
from cluster.eagle3.ttt import batch, evaluate, plan_batches, step_losses
from engine import Engine
from engine.spec.eagle3 import Eagle3Config, Eagle3Head

PLAN_AFTER = 20  # steps timed before a time budget (`max_seconds`) plans the rest
POSTFIX_EVERY = 20  # steps between the progress bar's loss readings
SAVE_EVERY_S = 120.0  # seconds between saves of the training state (`save_state`)
# float32 matmul precision of training on a GPU: "high" lets them run as TF32 on the tensor
# cores (the records' features are bf16 already); "highest" keeps full fp32.
MATMUL_PRECISION = "high"


def head_backend(block_size: int):
    """The attention backend a head trains with (`Eagle3Config` -> the torch reference)."""
    from engine.attention import TorchAttention

    return lambda c: TorchAttention(c.num_heads, c.num_kv_heads, c.head_dim, block_size)


def train(engine: Engine, train_records, eval_records, vocab_ids, *, unroll=5, epochs=4,
          lr=1e-3, batch_size=16, log_every=50, aux_layers=None,
          init: Eagle3Head | None = None, max_seconds: float | None = None,
          checkpoint=None, state: dict | None = None, save_state=None,
          stop=None) -> tuple[Eagle3Head, dict]:
    """Train a head on the records (`init`: continue from this head, keeping its draft vocabulary;
    vocab_ids is then ignored). `max_seconds`: fewer steps than `epochs` where they would not fit,
    planned from the observed pace; the learning-rate schedule ends with the plan.
    `checkpoint(head, entry)`: called after every logged held-out evaluation but the last, so a
    run cut short still leaves a head.
    Across runs: `save_state(state)` is called with everything the loop needs to go on (every
    SAVE_EVERY_S seconds, at each checkpoint and at the end); `state` continues from such a
    state, on the same records and settings, as if never stopped; `stop()`, asked after each
    step, ends this run early (info["stopped"])."""
    cfg = engine.config
    on_gpu = cfg.on_cuda
    if on_gpu:
        # The records on the device once, rather than each batch copying its answers'
        # features from host memory; and TF32 matmuls.
        train_records = [on_device(r, cfg.device) for r in train_records]
        eval_records = [on_device(r, cfg.device) for r in eval_records]
        precision = torch.get_float32_matmul_precision()
        torch.set_float32_matmul_precision(MATMUL_PRECISION)
    try:
        return _train(engine, train_records, eval_records, vocab_ids, unroll=unroll,
                      epochs=epochs, lr=lr, batch_size=batch_size, log_every=log_every,
                      aux_layers=aux_layers, init=init, max_seconds=max_seconds,
                      checkpoint=checkpoint, state=state, save_state=save_state, stop=stop)
    finally:
        if on_gpu:
            torch.set_float32_matmul_precision(precision)


def _new_head(engine: Engine, vocab_ids: torch.Tensor, aux_layers) -> Eagle3Head:
    """A fresh head over `vocab_ids`, its LM head and final norm started from the target's."""
    cfg, target = engine.config, engine.model
    hc = Eagle3Config.for_target(cfg.model, len(vocab_ids), aux_layers)
    with torch.device(cfg.device):
        head = Eagle3Head(hc, head_backend(cfg.block_size)(hc))
    head.set_vocab(vocab_ids.to(cfg.device))
    with torch.no_grad():
        head.lm_head.weight.copy_(target.lm_head.weight[vocab_ids.to(cfg.device)])
        head.norm.weight.copy_(target.norm.weight)
    return head


def _logged(head, engine: Engine, eval_records: list[Record], unroll: int, history: list,
            **entry) -> dict:
    """Evaluate on the held-out records and append the log entry (printed) to `history`."""
    ev = evaluate(head, engine.model, eval_records, unroll, engine.config.device,
                  torch.float32)
    history.append({**entry, **ev.entry()})
    tqdm.write(json.dumps(history[-1]))
    return history[-1]


def _train(engine: Engine, train_records, eval_records, vocab_ids, *, unroll, epochs, lr,
           batch_size, log_every, aux_layers, init, max_seconds, checkpoint=None, state=None,
           save_state=None, stop=None) -> tuple[Eagle3Head, dict]:
    target, device = engine.model, engine.config.device
    head = init.to(device) if init is not None else _new_head(engine, vocab_ids, aux_layers)
    head = head.to(torch.float32).train()
    for p in target.parameters():
        p.requires_grad_(False)
    opt = torch.optim.AdamW(head.parameters(), lr=lr, weight_decay=0.0, betas=(0.9, 0.95))
    batches = plan_batches([len(r.ids) for r in train_records], batch_size)
    asked = epochs * len(batches)
    plan = [asked]  # steps to run: the schedule reads it as it changes
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 50) * 0.5 * (
        1 + math.cos(math.pi * min(s / max(plan[0], 1), 1.0))))
    history: list[dict] = []
    step, before = 0, 0.0  # steps and seconds of earlier runs
    if state is not None:
        head.load_state_dict(state["head"])
        opt.load_state_dict(state["opt"])
        sched.load_state_dict(state["sched"])
        step, plan[0], history, before = (state["step"], state["plan"], state["history"],
                                          state["seconds"])
    elif init is not None:  # where the continued head starts, on these held-out records
        _logged(head, engine, eval_records, unroll, history, step=0, epoch=0, loss=None)
    first = step
    g = torch.Generator().manual_seed(0)
    bar = tqdm(total=plan[0], initial=step, desc="train", unit="step")
    t0 = saved = time.perf_counter()

    def snapshot() -> dict:
        return {"head": head.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                "step": step, "plan": plan[0], "history": history,
                "seconds": before + time.perf_counter() - t0}

    stopped = False
    for ep in range(epochs):
        # drawn every epoch, those of earlier runs too, so a resumed run meets the same order
        perm = torch.randperm(len(batches), generator=g).tolist()
        if step >= plan[0] or stopped:
            break
        for bi in perm[step - ep * len(batches):] if step > ep * len(batches) else perm:
            recs = [train_records[i] for i in batches[bi]]
            losses, accs = step_losses(head, target, *batch(recs, device, torch.float32),
                                       unroll)
            loss = sum(0.8**j * lo for j, lo in enumerate(losses))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(head.parameters(), 0.5)
            opt.step()
            sched.step()
            step += 1
            bar.update(1)
            if step % POSTFIX_EVERY == 0 or step == first + 1:  # each read waits for the GPU
                bar.set_postfix(loss=f"{loss.item():.3f}", acc0=f"{accs[0].item():.2f}")
            if max_seconds and (step == PLAN_AFTER or step % log_every == 0):
                pace = (before + time.perf_counter() - t0) / step
                plan[0] = max(step, min(asked, int(max_seconds / pace)))
                bar.total = plan[0]
                bar.refresh()
            if step % log_every == 0 or step == plan[0]:
                entry = _logged(head, engine, eval_records, unroll, history, step=step,
                                epoch=ep, loss=round(loss.item(), 4))
                if checkpoint is not None and step < plan[0]:
                    checkpoint(head, entry)
            if save_state is not None and (step % log_every == 0 or
                                           time.perf_counter() - saved > SAVE_EVERY_S):
                save_state(snapshot())
                saved = time.perf_counter()
            if step >= plan[0]:
                break
            if stop is not None and stop():
                stopped = True
                break
    bar.close()
    if save_state is not None:
        save_state(snapshot())
    return head.eval(), {"history": history, "steps": step, "steps_asked": asked,
                         "train_seconds": round(before + time.perf_counter() - t0, 1),
                         "matmul_precision": torch.get_float32_matmul_precision(),
                         "final_lr": sched.get_last_lr()[0], "stopped": stopped,
                         "resumed_at_step": first}
