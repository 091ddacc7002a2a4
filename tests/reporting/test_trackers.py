"""Experiment trackers (fixres_dist.reporting.trackers): the real MLflow and W&B packages, offline, fed a finished
run's record (:func:`conftest.scratch_job`'s metrics.jsonl), interrupted and resumed, read back with MLflow's
client and from W&B's offline run files; trackers that break; the flags and --config files."""
from __future__ import annotations

import json
import shutil
import struct
import sys
from pathlib import Path

import attrs
import pytest
import torch

from conftest import run_main
from fixres_dist.config import TrainerConfig
from fixres_dist.entry.cli import build_parser, config_fields
from fixres_dist.errors import FixresError
from fixres_dist.reporting import trackers
from fixres_dist.reporting.tensorboard_events import event_scalars

# mlflow and wandb are imported by the tests that use them (seconds), not as each test worker collects this file

BLOCK, HEADER = 32768, 7  # W&B's run file: LevelDB's log format (32 KiB blocks), after a 7-byte ":W&B" header


def wandb_records(run_folder: Path) -> list:
    """The records of an offline run folder's ``run-<id>.wandb`` (protobuf ``Record``s in LevelDB's log format:
    per chunk a CRC, its length, its kind: full, first, middle, last); the wandb package has no reader."""
    from wandb.proto import wandb_internal_pb2

    data = next(run_folder.glob("run-*.wandb")).read_bytes()
    assert data[:4] == b":W&B"
    records, position, pieces = [], HEADER, b""
    while position + HEADER <= len(data):
        if BLOCK - position % BLOCK < HEADER:  # a block's tail too short for a header is padding
            position += BLOCK - position % BLOCK
            continue
        length, kind = struct.unpack("<HB", data[position + 4:position + HEADER])
        if kind == 0:
            break
        pieces += data[position + HEADER:position + HEADER + length]
        position += HEADER + length
        if kind in (1, 4):  # full, last
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pieces)
            records.append(record)
            pieces = b""
    return records


def wandb_history(folder: Path) -> tuple[set[str], dict[str, list[tuple[int, float]]]]:
    """The run ids and, per tag, the ``(step, value)`` pairs of every offline run folder under ``folder``."""
    ids, values = set(), {}
    for run_folder in sorted((folder / "wandb").glob("offline-run-*")):
        ids.add(run_folder.name.split("-")[3])  # offline-run-<time>-<id>, then -<n> if the second was taken
        for record in wandb_records(run_folder):
            if record.WhichOneof("record_type") == "history":
                items = {item.key or "/".join(item.nested_key): json.loads(item.value_json)
                         for item in record.history.item}
                for key, value in items.items():
                    if not key.startswith("_"):
                        values.setdefault(key, []).append((items["_step"], value))
    return ids, values


def mlflow_curves(uri: str, run_id: str) -> dict[str, list[tuple[int, float]]]:
    from mlflow import MlflowClient

    client = MlflowClient(uri)
    return {key: sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))
            for key in client.get_run(run_id).data.metrics}


def expected(history: list[dict], images_per_epoch: int) -> dict[str, list[tuple[int, float]]]:
    curves = {}
    for entry in history:
        found = event_scalars(entry, images_per_epoch)
        for tag, value in found[1] if found else ():
            curves.setdefault(tag, []).append((found[0], value))
    return curves


@pytest.fixture
def tracked(scratch_job, tmp_path, monkeypatch):
    """scratch_job's configuration with both trackers: MLflow on a file store (the job test uses the default SQLite
    one), W&B offline, both under ``tmp_path``; its history; its images per epoch."""
    pytest.importorskip("mlflow")
    pytest.importorskip("wandb")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 keeps its file store behind this switch
    monkeypatch.setenv("WANDB_SILENT", "true")
    config = attrs.evolve(TrainerConfig.from_json((scratch_job / "config.json").read_text()),
                          shared_folder_path=str(tmp_path), job_id="tracked", trackers=("mlflow", "wandb"),
                          mlflow_tracking_uri=(tmp_path / "mlruns").as_uri(), wandb_dir=str(tmp_path / "wb"))
    config.job_folder.mkdir()
    history = [json.loads(line) for line in (scratch_job / "metrics.jsonl").read_text().splitlines()]
    return config, history, next(e["images"] for e in history if e["event"] == "train")


