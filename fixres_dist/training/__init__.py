"""One rank's training story and its parts: the Trainer, the loops (``engine``), optimizer and
schedule, MixUp/CutMix, checkpoints, recipes, fault injection, feature extraction and the memory a
training step needs (estimated before a run starts)."""
