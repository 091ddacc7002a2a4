"""What a run is built from, read and checked once: the data's file index and classes, the
checkpoint it continues, the weight file it starts from.

One path for both places that need it. :func:`preflight` runs it before anything starts (in the
launcher, or in rank 0's process before it meets its peers) with every check a bad command line
could fail, so that bad input is refused in seconds with nothing written; the
:class:`~fixres_dist.training.trainer.Trainer` then builds from what it returned (in the same
process) or, in a rank started elsewhere, runs :meth:`JobInputs.read` itself after meeting its peers,
so that its failure reaches them. Every check raises :class:`~fixres_dist.errors.FixresError`.
"""
from __future__ import annotations

import os
from pathlib import Path

import attrs
import torch

from fixres_dist import io, locks
from fixres_dist.config import TrainerConfig
from fixres_dist.data import file_index, hf_datasets, pipeline, shards
from fixres_dist.distributed import joblock, layout, placement, tensor_parallel
from fixres_dist.distributed.pipeline import check_schedule, check_starts, has_batchnorm, pieces, virtual_stages
from fixres_dist.errors import FixresError, plural
from fixres_dist.fixres import finetuning
from fixres_dist.models import architectures, class_names, lineage, preprocessing, resolutions, weights
from fixres_dist.reporting import profiling, tensorboard_events, trackers
from fixres_dist.training import checkpoint, extraction, memory_budget
from fixres_dist.training.memory_estimate import MemoryEstimate


@attrs.frozen
class Resume:
    """The checkpoint a run continues (:func:`fixres_dist.training.checkpoint.resume_source`):
    ``path``, ``note`` (a line for the log, or None) and its :class:`~fixres_dist.training.checkpoint.Contents`."""

    path: Path
    note: str | None
    contents: checkpoint.Contents


