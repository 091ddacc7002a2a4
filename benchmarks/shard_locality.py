"""Would a locality mode pay? One rank's share of an epoch read from shards whose pages are not in
memory: in the exact sampler's order (every rank reads samples spread over all shards) against a
locality mode's (the rank reads its own contiguous shards front to back, as streaming readers do).

The data: ``input_pipeline.py``'s folder of foolbox's 20 ImageNet JPEGs (72 KB on average) copied
``--images`` times, packed (``python -m fixres_dist.data.packing pack``, ``--shard-mib`` per shard).
For each order, rank 0 of ``--ranks`` reads its share (``--images / --ranks`` samples) twice:

* **cold**: every shard's pages dropped from the page cache first (``posix_fadvise(DONTNEED)``, no
  root needed), then each sample's bytes read (one ``pread``: ``ShardSplit.read``), wall seconds
  (the waits for the disk included);
* **decode**: the same samples read again (now cached) and decoded and transformed as a run's
  loader does (``SeededDataset`` with ``test_transform(--size)``), CPU seconds of the thread.

Printed: MB/s and img/s of the cold read per order and their ratio, and the decode's img/s per
core, which bounds what any read order can gain: a loader worker spends its time decoding.
This measures this machine's disk (a virtual disk here), not a parallel filesystem: on Lustre or
GPFS, where a read has a network round trip, the cold ratio would be the figure to measure again.

Run from the repository root:  .venv/bin/python benchmarks/shard_locality.py  [--images 16000]
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the package is not installed in .venv
sys.path.insert(0, str(Path(__file__).resolve().parent))
from fixres_dist.data import packing, pipeline, shards  # noqa: E402
from fixres_dist.data.samplers import ExactBatchSampler, SampleKey  # noqa: E402
from input_pipeline import make_jpeg_folder  # noqa: E402


def drop_cache(split: shards.ShardSplit) -> None:
    """Drop every shard of ``split`` from the page cache."""
    for path in split.shard_paths:
        descriptor = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(descriptor, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(descriptor)


def orders(size: int, ranks: int, seed: int = 0) -> dict[str, list[int]]:
    """name -> rank 0's samples of epoch 0: the exact sampler's, and a locality mode's (its contiguous
    share of the samples, which lie in its own shards, front to back)."""
    sampler = ExactBatchSampler(size, ranks, 0, 64, shuffle=True, seed=seed, training=True)
    sampler.set_epoch(0)
    exact = [key.index for batch in sampler for key in batch]
    return {"exact sampler (all shards)": exact, "locality (own shards, in order)": list(range(len(exact)))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data-dir", type=Path, default=Path(tempfile.gettempdir()) / "fixres_locality_bench")
    parser.add_argument("--images", type=int, default=16000, help="training JPEGs (default %(default)s)")
    parser.add_argument("--shard-mib", type=float, default=64)
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--size", type=int, default=224, help="test resolution of the decode (pixels)")
    parser.add_argument("--repeats", type=int, default=3, help="cold passes per order, interleaved; best kept")
    args = parser.parse_args()
    torch.set_num_threads(1)
    jpegs = make_jpeg_folder(args.data_dir / "jpegs", args.images, 20)
    packed = args.data_dir / f"packed-{args.shard_mib}"
    if not (packed / shards.MANIFEST).exists():
        packing.pack(jpegs, packed, args.shard_mib, workers=1, progress=False)
    split = shards.open_packed(packed).dataset("train")
    seeded = pipeline.SeededDataset(split, pipeline.test_transform(args.size), seed=0)
    chosen = orders(len(split), args.ranks)
    print(f"{len(split):,} JPEGs in {len(split.shard_paths)} shards of {args.shard_mib:g} MiB; rank 0 of "
          f"{args.ranks} reads {len(next(iter(chosen.values()))):,}; {len(os.sched_getaffinity(0))} cores, load "
          f"average {os.getloadavg()[0]:.2f}")
    cold = dict.fromkeys(chosen, (0.0, 0.0))
    for _ in range(args.repeats):
        for name, indices in chosen.items():
            drop_cache(split)
            start, read = time.perf_counter(), 0
            for index in indices:
                read += len(split.read(index))
            seconds = time.perf_counter() - start
            cold[name] = max(cold[name], (len(indices) / seconds, read / seconds / 1e6))
    indices = next(iter(chosen.values()))
    for index in indices:  # into the page cache
        split.read(index)
    warm_start = time.perf_counter()
    for index in indices:
        split.read(index)
    warm = len(indices) / (time.perf_counter() - warm_start)
    start = time.thread_time()
    for index in indices:
        seeded[SampleKey(index=index, epoch=0)]
    decode = len(indices) / (time.thread_time() - start)
    for name, (images, megabytes) in cold.items():
        print(f"{name:34s} cold read: {images:9,.0f} img/s {megabytes:8,.1f} MB/s")
    (exact, _), (local, _) = cold.values()
    print(f"locality / exact sampler, cold read: {local / exact:.2f}x; the same reads from the page cache: "
          f"{warm:,.0f} img/s (if cold ~ cached, the cache was not dropped)")
    share = (1 / exact) / (1 / exact + 1 / decode)
    print(f"read (cached), decode, test transform {args.size} px, per core: {decode:,.0f} img/s; a cold read in the "
          f"exact sampler's order is {share * 100:.1f} % of a loader's time per image, so a locality mode could gain "
          f"at most {share * (1 - exact / local) * 100:.1f} % of it here")


if __name__ == "__main__":
    main()
