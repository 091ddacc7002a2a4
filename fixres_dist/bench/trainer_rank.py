"""One benchmark rank: the project's Trainer, built through ``TrainerConfig`` for a parallel layout
(``--sharding``, ``--shard-group-size``, ``--tensor-parallel``, ``--pipeline-stages``), training on one
fixed in-memory batch; its peak memory (:mod:`fixres_dist.bench.rank_memory`) and step times.

A rank's spec is a plain dict (it crosses to the forked ranks): ``name`` (the job id's suffix and the
result files'), ``world`` (ranks), ``device`` (``cpu``: gloo; ``cuda``: NCCL, one GPU per rank),
``architecture``, ``size`` (pixels), ``batch`` (images per data-parallel rank per step), ``amp``,
``fields`` (the layout's ``TrainerConfig`` fields), and for :func:`measure_rank` ``memory_steps``,
``warmup`` and ``steps``. The optimizer is AdamW, the data the embedded dataset's classes.
"""
from __future__ import annotations

import statistics
import time
import warnings

import torch

from fixres_dist.bench.cost import step_seconds
from fixres_dist.bench.local_ranks import rank_result
from fixres_dist.bench.rank_memory import PeakMemory, local_bytes, model_state_bytes
from fixres_dist.config import TrainerConfig
from fixres_dist.data.pipeline import check_image_folder, embedded_data_path
from fixres_dist.data.samplers import ExactBatchSampler
from fixres_dist.distributed import layout
from fixres_dist.errors import FixresWarning
from fixres_dist.training.trainer import Trainer


def rank_config(spec: dict, rank: int, port: int, folder: str) -> TrainerConfig:
    """Rank ``rank``'s configuration: a from-scratch job ``bench-<name>`` in ``folder``, meeting at
    ``tcp://127.0.0.1:<port>``. Raises :class:`~fixres_dist.FixresError` where the layout's fields do not
    go together (the configuration's own checks)."""
    cuda = spec["device"] == "cuda"
    return TrainerConfig(num_tasks=spec["world"], global_rank=rank, local_rank=rank, job_id=f"bench-{spec['name']}",
                         dist_url=f"tcp://127.0.0.1:{port}", shared_folder_path=folder, mode="scratch",
                         architecture=spec["architecture"], input_size=spec["size"], batch=spec["batch"],
                         opt="adamw", epochs=spec.get("epochs", 1), workers=0, progress=False, device=spec["device"],
                         dist_backend="nccl" if cuda else "gloo", amp=spec["amp"], **spec["fields"])


def device_of(spec: dict, rank: int) -> torch.device:
    return torch.device("cuda", rank) if spec["device"] == "cuda" else torch.device("cpu")


class FixedBatches:
    """A Trainer's training loader: the same in-memory batch for every batch of its sampler (the
    project's ``ExactBatchSampler``, which the epoch loop asks for its sizes); ``stamp()``, if given, is
    called at every batch request and at the end."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, sampler: ExactBatchSampler, stamp=None):
        self.images, self.labels, self.batch_sampler, self.stamp = images, labels, sampler, stamp or (lambda: None)

    def __len__(self) -> int:
        return len(self.batch_sampler)

    def __iter__(self):
        for _ in self.batch_sampler:
            self.stamp()
            yield self.images, self.labels, 0
        self.stamp()


def fixed_batch(cfg: TrainerConfig, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``(images, labels, classes)``: uint8 (batch, 3, size, size) images and int64 (batch,) labels, random,
    the same on the ranks of one tensor group or pipeline (seeded by the data-parallel rank)."""
    num_classes = len(check_image_folder(embedded_data_path()))
    generator = torch.Generator().manual_seed(layout.of(cfg).data_rank(cfg.global_rank))
    size = cfg.first_input_size
    images = torch.randint(0, 256, (cfg.batch, 3, size, size), dtype=torch.uint8, generator=generator)
    labels = torch.randint(0, num_classes, (cfg.batch,), generator=generator)
    return images.to(device), labels.to(device), num_classes


def loader_for(cfg: TrainerConfig, images: torch.Tensor, labels: torch.Tensor, steps: int,
               stamp=None) -> FixedBatches:
    """``steps`` batches per epoch on every data-parallel rank, each the fixed batch."""
    replicas, batch, data_rank = cfg.data_parallel_size, cfg.batch, layout.of(cfg).data_rank(cfg.global_rank)
    return FixedBatches(images, labels, ExactBatchSampler(replicas * batch * steps, replicas, data_rank, batch,
                                                          shuffle=True, seed=cfg.seed, training=True), stamp)


def rank_setup(rank: int, spec: dict, port: int, folder: str):
    """A benchmark rank's configuration, device, unbuilt Trainer and fixed batch (images, labels, classes)."""
    warnings.simplefilter("ignore", FixresWarning)
    cfg = rank_config(spec, rank, port, folder)
    device = device_of(spec, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return cfg, device, Trainer(cfg, log=lambda message: None), fixed_batch(cfg, device)


def measure_rank(rank: int, spec: dict, port: int, folder: str) -> None:
    """One rank of a layout (the target of :func:`fixres_dist.bench.local_ranks.run_ranks`): build the
    Trainer with its memory counted, one step (it makes the optimizer state), ``memory_steps`` steps
    whose peak is the rank's ``peak``; then, memory no longer counted (the CPU's counter slows a step),
    ``warmup`` untimed and ``steps`` timed steps. Result (bytes, seconds): ``peak``, ``resident`` (after
    build), ``after_steps``, ``model_states``, ``step_times``, ``step_s`` (their median), ``build_s``,
    ``parameters`` (of the layers this rank holds a part of), ``local_parameters`` (its part),
    ``threads``, ``data_parallel``."""
    with rank_result(folder, spec["name"], rank) as result:
        cfg, device, trainer, (images, labels, _) = rank_setup(rank, spec, port, folder)
        try:
            with PeakMemory(device) as memory:
                started = time.perf_counter()
                trainer.build(train_loader=loader_for(cfg, images, labels, 1 + spec["memory_steps"]))
                build_seconds, resident = time.perf_counter() - started, memory.current()
                trainer.train_step(images, labels)  # creates the optimizer state
                memory.reset_peak()
                for _ in range(spec["memory_steps"]):
                    trainer.train_step(images, labels)
                peak, after = memory.peak(), memory.current()
            times = step_seconds(lambda: trainer.train_step(images, labels), spec["steps"], spec["warmup"], device)
            model = trainer.network.model
            result.update(peak=peak, resident=resident, after_steps=after, memory=memory.what,
                          model_states=model_state_bytes(model, trainer.step.optimizer), step_times=times,
                          step_s=statistics.median(times) if times else None, build_s=build_seconds,
                          parameters=sum(p.numel() for p in model.parameters()),
                          local_parameters=sum(local_bytes(p) // p.element_size() for p in model.parameters()),
                          threads=torch.get_num_threads(), data_parallel=cfg.data_parallel_size)
        finally:
            trainer.close()
