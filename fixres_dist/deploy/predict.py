"""``python -m fixres_dist.deploy.predict MODEL DATA --out FILE``: top-k class names and probabilities of
every image of ``DATA``, on 1 or N ranks.

``MODEL``: an export folder or a checkpoint of this project (:mod:`fixres_dist.deploy.exported`); ``DATA``:
a folder of images, packed shards or a Hugging Face dataset (:mod:`fixres_dist.deploy.prediction_data`);
``FILE``: CSV, JSON lines or parquet (:mod:`fixres_dist.deploy.prediction_files`). Each image goes
through the model's test transform (the one evaluation uses) and the softmax of its logits (float32).

Every image exactly once, and the same file whatever the world size: the data, in its order, is cut into
fixed batches of ``--batch`` images (the last one shorter), and whole batches are dealt to the ranks in
turn (batch ``b`` to rank ``b mod N``), so each image is computed in the same batch, hence with the same
logits bit for bit, on 1, 2 or 3 ranks (on this CPU the logits were also the same for 1, 2 and 3 threads).
Each rank writes its part (``part-<rank>.npz``) into a work folder beside ``FILE``
(``.<FILE name>.predict``, where the ranks also meet: a file rendezvous unless torchrun's or ``--dist-url``
says otherwise); rank 0 merges the parts in the data's order into ``FILE``, atomically, then removes the
work folder. A failure on any rank (a bad image with ``--on-bad-image error``, a full disk, a rank that died,
Ctrl-C) is one line and leaves no ``FILE`` and no work folder (:func:`run_rank`, :func:`spawn`; only a
killed rank 0 of ranks started apart leaves it, for the next run to reuse). The work folder's lock
(:func:`lock_work_folder`) refuses a second predict writing the same ``FILE``.

Ranks as the scripts take them (:func:`fixres_dist.distributed.placement.resolve_placement`): explicit
``--num-tasks/--global-rank/--local-rank``, torchrun's or SLURM's environment, else ``--num-tasks N``
spawns N local ranks.
"""
from __future__ import annotations

import functools
import multiprocessing.connection
import multiprocessing.forkserver
import multiprocessing.resource_tracker
import os
import shutil
import signal
import sys
import time
from pathlib import Path

import attrs
import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils.data import DataLoader

from fixres_dist import locks
from fixres_dist.arguments import Formatter, OneLineParser, non_negative_int, positive_int
from fixres_dist.data import pipeline
from fixres_dist.data.samplers import SampleKey
from fixres_dist.deploy import export, exported, prediction_data, prediction_files
from fixres_dist.distributed import collectives, orphans, placement, rendezvous
from fixres_dist.distributed.preemption import INTERRUPTED_EXIT_STATUS, ignoring, loader_worker_init, stop_with_launcher
from fixres_dist.errors import FixresError, first_line, say, user_message
from fixres_dist.io import write_private

DEFAULT_TOPK = 5
DEFAULT_BATCH = 32
DIST_TIMEOUT_S = 300.0  # seconds the ranks wait for each other
GRACE_S = 10.0  # seconds the other ranks have to end after one failed, before they are killed
LOCK_FILE = "lock"  # in the work folder: held by the predict writing OUT (its pid and host inside)
STOPPED = "predict stopped by SIGINT; nothing written"


@attrs.frozen
class Request:
    """One prediction, as the command line gives it (the flags' meanings in :func:`parser`)."""

    model: str
    data: str
    out: Path
    fmt: str
    topk: int = DEFAULT_TOPK
    batch: int = DEFAULT_BATCH
    workers: int = 0
    skip_bad_images: bool = False
    split: str = "val"
    weights: str = "model"
    job_id: str | None = None

    @property
    def work_folder(self) -> Path:
        """Where the ranks meet and write their parts: beside the output."""
        return self.out.parent / f".{self.out.name}.predict{'-' + self.job_id if self.job_id else ''}"


def check_request(request: Request, overwrite: bool) -> None:
    """Raise :class:`FixresError` for an output that cannot be written (its folder missing or unwritable,
    a folder of that name) or exists without ``overwrite``."""
    out = request.out
    if not out.parent.is_dir():
        raise FixresError(f"--out {out}: its folder {out.parent} does not exist")
    if not os.access(out.parent, os.W_OK | os.X_OK):
        raise FixresError(f"--out {out}: its folder {out.parent} is not writable")
    if out.is_dir():
        raise FixresError(f"--out {out} is a folder; give a file name")
    if out.exists() and not overwrite:
        raise FixresError(f"--out {out} exists; pass --overwrite to replace it, or give another file")


