"""Packed shards against the image folder: images read and decoded per core, and the start-up before
the first step (issue 26).

**Read path**, on real JPEGs: the folder of ``input_pipeline.py`` (foolbox's 20 ImageNet photos copied
``--images`` times, one class folder per label) and the same images packed
(``python -m fixres_dist.data.packing pack``, ``--shard-mib`` per shard). Per core: one process,
``torch.set_num_threads(1)``, a plain loop over every training image, img/s = images / CPU seconds
of the thread (``time.thread_time``); best of ``--repeats`` passes, the two interleaved. Each path
as a run's loader reads it: the folder's ``SeededDataset(image_folder(...), test_transform(K))``
against the same over the packed split (``--size`` K pixels: file or shard read, JPEG decode,
resize, centre crop); and the read alone (the file's bytes: ``open`` + ``read``; the shard's:
one ``pread``). The page cache holds both: this is CPU work, not disk.

**Start-up**, at ImageNet's file counts (``--files`` training images in ``--classes`` classes, 50
validation images a class): before the first step every rank holds both datasets. The folder's
figure is ``file_index.py``'s cached run (the file index loaded, one ``stat`` per folder; its
synthetic tree of empty files, made once under ``--tree-dir``); the packed figure is the same for
a synthetic packed folder of as many samples: ``shards.json``, the two indexes (real arrays, made
here) and its shards as sparse files of their declared sizes (``--shard-mib``, at the average size
of the JPEGs above: a start only ``stat``s the shards). Both with ``--ranks`` forked processes
after the launcher's check, as ``file_index.py`` measures it.

Run from the repository root:  .venv/bin/python benchmarks/packed_data.py  [--files 1281000]
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the package is not installed in .venv
sys.path.insert(0, str(Path(__file__).resolve().parent))
import file_index as folder_bench  # noqa: E402  (benchmarks/file_index.py)

from fixres_dist.data import packing, pipeline, shards  # noqa: E402
from fixres_dist.data.samplers import SampleKey  # noqa: E402
from input_pipeline import make_jpeg_folder  # noqa: E402


def read_paths(root: Path, packed: Path, size: int) -> dict:
    """name -> a function of an index: the four ways of the module docstring."""
    transform = pipeline.test_transform(size)
    folder = pipeline.image_folder(root, "train")
    ours = shards.open_packed(packed).dataset("train")
    folder_set, packed_set = (pipeline.SeededDataset(d, transform, seed=0) for d in (folder, ours))

    def folder_bytes(index):
        with open(folder.samples[index][0], "rb") as f:
            return f.read()
    return {"folder: read": folder_bytes, "shards: read": ours.read,
            f"folder: read, decode, test transform {size} px": lambda i: folder_set[SampleKey(index=i, epoch=1)],
            f"shards: read, decode, test transform {size} px": lambda i: packed_set[SampleKey(index=i, epoch=1)]}


def time_reads(paths: dict, images: int, repeats: int) -> dict[str, float]:
    """name -> best CPU img/s over ``repeats`` interleaved passes over ``images`` indices."""
    best = dict.fromkeys(paths, 0.0)
    for run in paths.values():
        run(0)  # first-call costs
    for _ in range(repeats):
        for name, run in paths.items():
            start = time.thread_time()
            for index in range(images):
                run(index)
            best[name] = max(best[name], images / (time.thread_time() - start))
    return best


def synthetic_pack(folder: Path, classes: int, train: int, val_per_class: int, image_bytes: int,
                   shard_mib: float) -> Path:
    """A packed folder of ``train`` + ``classes * val_per_class`` samples whose shards are sparse files
    (module docstring); made once, then reused."""
    root = folder / f"packed-{classes}x{train}+{val_per_class}-{image_bytes}-{shard_mib}"
    if (root / shards.MANIFEST).exists():
        return root
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    per_shard = max(1, int(shard_mib * 2 ** 20) // image_bytes)
    manifest = {"format": shards.FORMAT, "classes": [f"n{c:08d}" for c in range(classes)], "splits": {}}
    for split, count in (("train", train), ("val", classes * val_per_class)):
        shard = np.arange(count) // per_shard
        within = np.arange(count) % per_shard
        index = {"shard": shard.astype(np.int32), "offset": (within * (image_bytes + 1536) + 512).astype(np.int64),
                 "size": np.full(count, image_bytes, np.int64), "label": np.arange(count) % classes,
                 "key": np.array([f"{i:08d}".encode() for i in range(count)], dtype=bytes)}
        np.savez(root / shards.index_name(split), **index)
        entries = []
        for number, images in enumerate(np.bincount(shard)):
            name = f"{split}-{number:06d}.tar"
            size = int(images) * (image_bytes + 1536) + 1024
            with open(root / name, "wb") as f:
                f.truncate(size)  # sparse: no blocks
            entries.append({"name": name, "images": int(images), "bytes": size,
                            "sha256": hashlib.sha256(name.encode()).hexdigest()})  # never read: verify only
        manifest["splits"][split] = {"shards": entries, "index_sha256": shards.sha256(root / shards.index_name(split))}
    (root / shards.MANIFEST).write_text(json.dumps(manifest))
    return root


def packed_rank(root: Path, cache=None) -> None:
    """One rank's data before its first step on packed data: opened and checked, both datasets made."""
    data = shards.open_packed(root)
    assert len(data.dataset("train")) and len(data.dataset("val"))


