"""The data's file index at ImageNet scale: walking the folders against loading the index, per run and
for 8 ranks before their first step.

Builds (once; reused when it exists) a synthetic ImageFolder tree of empty files under ``--data-dir``:
``--classes`` (1,000) class folders in ``train/`` and ``val/``, ``--files`` training files in all
(default 1,281,000: ImageNet's 1,281 per class) and ``--val-per-class`` (50) validation files per
class, named like ImageNet's (``n00000000_17.JPEG``). Empty files cost an inode each and no blocks
(1.33 M inodes, a few hundred MB of folder entries). Then times, in seconds (best of
``--repeats``):

* torchvision's ``datasets.ImageFolder`` of ``train/`` and of ``val/``: one walk of the tree, what
  every rank of a plain torchvision script does;
* before the index: the preflight's check (:func:`fixres_dist.data.pipeline.check_image_folder`, one walk)
  and one rank's datasets (:func:`fixres_dist.data.pipeline.image_folder` of both splits, a second walk);
* first run: :func:`fixres_dist.data.file_index.data_index` without an index (the walk, recording each
  folder's stat) plus :meth:`~fixres_dist.data.file_index.DataIndex.save` (compress and write), and the
  file's size;
* cached run: ``data_index`` with the index there (load, and one ``stat`` per folder), then the
  datasets of both splits made from it;
* **time to the first step for 8 ranks** (``--ranks``), first run and cached run, and before the
  index: a real 8-rank training on 1.3 M empty files is not practical (they are no images, and on
  this machine's 2 cores the ranks' imports alone take minutes), so this measures exactly what a
  job does with the data before its first step: the preflight (index loaded or walked, the data
  checked from it, a walked index written; before: the check's walk), then ``--ranks`` processes at
  once, each making both datasets as a rank does (index loaded and checked, by
  :class:`fixres_dist.training.inputs.JobInputs`, then the datasets, by
  :class:`fixres_dist.data.job_data.JobData`; before: each walks the folders). The processes are forked
  from this one after its imports, so Python's and torch's import time (see
  ``process_group_ready.py``) is not counted. Wall clock from the preflight's start to the last
  rank holding its datasets.

Every figure is taken with the tree in the page cache (the tree was just made or walked), on a
local disk: on a network file system, where a listing or a ``stat`` is a round trip to the
server, the walks cost far more (minutes for ImageNet), while the cached run's cost (one ``stat``
per folder: 2,002 here) grows much less. The table's header gives the machine's cores and load
average: on a shared machine the 8-rank figures stretch with the load.

Run from the repository root:  .venv/bin/python benchmarks/file_index.py [--files 200000]
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the package is not installed in .venv
from torchvision import datasets

from fixres_dist.data import file_index, pipeline

DONE_MARK = ".complete"  # hidden: no part of the data (the walk never reads the root's own entries)


def make_tree(folder: Path, classes: int, train_files: int, val_per_class: int) -> Path:
    """The synthetic tree in ``folder`` (made unless complete); returns its root."""
    root = folder / f"{classes}x{train_files}+{val_per_class}"
    if (root / DONE_MARK).exists():
        return root
    shutil.rmtree(root, ignore_errors=True)
    start = time.monotonic()
    per_class = [train_files // classes + (c < train_files % classes) for c in range(classes)]
    for split, counts in (("train", per_class), ("val", [val_per_class] * classes)):
        for c, count in enumerate(counts):
            folder_c = root / split / f"n{c:08d}"
            folder_c.mkdir(parents=True)
            for i in range(count):
                os.close(os.open(folder_c / f"n{c:08d}_{i}.JPEG", os.O_CREAT | os.O_WRONLY, 0o644))
    (root / DONE_MARK).write_text("")
    time.sleep(file_index.RACY_MARGIN_NS / 1e9)  # let the last folders settle (else each check lists them again)
    print(f"made {root}: {train_files:,} train + {classes * val_per_class:,} val empty files in "
          f"{time.monotonic() - start:.0f} s", flush=True)
    return root


def best(repeats: int, function) -> float:
    """The fewest seconds ``function()`` took in ``repeats`` calls."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        times.append(time.perf_counter() - start)
    return min(times)


def rank_datasets(root: Path, cache: Path | None) -> None:
    """One rank's data before its first step (as JobInputs, then JobData): index loaded and checked (or
    walked), then both datasets; ``cache`` None: walk the folders, as before the index."""
    index = file_index.data_index(root, cache) if cache is not None else None
    train, val = pipeline.image_folder(root, "train", index), pipeline.image_folder(root, "val", index)
    assert len(train) and len(val)


def preflight(root: Path, cache: Path | None) -> None:
    """The launcher's part (launch.preflight, data only): the check, from the index when there is a cache."""
    if cache is None:
        pipeline.check_image_folder(root)
        return
    index = file_index.data_index(root, cache)
    pipeline.check_image_folder(root, index=index)
    index.save()


