"""Will it fit: the estimated peak memory per rank of a training step (fixres_dist.training.memory_estimate),
its table command (memory_table), and the preflight's refusal of a run over its memory budget (memory_budget)."""
from __future__ import annotations

import io
import json
import sys

import pytest
import torch.distributed as dist

from conftest import FAST, run_main
from fixres_dist.config import TrainerConfig
from fixres_dist.training import inputs, memory_budget, memory_estimate, memory_table, tracked_memory

SMALL = {"architecture": "resnet20", "input_size": 32, "batch": 8}  # a CIFAR ResNet: estimates in about a second
CLASSES = 10  # the embedded Fashion-MNIST's


def config(**fields) -> TrainerConfig:
    return TrainerConfig(**{**SMALL, **fields})


@pytest.fixture(scope="module")
def base() -> memory_estimate.MemoryEstimate:
    return memory_estimate.estimate(config(), CLASSES)


@pytest.fixture(scope="module")
def checkpointed() -> memory_estimate.MemoryEstimate:
    return memory_estimate.estimate(config(activation_checkpointing=True), CLASSES)


def test_the_estimate_grows_with_batch_and_resolution(base):
    assert base.known and base.peak == base.parameters + base.gradients + base.optimizer + base.activations
    larger_batch = memory_estimate.estimate(config(batch=32), CLASSES)
    larger_images = memory_estimate.estimate(config(input_size=64), CLASSES)
    assert larger_batch.activations > 3 * base.activations and larger_batch.peak > base.peak
    assert larger_images.activations > 3 * base.activations and larger_images.peak > base.peak
    assert larger_batch.parameters == base.parameters  # the model is the same
    line = base.describe()
    assert "GiB per rank at its peak" in line and "resnet20 at 32 px, batch 8 per rank" in line and "\n" not in line


def test_full_sharding_on_4_ranks_holds_less_than_ddp():
    """The sharded estimate runs as rank 0 of 4 on a fake process group, made and destroyed here: it
    leaves none behind, and another can be made after it."""
    excepthook = sys.excepthook
    ddp = memory_estimate.estimate(config(num_tasks=4, opt="adamw"), CLASSES)
    full = memory_estimate.estimate(config(num_tasks=4, opt="adamw", sharding="full"), CLASSES)
    assert ddp.known and full.known, (ddp.reason, full.reason)
    assert "full shard over 4 ranks" in full.setting and "DDP on 4 ranks" in ddp.setting
    assert full.parameters + full.optimizer < 0.5 * (ddp.parameters + ddp.optimizer)
    assert full.peak < ddp.peak
    assert not dist.is_initialized() and sys.excepthook is excepthook
    with memory_estimate.fake_process_group(2):
        assert dist.get_world_size() == 2
    assert not dist.is_initialized()


def test_activation_checkpointing_keeps_fewer_activations(base, checkpointed):
    assert checkpointed.activations < 0.6 * base.activations
    assert checkpointed.peak < base.peak


def test_sizes_below_a_thousandth_of_a_gib_keep_their_value():
    """No ``<0.001``: MiB, or bytes exactly below a MiB, where GiB would round the size away."""
    assert [memory_estimate.gib(size) for size in (0, 3112, 2 ** 20, 2 ** 30)] == \
        ["0 GiB", "3,112 bytes", "1 MiB", "1 GiB"]
    found = memory_estimate.MemoryEstimate("s", 2 ** 30 + 3112, parameters=2 ** 30, gradients=3112)
    assert found.breakdown() == "parameters 1 GiB, gradients 3,112 bytes, optimizer state 0 GiB, activations 0 GiB"


def test_a_pipeline_stage_with_activation_checkpointing_keeps_fewer_activations():
    """Pipeline stages (estimated on the meta device) recompute their blocks as a run's do, checkpointed
    before the cut: the same parameters per stage, fewer activations kept for the micro-batches in flight."""
    plain, checkpointed = (memory_estimate.estimate(config(num_tasks=4, pipeline_stages=2, activation_checkpointing=on),
                                                    CLASSES) for on in (False, True))
    assert plain.known and checkpointed.known, (plain.reason, checkpointed.reason)
    assert "activation checkpointing" in checkpointed.setting and "activation checkpointing" not in plain.setting
    assert checkpointed.parameters == plain.parameters and checkpointed.optimizer == plain.optimizer
    assert checkpointed.activations < 0.8 * plain.activations and checkpointed.peak < plain.peak
    print(f"resnet20 in 2 stages: activations {plain.activations:,} B, checkpointed {checkpointed.activations:,} B")


def test_a_model_the_fake_route_cannot_run_gives_no_estimate_and_the_reason(monkeypatch):
    def fails(*args):
        raise RuntimeError("no fake kernel for this\nsecond line")
    monkeypatch.setattr(tracked_memory, "tracked_steps", fails)
    found = memory_estimate.estimate(config(), CLASSES)
    assert not found.known and found.reason == "RuntimeError: no fake kernel for this"
    assert found.describe().startswith("no memory estimate for resnet20") and not found.fits(2 ** 40)


@pytest.mark.slow
def test_the_command_prints_its_table(capsys):
    memory_table.main(["--architecture", "resnet20", "--input-size", "32", "--batch", "8", "--num-tasks", "4",
                 "--shard-group-size", "2", "--num-classes", "10", "--opt", "adamw"])
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("resnet20 at 32 px, batch 8 per rank, 4 ranks, adamw, amp off, 10 classes")
    assert out[1].split() == ["choice", "peak", "params", "grads", "optim", "activ"]
    rows = {line[:14].strip(): [float(v) for v in line[14:].split()] for line in out[2:]}
    assert list(rows) == ["ddp", "ddp + AC", "full", "full + AC", "hybrid (2)"]
    assert all(len(values) == 5 for values in rows.values()), out
    assert not dist.is_initialized()


