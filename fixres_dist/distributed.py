"""Where a process sits in a job (rank resolution) and how the ranks meet (rendezvous).

Rank resolution follows one precedence, highest first (DESIGN.md):

1. explicit flags ``--global-rank/--local-rank`` with ``--num-tasks``;
2. torchrun's ``RANK / LOCAL_RANK / WORLD_SIZE`` (and ``MASTER_ADDR / MASTER_PORT``);
3. SLURM's ``SLURM_PROCID / SLURM_LOCALID / SLURM_NTASKS / SLURM_JOB_ID`` (what submitit's
   ``JobEnvironment`` reports too);
4. none of these and ``--num-tasks N > 1``: spawn N local ranks from this one command;
5. otherwise one process (world size 1, no process group).

A value given by two sources that disagree (``--num-tasks 4`` with ``WORLD_SIZE=2``) is an error.

Rendezvous. ``tcp://HOST:PORT`` and ``env://`` are the usual TCPStore rendezvous (rank 0 hosts the
store). ``file://PATH`` (the default, ``<shared>/<job-id>/rendezvous.json``) is a *published*
TCPStore: rank 0 opens a store on a free port and atomically writes its address and a random nonce
to PATH; the other ranks poll PATH, connect, and check the nonce. Ranks can therefore start in any
order, seconds apart, from different shells or nodes that share the folder. A file left behind by
a crashed run is harmless: its address refuses connections (or carries the wrong nonce), so joiners
keep polling until the new rank 0 overwrites it. Rank 0 deletes the file once everyone has arrived.
"""
from __future__ import annotations

import datetime
import json
import os
import secrets
import socket
import time
from pathlib import Path
from urllib.parse import urlparse

import attrs
import torch
import torch.distributed as dist

from .errors import FixresError, first_line

RENDEZVOUS_FILE = "rendezvous.json"
_PROBE_SECONDS = 3.0
_STORE: dist.Store | None = None  # this process's rendezvous store, once the group formed
_PEERS: dict[int, tuple[str, int]] = {}  # rank -> (host, pid), read once the group formed


class RendezvousInterrupted(Exception):
    """A stop signal arrived while this rank waited for its peers (nothing to checkpoint yet)."""


def _never() -> bool:
    return False


@attrs.frozen
class Placement:
    """Result of rank resolution.

    ``source`` is one of ``flags, torchrun, slurm, spawn, single``; ``job_id`` and ``dist_url`` are
    ``None`` where the source does not fix them (the launcher fills in defaults);
    ``local_world_size`` is the number of ranks on this node (used to share CPU threads).
    """

    source: str
    num_tasks: int
    global_rank: int
    local_rank: int
    local_world_size: int
    job_id: str | None
    dist_url: str | None


def _env_int(environ, name: str) -> int:
    try:
        return int(environ[name])
    except ValueError:
        raise FixresError(f"environment variable {name}={environ[name]!r} is not an integer") from None


def _slurm_tasks_on_node(environ, ntasks: int) -> int:
    value = environ.get("SLURM_NTASKS_PER_NODE") or environ.get("SLURM_TASKS_PER_NODE", "")
    head = value.split(",")[0].split("(")[0]
    return int(head) if head.isdigit() else ntasks


def _check_agree(flag_name: str, flag_value, env_name: str, env_value) -> None:
    if flag_value is not None and flag_value != env_value:
        raise FixresError(f"{flag_name} {flag_value} conflicts with {env_name}={env_value}; "
                          "drop the flag or fix the environment")


