"""The parallel layout as one object (fixres_dist.distributed.layout): its validation, each rank's
coordinates against a brute-force enumeration of the mesh, its description, its one device mesh (on
torch's fake process group: every rank's view, no communication), and its record in checkpoints,
older checkpoints included."""
from __future__ import annotations

import itertools
import json

import pytest
import torch
import torch.multiprocessing as mp
from torch import nn

import shown_commands as shown
from conftest import free_port, run_script
from fixres_dist.config import TrainerConfig
from fixres_dist.distributed import collectives, layout
from fixres_dist.distributed import pipeline as pp
from fixres_dist.distributed import tensor_parallel as tp
from fixres_dist.distributed.layout import AXES, Layout
from fixres_dist.entry.launch import start_method
from fixres_dist.errors import FixresError
from fixres_dist.training import checkpoint, dry_run, memory_estimate, split_memory, world_change
from split_models import LR, MOMENTUM, VIT, batch, model_of

# (world, keyword arguments of Layout.of_world) that are valid, and the sizes each gives
VALID = [(1, {}, (1, 1, 1, 1)), (4, {}, (4, 1, 1, 1)), (4, {"sharding": "full"}, (1, 4, 1, 1)),
         (8, {"sharding": "hybrid", "shard_group": 4}, (2, 4, 1, 1)), (8, {"tensor": 2}, (4, 1, 1, 2)),
         (8, {"pipeline": 4}, (2, 1, 4, 1)), (12, {"tensor": 2, "pipeline": 3}, (2, 1, 3, 2)),
         (16, {"sharding": "hybrid", "shard_group": 2, "tensor": 2, "pipeline": 2}, (2, 2, 2, 2)),
         (1024, {"tensor": 8, "pipeline": 16}, (8, 1, 16, 8))]


@pytest.mark.parametrize("world, kwargs, shape", VALID)
def test_a_layout_of_flags_has_their_sizes(world, kwargs, shape):
    found = Layout.of_world(world, **kwargs)
    assert found.shape == shape and found.world == world
    assert found.data_parallel_size == world // (kwargs.get("tensor", 1) * kwargs.get("pipeline", 1))
    tensor, pipeline = kwargs.get("tensor", 1), kwargs.get("pipeline", 1)
    assert (found.tensor_enabled, found.pipeline_enabled) == (tensor > 1, pipeline > 1)
    assert found.shard_enabled == (kwargs.get("sharding", "ddp") != "ddp" and found.shard > 1)


@pytest.mark.parametrize("world, kwargs, message", [
    (4, {"tensor": 3}, "--tensor-parallel 3 must divide the number of ranks (4)"),
    (4, {"tensor": 0}, "--tensor-parallel 0 must divide the number of ranks (4)"),
    (6, {"pipeline": 4}, "--pipeline-stages 4 must divide the number of ranks (6)"),
    (6, {"tensor": 2, "pipeline": 3, }, None),
    (12, {"tensor": 4, "pipeline": 6}, "--tensor-parallel 4 x --pipeline-stages 6 (24 ranks per model) must divide "
                                       "the number of ranks (12)"),
    (8, {"sharding": "hybrid", "shard_group": 3}, "--sharding hybrid: 8 data-parallel ranks do not split into shard "
                                                  "groups of 3 (--shard-group-size, default the ranks per node)"),
    (8, {"sharding": "hybrid", "shard_group": 4, "tensor": 4}, "--sharding hybrid: 2 data-parallel ranks do not "
                                                               "split into shard groups of 4"),
    (4, {"sharding": "zero3"}, "--sharding zero3: use ddp, full or hybrid"),
])
def test_every_bad_combination_is_one_line_naming_the_flags(world, kwargs, message):
    if message is None:  # the product divides the world size: valid
        assert Layout.of_world(world, **kwargs).world == world
        return
    with pytest.raises(FixresError) as caught:
        Layout.of_world(world, **kwargs)
    assert str(caught.value).startswith(message) and "\n" not in str(caught.value)


@pytest.mark.parametrize("field", ["replicate", "shard", "tensor", "pipeline"])
def test_a_layout_built_directly_refuses_a_size_below_one(field):
    with pytest.raises(FixresError, match=f"^Layout: {field} must be a whole number >= 1, not 0$"):
        Layout(**{field: 0})


