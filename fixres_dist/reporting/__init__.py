"""What a run shows and writes for people: metrics.jsonl, TensorBoard event files, progress bars
and the remaining time, and the FixRes and sweep reports."""
