"""A FixRes resolution sweep as one SLURM job array: one finetune per test resolution, one table.

:func:`sweep_configs` makes the finetune templates, :func:`fixres_dist.cluster.submission.submit_array`
submits them, :func:`gather_sweep` reads each task's result (and top-1 before finetuning from its
``metrics.jsonl``) into rows, and :func:`sweep_table` prints them.
"""
from __future__ import annotations

import json
from pathlib import Path

import attrs

from fixres_dist.cluster.monitor import first_failure, task_outcomes
from fixres_dist.cluster.submission import job_folder
from fixres_dist.config import TrainerConfig
from fixres_dist.errors import FixresError


def sweep_configs(template: TrainerConfig, resolutions: list[int]) -> list[TrainerConfig]:
    """``template`` (a finetune) at each test resolution; ``configs[i]`` finetunes at ``resolutions[i]``."""
    if not resolutions or any(r <= 0 for r in resolutions):
        raise FixresError("--resolutions needs one or more positive sizes in pixels, e.g. 32,48,64")
    if template.mode != "finetune":
        raise FixresError("a resolution sweep finetunes: give a finetune configuration")
    return [attrs.evolve(template, input_size=r) for r in resolutions]


def read_before_top1(folder: Path, resolution: int) -> float | None:
    """Top-1 at ``resolution`` before finetuning, from a job folder's metrics.jsonl (if logged)."""
    try:
        lines = (folder / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if event.get("event") == "eval" and event.get("epoch") == 0 and event.get("resolution") == resolution:
            return event.get("top1")
    return None


def gather_sweep(jobs, configs) -> list[dict]:
    """One row per resolution: rank 0's result after finetuning (or the error) and top-1 before."""
    rows = []
    for job, config in zip(jobs, configs):
        outcomes = task_outcomes(job)
        result = next((res for rank, res, _ in outcomes if rank == 0), None)
        failed = first_failure(outcomes)
        row = {"resolution": config.input_size, "job_id": job.job_id,
               "error": f"rank {failed[0]}: {failed[1]}" if failed else None,
               "top1_before": read_before_top1(job_folder(config, job.job_id), config.input_size)}
        if result is not None:
            row.update(top1=result["top1"], top5=result["top5"], images=result["images"])
        rows.append(row)
    return rows


def sweep_table(rows: list[dict], weight_path: str, epochs: int) -> str:
    lines = [f"FixRes sweep of {weight_path}: {epochs}-epoch finetune at each test resolution",
             "| test resolution | top-1 % before | top-1 % after | top-5 % after | job |",
             "|-----------------|----------------|---------------|---------------|-----|"]
    for row in rows:
        before = "" if row["top1_before"] is None else f"{row['top1_before']:.2f}"
        if row["error"]:
            lines.append(f"| {row['resolution']:12d} px | {before:>14} | failed: {row['error']} | | {row['job_id']} |")
        else:
            lines.append(f"| {row['resolution']:12d} px | {before:>14} | {row['top1']:13.2f} | "
                         f"{row['top5']:13.2f} | {row['job_id']} |")
    return "\n".join(lines)