def resolve_placement(num_tasks: int | None = None, global_rank: int | None = None,
                      local_rank: int | None = None, job_id: str | None = None,
                      dist_url: str | None = None, environ=None) -> Placement:
    """Decide this process's ranks from flags and environment, with the module's precedence.

    Arguments are the command-line values (``None`` when not given); ``environ`` defaults to
    ``os.environ``. Raises :class:`FixresError` for incomplete flags or conflicting sources.
    """
    environ = os.environ if environ is None else environ
    torchrun = all(k in environ for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE"))
    slurm = all(k in environ for k in ("SLURM_PROCID", "SLURM_NTASKS"))
    if num_tasks is not None and num_tasks < 1:
        raise FixresError(f"--num-tasks must be >= 1, got {num_tasks}")

    if global_rank is not None or local_rank is not None:
        if global_rank is None:
            raise FixresError("--local-rank needs --global-rank (and --num-tasks)")
        if num_tasks is None:
            raise FixresError("--global-rank needs --num-tasks")
        if torchrun:
            _check_agree("--num-tasks", num_tasks, "WORLD_SIZE", _env_int(environ, "WORLD_SIZE"))
            _check_agree("--global-rank", global_rank, "RANK", _env_int(environ, "RANK"))
            _check_agree("--local-rank", local_rank, "LOCAL_RANK", _env_int(environ, "LOCAL_RANK"))
        if num_tasks > 1 and job_id is None and dist_url is None:
            raise FixresError("ranks started separately must share a --job-id (with the same "
                              "--shared-folder-path) or an explicit --dist-url tcp://HOST:PORT")
        local = global_rank if local_rank is None else local_rank
        return Placement("flags", num_tasks, global_rank, local, num_tasks, job_id, dist_url)

    if torchrun:
        world = _env_int(environ, "WORLD_SIZE")
        _check_agree("--num-tasks", num_tasks, "WORLD_SIZE", world)
        run_id = environ.get("TORCHELASTIC_RUN_ID", "none")
        return Placement("torchrun", world, _env_int(environ, "RANK"), _env_int(environ, "LOCAL_RANK"),
                         int(environ.get("LOCAL_WORLD_SIZE", world)),
                         job_id or (None if run_id in ("", "none") else run_id), dist_url or "env://")

    if slurm:
        world = _env_int(environ, "SLURM_NTASKS")
        _check_agree("--num-tasks", num_tasks, "SLURM_NTASKS", world)
        slurm_job = environ.get("SLURM_JOB_ID")
        if "SLURM_ARRAY_JOB_ID" in environ and "SLURM_ARRAY_TASK_ID" in environ:
            slurm_job = f"{environ['SLURM_ARRAY_JOB_ID']}_{environ['SLURM_ARRAY_TASK_ID']}"
        return Placement("slurm", world, _env_int(environ, "SLURM_PROCID"),
                         _env_int({"SLURM_LOCALID": "0", **environ}, "SLURM_LOCALID"),
                         _slurm_tasks_on_node(environ, world),
                         job_id or slurm_job, dist_url)

    if num_tasks is not None and num_tasks > 1:
        return Placement("spawn", num_tasks, 0, 0, num_tasks, job_id, dist_url)
    return Placement("single", 1, 0, 0, 1, job_id, dist_url)


def default_job_id() -> str:
    """A fresh job id for runs that were given none: ``local-YYYYmmdd-HHMMSS-<pid>``."""
    return time.strftime("local-%Y%m%d-%H%M%S") + f"-{os.getpid()}"


def file_rendezvous_url(job_folder: Path) -> str:
    """The default rendezvous of a job: ``file://<job folder>/rendezvous.json`` (absolute)."""
    return "file://" + str((Path(job_folder) / RENDEZVOUS_FILE).absolute())


def _advertised_host() -> str:
    if os.environ.get("MASTER_ADDR"):
        return os.environ["MASTER_ADDR"]
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def _write_private_json(path: Path, payload: dict) -> None:
    """Write ``payload`` to ``path`` atomically, readable by the owner only."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(payload, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _tcp_store(host: str, port: int, world_size: int, is_master: bool, timeout: float) -> dist.TCPStore:
    return dist.TCPStore(host, port, world_size, is_master, datetime.timedelta(seconds=timeout),
                         wait_for_workers=False)


def _publish_and_wait(path: Path, world_size: int, timeout: float, should_stop=_never) -> dist.TCPStore:
    """Rank 0 of a file rendezvous: host a store, publish it, wait for every other rank."""
    host = _advertised_host()
    store = _tcp_store(host, 0, world_size, True, timeout)
    nonce = secrets.token_hex(16)
    store.set("fixres/nonce", nonce)
    _write_private_json(path, {"host": host, "port": store.port, "nonce": nonce,
                               "pid": os.getpid(), "time": time.time()})
    expected = [f"fixres/arrived/{r}" for r in range(1, world_size)]
    deadline = time.monotonic() + timeout
    while not store.check(expected):
        if should_stop():
            path.unlink(missing_ok=True)
            raise RendezvousInterrupted(f"stopped by a signal while waiting at {path}")
        if time.monotonic() > deadline:
            missing = [k.rsplit("/", 1)[1] for k in expected if not store.check([k])]
            raise FixresError(f"rank(s) {', '.join(missing)} of {world_size} never arrived at {path} "
                              f"within {timeout:g} s (same --job-id and --shared-folder-path?)")
        time.sleep(0.05)
    path.unlink(missing_ok=True)
    return store


def _join_published(path: Path, rank: int, world_size: int, timeout: float, should_stop=_never) -> dist.TCPStore:
    """A non-zero rank of a file rendezvous: poll the file until its store answers with its nonce."""
    deadline = time.monotonic() + timeout
    tried = None
    while time.monotonic() < deadline:
        if should_stop():
            raise RendezvousInterrupted(f"stopped by a signal while waiting for {path}")
        try:
            info = json.loads(path.read_text())
            key = (info["host"], int(info["port"]), info["nonce"])
        except (OSError, ValueError, KeyError, TypeError):
            key = None
        if key is not None and key != tried:
            tried = key
            try:
                store = _tcp_store(key[0], key[1], world_size, False, _PROBE_SECONDS)
                if store.check(["fixres/nonce"]) and store.get("fixres/nonce").decode() == key[2]:
                    store.set_timeout(datetime.timedelta(seconds=timeout))
                    store.set(f"fixres/arrived/{rank}", "1")
                    return store
            except (RuntimeError, OSError):
                pass  # a stale file from an earlier run: wait for the new rank 0 to replace it
        time.sleep(0.1)
    raise FixresError(f"rank 0 did not open the rendezvous {path} within {timeout:g} s "
                      "(is rank 0 running with the same --job-id and --shared-folder-path?)")


def _tcp_rendezvous(host: str, port: int, rank: int, world_size: int, timeout: float) -> dist.TCPStore:
    try:
        store = _tcp_store(host, port, world_size, rank == 0, timeout)
    except (RuntimeError, OSError) as exc:
        raise FixresError(f"cannot meet the other ranks at {host}:{port} within {timeout:g} s: "
                          f"{first_line(exc)}") from None
    return store


def make_store(dist_url: str, rank: int, world_size: int, timeout: float, should_stop=_never) -> dist.Store:
    """Build the rendezvous store for ``dist_url`` (file://, tcp:// or env://).

    Raises :class:`FixresError` when the peers do not show up within ``timeout`` seconds.
    """
    url = urlparse(dist_url)
    if url.scheme == "file":
        path = Path(url.path)
        if not path.parent.is_dir():
            raise FixresError(f"rendezvous folder {path.parent} does not exist")
        if rank == 0:
            return _publish_and_wait(path, world_size, timeout, should_stop)
        return _join_published(path, rank, world_size, timeout, should_stop)
    if url.scheme == "tcp":
        return _tcp_rendezvous(url.hostname, url.port, rank, world_size, timeout)
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not addr or not port:
        raise FixresError("--dist-url env:// needs MASTER_ADDR and MASTER_PORT in the environment")
    return _tcp_rendezvous(addr, int(port), rank, world_size, timeout)


def init_process_group(backend: str, dist_url: str, rank: int, world_size: int, timeout: float,
                       should_stop=_never) -> None:
    """Meet the other ranks and create the default process group (no-op for world size 1).

    ``should_stop()`` is polled while waiting at a file rendezvous; when it returns True,
    :class:`RendezvousInterrupted` is raised. Raises :class:`FixresError` on timeout.
    """
    if world_size == 1:
        return
    global _STORE
    store = make_store(dist_url, rank, world_size, timeout, should_stop)
    try:
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout))
    except (RuntimeError, dist.DistError) as exc:
        raise FixresError(f"process group ({backend}) did not form within {timeout:g} s: "
                          f"{first_line(exc)}") from None
    store.set(f"fixres/process/{rank}", f"{socket.gethostname()} {os.getpid()}")
    _STORE = store
    dist.barrier()
    for peer in range(world_size):
        host, pid = store.get(f"fixres/process/{peer}").decode().split()
        _PEERS[peer] = (host, int(pid))


def _process_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return not any(line.startswith("State:") and line.split()[1] in ("Z", "X") for line in f)
    except OSError:
        return False


def announce_failure(reason: str) -> None:
    """Tell the other ranks, through the rendezvous store, why this rank is about to stop."""
    if _STORE is not None and is_initialized():
        try:
            _STORE.set(f"fixres/failed/{dist.get_rank()}", reason[:300])
        except Exception:  # best effort: the store may be gone with rank 0
            pass


def lost_peers(wait: float = 3.0) -> str:
    """Which peer ranks failed or vanished, as a phrase, after a collective failed ("" if none known).

    Ranks on this host that died are found by process id (known since the group formed) without
    asking anyone; a rank that failed with an exception announced it in the rendezvous store
    (:func:`announce_failure`); if the store (hosted by rank 0) no longer answers, rank 0 is gone.
    Polls for up to ``wait`` seconds, as a dying peer may still be exiting.
    """
    if _STORE is None or not is_initialized():
        return ""
    me = dist.get_rank()
    _STORE.set_timeout(datetime.timedelta(seconds=3))
    deadline = time.monotonic() + wait
    while True:
        dead = [f"rank {rank} (pid {pid} is gone)" for rank, (host, pid) in sorted(_PEERS.items())
                if rank != me and host == socket.gethostname() and not _process_alive(pid)]
        if dead:
            return "; ".join(dead)
        failed = []
        for rank in _PEERS:
            try:
                if rank != me and _STORE.check([f"fixres/failed/{rank}"]):
                    failed.append(f"rank {rank}, which failed: {_STORE.get(f'fixres/failed/{rank}').decode()}")
            except Exception:  # the store died with its host process, rank 0
                return "rank 0 (and with it the rendezvous store)"
        if failed or time.monotonic() > deadline:
            return "; ".join(failed)
        time.sleep(0.2)


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum ``tensor`` over all ranks in place (identity for world size 1) and return it."""
    if is_initialized():
        dist.all_reduce(tensor)
    return tensor


def broadcast_object(obj, src: int = 0):
    """Rank ``src``'s ``obj`` on every rank (identity for world size 1)."""
    if not is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def barrier() -> None:
    if is_initialized():
        dist.barrier()


def destroy_process_group() -> None:
    global _STORE
    _STORE = None
    _PEERS.clear()
    if is_initialized():
        dist.destroy_process_group()


def average_batchnorm_statistics(model: torch.nn.Module) -> None:
    """Average the running mean/var of every BatchNorm in train mode over all ranks (``--dist-bn reduce``).

    Without it each rank keeps statistics of its own images (``broadcast_buffers=False``), and
    with DDP's default buffer broadcast they would be rank 0's alone (the FixRes reference's bug).
    """
    if not is_initialized():
        return
    world = dist.get_world_size()
    for module in model.modules():
        if isinstance(module, torch.nn.modules.batchnorm._BatchNorm) and module.training \
                and module.track_running_stats and module.running_mean is not None:
            for buffer in (module.running_mean, module.running_var):
                dist.all_reduce(buffer)
                buffer.div_(world)


def cuda_device(local_rank: int, environ=None) -> torch.device:
    """The GPU of the rank with ``local_rank`` on its node.

    ``cuda:<local_rank>`` among the visible devices; but when a launcher narrowed
    ``CUDA_VISIBLE_DEVICES`` to a single GPU for this task (SLURM ``--gpus-per-task 1``,
    ``--gpu-bind``), that GPU, ``cuda:0``, whatever the local rank. Raises :class:`FixresError` when
    no GPU is visible or the local rank has none.
    """
    environ = os.environ if environ is None else environ
    count = torch.cuda.device_count()
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if count == 0:
        raise FixresError(f"--device cuda but no CUDA GPU is visible (CUDA_VISIBLE_DEVICES={visible!r}); "
                          "use --device cpu")
    narrowed = visible is not None and len([v for v in visible.split(",") if v.strip()]) == 1
    if narrowed and count == 1:
        return torch.device("cuda", 0)
    if local_rank >= count:
        raise FixresError(f"local rank {local_rank} has no GPU: {count} visible (CUDA_VISIBLE_DEVICES={visible!r}); "
                          "start at most one rank per GPU on each node")
    return torch.device("cuda", local_rank)


def threads_per_rank(num_tasks: int, environ=None) -> int:
    """CPU threads for one rank: this process's usable cores shared by the ranks on this node.

    The ranks on a node are ``LOCAL_WORLD_SIZE`` (torchrun), ``SLURM_NTASKS_PER_NODE`` (SLURM) or
    ``num_tasks``. Without this, N ranks x all cores threads oversubscribe the CPU many times over.
    """
    environ = os.environ if environ is None else environ
    cores = len(os.sched_getaffinity(0))
    local = int(environ.get("LOCAL_WORLD_SIZE") or 0) or \
        (_slurm_tasks_on_node(environ, num_tasks) if "SLURM_NTASKS" in environ else num_tasks)
    if "SLURM_NTASKS" in environ and "SLURM_CPUS_PER_TASK" in environ:
        return max(1, int(environ["SLURM_CPUS_PER_TASK"]))
    return max(1, cores // max(1, min(local, cores)))