def job_start(root: Path, cache: Path | None, ranks: int, check=preflight, rank=rank_datasets) -> float:
    """Seconds from the launcher's ``check(root, cache)`` (default: :func:`preflight`) to every one of
    ``ranks`` forked processes done with ``rank(root, cache)`` (default: holding its datasets,
    :func:`rank_datasets`)."""
    context = multiprocessing.get_context("fork")
    start = time.perf_counter()
    check(root, cache)
    processes = [context.Process(target=rank, args=(root, cache)) for _ in range(ranks)]
    for process in processes:
        process.start()
    for process in processes:
        process.join()
    if any(p.exitcode for p in processes):
        raise SystemExit(f"a rank failed: exit codes {[p.exitcode for p in processes]}")
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data-dir", type=Path, default=Path(tempfile.gettempdir()) / "fixres_file_index_bench",
                        help="where the synthetic tree is made, or found (default %(default)s)")
    parser.add_argument("--files", type=int, default=1_281_000, help="training files in all (default %(default)s)")
    parser.add_argument("--classes", type=int, default=1000)
    parser.add_argument("--val-per-class", type=int, default=50)
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", metavar="FILE", help="write the figures here")
    args = parser.parse_args()
    root = make_tree(args.data_dir, args.classes, args.files, args.val_per_class)
    cache = Path(tempfile.mkdtemp(prefix="file-index-cache-"))
    try:
        figures = measure(root, cache, args)
    finally:
        shutil.rmtree(cache)
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1) + "\n")


def measure(root: Path, cache: Path, args) -> dict:
    files = args.files + args.classes * args.val_per_class
    print(f"file index: {files:,} files ({args.classes:,} classes) in {root}; {len(os.sched_getaffinity(0))} cores, "
          f"load average {os.getloadavg()[0]:.2f}; best of {args.repeats}", flush=True)
    figures = {"files": files, "classes": args.classes, "ranks": args.ranks, "load_average": os.getloadavg()[0]}
    figures["torchvision_walk_s"] = best(args.repeats, lambda: [datasets.ImageFolder(str(root / s)) for s in
                                                                 ("train", "val")])
    figures["before_walk_twice_s"] = best(args.repeats, lambda: (pipeline.check_image_folder(root),
                                                                  rank_datasets(root, None)))
    index_file = file_index.index_file(cache, root)

    def first_run():
        index_file.unlink(missing_ok=True)
        index = file_index.data_index(root, cache)
        assert index.built
        index.save()

    figures["build_and_save_s"] = best(args.repeats, first_run)
    figures["index_mb"] = index_file.stat().st_size / 2 ** 20
    loaded = []
    figures["load_and_check_s"] = best(args.repeats, lambda: loaded.append(file_index.data_index(root, cache)))
    assert not loaded[-1].built and not loaded[-1].racy_folders(), "the tree changed during the benchmark"
    figures["folders_checked"] = len(loaded[-1].folders)
    figures["datasets_from_index_s"] = best(args.repeats, lambda: [pipeline.image_folder(root, s, loaded[-1])
                                                                    for s in ("train", "val")])
    loaded.clear()
    figures["job_before_s"] = best(args.repeats, lambda: job_start(root, None, args.ranks))

    def first_job():
        index_file.unlink(missing_ok=True)
        return job_start(root, cache, args.ranks)

    figures["job_first_run_s"] = min(first_job() for _ in range(args.repeats))
    figures["job_cached_run_s"] = best(args.repeats, lambda: job_start(root, cache, args.ranks))
    rows = [("torchvision `datasets.ImageFolder`, train + val (one walk)", figures["torchvision_walk_s"]),
            ("before the index: preflight check + one rank's datasets (two walks)", figures["before_walk_twice_s"]),
            (f"first run: walk + write the index ({figures['index_mb']:.2f} MB)", figures["build_and_save_s"]),
            (f"cached run: load the index + check {figures['folders_checked']:,} folders",
             figures["load_and_check_s"]),
            ("cached run: one rank's datasets from the loaded index", figures["datasets_from_index_s"]),
            (f"{args.ranks} ranks to their first step, before the index (preflight walk, each rank walks)",
             figures["job_before_s"]),
            (f"{args.ranks} ranks to their first step, first run (preflight builds, ranks load)",
             figures["job_first_run_s"]),
            (f"{args.ranks} ranks to their first step, cached run (all load)", figures["job_cached_run_s"])]
    print("| what | seconds |\n|---|---:|")
    for what, seconds in rows:
        print(f"| {what} | {seconds:.3f} |")
    print(f"load average at the end {os.getloadavg()[0]:.2f}")
    return figures


if __name__ == "__main__":
    main()
