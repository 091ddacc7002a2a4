"""The command lines of main_scratch.py and main_finetune.py: ``--help`` and usage errors answer
without importing torch, every default in the help is the one the configuration gets, and each
script lists (and accepts) only its own flags."""
from __future__ import annotations

import argparse
import re
import subprocess
import sys

import attrs
import pytest
import torch

from conftest import ROOT, clean_env, start_script
from fixres_dist.config import CIFAR_RESNETS, LITE_MODELS, TIMM_PREFIX, TrainerConfig
from fixres_dist.entry.cli import (
    DEVICE_DEFAULTS,
    EARLY_STOPPING_FLAGS,
    FINETUNE_ONLY_FLAGS,
    RANK_FLAGS,
    SCRATCH_ONLY_FLAGS,
    build_parser,
    config_fields,
    shown,
)

MODES = ("scratch", "finetune")
HEAVY = ("torch", "torchvision", "numpy")
# Runs one way of starting a script in a fresh interpreter, then reports its exit status and which
# heavy modules it imported (on the last line of stdout).
PROBE = """
import sys
sys.argv = {argv!r}
try:
    {start}
except SystemExit as exc:
    status = exc.code
else:
    status = 0
print("\\nPROBE", status, ",".join(m for m in {heavy!r} if m in sys.modules))
"""


def entry_point(name: str) -> str:
    """setup.py's ``module:function`` for console script ``name``."""
    return re.search(rf'"{re.escape(name)}=([\w.]+:\w+)"', (ROOT / "setup.py").read_text()).group(1)


def starts(mode: str) -> dict[str, str]:
    """The ways to start ``main_<mode>.py``: the script itself and its console entry point."""
    module, function = entry_point(f"fixres-{mode}").split(":")
    return {"script": f"import runpy; runpy.run_path({str(ROOT / f'main_{mode}.py')!r}, run_name='__main__')",
            "entry point": f"from {module} import {function}; {function}()"}


def probe(start: str, argv: list[str]) -> tuple[int, list[str], str, str]:
    """``(exit status, heavy modules imported, output before the probe line, stderr)``."""
    proc = subprocess.run([sys.executable, "-c", PROBE.format(argv=argv, start=start, heavy=HEAVY)], cwd=ROOT,
                          env=clean_env(), capture_output=True, text=True, timeout=120)
    out, _, last = proc.stdout.rstrip("\n").rpartition("\n")
    word, status, heavy = last.split(" ", 2) if last.count(" ") == 2 else (last, "", "")
    assert word == "PROBE", (proc.stdout, proc.stderr)
    return int(status), [m for m in heavy.split(",") if m], out, proc.stderr


@pytest.mark.parametrize("how", ["script", "entry point"])
@pytest.mark.parametrize("mode", MODES)
def test_help_answers_without_torch_or_numpy(mode, how):
    status, heavy, out, err = probe(starts(mode)[how], [f"main_{mode}.py", "--help"])
    assert status == 0 and heavy == [], (heavy, err)
    assert "--architecture" in out and "usage:" in out


@pytest.mark.parametrize("how", ["script", "entry point"])
@pytest.mark.parametrize("mode, argv, message", [
    ("scratch", ["--last-norm", "bn1"], "--last-norm only applies to main_finetune.py"),
    ("finetune", ["--epochs", "0"], "argument --epochs: must be a positive whole number, got 0"),
    ("scratch", ["--batch", "1e3"], "argument --batch: '1e3' is not a whole number"),
    ("finetune", ["--config", "nowhere.yaml"], "--config nowhere.yaml: no such file"),
])
def test_usage_errors_answer_in_one_line_without_torch(mode, argv, message, how):
    status, heavy, out, err = probe(starts(mode)[how], [f"main_{mode}.py", *argv])
    assert status == 2 and heavy == [], (heavy, err)
    assert err.strip().count("\n") == 0 and message in err and out == "", err


def test_console_entry_points_are_the_torch_free_ones():
    for mode in MODES:
        assert entry_point(f"fixres-{mode}") == f"fixres_dist.entry.scripts:main_{mode}"


def expected_config(mode: str, argv: list[str] = ()) -> TrainerConfig:
    """The configuration ``main_<mode>.py argv`` runs with (ranks aside); finetune gets its one
    required flag, --weight-path."""
    fields = config_fields(build_parser(mode).parse_args(argv), mode)
    return TrainerConfig(**{**fields, "weight_path": "weights.pth"} if mode == "finetune" else fields)


def option_help(action: argparse.Action) -> str:
    return " ".join(action.help.split())