def open_inputs(request: Request):
    """The model and data of ``request``; raises :class:`FixresError` for either, a ``--topk`` above
    the model's classes, or packed data whose ``--max-side`` is below the model's resize."""
    model = exported.open_model(request.model, request.weights)
    if request.topk > model.num_classes:
        raise FixresError(f"--topk {request.topk} is more than the model's {model.num_classes} classes")
    data = prediction_data.open_data(request.data, request.split, request.work_folder)
    packed = getattr(data, "packed", None)  # packed with --max-side: enough pixels for the model's resize?
    if packed is not None:
        packed.check_sizes({f"the model's test resolution {model.input_size} px (resized to {model.resize_size} on "
                            "the shorter side)": (model.resize_size, 0)}, f"data {request.data}", smaller=False)
    return model, data


def batches(images: int, batch: int) -> list[list[int]]:
    """The data's fixed batches: indices ``[b * batch, (b + 1) * batch)``, the last one shorter."""
    return [list(range(start, min(start + batch, images))) for start in range(0, images, batch)]


class _Images(pipeline.SeededDataset):
    skip_flag = "--on-bad-image skip"


@torch.no_grad()
def top_k(net: torch.nn.Module, model: exported.ExportedModel, images: torch.Tensor, k: int):
    """The top ``k`` of a uint8 (B, 3, H, W) batch of test-transformed images: ``(probabilities, classes)``,
    float32 and int64 (B, k), most probable first (the softmax of ``net``'s float32 logits)."""
    logits = net(pipeline.normalize(images, model.normalization)).float()
    return torch.softmax(logits, dim=1).topk(k, dim=1)


def predict_part(request: Request, model: exported.ExportedModel, data, mine: list[list[int]]) -> dict:
    """Run ``mine`` (batches of data indices) through ``model``; returns numpy arrays ``index`` (N,), ``classes``
    (N, k) int64, ``probabilities`` (N, k) float32 and ``skipped`` (the indices of bad images skipped).
    Raises :class:`FixresError` naming a bad image unless ``request.skip_bad_images``."""
    net = model.build()
    keys = [[SampleKey(i, 0) for i in batch] for batch in mine]
    # Whole JPEGs: the pixels model.json's preprocessing promises to anyone who decodes them with Pillow.
    loader = DataLoader(_Images(data, model.transform(), 0, request.skip_bad_images, "full"), batch_sampler=keys,
                        num_workers=request.workers, collate_fn=list,
                        multiprocessing_context="fork" if request.workers else None,
                        worker_init_fn=functools.partial(loader_worker_init, (), os.getpid())  # die with this rank
                        if request.workers else None)
    index, classes, probabilities, skipped = [], [], [], []
    for batch, samples in zip(mine, loader):
        good = [(i, sample[0]) for i, sample in zip(batch, samples) if sample is not None]
        skipped += [i for i, sample in zip(batch, samples) if sample is None]
        if good:
            values, rows = top_k(net, model, torch.stack([image for _, image in good]), request.topk)
            index += [i for i, _ in good]
            classes.append(rows.numpy())
            probabilities.append(values.numpy())
    k = request.topk
    return {"index": np.asarray(index, np.int64), "skipped": np.asarray(skipped, np.int64),
            "classes": np.concatenate(classes) if classes else np.zeros((0, k), np.int64),
            "probabilities": np.concatenate(probabilities) if probabilities else np.zeros((0, k), np.float32)}


def _part(work: Path, rank: int) -> Path:
    return work / f"part-{rank}.npz"


def merge(request: Request, model: exported.ExportedModel, data, world: int) -> str:
    """Rank 0: the ranks' parts in the data's order, written to ``request.out``; returns the summary line."""
    parts = []
    for rank in range(world):
        with np.load(_part(request.work_folder, rank)) as part:
            parts.append({name: part[name] for name in part.files})
    index = np.concatenate([p["index"] for p in parts])
    order = np.argsort(index, kind="stable")
    classes = np.concatenate([p["classes"] for p in parts])[order]
    names = [[model.class_names[c] for c in row] for row in classes.tolist()]
    prediction_files.write(request.out, request.fmt, [data.ids[i] for i in index[order].tolist()], names,
                           np.concatenate([p["probabilities"] for p in parts])[order])
    skipped = np.sort(np.concatenate([p["skipped"] for p in parts]))
    first = f": first: {data.item_name(int(skipped[0]))}" if len(skipped) else ""
    return f"{request.out}: {len(index)} images, {len(skipped)} skipped{first}"