@pytest.mark.parametrize("args, status, message", [
    (["--architecture", "resnet81", "--input-size", "32"], 1, "did you mean resnet18"),
    (["--architecture", "alexnet", "--input-size", "32"], 1, "the smallest size it runs at is 63 px"),
    (["--architecture", "resnet20", "--input-size", "32", "--batch", "0"], 2,
     "--batch: must be a positive whole number"),
    (["--architecture", "resnet20"], 2, "--architecture and --input-size are required"),
])
def test_the_command_refuses_bad_input_in_one_line(args, status, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        memory_table.main(args)
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == status and len(err.splitlines()) == 1 and message in err, err


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("stdin, message", [
    (_Terminal(), "this is the preflight's internal child process: it reads a JSON request on stdin, not a terminal"),
    (io.StringIO("{not json"), "it reads a JSON request on stdin (see --help); that is not JSON: "),
    (io.StringIO("[1]"), "it reads a JSON object with config, num_classes and budget on stdin"),
    (io.StringIO('{"config": {"bogus": 1}, "num_classes": 10, "budget": 1}'), "config has unknown keys ['bogus']"),
    (io.StringIO('{"config": {"batch": 0}, "num_classes": 10, "budget": 1}'), "--batch must be > 0, got 0"),
])
def test_the_preflights_child_refuses_a_request_it_cannot_read_in_one_line(stdin, message, monkeypatch, capsys):
    """python -m fixres_dist.training.memory_budget (internal: the preflight's child process): a terminal, or
    what is not a request, on stdin: one line, exit status 2, nothing estimated."""
    monkeypatch.setattr(sys, "stdin", stdin)
    assert memory_budget.main([]) == 2
    captured = capsys.readouterr()
    assert captured.err == f"fixres_dist: memory_budget: {message}{captured.err.split(message, 1)[1]}" \
        and captured.err.count("\n") == 1 and captured.out == "", captured.err
    assert not dist.is_initialized()


def test_the_preflights_child_says_in_its_help_that_it_is_internal(capsys):
    with pytest.raises(SystemExit) as exit_info:
        memory_budget.main(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert exit_info.value.code == 0 and "Internal: the child process of the preflight's memory check" in out
    assert "one JSON request on stdin" in out and "one JSON line on stdout" in out


def test_the_preflights_child_answers_a_request_in_one_json_line(monkeypatch, capsys):
    request = {"config": config(num_tasks=2, sharding="full").to_dict(), "num_classes": CLASSES, "budget": 2 ** 40}
    monkeypatch.setattr(sys, "stdin", io.StringIO(json.dumps(request)))
    assert memory_budget.main([]) == 0
    found = memory_budget.Check.from_dict(json.loads(capsys.readouterr().out))
    assert found.first.known and found.fit is None and not dist.is_initialized()


def run_args(tmp_path, *args) -> list[str]:
    return ["--shared-folder-path", tmp_path / "shared", *FAST, "--architecture", "resnet20", *args]


def test_preflight_names_the_cheapest_change_that_fits(base, checkpointed, tmp_path, capsys):
    budget = (base.peak + checkpointed.peak) / 2 / memory_estimate.GIB  # only activation checkpointing fits
    code, err = run_main(capsys, "scratch", *run_args(tmp_path, "--memory-budget", f"{budget:.9f}"))
    assert code == 1 and len(err.strip().splitlines()) == 1, err
    assert "resnet20 needs an estimated" in err and "more than the budget of" in err
    assert "the cheapest change that fits: --activation-checkpointing (" in err
    assert not (tmp_path / "shared").exists()  # refused before anything was written


@pytest.mark.slow  # it estimates every alternative, sharded ones in a child: 15-20 s
def test_preflight_refuses_a_budget_the_model_can_never_meet(tmp_path, capsys):
    """Two ranks, sharded: the estimate and the search (activation checkpointing, then smaller batches)
    run in a child process with a fake process group; the launcher keeps none."""
    code, err = run_main(capsys, "scratch", *run_args(tmp_path, "--memory-budget", "0.0001", "--num-tasks", "2",
                                                      "--sharding", "full"))
    assert code == 1 and len(err.strip().splitlines()) == 1, err
    assert "no change of batch, sharding, split or checkpointing meets the budget of" in err
    assert "even at batch 2 with full shard over 2 ranks and activation checkpointing" in err
    assert not (tmp_path / "shared").exists() and not dist.is_initialized()


def test_preflight_within_the_budget_says_the_estimate(tmp_path, capsys):
    checked = inputs.preflight(config(memory_budget=64, shared_folder_path=str(tmp_path)))
    assert checked.memory_estimate is not None and checked.memory_estimate.known
    err = capsys.readouterr().err
    assert "fixres_dist: memory: an estimated" in err
    assert "within the budget of 64 GiB per rank (--memory-budget)" in err


def test_a_cpu_run_without_a_budget_estimates_nothing(monkeypatch, tmp_path):
    def never(*args, **kwargs):
        raise AssertionError("estimated")
    monkeypatch.setattr(memory_budget, "estimate", never)
    monkeypatch.setattr(memory_budget, "check_run", never)
    checked = inputs.preflight(config(shared_folder_path=str(tmp_path)))
    assert checked.memory_estimate is None
    assert memory_budget.check_budget(config(memory_budget=1, eval_only=True, weight_path=__file__), CLASSES) is None
