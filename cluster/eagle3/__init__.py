"""EAGLE-3 head training for `tandem train-eagle3` (the command itself: `cluster/train_eagle3.py`).

- `records`: self-distillation with the engine, the records it makes, the draft vocabulary.
- `ttt`: the unrolled "training-time test" chain, its losses and held-out accuracy.
- `loop`: the training loop (schedule, time budget, checkpoints).
- `vocab`: growing a trained head's draft vocabulary and refitting its LM head.
- `resume`: records written a chunk at a time and the training state, to go on in another run.
"""
