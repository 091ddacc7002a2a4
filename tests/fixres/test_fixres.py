"""The FixRes method: finetune scopes, all-rank BatchNorm statistics, sweeps, eval-only, features."""
from __future__ import annotations

import json
import math
import re
import stat
import tracemalloc

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp
from PIL import Image
from torch import nn
from torchvision import transforms as v1

from conftest import free_port, run_main, run_script, run_two_ranks_and_one
from fixres_dist import FixresError
from fixres_dist.data import pipeline
from fixres_dist.distributed import collectives
from fixres_dist.entry.launch import main, start_method
from fixres_dist.fixres import finetuning, sweep
from fixres_dist.models import architectures, batchnorm
from fixres_dist.training import extraction
from fixres_dist.training.checkpoint import load_checkpoint
from numeric import assert_near_reference, assert_settled_ranking, assert_within_spread, evaluation


def _events(folder):
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def scratch_checkpoint(scratch_job):
    """resnet18 trained at 32 px on tiny_data (2 ranks): the session's scratch job."""
    return scratch_job / "checkpoint.pth"


# ------------------------------------------------------------------------------------------ scopes
SMALL_NO_NORM = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 10))


@pytest.mark.parametrize("scope, expected", [
    ("head", {"fc.weight", "fc.bias"}),
    ("head+last-norm", {"fc.weight", "fc.bias", "layer4.1.bn2.weight", "layer4.1.bn2.bias"}),
])
def test_finetune_scope_trains_exactly_what_it_names(scope, expected):
    model = architectures.build_model("resnet18", 10)
    assert set(finetuning.freeze_for_finetune(model, 32, scope)) == expected
    assert {n for n, p in model.named_parameters() if p.requires_grad} == expected


def test_norms_and_all_scopes():
    model = architectures.build_model("resnet18", 10)
    trainable = set(finetuning.freeze_for_finetune(model, 32, "norms+head"))
    norms = {n for n, _ in model.named_parameters() if ".bn" in n or n.startswith("bn1") or "downsample.1" in n}
    assert trainable == norms | {"fc.weight", "fc.bias"}
    assert len(finetuning.freeze_for_finetune(model, 32, "all")) == len(list(model.parameters()))


@pytest.mark.parametrize("scope", ["head+last-norm", "norms+head"])
def test_scope_naming_layers_the_model_lacks_is_an_error(scope):
    with pytest.raises(FixresError, match=re.escape(f"--finetune-scope {scope}: Sequential has no normalisation")):
        finetuning.freeze_for_finetune(SMALL_NO_NORM, 16, scope)
    assert finetuning.freeze_for_finetune(SMALL_NO_NORM, 16, "head") == ["4.weight", "4.bias"]


def test_model_without_linear_head_is_an_error():
    with pytest.raises(FixresError, match="no nn.Linear classifier head"):
        finetuning.find_head_and_last_norm(architectures.build_model("squeezenet1_1", 10), 64)


# ------------------------------------------------------------------------ all-rank BatchNorm
def _synchronised_bn_rank(rank, world, port, out):
    torch.set_num_threads(1)
    collectives.init_process_group("gloo", f"tcp://127.0.0.1:{port}", rank, world, 60)
    torch.manual_seed(0)
    x = torch.randn(8, 3, 5, 5) * 3 + 2  # the union batch, the same on every rank
    weights = torch.randn(8, 3, 5, 5)
    sync = batchnorm.AllRanksBatchNorm(3)
    mine = x[rank::world].clone().requires_grad_()
    y = sync(mine)
    (y * weights[rank::world]).sum().backward()
    torch.save({"y": y.detach(), "grad": mine.grad, "mean": sync.running_mean, "var": sync.running_var},
               out / f"bn{rank}.pt")
    collectives.destroy_process_group()


def _batchnorm_on_the_union(dtype):
    """nn.BatchNorm2d in one process on the union batch of :func:`_synchronised_bn_rank` (in ``dtype``):
    its output, the input's gradient and the running statistics."""
    torch.manual_seed(0)
    x = (torch.randn(8, 3, 5, 5) * 3 + 2).to(dtype).requires_grad_()
    weights = torch.randn(8, 3, 5, 5).to(dtype)
    bn = nn.BatchNorm2d(3).to(dtype)
    y = bn(x)
    (y * weights).sum().backward()
    return {"y": y.detach(), "grad": x.grad, "mean": bn.running_mean, "var": bn.running_var}