def packed_check(root: Path, cache=None) -> None:
    """The launcher's check of packed data (``file_index.job_start``'s ``check``)."""
    shards.open_packed(root)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data-dir", type=Path, default=Path(tempfile.gettempdir()) / "fixres_packed_bench")
    parser.add_argument("--tree-dir", type=Path, default=Path(tempfile.gettempdir()) / "fixres_file_index_bench",
                        help="file_index.py's synthetic trees (made there once, or reused)")
    parser.add_argument("--images", type=int, default=1000, help="JPEGs of the read path (default %(default)s)")
    parser.add_argument("--size", type=int, default=224, help="test resolution of the read path (pixels)")
    parser.add_argument("--shard-mib", type=float, default=256)
    parser.add_argument("--files", type=int, default=200_000, help="training images of the start-up (default "
                        "%(default)s; ImageNet: 1281000)")
    parser.add_argument("--classes", type=int, default=1000)
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", metavar="FILE", help="write the figures here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    jpegs = make_jpeg_folder(args.data_dir / "jpegs", args.images, 20)
    packed = args.data_dir / "jpegs-packed"
    if not (packed / shards.MANIFEST).exists():
        packing.pack(jpegs, packed, min(args.shard_mib, 16), workers=1, progress=False)
    print(f"packed data: {args.images:,} JPEGs; {len(os.sched_getaffinity(0))} cores, load average "
          f"{os.getloadavg()[0]:.2f}; best of {args.repeats}", flush=True)
    rates = time_reads(read_paths(jpegs, packed, args.size), args.images, args.repeats)
    print("| read path, one core | img/s | shards / folder |\n|---|---:|---:|")
    names = list(rates)
    for folder_name, shard_name in ((names[0], names[1]), (names[2], names[3])):
        print(f"| {folder_name} | {rates[folder_name]:,.0f} | |")
        print(f"| {shard_name} | {rates[shard_name]:,.0f} | {rates[shard_name] / rates[folder_name]:.2f} |")
    image_bytes = int(np.mean([p.stat().st_size for p in (jpegs / "train").rglob("*.jpg")]))
    tree = folder_bench.make_tree(args.tree_dir, args.classes, args.files, 50)
    synthetic = synthetic_pack(args.data_dir, args.classes, args.files, 50, image_bytes, args.shard_mib)
    cache = Path(tempfile.mkdtemp(prefix="packed-bench-index-"))
    try:
        folder_bench.preflight(tree, cache)  # the index written: the cached run
        folder_start = folder_bench.best(args.repeats, lambda: folder_bench.job_start(tree, cache, args.ranks))
    finally:
        shutil.rmtree(cache)
    packed_start = folder_bench.best(
        args.repeats, lambda: folder_bench.job_start(synthetic, None, args.ranks, packed_check, packed_rank))
    shard_count = sum(len(s["shards"]) for s in shards.read_manifest(synthetic)["splits"].values())
    files = args.files + 50 * args.classes
    print(f"\n| start-up, {files:,} images, {args.ranks} ranks to their first step | seconds |\n|---|---:|")
    print(f"| image folder, cached file index ({files:,} files) | {folder_start:.3f} |")
    print(f"| packed, {shard_count:,} shards of {args.shard_mib:g} MiB | {packed_start:.3f} |")
    print(f"load average at the end {os.getloadavg()[0]:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"read_img_per_s": rates, "start_folder_s": folder_start,
                                               "start_packed_s": packed_start, "files": files,
                                               "shards": shard_count}, indent=1) + "\n")


if __name__ == "__main__":
    main()