def test_a_run_stopped_and_resumed_is_one_tracker_run_with_each_step_once(tracked):
    from mlflow import MlflowClient
    from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH

    config, history, per_epoch = tracked
    warned = []
    first_epoch = history[:next(i for i, e in enumerate(history) if e.get("epoch", 0) > 1)]  # up to its checkpoint

    # the first attempt: epoch 1's record and two per-step points, then stopped after its checkpoint
    run = trackers.Trackers(config, per_epoch, None, warned.append)
    assert set(run.open) == {"mlflow", "wandb"}, warned
    run.step_scalars(0, 2.5, 0.01)
    run.replay(first_epoch)
    run.step_scalars(per_epoch, 2.25, 0.02)  # after the checkpoint: the resumed run computes it again
    saved = run.checkpointed()
    run.close("KILLED")

    # resumed from the checkpoint: its history told again, the per-step point computed again, then the rest
    again = trackers.Trackers(config, per_epoch, saved, warned.append)
    assert again.checkpointed() == saved  # the same runs continued
    again.replay(first_epoch)
    again.step_scalars(per_epoch, 9.0, 9.0)  # held already: the first value stays
    again.step_scalars(per_epoch + 16, 2.0, 0.03)
    for entry in history[len(first_epoch):]:
        again.event(entry)
    again.close("FINISHED")
    assert warned == []

    want = expected(history, per_epoch)
    want.update({"train/loss_step": [(0, 2.5), (per_epoch, 2.25), (per_epoch + 16, 2.0)],
                 "train/lr_step": [(0, 0.01), (per_epoch, 0.02), (per_epoch + 16, 0.03)]})
    assert {"train/loss", "eval/top1/32px", "step_time_ms/compute/rank0"} <= set(want)

    client = MlflowClient(config.mlflow_tracking_uri)
    experiment = client.get_experiment_by_name(trackers.DEFAULT_EXPERIMENT)
    runs = client.search_runs([experiment.experiment_id])
    assert [r.info.run_id for r in runs] == [saved["mlflow"]]
    assert runs[0].info.status == "FINISHED" and runs[0].info.run_name == "tracked"
    assert runs[0].data.params == trackers.parameters(config.to_dict(), MAX_PARAM_VAL_LENGTH)
    assert mlflow_curves(config.mlflow_tracking_uri, saved["mlflow"]) == pytest.approx(want)

    ids, curves = wandb_history(Path(config.wandb_dir))
    assert ids == {saved["wandb"]}  # one offline folder per attempt, the same run
    # offline, W&B cannot say where its run stops: the point the first attempt sent after its checkpoint (which only
    # a kill leaves: a stop signal checkpoints where it stops) comes again from the resumed attempt's folder, and
    # W&B's sync, whose steps only increase, keeps the first; the record before the checkpoint is not sent again
    want["train/loss_step"].insert(2, (per_epoch, 9.0))
    want["train/lr_step"].insert(2, (per_epoch, 9.0))
    assert {tag: sorted(points) for tag, points in curves.items()} == want

    # the launcher's end of a successful run: the sweep plot and the exported model, into the runs saved
    folder = config.job_folder
    torch.save({"trackers": saved}, folder / trackers.CHECKPOINT_FILE)
    from matplotlib.figure import Figure

    Figure(figsize=(1, 1)).savefig(folder / "resolution_sweep.png")
    (folder / "export").mkdir()
    (folder / "export" / "model.json").write_text("{}")
    trackers.log_final_artifacts(config, folder)
    logged = client.list_artifacts(saved["mlflow"])
    assert sorted(a.path for a in logged) == ["export", "resolution_sweep.png"]
    assert [a.path for a in client.list_artifacts(saved["mlflow"], "export")] == ["export/model.json"]
    last = sorted((Path(config.wandb_dir) / "wandb").glob("offline-run-*"))[-1]
    kinds = [r.WhichOneof("record_type") for r in wandb_records(last)]
    assert "artifact" in kinds and last.name.split("-")[3] == saved["wandb"]