@pytest.mark.numeric
def test_all_ranks_batchnorm_equals_one_process_on_the_union(tmp_path):
    """Each rank's output, input gradient and running statistics are one process's on the union batch,
    to rounding: within :data:`numeric.FACTOR` of that process's float32 error from float64."""
    mp.start_processes(_synchronised_bn_rank, args=(2, free_port(), tmp_path), nprocs=2, start_method=start_method())
    baseline, reference = _batchnorm_on_the_union(torch.float32), _batchnorm_on_the_union(torch.float64)
    for rank in range(2):
        got = torch.load(tmp_path / f"bn{rank}.pt")
        mine = {k: v[rank::2] if k in ("y", "grad") else v for k, v in baseline.items()}
        assert_near_reference(got, mine, {k: v[rank::2] if k in ("y", "grad") else v for k, v in reference.items()},
                              f"rank {rank}")


def test_synchronise_keeps_parameters_and_state_dict_keys():
    model = architectures.build_model("resnet18", 10)
    keys, weight = list(model.state_dict()), model.layer4[1].bn2.weight
    assert batchnorm.synchronise(model, ["layer4.1.bn2"]) == ["layer4.1.bn2"]
    assert isinstance(model.layer4[1].bn2, batchnorm.AllRanksBatchNorm) and model.layer4[1].bn2.weight is weight
    assert list(model.state_dict()) == keys and type(model.layer4[1].bn1) is nn.BatchNorm2d


@pytest.mark.numeric
def test_two_rank_finetune_equals_one_process_on_the_union(few_data, scratch_checkpoint, tmp_path):
    """2 ranks x 8 images per step == 1 process x 16 images: same head, same last-BN statistics (20
    images: a full step, then one of 2 + 2), to rounding: within :data:`numeric.FACTOR` of the spread of
    the one process in two summation orders (its two memory formats)."""
    common = ["--data-path", few_data, "--weight-path", scratch_checkpoint, "--input-size", 40,
              "--epochs", 1, "--workers", 0, "--no-progress", "--shared-folder-path", tmp_path,
              "--learning-rate", 0.5]
    two, _ = run_two_ranks_and_one("finetune", *common)
    assert "BatchNorm statistics over all 2 ranks' images: layer4.1.bn2" in two.stdout
    a, b, other = (load_checkpoint(tmp_path / job / "checkpoint.pth") for job in ("two", "one", "one-other"))
    start = load_checkpoint(scratch_checkpoint)["model"]
    moved = [k for k in start if not torch.equal(start[k], b["model"][k])]
    assert set(moved) == {"fc.weight", "fc.bias", "layer4.1.bn2.weight", "layer4.1.bn2.bias",
                          "layer4.1.bn2.running_mean", "layer4.1.bn2.running_var", "layer4.1.bn2.num_batches_tracked"}
    assert torch.equal(a["model"]["layer4.1.bn2.num_batches_tracked"], b["model"]["layer4.1.bn2.num_batches_tracked"])
    trained = [k for k in moved if b["model"][k].is_floating_point()]
    assert_within_spread(*({k: state["model"][k] for k in trained} for state in (a, b, other)), "2 ranks vs 1")
    var = "layer4.1.bn2.running_var"
    for rank in a["ranks"]:  # every rank holds the union's statistics, not its own
        assert_within_spread({var: rank["buffers"][var]}, {var: b["model"][var]}, {var: other["model"][var]},
                             "a rank's statistics vs 1 process's")


# ----------------------------------------------------------------------- finetune augmentation
def test_fixres_augmentation_is_a_small_shift_flip_and_jitter():
    image = Image.fromarray(np.random.default_rng(0).integers(0, 255, (60, 80, 3), dtype=np.uint8))
    test = pipeline.finetune_transform(48, "test")(image)
    outputs = []
    for seed in range(6):
        torch.manual_seed(seed)
        outputs.append(pipeline.finetune_transform(48, "fixres")(image))
    assert test.shape == outputs[0].shape == (3, 48, 48) and test.dtype == torch.uint8
    assert len({o.float().sum().item() for o in outputs}) > 1  # random
    centre = v1.CenterCrop(48)(v1.Resize(round(48 / 0.875))(image))
    assert torch.equal(test, torch.from_numpy(np.array(centre)).permute(2, 0, 1))


