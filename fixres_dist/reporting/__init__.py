"""What a run shows and writes for people: metrics.jsonl, TensorBoard event files, progress bars
and the remaining time, the FixRes and sweep reports, and extracted features."""