def test_a_broken_tracker_is_one_warning_and_a_missing_package_a_refusal(tracked, monkeypatch, capsys):
    config, history, per_epoch = tracked
    (config.job_folder / "not-a-folder").write_text("")
    broken = attrs.evolve(config, mlflow_tracking_uri="nosuchscheme://tracker",
                          wandb_dir=str(config.job_folder / "not-a-folder"))
    warned = []
    run = trackers.Trackers(broken, per_epoch, {"mlflow": "kept"}, warned.append)
    run.replay(history)
    assert run.open == {} and run.checkpointed() == {"mlflow": "kept"}  # a resumed run id is kept while off
    assert len(warned) == 2 and all("\n" not in w and "training goes on" in w for w in warned)
    assert warned[0].startswith("MLflow tracking could not start") and warned[1].startswith("W&B tracking could")
    torch.save({"trackers": {"mlflow": "kept"}}, config.job_folder / trackers.CHECKPOINT_FILE)
    (config.job_folder / "export").mkdir()
    capsys.readouterr()
    trackers.log_final_artifacts(attrs.evolve(broken, trackers=("mlflow",), wandb_dir=None), config.job_folder)
    err = capsys.readouterr().err
    assert err.startswith("fixres_dist: warning: MLflow tracking could not log the artifacts") and \
        err.count("\n") == 1, err

    # a store that goes away mid-run: one warning, then that tracker is off and the other goes on
    works = attrs.evolve(config, trackers=("mlflow",), wandb_dir=None)
    warned.clear()
    run = trackers.Trackers(works, per_epoch, None, warned.append)
    shutil.rmtree(Path(works.mlflow_tracking_uri[len("file://"):]))
    run.replay(history)
    run.checkpointed()
    run.step_scalars(0, 1.0, 1.0)
    run.close("FINISHED")
    assert len(warned) == 1 and warned[0].startswith("MLflow tracking stopped"), warned

    # the preflight's check: a tracker's package missing is refused before anything starts
    trackers.check_available(config)
    monkeypatch.setitem(sys.modules, "wandb", None)  # Python's own way to make an import fail
    status, err = run_main(capsys, "scratch", "--data-path", config.data_path, "--shared-folder-path",
                           config.shared_folder_path, "--job-id", "refused", "--architecture", "resnet20",
                           "--input-size", 32, "--tracker", "mlflow,wandb")
    assert status == 1 and err == ("fixres_dist: rank 0: --tracker wandb needs the wandb package, not installed: "
                                   "pip install -e '.[trackers]'\n"), err
    assert not (Path(config.shared_folder_path) / "refused").exists()
    monkeypatch.setitem(sys.modules, "alembic", None)
    with pytest.raises(FixresError, match="--tracker mlflow needs the alembic package"):
        trackers.check_available(attrs.evolve(config, trackers=("mlflow",), mlflow_tracking_uri=None, wandb_dir=None))


def test_tracker_flags_and_config_files(tiny_data, tmp_path):
    parser = build_parser("finetune")
    base = ["--data-path", str(tiny_data), "--weight-path", str(tmp_path / "w.pth")]
    args = parser.parse_args([*base, "--tracker", "mlflow", "--tracker", "wandb,mlflow", "--mlflow-experiment", "e",
                              "--wandb-mode", "online", "--wandb-dir", str(tmp_path)])
    config = TrainerConfig(**config_fields(args, "finetune"))
    assert config.trackers == ("mlflow", "wandb") and config.wandb_mode == "online"
    assert (config.mlflow_experiment, config.wandb_dir, config.mlflow_tracking_uri) == ("e", str(tmp_path), None)
    assert TrainerConfig.from_json(config.to_json()) == config
    assert trackers.mlflow_uri(config) == f"sqlite:///{(config.job_folder / 'mlflow.db').absolute()}"
    untracked = TrainerConfig(**config_fields(parser.parse_args(base), "finetune"))
    assert config.derived_job_id() == untracked.derived_job_id()  # trackers are no part of the job's identity

    with pytest.raises(SystemExit):
        parser.parse_args([*base, "--tracker", "mlflow,tensorboard"])
    for flags, message in ((["--mlflow-tracking-uri", "x"], "--mlflow-tracking-uri needs --tracker mlflow"),
                           (["--tracker", "mlflow", "--wandb-project", "p"], "--wandb-project needs --tracker wandb"),
                           (["--tracker", "mlflow", "--mlflow-experiment", " "], "must not be empty")):
        with pytest.raises(FixresError, match=message):
            TrainerConfig(**config_fields(parser.parse_args([*base, *flags]), "finetune"))

    # --config: a YAML file's list, and a run's own config.json
    yaml_file = tmp_path / "run.yaml"
    yaml_file.write_text("tracker: [wandb, mlflow]\nwandb-project: p\n")
    args = parser.parse_args([*base, "--config", str(yaml_file)])
    assert (args.trackers, args.wandb_project) == (("wandb", "mlflow"), "p")
    (tmp_path / "config.json").write_text(config.to_json())
    args = parser.parse_args(["--config", str(tmp_path / "config.json")])
    assert TrainerConfig(**config_fields(args, "finetune")).trackers == ("mlflow", "wandb")

    assert trackers.parameters({"a": "x" * 7000, "b": {"c": [1, 2]}, "d": None, "e": 2.5}, 6000) == \
        {"a": "x" * 6000, "b.c": "[1, 2]", "d": "null", "e": "2.5"}
