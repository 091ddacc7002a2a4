"""One rank's training story and its parts: the Trainer, the loops (``engine``), optimizer and
schedule, MixUp/CutMix, the non-finite-loss guard, checkpoints, recipes and fault injection."""