# ------------------------------------------------------------------------------ the paper's estimate
def test_apparent_size_estimate_matches_torchvision_random_resized_crop():
    assert finetuning.apparent_size_test_resolution(224) == pytest.approx(305.6, abs=0.5)
    image = torch.zeros(3, 1000, 1000)
    torch.manual_seed(0)

    def simulated(ratio):  # torchvision's own crop sampling on a square image
        crops = [v1.RandomResizedCrop.get_params(image, scale=(0.08, 1.0), ratio=ratio) for _ in range(20000)]
        return 0.875 * 224 * float(np.mean([1000 / math.sqrt(h * w) for _, _, h, w in crops]))

    assert simulated((1.0, 1.0)) == pytest.approx(finetuning.apparent_size_test_resolution(224), rel=0.01)
    # with aspect-ratio jitter, torchvision redraws crops that do not fit, favouring small ones (documented)
    assert 1.0 < simulated((3 / 4, 4 / 3)) / finetuning.apparent_size_test_resolution(224) < 1.08


def test_best_resolution_takes_the_smallest_within_one_standard_error():
    evals = [{"resolution": 32, "top1": 80.0, "images": 1000}, {"resolution": 48, "top1": 81.0, "images": 1000},
             {"resolution": 64, "top1": 78.0, "images": 1000}]
    assert sweep.standard_error(81.0, 1000) == pytest.approx(1.24, abs=0.01)
    assert sweep.best_resolution(evals) == 32  # 80.0 is within 1.24 points of 81.0
    assert sweep.best_resolution([{**e, "images": 100000} for e in evals]) == 48
    with pytest.raises(FixresError):
        sweep.best_resolution([])