@pytest.mark.parametrize("mode", MODES)
def test_every_default_in_the_help_is_the_one_used(mode, monkeypatch):
    monkeypatch.setenv("COLUMNS", "10000")  # one line per option: nothing wrapped at a hyphen
    parser = build_parser(mode)
    rendered = " ".join(parser.format_help().split())
    config = expected_config(mode)
    fields = attrs.fields_dict(TrainerConfig)
    checked = []
    for action in parser._actions:
        if action.dest not in fields or action.dest in (*RANK_FLAGS, "weight_path") or action.help == argparse.SUPPRESS:
            continue  # ranks: resolved by placement; --weight-path: given here (no default)
        text, value = option_help(action), getattr(config, action.dest)
        if action.dest == "device":
            assert "default: cuda when available, else cpu" in text
            assert value == ("cuda" if torch.cuda.is_available() else "cpu")
        elif action.dest in DEVICE_DEFAULTS:
            cuda, cpu = DEVICE_DEFAULTS[action.dest]
            wanted = f"default: {shown(cuda)} with --device cuda, {shown(cpu)} with --device cpu"
            assert wanted in text and wanted in rendered, text
            for device, default in (("cuda", cuda), ("cpu", cpu)):
                assert config_fields(build_parser(mode).parse_args(["--device", device]), mode)[action.dest] == default
            assert value == (cuda if config.device == "cuda" else cpu)
        elif action.dest == "progress":  # decided by the run: on when stderr is a terminal
            assert value is None and "default: on when stderr is a terminal" in text
        elif isinstance(action, argparse.BooleanOptionalAction):  # --x / --no-x: off (on) unless given
            assert f"(default: {'on' if value else 'off'})" in text and isinstance(value, bool), (action.dest, text)
        elif action.nargs == 0:  # an on/off flag: giving it is the other value
            assert value is (not action.const), action.dest
        elif value is not None:
            wanted = f"default {shown(value)}"
            assert re.search(rf"{re.escape(wanted)}(?![\w.])", text), (action.dest, text)
            assert wanted in rendered
        checked.append(action.dest)
    assert {"epochs", "learning_rate", "momentum", "weight_decay", "norm_weight_decay", "warmup_epochs", "seed",
            "batch", "workers", "input_size", "dist_timeout", "keep_checkpoints", "amp", "channels_last",
            "dist_backend", "device"} <= set(checked)


def test_the_scripts_show_their_own_defaults():
    def epochs_help(mode):
        return next(option_help(a) for a in build_parser(mode)._actions if a.dest == "epochs")
    for mode in MODES:
        assert f"default {expected_config(mode).epochs})" in epochs_help(mode)
    assert expected_config("scratch").epochs != expected_config("finetune").epochs


def test_flags_not_given_parse_to_none():
    for mode in MODES:
        parsed = vars(build_parser(mode).parse_args([]))
        assert parsed and all(value is None for value in parsed.values()), parsed


def visible_flags(mode: str) -> set[str]:
    return {flag for action in build_parser(mode)._actions if action.help != argparse.SUPPRESS
            for flag in action.option_strings}


def test_each_script_lists_only_its_own_flags(monkeypatch):
    monkeypatch.setenv("COLUMNS", "10000")
    assert visible_flags("finetune") - visible_flags("scratch") == set(FINETUNE_ONLY_FLAGS)
    assert visible_flags("scratch") - visible_flags("finetune") == {*SCRATCH_ONLY_FLAGS, *EARLY_STOPPING_FLAGS}
    scratch = build_parser("scratch").format_help()
    assert "finetune" not in scratch.lower() and "'auto'" not in scratch, scratch
    finetune = build_parser("finetune").format_help()
    assert "FixRes finetune, evaluation and feature extraction:" in finetune and "'auto'" in finetune


@pytest.mark.parametrize("mode, flag", [("scratch", flag) for flag in FINETUNE_ONLY_FLAGS] +
                         [("finetune", flag) for flag in (*SCRATCH_ONLY_FLAGS, *EARLY_STOPPING_FLAGS)])
def test_the_other_scripts_flags_are_usage_errors(mode, flag, capsys):
    other = "main_finetune.py" if mode == "scratch" else "main_scratch.py"
    for argv in ([flag], [flag, "x"]):
        with pytest.raises(SystemExit) as exit_info:
            build_parser(mode).parse_args(argv)
        assert exit_info.value.code == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"error: {flag} only applies to {other}" in err, err


def test_input_size_auto_is_main_finetune_s(capsys):
    assert build_parser("finetune").parse_args(["--input-size", "auto"]).input_size == "auto"
    with pytest.raises(SystemExit) as exit_info:
        build_parser("scratch").parse_args(["--input-size", "auto"])
    assert exit_info.value.code == 2
    assert "--input-size: 'auto' only applies to main_finetune.py" in capsys.readouterr().err


def test_architecture_help_names_every_family():
    action = next(a for a in build_parser("scratch")._actions if a.dest == "architecture")
    text = option_help(action)
    lite = list(LITE_MODELS)
    for name in (*CIFAR_RESNETS, lite[0], lite[-1], f"{TIMM_PREFIX}<name>", "--low-res-stem", "vit_b_16",
                 f"default {TrainerConfig().architecture}"):
        assert name in text, (name, text)


def test_parsed_arguments_reach_the_launcher(tmp_path):
    """The scripts' entry point (:func:`fixres_dist.entry.scripts.run_script`, all that main_scratch.py runs)
    parses first and hands the launcher the parsed arguments (exit 1: a bad value). The script file
    itself, as a new interpreter: test_bad_input.py::test_real_process_exit_status_and_single_line."""
    proc = start_script("scratch", "--num-tasks", "0", "--shared-folder-path", tmp_path)
    proc.wait(timeout=240)
    assert proc.returncode == 1 and proc.stderr.strip() == "fixres_dist: rank 0: --num-tasks must be >= 1, got 0", \
        proc.stderr
