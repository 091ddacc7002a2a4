"""The process group and the collectives the Trainer uses; each an identity for world size 1.

Where a process sits is :mod:`fixres_dist.distributed.placement`; how the ranks meet is
:mod:`fixres_dist.distributed.rendezvous`. Every helper here works without a process group (one process), so
the Trainer has one code path for every world size.
"""
from __future__ import annotations

import datetime
import inspect

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.nn.parallel import DistributedDataParallel

from fixres_dist.distributed import network
from fixres_dist.distributed.rendezvous import LostPeers, Rendezvous, make_store, meet_hosts
from fixres_dist.errors import FixresError, first_line

# DDP's switch for re-broadcasting rank 0's buffers at each forward: torch 2.14 renamed it
# forward_sync_buffers (the old name warns there); torch 2.4-2.13 knows only broadcast_buffers
BUFFER_SYNC = ("forward_sync_buffers" if "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
               else "broadcast_buffers")


def device_mesh(device_type: str, shape: tuple[int, ...], names: tuple[str, ...]) -> DeviceMesh:
    """``init_device_mesh`` of ``shape`` (ranks per dimension) named ``names``, after a barrier: every rank
    arrives before the mesh's process groups form (ranks seconds apart saw gloo reset their connections
    as a group formed). A collective: every rank calls it."""
    dist.barrier()
    return init_device_mesh(device_type, shape, mesh_dim_names=names)


def init_process_group(backend: str, dist_url: str, rank: int, world_size: int, timeout: float,
                       should_stop=None, check_joinable=None) -> Rendezvous | None:
    """Meet the other ranks and create the default process group; returns the :class:`Rendezvous`.

    World size 1: no group, returns None. ``should_stop()`` and ``check_joinable()``, if given, are polled
    while waiting at a file rendezvous (:func:`~fixres_dist.distributed.rendezvous.make_store`). Before the
    group is created the ranks exchange where they run and each picks the interface its
    collectives use (:mod:`fixres_dist.distributed.network`; sets ``GLOO_SOCKET_IFNAME``/``NCCL_SOCKET_IFNAME``
    where unset). Raises :class:`FixresError` on timeout or when no interface reaches the peers,
    :class:`~fixres_dist.distributed.rendezvous.LostPeers` when a peer dies or vanishes meanwhile.
    """
    if world_size == 1:
        return None
    store, address = make_store(dist_url, rank, world_size, timeout, should_stop, check_joinable)
    hosts = meet_hosts(store, rank, world_size, timeout)
    link = network.choose_link(hosts[rank].name, {r: (h.name, list(h.addresses)) for r, h in hosts.items()})
    network.apply_link(link)
    rendezvous = Rendezvous(store, rank, world_size, address, hosts, link)
    rendezvous.start_heartbeat()
    try:
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=collective_timeout(timeout)))
        rendezvous.register()
    except (RuntimeError, dist.DistError) as exc:  # a peer died or vanished, or the network refused
        gone = rendezvous.lost_peers()
        rendezvous.stop_heartbeat()
        if gone:
            raise LostPeers(gone) from None
        raise FixresError(f"process group ({backend}) did not form: {first_line(exc)}") from None
    return rendezvous


LOST_PEERS_S = 10.0  # what naming the lost peers may take after a collective timed out (seconds)


def collective_timeout(dist_timeout: float) -> float:
    """How long one collective may wait for a peer (seconds): ``--dist-timeout`` less the time
    :meth:`~fixres_dist.distributed.rendezvous.Rendezvous.lost_peers` takes (at most half of it), so that a
    rank whose peers vanished without a word (a node cut off the network) names them and exits
    within ``--dist-timeout``."""
    return max(dist_timeout / 2, dist_timeout - LOST_PEERS_S)


def is_collective_failure(exc: BaseException) -> bool:
    """Whether ``exc`` is a failure of torch.distributed's communication (a c10d error, or gloo's
    timeouts and closed connections, which reach Python as plain RuntimeErrors) rather than of
    this rank's own computation."""
    return isinstance(exc, dist.DistError) or (isinstance(exc, RuntimeError) and "gloo" in str(exc).lower())


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def destroy_process_group() -> None:
    if is_initialized():
        dist.destroy_process_group()


def control_group():
    """A gloo group for small CPU messages (stop flags, gathered RNG states) without a device sync.

    The world group itself on gloo; None without a process group. A collective: every rank calls it.
    """
    if not is_initialized():
        return None
    return dist.group.WORLD if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum ``tensor`` over all ranks in place (identity for world size 1) and return it."""
    if is_initialized():
        dist.all_reduce(tensor)
    return tensor


def all_reduce_max(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """Maximum of ``tensor`` over all ranks of ``group``, in place (identity for world size 1)."""
    if is_initialized():
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
    return tensor


def start_all_reduce_max(tensor: torch.Tensor, group=None):
    """Start a MAX all-reduce of ``tensor`` over ``group``, in place, in the background; returns the
    handle whose ``wait()`` finishes it. Needs a process group (every rank starts the same ones, in
    the same order)."""
    return dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group, async_op=True)


def gather_object(obj, group=None) -> list | None:
    """Every rank's ``obj`` on rank 0 (a list, in rank order); None on the other ranks."""
    if not is_initialized():
        return [obj]
    rank0 = dist.get_rank() == 0
    gathered = [None] * dist.get_world_size() if rank0 else None
    dist.gather_object(obj, gathered, dst=0, group=group)
    return gathered


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


def average_batchnorm_statistics(model: torch.nn.Module, group=None) -> None:
    """Average the running mean/var of every BatchNorm in train mode over the ranks of ``group`` (None:
    all ranks; a pipeline's stage: its data-parallel ranks, which hold the same layers) (``--dist-bn reduce``).

    Without it each rank keeps statistics of its own images (``broadcast_buffers=False``), and
    with DDP's default buffer broadcast they would be rank 0's alone (the FixRes reference's bug).
    """
    if not is_initialized():
        return
    world = dist.get_world_size(group)
    for module in model.modules():
        if isinstance(module, torch.nn.modules.batchnorm._BatchNorm) and module.training \
                and module.track_running_stats and module.running_mean is not None:
            for buffer in (module.running_mean, module.running_var):
                dist.all_reduce(buffer, group=group)
                buffer.div_(world)
