"""docs/using.md as it is written: every command and every Python block of the page, in its order, from
a finished training (:func:`conftest.scratch_job`'s checkpoint as ``/tmp/runs/my-training``) on
:func:`jobs_fixtures.few_data` (``DATA``), with its validation images as the new photos
(``/tmp/photos``). Slow: two 2-rank finetunes that export themselves and are tracked, an export and a
2-rank prediction (about a minute and a half on 2 cores)."""
from __future__ import annotations

import contextlib
import io
import json
import re
import shutil

import pytest

import shown_commands as shown
from conftest import ROOT, run_script
from fixres_dist.deploy import export, predict

PAGE = ROOT / "docs" / "using.md"
OWN = ("epochs", "job_id", "config_file", "dist_url")  # what the rerun from config.json has of its own


def python_blocks() -> list[str]:
    """The page's ```python blocks, in order."""
    return re.findall(r"^```python\n(.*?)^```$", PAGE.read_text(), re.S | re.M)


def run_block(code: str, **paths) -> list[str]:
    """Execute a Python block of the page with its paths (keys) replaced (values); its printed lines."""
    for shown_path, real in paths.items():
        code = code.replace(shown_path, str(real))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, str(PAGE), "exec"), {"__name__": "docs_using"})
    return out.getvalue().splitlines()


@pytest.mark.slow
def test_the_page_from_a_finetune_to_predictions_and_an_exported_model(scratch_job, few_data, tmp_path):
    runs, photos = tmp_path / "runs", tmp_path / "photos"
    (runs / "my-training").mkdir(parents=True)
    shutil.copy(scratch_job / "checkpoint.pth", runs / "my-training" / "checkpoint.pth")
    photos.mkdir()
    for number, image in enumerate(sorted((few_data / "val").rglob("*.png"))):
        shutil.copy(image, photos / f"photo{number:02d}.png")
    values = {"DATA": few_data, "/tmp/runs": runs, "/tmp/photos": photos}

    def argv(command: str) -> list[str]:
        return shown.argv(command, **values)

    # 1. the finetune: its best checkpoint, its export folder, its MLflow run
    finetune = argv(shown.command("python main_finetune.py --num-tasks 2 --data-path DATA --shared-folder"))
    done = run_script("finetune", *finetune[2:])
    assert done.returncode == 0, done.stderr[-3000:]
    job = runs / "fixres48"
    assert (job / "best.pth").is_file() and (job / "mlflow.db").is_file(), sorted(p.name for p in job.iterdir())
    assert "--export: " in done.stdout and json.loads((job / "export" / "model.json").read_text())["input_size"] == 48
    # 2. again from its config.json: the same settings, its own placement and epochs
    again = argv(shown.command("python main_finetune.py --config /tmp/runs/fixres48/config.json"))
    done = run_script("finetune", *again[2:])
    assert done.returncode == 0, done.stderr[-3000:]
    first, second = (json.loads((runs / name / "config.json").read_text()) for name in ("fixres48", "fixres48-longer"))
    assert second["epochs"] == 3 and first["epochs"] == 2
    assert {k: v for k, v in second.items() if k not in OWN} == \
        {k: v for k, v in first.items() if k not in OWN}
    # 3. the best epoch exported
    command = argv(shown.command("python -m fixres_dist.deploy.export /tmp/runs/fixres48/best.pth"))
    assert export.main(command[3:]) == 0
    best = json.loads((runs / "fixres48-best" / "model.json").read_text())
    assert best["source"]["checkpoint"].endswith("best.pth") and best["weights"] == "model"
    # 4. ONNX Runtime without this package: one class name per photo
    onnx_block, mlflow_block = python_blocks()
    named = [line.split() for line in run_block(onnx_block, **values)]
    assert [name for name, _ in named] == sorted(p.name for p in photos.iterdir())
    assert all(label in best["class_names"] for _, label in named), named
    # 5. predictions on 2 ranks: every photo once, in order; the top class ONNX Runtime's where it is clear
    command = argv(shown.command("python -m fixres_dist.deploy.predict /tmp/runs/fixres48-best"))
    assert predict.main(command[3:]) == 0
    rows = [json.loads(line) for line in (runs / "photos.jsonl").read_text().splitlines()]
    assert [row["id"] for row in rows] == [name for name, _ in named]
    clear = [(row["class_1"], label) for row, (_, label) in zip(rows, named)
             if row["probability_1"] - row["probability_2"] > 1e-3]  # ONNX's float32 rounding differs from torch's
    assert clear and all(ours == theirs for ours, theirs in clear), clear
    # 6. the MLflow run: top-1 at each epoch's end, the export folder among its artifacts
    lines = run_block(mlflow_block, **values)
    steps = [int(line.split()[0]) for line in lines[:-1]]
    assert len(steps) >= 2 and steps == sorted(steps), lines
    assert "export" in lines[-1], lines