def lock_work_folder(request: Request) -> int:
    """Make the work folder and hold its lock (``flock``, :mod:`fixres_dist.locks`: it dies with this
    process); returns the lock file's descriptor, this process's pid and host written in it. Raises
    :class:`FixresError` in one line when another predict writing the same ``--out`` holds it (naming
    its pid and host), or the folder cannot be made or locked."""
    work = request.work_folder
    lock = work / LOCK_FILE
    for _ in range(3):  # a folder removed between our open and our lock (its predict ended): again
        try:
            work.mkdir(mode=0o700, exist_ok=True)
            fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as exc:
            raise FixresError(f"cannot make the work folder {work}: {exc.strerror or exc}") from None
        try:
            if not locks.try_lock(fd, lock, "two predicts writing the same --out would not be kept apart"):
                pid, host = (os.pread(fd, 300, 0).decode(errors="replace").split() + ["?", "?"])[:2]
                raise FixresError(f"--out {request.out} is being written by another predict (pid {pid} on host "
                                  f"{host}); wait for it to end, or give another --out")
            if lock.exists() and os.path.samestat(os.fstat(fd), lock.stat()):
                os.ftruncate(fd, 0)
                os.pwrite(fd, f"{os.getpid()} {os.uname().nodename}\n".encode(), 0)
                return fd
        except OSError as exc:
            os.close(fd)
            raise FixresError(f"cannot write {lock}: {exc.strerror or exc}") from None
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)
    raise FixresError(f"cannot lock {lock}: the folder keeps being removed by another predict")


def remove_work_folder(request: Request, lock: int | None = None) -> None:
    """The work folder removed (its parts, rendezvous file and lock), then ``lock`` released."""
    shutil.rmtree(request.work_folder, ignore_errors=True)
    if lock is not None:
        os.close(lock)


def _lost(exc: BaseException, meeting) -> str | None:
    """After a failed collective: ``lost rank R (host H...); stopping`` naming the peers that died or
    vanished (:meth:`~fixres_dist.distributed.rendezvous.Rendezvous.lost_peers`), else the failure in one
    line; None for an exception that is no collective's failure (a bug: re-raised)."""
    if not collectives.is_collective_failure(exc):
        return None
    gone = meeting.lost_peers() if meeting is not None else ""
    return str(rendezvous.LostPeers(gone)) if gone else f"a collective failed: {first_line(exc)}"


def _share(request: Request, rank: int, world: int, inputs, owner: bool) -> tuple[str, str]:
    """This rank's batches predicted and written as its part; the first failure of any rank, or rank 0's
    merge of the parts into the file, as ``("done", summary line)`` or ``("fail", line)`` on every rank.
    Rank 0 removes the work folder once the file is written, or after a failure where it ``owner``s it."""
    failure = None
    try:
        model, data = inputs or open_inputs(request)
        part = predict_part(request, model, data, batches(len(data), request.batch)[rank::world])
        try:
            write_private(_part(request.work_folder, rank), lambda f: np.savez(f, **part))
        except OSError as exc:
            raise FixresError(f"cannot write {_part(request.work_folder, rank)}: {exc.strerror or exc}") from None
    except Exception as exc:  # a FixresError, also one a loader worker raised: ends every rank
        failure = user_message(exc)
        if failure is None:
            raise
    failures = collectives.gather_object(failure)
    outcome = None
    if rank == 0:
        failure = next((f for f in failures if f is not None), None)
        try:
            outcome = ("fail", failure) if failure else ("done", merge(request, model, data, world))
        except FixresError as exc:
            outcome = ("fail", str(exc))
        if owner or outcome[0] == "done":
            shutil.rmtree(request.work_folder, ignore_errors=True)
    return collectives.broadcast_object(outcome)


