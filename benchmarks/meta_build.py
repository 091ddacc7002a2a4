"""Peak memory per rank while a sharded model is built and its weights loaded (issue 42, item 4): every
rank building the whole model and reading the weight file, against the project's start, where every
rank but 0 builds on the meta device and receives its shards of rank 0's tensors one tensor at a time.

For each way, a fresh set of ``--ranks`` local gloo ranks (one process each) starts from the same weight
file (the model's random initialisation saved once, ``torch.save``), and each rank reports its resident
memory (``VmRSS``) before it builds anything, its peak (``VmHWM``, the kernel's high-water mark of the
process's resident memory) when the model is sharded and loaded, and what it still holds then (``VmRSS``,
after ``gc.collect``): bytes of every kind (tensors, the file's pages, the allocator's), not only tensors.
The model's own bytes (fp32 parameters and buffers) are printed beside them.

* ``whole``: what the project did until 13b69afa, and what an FSDP2 start without the meta device does:
  every rank builds the model (``build_model``), reads the weight file whole (``torch.load``) and loads it,
  rank 0's tensors are broadcast (as DDP does), then ``fully_shard`` per block and the root.
* ``fixres_dist``: the project's :class:`~fixres_dist.training.network.Network` for ``--sharding full``
  from ``--weight-path`` (the weight file read as :meth:`~fixres_dist.training.inputs.JobInputs.read` reads
  it: memory-mapped, its values checked on rank 0 only), then ``Network.wrap``: the strategy's
  ``fully_shard`` per block and the root, and :func:`~fixres_dist.distributed.sharding.load_from_rank0`.

No training step runs: the step is the same code in both ways (``benchmarks/sharding.py`` measures it).

    python benchmarks/meta_build.py                              # timm's ViT-L/16 (304 M parameters), 2 ranks
    python benchmarks/meta_build.py --architecture resnet50 --ranks 4
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fixres_dist.bench import local_ranks  # noqa: E402
from fixres_dist.config import TrainerConfig  # noqa: E402
from fixres_dist.distributed import blocks, sharding  # noqa: E402
from fixres_dist.models import architectures, weights  # noqa: E402
from fixres_dist.training.network import Network  # noqa: E402

GIB = 2 ** 30
CLASSES = 1000


def _status(field: str) -> int:
    """``field`` of /proc/self/status (``VmRSS``, ``VmHWM``), in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _whole(architecture: str, path: Path, mesh) -> None:
    model = architectures.build_model(architecture, CLASSES)
    model.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
    sharding.start_from_rank0(model)
    for _, block in blocks.blocks(model):
        torch.distributed.fsdp.fully_shard(block, mesh=mesh)
    torch.distributed.fsdp.fully_shard(model, mesh=mesh)


def _fixres_dist(architecture: str, path: Path, rank: int, ranks: int) -> None:
    config = TrainerConfig(mode="finetune", architecture=architecture, num_tasks=ranks, global_rank=rank,
                           sharding="full", weight_path=str(path))
    found = weights.read_weight_file(path, check_values=rank == 0)
    network = Network(config, [str(i) for i in range(CLASSES)], 224, found, torch.device("cpu"),
                      lambda line: None, lambda line: None)
    network.wrap(224)


def _rank(rank: int, ranks: int, port: int, way: str, architecture: str, path: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=ranks)
    mesh = init_device_mesh("cpu", (ranks,))
    dist.barrier()
    before, file_before = _status("VmRSS"), _status("RssFile")
    if way == "whole":
        _whole(architecture, Path(path), mesh)
    else:
        _fixres_dist(architecture, Path(path), rank, ranks)
    dist.barrier()
    gc.collect()
    measured = {"before": before, "peak": _status("VmHWM"), "after": _status("VmRSS"),
                "file": _status("RssFile") - file_before}
    Path(out, f"{way}-{rank}.json").write_text(json.dumps(measured))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--architecture", default="timm/vit_large_patch16_224")
    parser.add_argument("--ranks", type=int, default=2)
    args = parser.parse_args()
    model = architectures.build_model(args.architecture, CLASSES)
    model_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder, "weights.pth")
        torch.save(model.state_dict(), path)
        del model
        for way in ("whole", "fixres_dist"):
            port = local_ranks.free_port()
            mp.spawn(_rank, (args.ranks, port, way, args.architecture, str(path), folder), nprocs=args.ranks)
        rows = {(way, rank): json.loads(Path(folder, f"{way}-{rank}.json").read_text())
                for way in ("whole", "fixres_dist") for rank in range(args.ranks)}
    print(f"{args.architecture}: {model_bytes / GIB:.2f} GiB of fp32 parameters and buffers; --sharding full on "
          f"{args.ranks} gloo ranks, one process each, {os.cpu_count()} CPU cores; memory per rank, GiB")
    print("| way | rank | peak above the start | held after | of which mapped file pages | peak / the model's bytes |")
    print("|---|---|---|---|---|---|")
    for (way, rank), m in rows.items():
        peak, held = m["peak"] - m["before"], m["after"] - m["before"]
        print(f"| {way} | {rank} | {peak / GIB:.2f} | {held / GIB:.2f} | {m['file'] / GIB:.2f} | "
              f"{peak / model_bytes:.2f} |")
    for rank in [*range(args.ranks), None]:  # None: all ranks together, one node's sum of peaks
        whole, ours = (sum(m["peak"] - m["before"] for (w, r), m in rows.items() if w == way and rank in (r, None))
                       for way in ("whole", "fixres_dist"))
        print(f"{f'rank {rank}' if rank is not None else 'all ranks'}: peak {ours / GIB:.2f} GiB against "
              f"{whole / GIB:.2f} GiB ({ours / whole:.2f}x)")


if __name__ == "__main__":
    main()