# ----------------------------------------------------------------------- sweeps, auto, eval-only
def test_finetune_auto_sweeps_plots_and_finetunes_at_the_best(few_data, scratch_checkpoint, tmp_path):
    result = run_script("finetune", "--num-tasks", 2, "--job-id", "auto", "--shared-folder-path", tmp_path,
                        "--data-path", few_data, "--weight-path", scratch_checkpoint, "--input-size", "auto",
                        "--test-sizes", "32,40,48", "--batch", 8, "--epochs", 1, "--workers", 0, "--no-progress",
                        "--finetune-augmentation", "fixres")
    assert result.returncode == 0, result.stderr[-3000:]
    folder = tmp_path / "auto"
    events = _events(folder)
    before = {e["resolution"]: e for e in events if e.get("label") == "before"}
    after = {e["resolution"]: e for e in events if e.get("label") == "after"}
    assert sorted(before) == sorted(after) == [32, 40, 48]
    chosen = [e for e in events if e["event"] == "input_size"][0]["resolution"]
    assert chosen == sweep.best_resolution(list(before.values()))
    assert load_checkpoint(folder / "checkpoint.pth")["input_size"] == chosen
    assert json.loads((folder / "config.json").read_text())["input_size"] == "auto"
    assert [e["resolution"] for e in events if e["event"] == "eval" and "label" not in e] == [chosen]
    report = [e for e in events if e["event"] == "sweep"][0]
    assert report["stage"] == "after" and report["best_resolution"] in (32, 40, 48)
    assert report["apparent_size_estimate"] == pytest.approx(finetuning.apparent_size_test_resolution(32))
    assert (folder / "resolution_sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = (folder / "resolution_sweep.md").read_text()
    assert "top-1 % before finetuning" in table and "top-1 % after finetuning" in table and "(best)" in table
    assert "apparent-object-size estimate" in result.stdout and f"finetuning at {chosen} px" in result.stdout


@pytest.mark.numeric
def test_eval_only_sweep_and_features_are_exact_on_any_world_size(few_data, scratch_checkpoint, tmp_path):
    """--eval-only on 1 and 2 ranks: the same sweep (top-1: exact, the float64 evaluation's), and features
    in dataset order, each image once (20 images in batches of 7: the ranks' last batches are uneven),
    each row the model's outputs on its image to rounding (:func:`numeric.assert_near_reference`). The
    1-rank run replaces an earlier run's logits.npy, as --overwrite allows (refused without it: the next
    test)."""
    tops, arrays = {}, {}
    earlier = tmp_path / "features1" / "logits.npy"
    earlier.parent.mkdir()
    earlier.write_bytes(b"earlier results")
    for ranks in (1, 2):
        out = tmp_path / f"features{ranks}"
        result = run_script("scratch", "--num-tasks", ranks, "--job-id", f"eval{ranks}", "--eval-only",
                            "--weight-path", scratch_checkpoint, "--test-sizes", "32,48", "--test-size", 40,
                            "--extract-features", out, "--extract-split", "train", "--shared-folder-path",
                            tmp_path, "--data-path", few_data, "--workers", 0, "--no-progress", "--batch", 7,
                            *(["--overwrite"] if ranks == 1 else []))
        assert result.returncode == 0, result.stderr[-3000:]
        events = _events(tmp_path / f"eval{ranks}")
        assert not [e for e in events if e["event"] == "train"]
        tops[ranks] = [(e["resolution"], e["top1"], e["images"]) for e in events if e["event"] == "eval"]
        assert not (tmp_path / f"eval{ranks}" / "checkpoint.pth").exists()
        arrays[ranks] = {name: np.load(out / f"{name}.npy") for name in ("logits", "embeddings", "labels")}
        info = json.loads((out / "features.json").read_text())
        assert info["images"] == 20 and info["resolution"] == 40 and info["split"] == "train"
        assert {f.name: stat.S_IMODE(f.stat().st_mode) for f in out.iterdir()} == \
            {f"{name}.npy": 0o600 for name in ("logits", "embeddings", "labels")} | {"features.json": 0o600}
    assert tops[1] == tops[2] and [t[0] for t in tops[1]] == [32, 48] and all(t[2] == 10 for t in tops[1])
    model = architectures.build_model("resnet18", 10)
    model.load_state_dict(load_checkpoint(scratch_checkpoint)["model"])
    for size, top1, _ in tops[1]:  # counts, compared exactly: no image of these is within rounding of changing class
        exact, plain = (evaluation(model, "resnet18", few_data, "val", size, dtype) for dtype in (torch.float64,
                                                                                                   torch.float32))
        assert_settled_ranking(exact["logits"], plain["logits"], f"{size} px", ks=(1,))
        assert top1 == exact["top1"]
    targets = pipeline.image_folder(few_data, "train").targets
    for ranks in (1, 2):
        assert arrays[ranks]["logits"].shape == (20, 10) and arrays[ranks]["embeddings"].shape == (20, 512)
        assert arrays[ranks]["labels"].tolist() == targets
        assert np.abs(arrays[ranks]["embeddings"]).sum(axis=1).min() > 0  # every row written
    # every row the model's outputs on that image of the dataset, to rounding (rows in other batches)
    exact, plain = (evaluation(model, "resnet18", few_data, "train", 40, dtype, head="fc")
                    for dtype in (torch.float64, torch.float32))
    features = ("logits", "embeddings")
    for ranks in (1, 2):
        assert_near_reference({k: torch.from_numpy(arrays[ranks][k]) for k in features},
                              {k: plain[k] for k in features}, {k: exact[k] for k in features},
                              f"features on {ranks} rank(s)")


def test_extraction_refuses_existing_results_unless_overwrite(few_data, scratch_checkpoint, tmp_path, capsys):
    """Refused in preflight, the earlier file untouched (with --overwrite a run replaces it: the 1-rank
    run of test_eval_only_sweep_and_features_are_exact_on_any_world_size)."""
    out = tmp_path / "features"
    out.mkdir()
    (out / "logits.npy").write_bytes(b"earlier results")
    args = ["--eval-only", "--weight-path", scratch_checkpoint, "--extract-features", out, "--shared-folder-path",
            tmp_path, "--data-path", few_data, "--workers", 0, "--no-progress"]
    with pytest.raises(SystemExit) as refused:  # in this process: preflight refuses before the run
        main("scratch", ["--job-id", "r", *map(str, args)])
    err = capsys.readouterr().err.strip()
    assert refused.value.code == 1 and "already holds logits.npy; pass --overwrite" in err
    assert len(err.splitlines()) == 1
    assert (out / "logits.npy").read_bytes() == b"earlier results"


def test_extraction_streams_rows_instead_of_gathering_them(tiny_data, tmp_path):
    """Peak Python/numpy memory stays flat when the split grows 25-fold (rows go to disk per batch);
    8 px images: what is measured is the rows written, not the network's work."""
    model = architectures.build_model("resnet18", 10).eval()

    def peak_bytes(images: int) -> int:
        dataset = pipeline.image_folder(tiny_data, "train")
        dataset.samples = (dataset.samples * 5)[:images]  # the same files, listed again
        loader = pipeline.make_loader(dataset, pipeline.test_transform(8), batch_size=8, world_size=1, rank=0,
                                  shuffle=False, seed=0, workers=0)
        tracemalloc.start()
        info = extraction.extract(model, "fc", loader, torch.device("cpu"), tmp_path / str(images), 8, {}, rank0=True)
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        assert info["images"] == images and np.load(tmp_path / str(images) / "embeddings.npy").shape == (images, 512)
        return peak

    peak_bytes(16)  # warm-up: first-call allocations of torch and the loader
    small, large = peak_bytes(16), peak_bytes(400)
    grown_output = (400 - 16) * (512 + 10 + 2) * 4
    assert large - small < grown_output / 4, f"peak grew {large - small} bytes for {grown_output} more bytes of output"


# ----------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("sizes, message", [
    ("0,64", "'0' in '0,64' is not a positive number of pixels"),
    ("48,-8", "'-8' in '48,-8' is not a positive number of pixels"),
    ("48,6.5", "'6.5' in '48,6.5' is not an integer number of pixels"),
    ("48,,64", "'' in '48,,64' is not an integer number of pixels"),
])
def test_bad_test_sizes_are_refused(sizes, message, tmp_path, capsys):
    code, err = run_main(capsys, "scratch", "--test-sizes", sizes, "--shared-folder-path", tmp_path)
    assert code == 2 and message in err and not any(tmp_path.iterdir())