def run_rank(request: Request, rank: int, world: int, dist_url: str | None = None, inputs=None,
             spawned: bool = False) -> int:
    """This rank's share (module docstring); rank 0 prints the summary line (stdout) or the first
    failure (stderr, one line). ``inputs``: the model and data, when the caller opened them. ``spawned``:
    started by :func:`spawn`, which holds the work folder's lock and itself reports a rank that died and
    Ctrl-C (this rank is then silent about them), else rank 0 takes the lock. Returns the exit status: 0,
    1 when any rank failed (also a peer lost: one line naming it), 130 after Ctrl-C (SIGINT); rank 0
    removes the work folder whenever the run fails."""
    work = request.work_folder
    if world > 1 and not os.environ.get("OMP_NUM_THREADS"):  # the node's cores shared by its ranks
        torch.set_num_threads(placement.threads_per_rank(world))
    outcome = meeting = lock = None
    owner = rank == 0 and not spawned  # removes the work folder when the run fails (spawned: the parent, locked)
    try:
        try:
            if rank == 0 and not spawned:
                owner = False  # until the lock is ours: the folder may be another predict's
                lock = lock_work_folder(request)
                owner = True
            work.mkdir(mode=0o700, exist_ok=True)
            meeting = collectives.init_process_group("gloo", dist_url or f"file://{work / 'rendezvous'}", rank, world,
                                                     DIST_TIMEOUT_S)
        except (FixresError, OSError) as exc:
            if not (spawned and isinstance(exc, rendezvous.LostPeers)):
                say(f"fixres_dist: rank {rank}: {exc}")
            return 1
        try:
            outcome = _share(request, rank, world, inputs, owner)
        except (RuntimeError, dist.DistError) as exc:  # a peer died or vanished
            lost = _lost(exc, meeting)
            if lost is None:
                raise
            if not spawned:
                say(f"fixres_dist: rank {rank}: {lost}")
            return 1
        finally:
            if meeting is not None:
                meeting.stop_heartbeat()
            collectives.destroy_process_group()
    except KeyboardInterrupt:
        if not spawned:
            say(f"fixres_dist: {'' if world == 1 else f'rank {rank}: '}{STOPPED}")
        return INTERRUPTED_EXIT_STATUS
    finally:
        if outcome is None or outcome[0] != "done":
            if owner:
                remove_work_folder(request)
        if lock is not None:
            os.close(lock)
    done, line = outcome
    if rank == 0 and done == "done":
        print(line, flush=True)
    elif rank == 0:
        say(f"fixres_dist: {line}")
    return 0 if done == "done" else 1


def _spawned(index: int, request: Request, world: int) -> None:
    stop_with_launcher()  # a launcher killed (SIGKILL) ends its ranks, as training's does
    os.environ[rendezvous.ONE_HOST] = "1"  # rank 0's store listens on loopback only
    code = run_rank(request, index, world, spawned=True)
    if code:
        raise SystemExit(code)


def _how_ended(code: int) -> str:
    return f"ended by {signal.Signals(-code).name}" if code < 0 else f"exited with status {code}"


def _wait_for_ranks(processes) -> tuple[int, int] | None:
    """Wait until every rank has ended; returns ``(rank, exit code)`` of the first that died (a signal, a crash:
    the others are killed at once), or None. After a rank failed otherwise, the others have :data:`GRACE_S`."""
    died, deadline = None, None
    while any(p.exitcode is None for p in processes):
        multiprocessing.connection.wait([p.sentinel for p in processes if p.exitcode is None], timeout=1.0)
        ended = [(rank, p.exitcode) for rank, p in enumerate(processes) if p.exitcode not in (None, 0)]
        died = died or next(((r, c) for r, c in ended if c not in (1, INTERRUPTED_EXIT_STATUS)), None)
        if deadline is None and ended:
            deadline = time.monotonic() + (0 if died else GRACE_S)
        if deadline is not None and time.monotonic() >= deadline:
            for p in processes:
                p.kill()
    return died


def spawn(request: Request, world: int) -> int:
    """Hold the work folder's lock, start ``world`` local ranks (forked from a forkserver that imported
    this module once) and wait for them all; returns 0, 1 when a rank failed, 130 after Ctrl-C. A rank
    that died (a signal, a crash: it said nothing) is named in one line (``rank 1 ended by SIGKILL``) and
    the others are ended at once; a rank that failed alone otherwise (the others wait for it in a
    collective) has the others ended :data:`GRACE_S` seconds later; what the ranks leave (loader workers) is
    killed once they have ended (:func:`fixres_dist.distributed.orphans.adopting_orphans`). The work folder is
    removed unless the run succeeded."""
    lock = lock_work_folder(request)
    method = "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"
    with ignoring((signal.SIGINT,)):  # helpers started now (forkserver, resource tracker) ignore Ctrl-C
        multiprocessing.resource_tracker.ensure_running()
        if method == "forkserver":
            mp.set_forkserver_preload([__name__])
            multiprocessing.forkserver.ensure_running()
    processes, died, code = [], None, 1
    with orphans.adopting_orphans() as keep:  # nor anything a rank leaves (its loader workers)
        try:
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})  # a Ctrl-C meanwhile: once they are known
            try:
                processes = mp.start_processes(_spawned, args=(request, world), nprocs=world, join=False,
                                               start_method=method).processes
                keep.update(p.pid for p in processes)
            finally:
                signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
            died = _wait_for_ranks(processes)
            code = 0 if all(p.exitcode == 0 for p in processes) else 1
        except KeyboardInterrupt:  # Ctrl-C: the ranks (which ignore it, as the forkserver) end now
            code = INTERRUPTED_EXIT_STATUS
        finally:  # no rank outlives this call
            for p in processes:
                if p.exitcode is None:
                    p.terminate()
                    p.join()
    if code == INTERRUPTED_EXIT_STATUS and processes and all(p.exitcode == 0 for p in processes):
        code = 0  # too late: the ranks had written FILE (rank 0 said so)
    elif code == INTERRUPTED_EXIT_STATUS:
        say(f"fixres_dist: {STOPPED}")
    if code:
        remove_work_folder(request, lock)
    else:
        os.close(lock)
    if died is not None and code == 1:
        say(f"fixres_dist: rank {died[0]} {_how_ended(died[1])}; stopped the other ranks, nothing written")
    return code