@pytest.mark.parametrize("sizes", [(1, 1, 1, 1), (4, 1, 1, 1), (1, 4, 1, 1), (2, 2, 1, 1), (2, 1, 1, 2),
                                   (3, 1, 2, 1), (2, 2, 2, 2), (1, 1, 4, 2), (2, 3, 1, 1)])
def test_coordinates_of_every_rank_are_the_meshs(sizes):
    """Brute force: the ranks in row-major order of the (data, shard, stage, tensor) grid."""
    found = Layout(*sizes[:2], tensor=sizes[3], pipeline=sizes[2])
    grid = itertools.product(*(range(n) for n in sizes))
    for rank, (data, shard, stage, tensor) in enumerate(grid):
        where = found.coordinates(rank)
        assert (where.data, where.shard, where.stage, where.tensor) == (data, shard, stage, tensor)
        assert where.data_rank == data * sizes[1] + shard == found.data_rank(rank)
        assert (found.stage(rank), found.tensor_rank(rank)) == (stage, tensor)
        assert found.counts_metrics(rank) == (tensor == 0 and stage == sizes[2] - 1)
    assert found.world == rank + 1
    assert found.counts_metrics(found.totals_rank) and not any(map(found.counts_metrics, range(found.totals_rank)))
    with pytest.raises(FixresError, match=f"^rank {found.world} is not one of the {found.world} ranks of "):
        found.coordinates(found.world)


@pytest.mark.parametrize("tensor, pipeline", [(1, 1), (2, 1), (4, 1), (1, 2), (1, 4)])
def test_coordinates_are_what_the_config_meant_before(tensor, pipeline):
    """What TrainerConfig's data_parallel_rank, counts_metrics and totals_rank computed before the layout
    (tensor groups and pipelines of consecutive ranks), rank by rank."""
    world = 8
    found = layout.of(TrainerConfig(num_tasks=world, tensor_parallel=tensor, pipeline_stages=pipeline,
                                    architecture="timm/test_vit", input_size=32, test_size=32, batch=8))
    for rank in range(world):
        assert found.data_rank(rank) == rank // (tensor * pipeline)
        assert found.counts_metrics(rank) == (rank % tensor == 0 and rank % pipeline == pipeline - 1)
    assert found.totals_rank == pipeline - 1
    assert found.rank_name(3) == {(1, 1): "rank 3", (2, 1): "rank 3 (tensor group 1)",
                                  (4, 1): "rank 3 (tensor group 0)", (1, 2): "rank 3 (stage 1 of pipeline 1)",
                                  (1, 4): "rank 3 (stage 3 of pipeline 0)"}[(tensor, pipeline)]


@pytest.mark.parametrize("sizes, words", [
    ((1, 1, 1, 1), "1 rank"), ((4, 1, 1, 1), "4 ranks = 4 data"), ((1, 4, 1, 1), "4 ranks = 4 shard"),
    ((2, 2, 1, 1), "4 ranks = 2 replicate x 2 shard"), ((2, 1, 2, 1), "4 ranks = 2 data x 2 tensor"),
    ((2, 1, 1, 2), "4 ranks = 2 data x 2 stage"), ((8, 1, 8, 16), "1,024 ranks = 8 data x 16 stage x 8 tensor"),
    ((1, 1, 2, 2), "4 ranks = 2 stage x 2 tensor")])
def test_the_description_names_each_axis_in_use(sizes, words):
    replicate, shard, tensor, pipeline = sizes
    assert Layout(replicate, shard, tensor, pipeline).describe() == words


def test_comparing_layouts_prints_both():
    before, after = Layout(2, tensor=2), Layout(2)
    assert after.compare(before) == "layout 4 ranks = 2 data x 2 tensor -> 2 ranks = 2 data: the same 2 " \
                                    "data-parallel ranks, ranks in new roles"
    assert Layout(4).compare(Layout(2, pipeline=2)) == "layout 4 ranks = 2 data x 2 stage -> 4 ranks = 4 data: " \
                                                       "data-parallel ranks 2 -> 4, ranks in new roles"
    assert Layout(1, 4).compare(Layout(4)) == "layout 4 ranks = 4 data -> 4 ranks = 4 shard: the same 4 " \
                                              "data-parallel ranks"  # sharding: every rank keeps its role
    assert Layout(1, 4).same_roles(Layout(4)) and Layout(4).compare(Layout(4)) is None


