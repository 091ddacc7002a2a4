"""Pack a data folder into WebDataset tar shards with an index, and verify a packed folder.

    python -m fixres_dist.data.packing pack SOURCE OUT [--shard-size 256] [--workers N]
    python -m fixres_dist.data.packing verify OUT

``pack`` reads ``SOURCE/train`` and ``SOURCE/val`` as a run reads them (ImageFolder: hidden files
skipped, the same class folders in both, symbolic-link loops refused; :mod:`fixres_dist.data.pipeline`)
and writes into ``OUT`` what :mod:`fixres_dist.data.shards` reads: shards of about ``--shard-size``
MiB each (``train-000000.tar``, ...: every image file's bytes as they are, not decoded or
re-encoded, and its class number), the index of each split and ``shards.json``. Shards are written
by ``--workers`` processes at once, each into a hidden temporary file renamed when complete
(fsynced), so a killed pack leaves no half-written shard under a shard's name; ``shards.json`` comes
last. Run it again to continue: the temporary files are removed, and a shard already written with the
planned samples (same keys and image sizes) is kept; a finished pack of another source is never
packed over. Worker processes end with the command, however it ends. The shards are the same bytes whoever packs
them (members in order, mode 0444, time 0, no owner), so their SHA-256 identifies the data.

``verify`` reads every shard: its size and SHA-256 against ``shards.json``, and each shard indexed
again against the split's index. Each problem ends either command in one line naming the file, exit 1.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import fcntl
import hashlib
import io
import json
import math
import os
import re
import signal
import sys
import tarfile
from pathlib import Path

import attrs
import numpy as np
from tqdm import tqdm

from fixres_dist.data import pipeline, shards
from fixres_dist.entry import startup
from fixres_dist.errors import FixresError, plural, say
from fixres_dist.io import remove_stale_temporaries, write_private

SHARED = 0o644  # packed data is read by others (less the umask), unlike a run's own files
STATE = ".pack.json"  # the source, and each finished shard's plan digest and entry: what a continued pack keeps
LOCK = ".pack.lock"
# What a pack folder may hold: shards, indexes, the manifest, the state, the lock and temporary files.
OURS = re.compile(r"(train|val)-\d{6}\.tar|(train|val)\.index\.npz|shards\.json|\.pack\.(json|lock)|\..+\.tmp")


@attrs.frozen
class ShardPlan:
    """One shard to write: its file name, the split's number of its first sample (keys count from
    it) and its samples as ``(image file, class number)``."""

    name: str
    first: int
    samples: tuple[tuple[str, int], ...]

    def keys(self) -> list[str]:
        return [f"{self.first + number:08d}" for number in range(len(self.samples))]

    def digest(self) -> str:
        """SHA-256 of what the shard is made of: each sample's file (path, size, modification time)
        and class number. A finished shard is kept by a continued pack only if this is unchanged."""
        stats = [(path, (st := os.stat(path)).st_size, st.st_mtime_ns, label) for path, label in self.samples]
        return hashlib.sha256(json.dumps([self.name, self.first, stats]).encode()).hexdigest()


def plan(source: Path, shard_bytes: int) -> tuple[list[str], dict[str, list[ShardPlan]]]:
    """The class names of ``source`` and, for each split, its shards: consecutive samples in the
    ImageFolder's order, a new shard once one holds ``shard_bytes`` of image files. Raises
    :class:`FixresError` as a run does for a bad data folder."""
    classes = pipeline.check_image_folder(source)
    planned = {}
    for split in shards.SPLITS:
        samples = pipeline.image_folder(source, split).samples
        split_shards, current, size = [], [], 0
        for path, label in samples:
            current.append((path, label))
            size += os.stat(path).st_size
            if size >= shard_bytes:
                split_shards.append(current)
                current, size = [], 0
        if current:
            split_shards.append(current)
        first = np.cumsum([0] + [len(s) for s in split_shards])
        planned[split] = [ShardPlan(f"{split}-{number:06d}.tar", int(first[number]), tuple(s))
                          for number, s in enumerate(split_shards)]
    return classes, planned


def _member(name: str, size: int) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime = size, 0o444, 0
    return info


def write_shard(shard: ShardPlan, out: Path, num_classes: int) -> tuple[dict, shards.ShardIndex]:
    """Write ``shard`` into ``out`` (atomically: :func:`fixres_dist.io.write_private`, a hidden temporary
    file, fsynced, renamed); returns its ``shards.json`` entry and its index."""
    def write(file):
        with tarfile.open(fileobj=file, mode="w", format=tarfile.USTAR_FORMAT) as tar:
            for key, (path, label) in zip(shard.keys(), shard.samples):
                with open(path, "rb") as image:  # streamed: a large file is never held whole
                    tar.addfile(_member(f"{key}{Path(path).suffix.lower()}", os.fstat(image.fileno()).st_size), image)
                text = str(label).encode()
                tar.addfile(_member(f"{key}.cls", len(text)), io.BytesIO(text))
    final = write_private(out / shard.name, write, SHARED)
    found = shards.index_shard(final, num_classes)
    return _entry(final, found), found


def kept_shard(shard: ShardPlan, out: Path, num_classes: int, entry: dict) -> tuple[dict, shards.ShardIndex]:
    """A shard this pack finished before (``entry``: its ``shards.json`` entry then), indexed again."""
    return entry, shards.index_shard(out / shard.name, num_classes)


def _entry(path: Path, found: shards.ShardIndex) -> dict:
    return {"name": path.name, "images": len(found.keys), "bytes": path.stat().st_size, "sha256": shards.sha256(path)}


def pack(source: str | Path, out: str | Path, shard_mib: float = 256, workers: int = 1,
         progress: bool = True) -> dict:
    """Pack ``source`` into ``out`` (module docstring); returns ``shards.json``'s content (with
    ``kept``: the shards a continued pack kept). Raises :class:`FixresError` for a bad data folder, an
    ``out`` it must not write into (:func:`_check_destination`), another pack into ``out`` running,
    or a file it cannot read or write."""
    source, out = Path(source), Path(out)
    if not math.isfinite(shard_mib) or shard_mib <= 0:
        raise FixresError(f"--shard-size must be a positive number of MiB; got {shard_mib}")
    classes, planned = plan(source, int(shard_mib * 2 ** 20))
    state = _check_destination(source, out)
    with _locked(out):
        try:
            return _pack(source, out, classes, planned, state, workers, progress)
        except OSError as exc:
            raise FixresError(f"cannot pack into {out}: {exc.strerror or exc}"
                              f"{f' ({exc.filename})' if exc.filename else ''}; run the command again to "
                              "continue") from None


def _pack(source: Path, out: Path, classes: list[str], planned: dict[str, list[ShardPlan]], state: dict,
          workers: int, progress: bool) -> dict:
    remove_stale_temporaries(out)  # of a killed pack
    (out / shards.MANIFEST).unlink(missing_ok=True)  # incomplete from here until the new one is written
    state = {"source": str(source.resolve()), "shards": state.get("shards", {})}
    jobs = [(split, shard, shard.digest()) for split in shards.SPLITS for shard in planned[split]]
    results, kept = {}, 0
    pool = concurrent.futures.ProcessPoolExecutor(max(1, workers), initializer=startup.die_with_parent)
    try:
        futures = {}
        for split, shard, digest in jobs:
            done = state["shards"].get(shard.name, {})
            if done.get("digest") == digest and _size(out / shard.name) == done["entry"]["bytes"]:
                futures[pool.submit(kept_shard, shard, out, len(classes), done["entry"])] = (shard.name, digest, True)
            else:
                futures[pool.submit(write_shard, shard, out, len(classes))] = (shard.name, digest, False)
        for future in tqdm(concurrent.futures.as_completed(futures), total=len(futures), desc="packing",
                           unit="shard", disable=not progress):
            entry, found = future.result()
            name, digest, was_kept = futures[future]
            results[name], kept = (entry, found), kept + was_kept
            state["shards"][name] = {"digest": digest, "entry": entry}
            write_private(out / STATE, json.dumps(state), SHARED)
    finally:
        pool.shutdown(wait=True, cancel_futures=True)  # on a failure: no queued shard starts
    manifest = {"format": shards.FORMAT, "source": state["source"], "classes": classes, "splits": {}}
    for split in shards.SPLITS:
        entries = [results[shard.name] for shard in planned[split]]
        index_path = out / shards.index_name(split)
        write_private(index_path, lambda f, e=entries: np.savez(f, **_index_arrays(e)), SHARED)
        manifest["splits"][split] = {"shards": [entry for entry, _ in entries],
                                     "index_sha256": shards.sha256(index_path)}
    write_private(out / shards.MANIFEST, json.dumps(manifest, indent=1), SHARED)
    named = {shard.name for _, shard, _ in jobs}
    for old in out.glob("*.tar"):
        if old.name not in named:  # of an earlier pack of this source with another shard size
            old.unlink()
    return {**manifest, "kept": kept}


def _size(path: Path) -> int | None:
    try:
        return path.stat().st_size
    except OSError:
        return None


@contextlib.contextmanager
def _locked(out: Path):
    """One pack into ``out`` at a time (``flock`` on ``out/.pack.lock``, released when the process ends)."""
    descriptor = os.open(out / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            raise FixresError(f"another pack into {out} is running; wait for it to end") from None
        yield
    finally:
        os.close(descriptor)


def _check_destination(source: Path, out: Path) -> dict:
    """``out`` made if need be; returns what an earlier pack of ``source`` into it recorded (:data:`STATE`;
    empty for a new folder). Raises :class:`FixresError` for ``out`` inside ``source``, a file, a
    folder holding other files or shards this command did not write, or a pack of another source."""
    if out.resolve().is_relative_to(source.resolve()):
        raise FixresError(f"cannot pack into {out}: it is inside the data folder {source} (it would become part of "
                          "the data); pack into a folder outside it")
    try:
        out.mkdir(parents=True, exist_ok=True)
        names = [p.name for p in out.iterdir()]
    except OSError as exc:
        raise FixresError(f"cannot pack into {out}: {exc.strerror or exc}") from None
    foreign = [name for name in names if not OURS.fullmatch(name)]
    if foreign:
        raise FixresError(f"{out} holds files that are not a pack's ({', '.join(sorted(foreign)[:3])}): pack into a "
                          "new or empty folder")
    try:
        state = json.loads((out / STATE).read_text())
        earlier = state["source"]
    except FileNotFoundError:
        if any(name.endswith((".tar", ".npz", ".json")) for name in names):
            raise FixresError(f"{out} holds shards that this command did not write (no {STATE}): pack into a new or "
                              "empty folder") from None
        return {}
    except (OSError, ValueError, KeyError, TypeError):
        raise FixresError(f"{out / STATE} is damaged: pack into a new or empty folder") from None
    if earlier != str(source.resolve()):
        raise FixresError(f"{out} holds a pack of {earlier}, not of {source}: packing would replace that data (and a "
                          "job resuming on it would refuse it); pack into a new folder, or remove this one first")
    return state


def _index_arrays(entries: list[tuple[dict, shards.ShardIndex]]) -> dict[str, np.ndarray]:
    found = [index for _, index in entries]
    return {"shard": np.concatenate([np.full(len(f.keys), n, np.int32) for n, f in enumerate(found)]),
            "offset": np.concatenate([f.offsets for f in found]), "size": np.concatenate([f.sizes for f in found]),
            "label": np.concatenate([f.labels for f in found]),
            "key": np.array([key.encode() for f in found for key in f.keys], dtype=bytes)}


def verify(out: str | Path, workers: int = 1, progress: bool = True) -> str:
    """Read every shard of the packed folder ``out`` (module docstring); returns a one-line summary.
    Raises :class:`FixresError` naming the first shard or index that does not match."""
    out = Path(out)
    if not shards.is_packed(out):
        raise FixresError(f"{out} is not a packed data folder (no {shards.MANIFEST}, no tar shards)")
    data = shards.open_packed(out)
    jobs = [(split, number, entry) for split in shards.SPLITS
            for number, entry in enumerate(data.manifest["splits"][split]["shards"])]
    pool = concurrent.futures.ProcessPoolExecutor(max(1, workers), initializer=startup.die_with_parent)
    try:
        futures = [pool.submit(_check_shard, out / entry["name"], entry["sha256"], len(data.classes))
                   for _, _, entry in jobs]
        for (split, number, entry), future in tqdm(zip(jobs, futures), total=len(jobs), desc="verifying",
                                                   unit="shard", disable=not progress):
            found = future.result()
            index = data.indexes[split]
            mine = index["shard"] == number
            if ([key.decode() for key in index["key"][mine]] != found.keys
                    or not np.array_equal(index["offset"][mine], found.offsets)
                    or not np.array_equal(index["size"][mine], found.sizes)
                    or not np.array_equal(index["label"][mine], found.labels)):
                raise FixresError(f"shard {out / entry['name']} does not match the index {shards.index_name(split)}: "
                                  "pack the data again")
    except OSError as exc:
        raise FixresError(f"cannot read {exc.filename or out}: {exc.strerror or exc}") from None
    finally:
        pool.shutdown(wait=True, cancel_futures=True)  # the first problem ends it: no queued shard is read
    images = sum(data.images(split) for split in shards.SPLITS)
    return f"{out}: verified {plural(len(jobs), 'shard')}, {images:,} images, {len(data.classes)} classes"


def _check_shard(path: Path, digest: str, num_classes: int) -> shards.ShardIndex:
    if shards.sha256(path) != digest:
        raise FixresError(f"shard {path}: its SHA-256 is not the one in {shards.MANIFEST} (changed or damaged since "
                          "packing): pack the data again")
    return shards.index_shard(path, num_classes)


def _interrupted(signum, frame):
    """SIGTERM ends the command as Ctrl-C does: one line (the workers end with it)."""
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fixres_dist.data.packing",
                                     description="pack a data folder into WebDataset tar shards, or verify a pack")
    commands = parser.add_subparsers(dest="command", required=True)
    packing = commands.add_parser("pack", help="pack SOURCE (train/ and val/ class folders) into OUT")
    packing.add_argument("source", help="the data folder (train/ and val/ with one folder per class)")
    packing.add_argument("out", help="the folder to write the shards into (new, or a pack to continue)")
    packing.add_argument("--shard-size", type=float, default=256,
                         help="MiB of image files per shard (default 256; a tar adds 1 KiB per image)")
    checking = commands.add_parser("verify", help="read every shard of OUT and check it")
    checking.add_argument("out", help="a packed folder")
    for sub in (packing, checking):
        sub.add_argument("--workers", type=int, default=min(8, os.cpu_count() or 1),
                         help="processes that pack or read shards at once (default: the CPUs, at most 8)")
        sub.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, _interrupted)
    try:
        if args.command == "verify":
            print(verify(args.out, args.workers, not args.no_progress))
            return 0
        manifest = pack(args.source, args.out, args.shard_size, args.workers, not args.no_progress)
    except FixresError as exc:
        say(f"fixres_dist: {exc}")
        return 1
    except KeyboardInterrupt:
        say(f"fixres_dist: {args.command} interrupted" + ("; run the same command again to continue (finished "
                                                            "shards are kept)" if args.command == "pack" else ""))
        return 130
    written = {split: manifest["splits"][split]["shards"] for split in shards.SPLITS}
    counts = ", ".join(f"{sum(s['images'] for s in written[split]):,} {split} images in "
                       f"{plural(len(written[split]), 'shard')}" for split in shards.SPLITS)
    kept = f" ({manifest['kept']} already written, kept)" if manifest["kept"] else ""
    print(f"{args.out}: {counts}{kept}, {len(manifest['classes'])} classes; use it as --data-path")
    return 0


if __name__ == "__main__":
    sys.exit(main())