def parser() -> OneLineParser:
    """The command line (module docstring)."""
    p = OneLineParser(prog="python -m fixres_dist.deploy.predict", formatter_class=Formatter,
                      description="top-k class names and probabilities of every image of DATA, on 1 or N ranks")
    p.add_argument("model", metavar="MODEL", help="an export folder (fixres_dist.deploy.export) or a checkpoint")
    p.add_argument("data", metavar="DATA", help="a folder of images (at any depth), packed shards or a Hugging "
                   "Face dataset (saved or parquet)")
    p.add_argument("--out", required=True, metavar="FILE", type=Path,
                   help="the predictions file (must not exist, unless --overwrite)")
    p.add_argument("--format", choices=sorted(set(prediction_files.FORMATS.values())),
                   help="csv, jsonl or parquet (default: from --out's suffix)")
    p.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    p.add_argument("--topk", metavar="K", type=positive_int, default=DEFAULT_TOPK,
                   help=f"classes per image, most probable first (default {DEFAULT_TOPK})")
    p.add_argument("--batch", metavar="N", type=positive_int, default=DEFAULT_BATCH,
                   help=f"images per batch; the batches are the same on any number of ranks (default {DEFAULT_BATCH})")
    p.add_argument("--workers", metavar="N", type=non_negative_int, default=0,
                   help="data loader worker processes per rank (default 0)")
    p.add_argument("--on-bad-image", choices=("error", "skip"), default="error",
                   help="an image that cannot be read: stop, naming it (default), or skip it and count it")
    p.add_argument("--split", choices=("train", "val"), default="val",
                   help="the split of packed shards or a Hugging Face dataset (default val)")
    p.add_argument("--weight-key", choices=export.ENTRIES, default="model",
                   help="a checkpoint's weights: the trained ones or their moving average (default model)")
    p.add_argument("--num-tasks", metavar="N", type=positive_int,
                   help="ranks in all; alone: spawn that many local ranks")
    p.add_argument("--global-rank", metavar="R", type=int, help="this process's rank (with --num-tasks)")
    p.add_argument("--local-rank", metavar="L", type=int, help="this process's rank on its node")
    p.add_argument("--job-id", help="names the work folder beside --out (default: SLURM's job id, or none)")
    p.add_argument("--dist-url", help="where the ranks meet (default: a file beside --out; torchrun: env://)")
    return p


def main(argv: list[str] | None = None) -> int:
    """Run the command; returns the exit status (0, or 1 with one line on stderr; usage errors exit 2)."""
    args = parser().parse_args(argv)
    try:
        return _main(args)
    except KeyboardInterrupt:  # Ctrl-C before any rank started (the model or data being read)
        say(f"fixres_dist: {STOPPED}")
        return INTERRUPTED_EXIT_STATUS


def _main(args) -> int:
    try:
        where = placement.resolve_placement(args.num_tasks, args.global_rank, args.local_rank, args.job_id,
                                            args.dist_url)
        request = Request(args.model, args.data, args.out, prediction_files.format_of(args.out, args.format),
                          args.topk, args.batch, args.workers, args.on_bad_image == "skip", args.split,
                          args.weight_key, where.job_id)
        check_request(request, args.overwrite)
        inputs = open_inputs(request) if where.source in ("spawn", "single") else None
    except FixresError as exc:
        say(f"fixres_dist: {exc}")
        return 1
    if where.source == "spawn":
        try:
            return spawn(request, where.num_tasks)
        except FixresError as exc:  # the work folder is another predict's
            say(f"fixres_dist: {exc}")
            return 1
    return run_rank(request, where.global_rank, where.num_tasks, where.dist_url, inputs)


if __name__ == "__main__":
    sys.exit(main())