@pytest.mark.parametrize("args, message", [
    (["--architecture", "vit_b_16", "--input-size", 40], "divisible by its patch size 16"),
    (["--architecture", "vit_b_16", "--input-size", 32, "--test-sizes", "32,50"], "divisible by its patch size 16"),
    (["--eval-only"], "--eval-only needs --weight-path"),
])
def test_bad_fixres_options_fail_in_seconds_with_one_line(args, message, tmp_path, capsys):
    code, err = run_main(capsys, "scratch", *args, "--shared-folder-path", tmp_path)
    assert code == 1 and message in err, err
    assert len(err.strip().splitlines()) == 1 and not any(tmp_path.iterdir())


def test_auto_without_candidates_and_checkpoint_without_head_are_refused(scratch_checkpoint, tmp_path, capsys):
    code, err = run_main(capsys, "finetune", "--weight-path", scratch_checkpoint, "--input-size", "auto",
                         "--shared-folder-path", tmp_path)
    assert code == 1 and "--input-size auto needs --test-sizes" in err
    headless = tmp_path / "headless.pth"
    torch.save({k: v for k, v in load_checkpoint(scratch_checkpoint)["model"].items() if not k.startswith("fc.")},
               headless)
    code, err = run_main(capsys, "finetune", "--weight-path", headless, "--shared-folder-path", tmp_path / "runs")
    assert code == 1 and "has no classifier head" in err, err
    assert len(err.strip().splitlines()) == 1


def test_frozen_backbone_runs_as_at_test_time_during_the_finetune():
    """Frozen BatchNorms, dropout and stochastic depth stay in eval mode; what trains is in train mode."""
    model = architectures.build_model("efficientnet_b0", 10)
    finetuning.freeze_for_finetune(model, 64)
    finetuning.set_train_mode(model)
    head, norm = finetuning.find_head_and_last_norm(model, 64)
    modules = dict(model.named_modules())
    assert modules[head].training and modules[norm].training
    assert not any(m.training for name, m in modules.items() if name not in (head, norm))
    finetuning.freeze_for_finetune(model, 64, "all")
    finetuning.set_train_mode(model)
    assert all(m.training for m in model.modules())