def test_a_hybrid_shard_group_not_given_is_a_nodes_ranks(monkeypatch):
    config = TrainerConfig(num_tasks=8, sharding="hybrid", dist_bn="reduce")
    monkeypatch.delenv("SLURM_NTASKS_PER_NODE", raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert layout.of(config).shape == (2, 4, 1, 1)
    assert layout.of(config, ranks_per_node=2).shape == (4, 2, 1, 1)  # as the ranks found when they met
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")  # divides no 8: all ranks
    assert layout.of(config).shape == (1, 8, 1, 1)


@pytest.mark.parametrize("sizes", [(2, 2, 1, 2), (1, 1, 4, 2), (4, 1, 2, 1)])
def test_every_ranks_view_of_the_one_mesh(sizes):
    """The mesh on torch's fake process group, as each rank builds it: its coordinates are the layout's,
    and the sub-meshes the strategies take hold the ranks the layout says."""
    found = Layout(sizes[0], sizes[1], tensor=sizes[3], pipeline=sizes[2])
    for rank in range(found.world):
        with memory_estimate.fake_process_group(found.world, rank=rank):
            mesh = found.mesh("cpu")
            where = found.coordinates(rank)
            assert mesh.mesh_dim_names == AXES and tuple(mesh.shape) == found.shape
            assert tuple(mesh.get_coordinate()) == (where.data, where.shard, where.stage, where.tensor)
            tensor_group = mesh["tensor"].mesh.flatten().tolist()
            assert tensor_group == [r for r in range(found.world) if found.coordinates(r).data_rank == where.data_rank
                                    and found.stage(r) == where.stage]
            stage_group = mesh["data", "shard"].mesh.flatten().tolist()  # the ranks that hold the same layers
            assert stage_group == [r for r in range(found.world) if found.stage(r) == where.stage
                                   and found.tensor_rank(r) == where.tensor]


def _contents(ranks: int, config: dict, recorded: dict | None) -> checkpoint.Contents:
    return checkpoint.Contents(model={"w": torch.zeros(2)}, optimizer={}, epoch=0, images_in_epoch=0, global_step=1,
                               ranks=[{"host": "h"}] * ranks, config={"batch": 8, **config}, metrics=[],
                               layout=recorded)


def test_a_checkpoint_records_its_layout_and_an_older_one_is_read_from_its_config(tmp_path):
    written = Layout(2, tensor=2)
    (tmp_path / "new").mkdir(), (tmp_path / "old").mkdir()
    path = checkpoint.save_checkpoint(tmp_path / "new", _contents(4, {"tensor_parallel": 2},
                                                                  written.to_dict()).as_dict(), 1)
    read = checkpoint.Contents.from_dict(checkpoint.load_checkpoint(path))
    assert read.layout == {"replicate": 2, "shard": 1, "tensor": 2, "pipeline": 1}
    assert world_change.SavedRun.of(read).layout == written and world_change.SavedRun.of(read).data_parallel_size == 2
    # written before there was a layout entry: the keys it has always had say the same
    older = _contents(4, {"tensor_parallel": 2}, None).as_dict()
    assert "layout" not in older
    path = checkpoint.save_checkpoint(tmp_path / "old", older, 1)
    read = checkpoint.Contents.from_dict(checkpoint.load_checkpoint(path))
    assert read.layout is None and world_change.SavedRun.of(read).layout == written
    for config, ranks, shape in (({}, 4, (4, 1, 1, 1)), ({"pipeline_stages": 2}, 4, (2, 1, 2, 1)),
                                 ({"sharding": "hybrid", "shard_group_size": 2}, 8, (4, 2, 1, 1)),
                                 ({"sharding": "full"}, 1, (1, 1, 1, 1))):
        assert Layout.saved(None, config, ranks).shape == shape


# ------------------------------------------------------------------ the dry run
def test_a_dry_run_of_1024_ranks_on_one_cpu(capsys):
    """8 tensor x 16 pipeline x 8 data: validated, its mesh built as rank 1,023 builds it (fake process
    group), each stage's memory per rank estimated; the weights of every stage add up to the model's."""
    argv = shown.argv(shown.command("python -m fixres_dist.training.dry_run"))
    assert argv[:3] == ["python", "-m", "fixres_dist.training.dry_run"] and dry_run.main(argv[3:]) == 0
    captured = capsys.readouterr()
    assert captured.err.startswith("fixres_dist: dry run: the run refuses this layout: --pipeline-stages 16 does "
                                   "not go with --tensor-parallel yet; ") and captured.err.count("\n") == 1
    assert captured.err.endswith("; sized for when it is built (--sized-ahead)\n")
    out = captured.out.splitlines()
    assert out[0] == "layout: 1,024 ranks = 8 data x 16 stage x 8 tensor"
    assert out[1] == "mesh: data 8 x shard 1 x stage 16 x tensor 8; rank 1023 at (7, 0, 15, 7) (built on a fake " \
                     "process group)"
    assert len(out) == 2 + 16 + 1 and out[-1].startswith("largest: ") and "stage 15 (blocks.23 .. head)" in out[-2]
    assert not torch.distributed.is_initialized()  # the fake process group is gone


USAGE = "python -m fixres_dist.training.dry_run: error: argument "
REFUSED = "fixres_dist: dry run: the run refuses this layout: "
TINY = ["--architecture", VIT, "--input-size", "32", "--classes", "10", "--batch", "8"]
# (argv, exit status, the start of the one line on stderr): usage errors (2), then what a run refuses (1)
BAD = [(["--num-tasks", "8", "--batch", "0"], 2, USAGE + "--batch: must be a positive whole number, got 0"),
       (["--num-tasks", "8", "--batch", "-3"], 2, USAGE + "--batch: must be a positive whole number, got -3"),
       (["--num-tasks", "0"], 2, USAGE + "--num-tasks: must be a positive whole number, got 0"),
       (["--num-tasks", "2147483648"], 2, USAGE + "--num-tasks: a dry run takes at most 65,536 ranks"),
       (["--num-tasks", "99999999999999999992"], 2, USAGE + "--num-tasks: a dry run takes at most 65,536 ranks"),
       (["--num-tasks", "8", "--tensor-parallel", "0"], 2, USAGE + "--tensor-parallel: must be a positive whole"),
       (["--num-tasks", "8", "--pipeline-stages", "-1"], 2, USAGE + "--pipeline-stages: must be a positive whole"),
       (["--num-tasks", "8", "--pipeline-microbatches", "0"], 2, USAGE + "--pipeline-microbatches: must be a"),
       (["--num-tasks", "8", "--num-classes", "0"], 2, USAGE + "--num-classes/--classes: must be a positive"),
       (["--num-tasks", "8", "--input-size", "x"], 2, USAGE + "--input-size: 'x' is not a whole number of pixels"),
       (["--num-tasks", "8", "--lr", "0.1"], 2, "python -m fixres_dist.training.dry_run: error: unrecognized "),
       (["--num-tasks", "8", *TINY, "--input-size", "7"], 1,
        f"fixres_dist: dry run: {VIT} cannot train on 7 px images"),
       (["--num-tasks", "8", *TINY, "--input-size", "5000"], 1, REFUSED + "--input-size 5000 px is above 4096 px"),
       (["--num-tasks", "8", *TINY, "--sharding", "hybrid", "--shard-group-size", "2", "--tensor-parallel", "2"], 1,
        REFUSED + "--tensor-parallel 2 does not go with --sharding hybrid yet"),
       (["--num-tasks", "8", *TINY, "--sharding", "full", "--pipeline-stages", "2"], 1,
        REFUSED + "--pipeline-stages 2 does not go with --sharding full yet"),
       (["--num-tasks", "8", *TINY, "--tensor-parallel", "2", "--pipeline-stages", "2"], 1,
        REFUSED + "--pipeline-stages 2 does not go with --tensor-parallel yet"),
       (["--num-tasks", "8", "--architecture", "vit_b_16", "--tensor-parallel", "2"], 1,
        REFUSED + "--tensor-parallel cannot run torchvision's vit_b_16"),
       (["--num-tasks", "8", "--architecture", "vit_b_16", "--pipeline-stages", "2"], 1,
        REFUSED + "--pipeline-stages cannot run torchvision's vit_b_16"),
       (["--num-tasks", "8", *TINY, "--pipeline-stages", "4", "--pipeline-microbatches", "2"], 1,
        REFUSED + "--pipeline-microbatches 2: 1f1b needs at least one per stage (4)"),
       (["--num-tasks", "8", *TINY, "--pipeline-stages", "2", "--batch", "9"], 1,
        REFUSED + "--batch 9 does not split into 2 equal micro-batches"),
       (["--num-tasks", "8", "--pipeline-microbatches", "4"], 1,
        REFUSED + "--pipeline-microbatches applies to a model cut into stages"),
       (["--num-tasks", "8", "--pipeline-schedule", "interleaved-1f1b"], 1,
        REFUSED + "--pipeline-schedule applies to a model cut into stages"),
       (["--num-tasks", "8", "--shard-group-size", "2"], 1,
        REFUSED + "--shard-group-size applies to --sharding hybrid"),
       (["--num-tasks", "8", "--sharding", "hybrid"], 1,
        "fixres_dist: dry run: --sharding hybrid needs --shard-group-size in a dry run"),
       (["--num-tasks", "8", "--sharding", "hybrid", "--shard-group-size", "1"], 1,
        "fixres_dist: dry run: --shard-group-size 1 shards over one rank, which is DDP: use --sharding ddp"),
       (["--num-tasks", "8", "--sharding", "hybrid", "--shard-group-size", "3"], 1,
        "fixres_dist: dry run: --sharding hybrid: 8 data-parallel ranks do not split into shard groups of 3"),
       (["--num-tasks", "1040", "--tensor-parallel", "8", "--pipeline-stages", "16", "--sized-ahead"], 1,
        "fixres_dist: dry run: --tensor-parallel 8 x --pipeline-stages 16 (128 ranks per model) must divide the "
        "number of ranks (1040)"),
       (["--num-tasks", "8", "--architecture", "vit_b_16", "--tensor-parallel", "2", "--sized-ahead"], 1,
        REFUSED + "--tensor-parallel cannot run torchvision's vit_b_16")]


@pytest.mark.parametrize("argv, status, line", BAD, ids=[" ".join(argv) for argv, _, _ in BAD])
def test_a_dry_run_refuses_bad_input_in_one_line(argv, status, line, capsys):
    """Bad values (usage errors, exit status 2) and what the run itself refuses (its configuration's
    checks and the preflight's, exit status 1): one line on stderr, nothing estimated, no process group left."""
    try:
        found = dry_run.main(argv)
    except SystemExit as exc:
        found = exc.code
    err = capsys.readouterr().err
    assert found == status and err.startswith(line) and err.count("\n") == 1, err
    assert not torch.distributed.is_initialized()


def test_a_dry_run_takes_the_scripts_names_and_schedules(capsys):
    """--num-classes (the scripts' name), interleaved 1F1B (two micro-batches per stage by default)."""
    assert dry_run.main(["--num-tasks", "4", *TINY, "--num-classes", "7", "--pipeline-stages", "2",
                         "--pipeline-schedule", "interleaved-1f1b"]) == 0
    captured = capsys.readouterr()
    assert captured.err == "" and "4 micro-batch(es) of 2 images" in captured.out, captured.out


def _held(rank: int, world: int, port: int, folder) -> None:
    """What each rank of a real gloo run holds: a pipeline of 2 stages (x 2 data-parallel ranks) and a
    tensor split over 2 ranks (x 2), each after one SGD step with momentum (its state exists)."""
    torch.set_num_threads(1)
    collectives.init_process_group("gloo", f"tcp://127.0.0.1:{port}", rank, world, 120)
    held = {}
    pipe = pp.Pipeline(model_of(VIT), pp.pipeline_mesh(torch.device("cpu"), world, 2), size=32, schedule="gpipe",
                       microbatches=2, architecture=VIT)
    model = tp.parallelize(split := model_of(VIT), tp.tensor_mesh(torch.device("cpu"), world, 2)["tensor"], VIT)
    for name, module, step in (("pipeline", pipe.module, lambda: pipe.train_step(*batch(0))),
                               ("tensor", split, lambda: nn.functional.cross_entropy(split(batch(0)[0]),
                                                                                     batch(0)[1]).backward())):
        optimizer = torch.optim.SGD(module.parameters(), lr=LR, momentum=MOMENTUM)
        step()
        optimizer.step()
        local = [p.to_local() if isinstance(p, torch.distributed.tensor.DTensor) else p for p in module.parameters()]
        states = [s["momentum_buffer"] for s in optimizer.state.values()]
        held[name] = {"parameters": sum(p.numel() * p.element_size() for p in local),
                      "optimizer": sum((s.to_local() if hasattr(s, "to_local") else s).numel() * 4 for s in states),
                      "largest": max(p.numel() * p.element_size() for p in local)}
    del model
    (folder / f"held{rank}.json").write_text(json.dumps(held))
    collectives.destroy_process_group()


def test_the_dry_runs_exact_parts_are_what_a_real_gloo_run_holds(tmp_path):
    """Parameters and optimizer state per rank, the dry run's (meta device, fake process group) against 4
    real gloo ranks': equal to the byte (the optimizer's with its step's temporaries), for each stage of a
    pipeline and each rank of a tensor group."""
    mp.start_processes(_held, args=(4, free_port(), tmp_path), nprocs=4, start_method=start_method())
    held = [json.loads((tmp_path / f"held{rank}.json").read_text()) for rank in range(4)]
    common = ["--num-tasks", "4", "--architecture", VIT, "--input-size", "32", "--classes", "10", "--batch", "8"]
    staged = dry_run.dry_run(dry_run.parser().parse_args([*common, "--pipeline-stages", "2",
                                                          "--pipeline-schedule", "gpipe"]))
    split = dry_run.dry_run(dry_run.parser().parse_args([*common, "--tensor-parallel", "2"]))
    def state(kind, rank):  # the optimizer's state, and the temporaries of its step on the largest parameter
        return held[rank][kind]["optimizer"] + split_memory.STEP_TEMPORARIES * held[rank][kind]["largest"]
    for rank in range(4):
        stage = staged.stages[rank % 2]
        assert (stage.parameters, stage.optimizer) == (held[rank]["pipeline"]["parameters"], state("pipeline", rank))
        assert (split.stages[0].parameters, split.stages[0].optimizer) == (held[rank]["tensor"]["parameters"],
                                                                           state("tensor", rank)), rank


def test_a_hybrid_checkpoint_records_the_shard_groups_its_mesh_was_built_with(tiny_data, tmp_path):
    """No --shard-group-size: the launcher's hint (SLURM_NTASKS_PER_NODE=2) says 2 ranks per node, but the
    4 ranks met on one host, and the mesh shards over the ranks of a node as they met (4): the checkpoint
    records that layout, not the hint's."""
    result = run_script("scratch", "--num-tasks", 4, "--job-id", "hybrid", "--shared-folder-path", tmp_path,
                        "--data-path", tiny_data, "--architecture", "timm/test_vit", "--input-size", 32, "--batch", 4,
                        "--epochs", 1, "--workers", 0, "--no-progress", "--sharding", "hybrid",
                        env={"SLURM_NTASKS_PER_NODE": "2"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert "sharded over a mesh of 1 replicate x 4 shard ranks" in result.stderr + result.stdout
    saved = checkpoint.Contents.from_dict(checkpoint.load_checkpoint(tmp_path / "hybrid" / checkpoint.CHECKPOINT_FILE))
    assert saved.layout == {"replicate": 1, "shard": 4, "tensor": 1, "pipeline": 1}


@pytest.mark.parametrize("split", [["--pipeline-stages", "2"], ["--tensor-parallel", "2"]])
def test_a_dry_run_shards_a_split_model_over_its_data_parallel_ranks(split):
    """--sharding full with stages (a layout the run refuses for now: --sized-ahead) or tensor groups: each rank holds a
    quarter of its stage's or tensor rank's weights (and the largest block gathered), of their gradients
    and optimizer state, against DDP's whole ones."""
    common = ["--num-tasks", "8", *split, "--architecture", VIT, "--input-size", "32", "--classes", "10",
              "--batch", "8", "--sized-ahead"]
    sharded = dry_run.dry_run(dry_run.parser().parse_args([*common, "--sharding", "full"]))
    replicated = dry_run.dry_run(dry_run.parser().parse_args(common))
    assert sharded.layout.shard == 4 and replicated.layout.replicate == 4
    staged = split[0] == "--pipeline-stages"  # tensor groups sharded over their data-parallel ranks run (2-D)
    assert (sharded.refused or "").startswith("the run refuses this layout: --pipeline-stages 2 does not go with "
                                              "--sharding full yet" if staged else "") and replicated.refused is None
    for shard, whole in zip(sharded.stages, replicated.stages):
        assert whole.parameters / 4 < shard.parameters < whole.parameters
        assert shard.gradients < whole.gradients / 3 and shard.optimizer < whole.optimizer / 3
        assert shard.peak < whole.peak
