"""``--config FILE`` (:mod:`fixres_dist.entry.config_file`): a run's settings from a YAML or JSON file, a
run's own config.json included, under the flags given; placement never read from a file; each bad file
refused in one line before anything starts. All in this process but the last test, which runs
docs/recipes.md's example: a job from a YAML file, then one from its config.json."""
from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import attrs
import pytest

import shown_commands as shown
from conftest import run_main, run_script
from fixres_dist.config import TrainerConfig
from fixres_dist.entry import config_file
from fixres_dist.entry.cli import build_parser, config_fields
from fixres_dist.entry.launch import build_config
from fixres_dist.training import recipes

# What a run's config.json holds that sets nothing here: its placement and its record (the note names them).
PLACEMENT = {"num_tasks", "global_rank", "local_rank", "job_id", "dist_url"}
IGNORED_OF_SCRATCH = ("config_file, dist_url, finetune_augmentation, finetune_scope, global_batch, global_batch_ranks, "
                      "global_rank, job_id, last_norm, local_rank, num_tasks")


def parsed(mode: str, path, *argv):
    return build_parser(mode).parse_args(["--config", str(path), *map(str, argv)])


def fields(mode: str, path, *argv) -> dict:
    """The configuration fields of ``main_<mode>.py --config path argv`` (ranks aside)."""
    return config_fields(parsed(mode, path, *argv), mode)


def placed(mode: str, argv: list[str], num_tasks: int, job_id: str | None = None) -> TrainerConfig:
    """The configuration ``main_<mode>.py argv`` runs rank 0 of ``num_tasks`` with."""
    config = TrainerConfig(**config_fields(build_parser(mode).parse_args(argv), mode))
    return config.placed(num_tasks=num_tasks, global_rank=0, local_rank=0, job_id=job_id)


def test_yaml_keys_as_fields_or_flags_and_values_as_config_json_writes_them(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("architecture: resnet20\ninput-size: 24\n--batch: 16\ntest_sizes: [24, 28, 32]\n"
                    "learning_rate: 1e-3\n"  # text to YAML 1.1 (no dot), a number to the flag
                    "mean: 0.5\nstd: [0.25, 0.25, 0.25]\nprogress: false\nmodel-ema: true\nauto_augment: null\n"
                    "compile: true\nstall_timeout: off\n")
    got = attrs.asdict(TrainerConfig(**fields("scratch", path)))
    assert {k: got[k] for k in ("architecture", "input_size", "batch", "test_sizes", "learning_rate", "mean", "std",
                                "progress", "model_ema", "auto_augment", "compile", "stall_timeout")} == {
        "architecture": "resnet20", "input_size": 24, "batch": 16, "test_sizes": (24, 28, 32), "learning_rate": 1e-3,
        "mean": (0.5,) * 3, "std": (0.25,) * 3, "progress": False, "model_ema": True, "auto_augment": None,
        "compile": "inductor", "stall_timeout": 0.0}
    assert got["config_file"] == os.path.realpath(path) and got["epochs"] == 8  # main_scratch.py's default


def test_json_overrides_a_recipe_as_flags_do(tmp_path):
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"recipe": "torchvision-resnet50", "model_ema": False, "auto_augment": None,
                                "epochs": 3, "ra_reps": 1}))
    got, recipe = fields("scratch", path), recipes.recipe_fields("torchvision-resnet50", "scratch")
    assert (got["model_ema"], got["auto_augment"], got["epochs"], got["ra_reps"]) == (False, None, 3, 1)
    assert got["label_smoothing"] == recipe["label_smoothing"] and got["input_size"] == recipe["input_size"]