@attrs.frozen
class JobInputs:
    """The inputs of one run of ``config``, read and checked (see the module docstring).

    ``root``: the data folder; ``index``: its file index (:mod:`fixres_dist.data.file_index`, walked
    or loaded; written by rank 0 or the launcher), packed data's (:mod:`fixres_dist.data.shards`) or a
    Hugging Face dataset's (:mod:`fixres_dist.data.hf_datasets`);
    ``classes``: the class names, in label order;
    ``resume``: the checkpoint continued, or None; ``weights``: ``--weight-path`` read, or None;
    ``memory_estimate``: the preflight's estimate of the peak memory per rank
    (:func:`fixres_dist.training.memory_budget.check_budget`), or None when none was made.
    """

    root: Path
    index: file_index.DataIndex | shards.PackedData | hf_datasets.HFData
    classes: list[str]
    resume: Resume | None
    weights: weights.WeightFile | None
    memory_estimate: MemoryEstimate | None = None

    @classmethod
    def read(cls, config: TrainerConfig) -> "JobInputs":
        """The checks that building the run makes anyway: the job folder (writable, on a filesystem
        that can lock: :mod:`fixres_dist.locks`), the data and their index, a too large
        ``--grad-accum-steps``, the checkpoint continued (its configuration, and its
        classes: the data's, in the same order), the features folder, the weight file (with
        ``--eval-only``, a classifier row for every class of the data:
        :mod:`fixres_dist.models.class_names`)."""
        _check_job_folder(config)
        root, index, classes = _read_data(config)
        if config.profile:
            profiling.check_folder(config.job_folder / profiling.FOLDER)
        path, note = checkpoint.resume_source(config.job_folder, config.resume)
        if path is None:  # a resume keeps the global batch it trained with (training.world_change)
            _check_accumulation(config, index)
        resume = None
        if path is not None:
            state = checkpoint.load_checkpoint(path)
            checkpoint.check_resumable(config, state["config"], path)
            class_names.check_resumable(state.get("classes"), classes, path, root)
            checkpoint.check_same_data(state.get("data"), index.identity(), path, root,
                                       state["config"].get("data_path") or str(pipeline.embedded_data_path()))
            resume = Resume(path, note, checkpoint.Contents.from_dict(state))
        if config.profile:  # the window counts this process' steps: a resumed run has fewer left
            ranks = config.data_parallel_size
            steps = -(-(-(-index.train_images // ranks)) // (config.batch * config.grad_accum_steps))
            left, done = steps * config.epochs, 0
            if resume is not None:  # from where it stopped, on this run's world size
                c, per_step = resume.contents, config.batch * config.data_parallel_size * config.grad_accum_steps
                left, done = (config.epochs - c.epoch) * steps - -(-c.images_in_epoch // per_step), c.global_step
            profiling.check_window(config.profile, config.profile_after, left, done)
        if config.extract_features:
            extraction.check_destination(config.extract_features, config.overwrite)
        found = weights.read_weight_file(config.weight_path, config.weight_key, check_values=config.global_rank == 0) \
            if config.weight_path else None  # checked once, by rank 0: the same file on every rank
        if found is not None and config.eval_only:
            class_names.check_evaluable(found.classes, classes, found.path)
        return cls(root, index, classes, resume, found)


def _read_data(config: TrainerConfig) -> tuple[Path, file_index.DataIndex | shards.PackedData | hf_datasets.HFData,
                                               list[str]]:
    """The data folder, its index and its class names: packed shards (:mod:`fixres_dist.data.shards`),
    a Hugging Face dataset (:mod:`fixres_dist.data.hf_datasets`) or an ImageFolder (its file index,
    :mod:`fixres_dist.data.file_index`), checked; at least 2 training images per rank."""
    root = Path(config.data_path or pipeline.embedded_data_path())
    if shards.is_packed(root):
        packed = shards.open_packed(root, 2 * config.data_parallel_size)
        return root, packed, packed.classes
    if hf_datasets.is_hf_dataset(root):
        found = hf_datasets.open_hf_dataset(root, config.file_index_folder, 2 * config.data_parallel_size)
        return root, found, found.classes
    index = file_index.data_index(root, config.file_index_folder)
    return root, index, pipeline.check_image_folder(root, 2 * config.data_parallel_size, index)


def _check_accumulation(config: TrainerConfig, index) -> None:
    if config.grad_accum_steps > 1 and not config.eval_only:
        train_images = index.train_images
        step = config.batch * config.data_parallel_size * config.grad_accum_steps
        if step > train_images:
            raise FixresError(f"--grad-accum-steps {config.grad_accum_steps}: one step would take {step:,} images "
                              f"(--batch {config.batch} x {config.data_parallel_size} "
                              f"{'data-parallel ' if layout.of(config).tensor_enabled else ''}rank(s) x "
                              f"{config.grad_accum_steps}), "
                              f"more than the {train_images:,} training images; the linear scaling rule would count "
                              "images that are not there")


def _check_job_folder(config: TrainerConfig) -> None:
    shared = Path(config.shared_folder_path).absolute()
    io.check_own_job_folder(shared / config.job_id)
    existing = next(p for p in (shared / config.job_id, *(shared / config.job_id).parents) if p.exists())
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        raise FixresError(f"cannot create the job folder {shared / config.job_id}: {existing} is not a writable folder")
    try:  # the job lock's filesystem, before anything is written
        locks.check_lockable(shared / config.job_id, joblock.UNGUARDED, existing)
    except OSError as exc:
        raise FixresError(f"cannot create the job folder {shared / config.job_id}: {existing}: "
                          f"{exc.strerror or exc}") from None


def preflight(config: TrainerConfig) -> JobInputs:
    """:meth:`JobInputs.read`, then what only a whole command line can fail: the architecture, the
    GPU, the ``--compile`` backend, every resolution (measured: :mod:`fixres_dist.models.resolutions`),
    TensorBoard, the weights against the model (their head's rows mapped by class name) and the
    finetune scope, and whether a training step fits the memory budget (``--memory-budget``, or the
    GPU's memory; estimated on the CPU: :func:`fixres_dist.training.memory_budget.check_budget`; nothing
    is estimated on a CPU run without a budget). Writes a walked file index once every check passed
    (bad input leaves nothing written). With ``--tensor-parallel``: whether the model can be split."""
    inputs = JobInputs.read(config)
    architectures.check_architecture(config.architecture, config.low_res_stem)
    if config.device == "cuda":
        placement.cuda_device(config.local_rank)
    if config.compile:
        _check_compile_backend(config.compile)
    if config.shard_group_size and config.num_tasks % config.shard_group_size:
        raise FixresError(f"--sharding hybrid: {plural(config.num_tasks, 'rank')} do not split into shard groups of "
                          f"--shard-group-size {config.shard_group_size}")
    check_split(config, len(inputs.classes))
    if config.tensorboard:
        tensorboard_events.check_available()
        tensorboard_events.check_folder(config.job_folder)
    trackers.check_available(config)
    check_sizes(config, len(inputs.classes), lineage.for_run(config, inputs.weights).train_size)
    check_pack_sizes(config, inputs)
    if inputs.weights:
        _check_weights(config, inputs)
    estimate = memory_budget.check_budget(config, len(inputs.classes))
    inputs.index.save()
    return attrs.evolve(inputs, memory_estimate=estimate)


def check_sizes(config: TrainerConfig, num_classes: int, trained_at: int | None = None) -> None:
    """Every resolution of ``config`` that its architecture cannot take (a ViT's patch size, then
    measured on the meta device: :func:`fixres_dist.models.resolutions.check_run_sizes`; ``trained_at``:
    the weights' training size): FixresError, one line. The preflight's check, and the dry run's."""
    sizes = {config.input_size, config.test_size, config.train_size, *(config.test_sizes or ())} - {None, "auto"}
    for size in sorted(sizes):
        architectures.check_resolution(config.architecture, size)
    resolutions.check_run_sizes(config, num_classes, trained_at)


def check_pack_sizes(config: TrainerConfig, inputs: JobInputs) -> None:
    """Packed data made with ``--max-side N`` (:mod:`fixres_dist.data.packing`) against every resolution the
    run uses (:func:`fixres_dist.models.resolutions.run_sizes`): training from scratch at K needs shorter sides
    of K pixels (RandomResizedCrop's largest box is the whole image, then not upsampled); an evaluation and
    the finetune's training at K need round(K / crop ratio) (the test transform's resize), the crop ratio
    as the run resolves it. FixresError in one line naming the resolution that needs the most (packing for
    it serves them all)."""
    packed = inputs.index
    if not isinstance(packed, shards.PackedData) or packed.max_side is None:
        return
    crop = preprocessing.resolve(config, inputs.weights.config if inputs.weights else None).crop_ratio
    served = packed.largest_test_size(crop)
    train, evaluate = resolutions.run_sizes(config, lineage.for_run(config, inputs.weights).train_size)

    def test_side(what: str, size: int) -> tuple[str, tuple[int, int]]:
        return f"{what} {size} px ({size} / crop ratio {crop})", (pipeline.resize_size(size, crop), served)
    needs = dict(test_side("the finetune at", size) for size in train) if config.mode == "finetune" else {
        f"training at {size} px (RandomResizedCrop's largest box is the whole image)": (size, packed.max_side)
        for size in train}
    needs.update(test_side("test resolution", size) for size in evaluate)
    packed.check_sizes(needs)


def check_split(config: TrainerConfig, num_classes: int) -> None:
    """The layout of ``config`` against its world size (FixresError naming the flags), and with
    ``--tensor-parallel`` or ``--pipeline-stages`` whether the model (built on the meta device: shapes
    only) splits so: the preflight's check, and the dry run's (:mod:`fixres_dist.training.dry_run`)."""
    ranks = layout.of(config)
    if not ranks.split:
        return
    with torch.device("meta"):
        model = architectures.build_model(config.architecture, num_classes, image_size=config.first_input_size,
                                          low_res_stem=config.low_res_stem)
    if ranks.tensor_enabled:
        tensor_parallel.splittable(model, ranks.tensor, config.architecture, heads=not ranks.shard_enabled)
    else:
        _check_stages(config, ranks.pipeline, model)


def _check_stages(config: TrainerConfig, stages: int, model: torch.nn.Module) -> None:
    """--pipeline-stages ``stages``: the schedule can run its micro-batches, --batch splits into them, and
    ``model`` (on the meta device) has a stem, blocks and a head to cut into that many stages."""
    virtual = virtual_stages(config.pipeline_schedule)
    count = stages * virtual
    microbatches = config.pipeline_microbatches or count
    check_schedule(config.pipeline_schedule, virtual, microbatches, stages)
    if config.batch % microbatches:
        raise FixresError(f"--batch {config.batch} does not split into {microbatches} equal micro-batches "
                          "(--pipeline-microbatches; default: one per stage)")
    if config.batch < 2 * microbatches and has_batchnorm(model) and not config.eval_only:
        raise FixresError(f"--batch {config.batch} in {microbatches} micro-batches leaves 1 image per micro-batch: "
                          f"{config.architecture}'s BatchNorm cannot train on one "
                          "(fewer --pipeline-microbatches, or a larger --batch)")
    found = len(pieces(model, config.architecture))
    if found < count:
        raise FixresError(f"--pipeline-stages {stages}: {config.architecture} has only {found} pieces "
                          f"(stem, blocks, head) for {count} stages")
    if config.pipeline_split is not None:
        check_starts(list(config.pipeline_split), count, found)

def _check_compile_backend(backend: str) -> None:
    import torch._dynamo  # seconds to import: only with --compile

    if backend not in torch._dynamo.list_backends(exclude_tags=()):
        raise FixresError(f"--compile {backend!r} is not a torch.compile backend; known: "
                          f"{', '.join(torch._dynamo.list_backends())}")


def _check_weights(config: TrainerConfig, inputs: JobInputs) -> None:
    build_size = resolutions.build_size(config)
    model = architectures.build_model(config.architecture, len(inputs.classes), image_size=build_size,
                                      low_res_stem=config.low_res_stem)
    loaded = weights.load_weights(model, inputs.weights, classes=inputs.classes)
    if config.input_size == "auto" and loaded.new_head_from is not None:
        raise FixresError(
            f"--input-size auto picks the finetune resolution from the sweep before finetuning, but "
            f"{config.weight_path} gets a new {len(inputs.classes)}-class head (its head has {loaded.new_head_from} "
            f"classes): that sweep would rank an untrained head. Train the head first at one size "
            f"(main_finetune.py --input-size N --finetune-scope head), then FixRes-finetune that "
            f"checkpoint.pth with --input-size auto")
    if config.mode == "finetune" and not config.eval_only:
        finetuning.trainable_modules(model, build_size, config.finetune_scope, config.last_norm)