def test_flags_given_override_the_file_and_flags_left_out_do_not(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("epochs: 5\nbatch: 16\nlearning_rate: 0.2\nsync_bn: true\n")
    assert (fields("scratch", path)["epochs"], fields("scratch", path)["batch"]) == (5, 16)  # over the defaults
    args = parsed("scratch", path, "--epochs", 2, "--learning-rate", 0.3)
    got = config_fields(args, "scratch")
    assert (got["epochs"], got["batch"], got["learning_rate"], got["sync_bn"]) == (2, 16, 0.3, True)
    assert getattr(args, config_file.NOTE) == (f"settings read from --config {os.path.realpath(path)}; the command "
                                               "line's --epochs, "
                                               "--learning-rate instead of the file's")


SCRATCH_RUNS = {
    "recipe with overrides": ["--architecture", "resnet20", "--recipe", "torchvision-resnet50", "--auto-augment",
                              "none", "--no-model-ema", "--epochs", "2"],
    "step schedule, repeats, EMA": ["--lr-scheduler", "step", "--lr-gamma", "0.5", "--ra-sampler", "--model-ema",
                                    "--model-ema-steps", "4", "--test-sizes", "24,32", "--no-progress"],
    "evaluation with a recipe": ["--eval-only", "--weight-path", "w.pth", "--recipe", "torchvision-resnet50"],
}


@pytest.mark.parametrize("run", list(SCRATCH_RUNS))
def test_a_runs_config_json_gives_its_configuration_back(run, tmp_path):
    """Every field, defaults included, restated by config.json: the same configuration, placement aside (its
    defaults restated do not count as flags given: --lr-step-size 30 with cosine, --model-ema-decay without
    --model-ema)."""
    first = placed("scratch", SCRATCH_RUNS[run], num_tasks=2)
    path = tmp_path / "config.json"
    path.write_text(first.to_json())
    args = parsed("scratch", path, "--job-id", "again")
    again = TrainerConfig(**config_fields(args, "scratch")).placed(num_tasks=1, global_rank=0, local_rank=0,
                                                                     job_id=args.job_id)
    changed = {k for k, v in first.to_dict().items() if again.to_dict()[k] != v}
    assert changed == {"num_tasks", "job_id", "dist_url", "config_file"}
    assert getattr(args, config_file.NOTE) == (f"settings read from --config {os.path.realpath(path)}; ignored, as no "
                                               "setting of this run (where its run sat, its record, the other script's "
                                               f"options): {IGNORED_OF_SCRATCH}; its run had 2 rank(s), and --batch "
                                               "is per rank: run on 2 (--num-tasks 2, or its launcher's) for its "
                                               "global batch and learning rate")


def test_a_finetunes_config_json_gives_its_configuration_back(tmp_path):
    first = placed("finetune", ["--weight-path", "w.pth", "--input-size", "auto", "--test-sizes", "32,40",
                                "--finetune-scope", "head", "--last-norm", "bn1"], num_tasks=1, job_id="ft")
    path = tmp_path / "config.json"
    path.write_text(first.to_json())
    again = TrainerConfig(**fields("finetune", path)).placed(num_tasks=1, global_rank=0, local_rank=0)
    assert {k for k, v in first.to_dict().items() if again.to_dict()[k] != v} == {"job_id", "config_file"}
    assert "auto_augment" in getattr(parsed("finetune", path), config_file.NOTE)  # main_scratch.py's, unset


TORCHRUN = {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
SLURM = {"SLURM_PROCID": "1", "SLURM_LOCALID": "1", "SLURM_NTASKS": "2", "SLURM_JOB_ID": "77"}


@pytest.mark.parametrize("environ, argv, expected", [
    (TORCHRUN, [], ("torchrun", 2, 1, "scratch-")),
    (SLURM, [], ("slurm", 2, 1, "77")),
    ({}, ["--num-tasks", "2", "--global-rank", "1", "--job-id", "mine"], ("flags", 2, 1, "mine")),
    ({}, [], ("single", 1, 0, "scratch-")),
])
def test_placement_is_never_read_from_a_file(environ, argv, expected, tmp_path):
    """A file's ranks, job id and rendezvous would be explicit flags, above torchrun and SLURM: they are ignored
    (named in the log's note), and the precedence holds."""
    path = tmp_path / "run.yaml"
    path.write_text("num_tasks: 4\nglobal-rank: 3\n--local-rank: 3\njob_id: theirs\ndist_url: tcp://10.0.0.1:1234\n")
    config, source = build_config("scratch", parsed("scratch", path, *argv), environ)
    assert (source, config.num_tasks, config.global_rank) == expected[:3] and config.job_id.startswith(expected[3])
    assert "10.0.0.1" not in config.dist_url


def written(name: str, content: str | bytes):
    """How a file ``name`` holding ``content`` is made in a folder."""
    def make(folder) -> str:
        (folder / name).write_bytes(content if isinstance(content, bytes) else content.encode())
        return name
    return make


def bad(text: str):
    return written("run.yaml", text)


def unreadable(folder) -> str:
    """A file whose reading is refused (its mode 000 would not stop root: the refusal is made here)."""
    written("run.yaml", "epochs: 1\n")(folder)
    (folder / "run.yaml").chmod(0)
    return "run.yaml"


def refusing_to_read(monkeypatch, name: str) -> None:
    """Reading a file called ``name`` fails as a file of mode 000 does for a user other than root."""
    read = Path.read_text

    def read_text(self, *args, **kwargs):
        if self.name == name:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(self))
        return read(self, *args, **kwargs)
    monkeypatch.setattr(Path, "read_text", read_text)


# name -> (script, how the file is made in a folder (returns its name), the message after "--config <file>: ").
BAD_FILES = {
    "missing": ("scratch", lambda folder: "nowhere.yaml", "no such file"),
    "a folder": ("scratch", lambda folder: (folder / "x.yaml").mkdir() or "x.yaml", "is a folder, not a file"),
    "unreadable": ("scratch", unreadable, "cannot be read (Permission denied)"),
    "not text": ("scratch", written("b.yaml", b"\xff\xfe"), "is not UTF-8 text"),
    "another suffix": ("scratch", written("run.toml", ""), "give a YAML (.yaml, .yml) or JSON (.json) file"),
    "malformed YAML": ("scratch", bad("epochs: [1, 2\n"),
                       "not valid YAML: expected ',' or ']', but got '<stream end>' at line 2, column 1"),
    "malformed JSON": ("scratch", written("r.json", '{"epochs": 1,}'),
                       "not valid JSON: Expecting property name enclosed in double quotes at line 1, column 14"),
    "a list": ("scratch", bad("- epochs\n"), "holds a list, not a mapping of option names to values (e.g. "
                                              "input_size: 64)"),
    "one value": ("scratch", bad("3\n"), "holds a single value (3), not a mapping of option names to values "
                                         "(e.g. input_size: 64)"),
    "empty": ("scratch", bad(""), "holds nothing, not a mapping of option names to values (e.g. input_size: 64)"),
    "unknown field": ("scratch", bad("inptu_size: 32\n"), "unknown option 'inptu_size'; did you mean input_size?"),
    "unknown flag": ("scratch", bad("--wieght-decay: 0.1\n"), "unknown option '--wieght-decay'; did you mean "
                                                               "--weight-decay?"),
    "one key twice": ("scratch", bad("epochs: 2\nbatch: 8\nepochs: 5\n"),
                      "'epochs' is given twice (which one is meant?)"),
    "one JSON key twice": ("scratch", written("r.json", '{"epochs": 2, "epochs": 9}'),
                           "'epochs' is given twice (which one is meant?)"),
    "two keys of one option": ("scratch", bad("input-size: 32\ninput_size: 40\n"),
                               "input-size and input_size are one option, --input-size"),
    "wrong type": ("scratch", bad("epochs: three\n"), "argument --epochs: 'three' is not a whole number"),
    "out of range": ("finetune", bad("epochs: 0\n"), "argument --epochs: must be a positive whole number, got 0"),
    "not a choice": ("scratch", bad("amp: fp32\n"),
                     "argument --amp: invalid choice: 'fp32' (choose from 'bf16', 'fp16', 'off')"),
    "switch not true or false": ("scratch", bad("sync_bn: 1\n"), "argument --sync-bn: expected true or false, got 1"),
    "true for a number": ("scratch", bad("epochs: true\n"), "argument --epochs: expected a value, got true"),
    "finetune option in main_scratch.py": ("scratch", bad("finetune_scope: head\n"),
                                           "--finetune-scope only applies to main_finetune.py"),
    "scratch option in main_finetune.py": ("finetune", bad("random-erase: 0.25\n"),
                                           "--random-erase only applies to main_scratch.py (the finetune's "
                                           "preprocessing is --finetune-augmentation's)"),
    "the other script's config.json": ("finetune", bad("mode: scratch\nepochs: 2\n"),
                                       "is the configuration of a main_scratch.py run, not of main_finetune.py"),
    "another --config in it": ("scratch", bad("config: other.yaml\n"),
                               "a --config file cannot name another (config: other.yaml)"),
}


@pytest.mark.parametrize("case", list(BAD_FILES))
def test_a_bad_file_is_one_line_and_nothing_is_written(case, tmp_path, capsys, monkeypatch):
    script, make, message = BAD_FILES[case]
    if case == "unreadable":
        refusing_to_read(monkeypatch, "run.yaml")
    monkeypatch.chdir(tmp_path)
    name = make(tmp_path)
    status, err = run_main(capsys, script, "--config", name, "--shared-folder-path", tmp_path / "shared")
    assert status == 2 and err.count("\n") == 1, err
    assert err.endswith(f": error: --config {name}: {message}\n"), err
    assert not (tmp_path / "shared").exists()


@pytest.mark.parametrize("text, status, message", [
    ("lr_step_size: 5\n", 2, "error: --lr-step-size only applies to --lr-scheduler step, not cosine"),
    ("learning_rate: -1\n", 1, "fixres_dist: rank 0: --learning-rate must be > 0, got -1.0"),
])
def test_values_the_configuration_refuses_get_the_flags_message(text, status, message, tmp_path, capsys):
    (tmp_path / "run.yaml").write_text(text)
    got, err = run_main(capsys, "scratch", "--config", tmp_path / "run.yaml", "--shared-folder-path", tmp_path / "s")
    assert got == status and err.count("\n") == 1 and message in err, err
    assert not (tmp_path / "s").exists()


def test_a_run_starts_again_from_its_config_json(tiny_data, tmp_path):
    """docs/recipes.md's example, as shown, on tiny data: a job from a YAML file, then a new job from its
    config.json with another job id and --epochs: the same configuration but for those and the file read; both
    logs say which file was read, the second which keys it ignored."""
    first, second = shown.block("python main_scratch.py --config run.yaml")
    (tmp_path / "run.yaml").write_text(f"data_path: {tiny_data}\narchitecture: resnet20\ninput_size: 24\nbatch: 8\n"
                                       "epochs: 2\nworkers: 0\nprogress: false\n")
    made = run_script("scratch", *shown.argv(first)[2:], cwd=tmp_path)
    assert made.returncode == 0, made.stderr[-3000:]
    again = run_script("scratch", *shown.argv(second)[2:], cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    runs = tmp_path / "runs"
    one, two = (json.loads((runs / job / "config.json").read_text()) for job in ("from-file", "again"))
    assert {k for k in one if one[k] != two[k]} == {"job_id", "epochs", "config_file"}
    assert (two["epochs"], one["config_file"], two["config_file"]) == (
        1, os.path.realpath(tmp_path / "run.yaml"), os.path.realpath(runs / "from-file" / "config.json"))
    assert made.stdout.splitlines()[1] == f"settings read from --config {os.path.realpath(tmp_path / 'run.yaml')}"
    assert again.stdout.splitlines()[1] == (
        f"settings read from --config {os.path.realpath(runs / 'from-file' / 'config.json')}; the command line's "
        f"--epochs instead of the file's; ignored, as no setting of this run (where its run sat, its record, the "
        f"other script's options): {IGNORED_OF_SCRATCH}")
