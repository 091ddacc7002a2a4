"""``python -m fixres_dist.bench.strategies`` (issue 42): one model over several parallel layouts on
local gloo ranks, side by side in one table and in JSON; a layout the Trainer refuses is a row saying
why; bad input is one line and exit status 2 before any rank starts."""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from argparse import Namespace
from pathlib import Path

import pytest

import shown_commands as shown
from conftest import ROOT, clean_env
from fixres_dist.bench import local_ranks, strategies
from fixres_dist.bench.layouts import parse_layouts

MIB = 2 ** 20
TINY = ["--architecture", "timm/test_vit", "--size", "32", "--batch", "8"]
LAYOUTS = ["ddp", "full", "tensor:2", "pipeline:2", "full+pipeline:2"]  # the last: refused by the Trainer (not yet)


def run(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fixres_dist.bench.strategies", *args], capture_output=True,
                          text=True, timeout=timeout, env=clean_env(), cwd=ROOT)


@pytest.mark.slow  # five layouts benchmarked on 2 ranks: 55 s of a 2-core test run; the bench's refusals, failures and
# Ctrl-C stay in the README's test command
def test_four_layouts_on_two_ranks_side_by_side(tmp_path):
    """docs/sharding.md's command, shrunk to timm's test ViT on 2 ranks for 2 CPU cores."""
    command = shown.argv(shown.command("python -m fixres_dist.bench.strategies"))
    shown_args = strategies.build_parser().parse_args(command[3:])
    assert [layout.text for layout in shown_args.layouts] == ["ddp", "full", "hybrid:2", "tensor:2", "pipeline:2"]
    assert shown_args.ranks == 4 and shown_args.json == Path("strategies.json")
    saved = tmp_path / "strategies.json"
    done = run(*TINY, "--ranks", "2", "--steps", "2", "--warmup", "0", "--layouts", ",".join(LAYOUTS),
               "--json", str(saved))
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-3000:]
    out = done.stdout.splitlines()
    assert out[0].startswith("python -m fixres_dist.bench.strategies: timm/test_vit @ 32 px, batch 8 ")
    assert "; 2 timed steps after 0 warm-up steps; " in out[0], out[0]
    header = out.index("| " + " | ".join(strategies.COLUMNS) + " |")
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in out[header + 2:header + 2 + len(LAYOUTS)]]
    assert [r[0] for r in rows] == LAYOUTS
    assert [r[1] for r in rows[:4]] == ["2 data", "2 shard", "2 tensor", "2 stage"]
    for r in rows[:4]:
        img_s, step, peak, states = (float(v.replace(",", "")) for v in r[2:6])
        assert img_s > 0 and step > 0 and peak > 0 and states > 0, r
    assert rows[0][6:] == ["1.00", "1.00"]  # the reference row
    assert rows[4][2].startswith("error: --pipeline-stages 2 does not go with --sharding full"), rows[4]

    figures = json.loads(saved.read_text())
    assert figures["settings"] == {"architecture": "timm/test_vit", "size": 32, "batch": 8, "ranks": 2, "amp": "off",
                                   "steps": 2, "warmup": 0, "memory_steps": 1}
    layouts = {row["layout"]: row for row in figures["layouts"]}
    assert list(layouts) == LAYOUTS
    assert layouts["full+pipeline:2"]["error"] and layouts["full+pipeline:2"]["ranks"] == []
    for name in LAYOUTS[:4]:
        row = layouts[name]
        assert row["error"] is None and [r["rank"] for r in row["ranks"]] == [0, 1]
        for rank in row["ranks"]:
            assert len(rank["step_times"]) == 2 and rank["peak"] >= rank["resident"] > 0
            assert set(rank["model_states"]) == {"parameters", "gradients", "optimizer"}
        assert row["img_s"] == pytest.approx(8 * row["ranks"][0]["data_parallel"] / row["step_s"])
        assert row["peak_mib"] == max(r["peak"] for r in row["ranks"]) / 2**20
    # Every rank of DDP holds the whole model's states; the other layouts hold about half of them on 2 ranks.
    ddp = layouts["ddp"]["model_states_mib"]
    assert all(layouts[name]["model_states_mib"] < 0.75 * ddp for name in ("full", "tensor:2", "pipeline:2"))
    assert layouts["tensor:2"]["ranks"][0]["data_parallel"] == 1 and layouts["ddp"]["ranks"][0]["data_parallel"] == 2


def failing_rank(rank: int, spec: dict, port: int, folder: str) -> None:
    """Rank 1 fails at once; rank 0 waits for it as for a peer in a collective, and would wait a minute."""
    with local_ranks.rank_result(folder, spec["name"], rank) as result:
        if rank == 1:
            raise RuntimeError("broken on purpose\nsecond line")
        time.sleep(60)
        result["done"] = True


def test_a_failed_rank_ends_its_peers_and_is_one_line(tmp_path):
    results = local_ranks.run_ranks(failing_rank, {"world": 2, "name": "broken"}, tmp_path, grace=1)
    assert results[1] == {"rank": 1, "error": "RuntimeError: broken on purpose"}
    assert results[0]["rank"] == 0 and results[0]["error"] == "no result (ended when rank 1 failed)", results
    row = strategies.summary(parse_layouts("ddp")[0], Namespace(ranks=2, batch=8), results, None)
    assert row["error"] == "rank 1: RuntimeError: broken on purpose"  # the cause, not the peer it took down


def test_meshes_in_words():
    layouts = parse_layouts("ddp,full,hybrid:2,tensor:2,pipeline:2,pipeline:2+tensor:2")
    assert [layout.mesh(8) for layout in layouts] == ["8 data", "8 shard", "4 replicate x 2 shard",
                                                     "4 data x 2 tensor", "4 data x 2 stage",
                                                     "2 data x 2 stage x 2 tensor"]
    assert layouts[2].fields() == {"sharding": "hybrid", "shard_group_size": 2, "tensor_parallel": 1,
                                   "pipeline_stages": 1}


def test_the_header_counts_in_words():
    args = Namespace(architecture="resnet18", size=32, batch=8, amp="off", ranks=1, steps=1, warmup=1)
    assert "amp off, 1 rank on cpu; 1 timed step after 1 warm-up step; load average" in strategies.header(args, "cpu")


@pytest.mark.parametrize("args, message", [
    (["--layouts", "ddp,foo"], "argument --layouts: unknown layout 'foo': expected ddp, full, hybrid:G"),
    (["--layouts", "tensor:1"], "tensor:1 must be at least 2"),
    (["--layouts", "full+ddp"], "'full+ddp': two shardings"),
    (["--layouts", "ddp,,full"], "'ddp,,full': an empty layout between commas"),
    (["--layouts", "ddp,hybrid"], "'hybrid': give hybrid's shard group size, as hybrid:2"),
    (["--ranks", "0"], "argument --ranks: must be a positive whole number, got 0"),
    (["--ranks", "3", "--layouts", "ddp,tensor:2"], "--layouts tensor:2: 2 tensor does not divide --ranks 3"),
    (["--ranks", "4", "--layouts", "hybrid:3"], "shard groups of 3 do not divide the 4 data-parallel ranks"),
    (["--architecture", "resnet81"], "did you mean resnet18"),
    (["--architecture", "timm/test_vit", "--size", "30"], "timm/test_vit"),
    (["--architecture", "timm/test_vit", "--size", "7"], "--size 7: timm/test_vit needs an image size divisible by its "
     "patch size 16; 7 is not (nearest: 16)"),
    (["--amp", "fp16", "--device", "cpu"], "--amp fp16 needs --device cuda"),
    (["--json", "/proc/strategies.json"], "--json /proc/strategies.json: cannot write there"),
])
def test_bad_input_is_one_line_before_any_rank(args, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        strategies.main(args)
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert exit_info.value.code == 2 and len(err.splitlines()) == 1 and message in err, err
    assert err.startswith(strategies.PROG) and captured.out == ""  # no header: nothing was measured


def test_bad_input_exits_2_from_the_command():
    done = run("--ranks", "2", "--layouts", "ddp,pipeline:3", timeout=60)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.strip() == ("python -m fixres_dist.bench.strategies: --layouts pipeline:3: 3 stages does "
                                   "not divide --ranks 2")


def test_json_replaces_an_existing_file_atomically_owner_only(tmp_path, monkeypatch, capsys):
    """--json on an existing file: a new file renamed over it (another inode, 0600), never rewritten in place."""
    saved = tmp_path / "strategies.json"
    saved.write_text("old\n")
    saved.chmod(0o644)
    before = saved.stat().st_ino
    monkeypatch.setattr(strategies, "check", lambda args, folder: setattr(args, "device", "cpu"))
    layout = parse_layouts("ddp")[0]
    rank = {"rank": 0, "step_s": 0.5, "peak": MIB, "resident": MIB, "model_states": {"parameters": MIB}}
    monkeypatch.setattr(strategies, "measure", lambda args, folder: strategies.with_ratios(
        [strategies.summary(layout, args, [rank], None)]))
    strategies.main(["--ranks", "1", "--layouts", "ddp", "--json", str(saved)])
    assert json.loads(saved.read_text())["layouts"][0]["layout"] == "ddp"
    assert saved.stat().st_ino != before and saved.stat().st_mode & 0o777 == 0o600
    assert [p.name for p in tmp_path.iterdir()] == ["strategies.json"]  # no temporary file left
    assert "| ddp |" in capsys.readouterr().out


def group_processes(group: int) -> dict[int, int]:
    """The processes of process group ``group``: {pid: parent pid}."""
    found = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[2]) == group:
            found[int(stat.parent.name)] = int(fields[1])
    return found


@pytest.mark.parametrize("moment", ["ranks running", "starting"])
def test_ctrl_c_ends_everything_in_one_line(tmp_path, moment):
    """SIGINT to the whole process group, as a terminal sends it: while a layout's ranks run, or while torch
    loads. Exit status 130, one line, no traceback, no process of the group left, no temporary folder, the
    --json file as it was."""
    temp = Path(tempfile.mkdtemp(prefix="bs"))  # short: the forkserver's socket goes there (AF_UNIX: 108 bytes)
    saved = tmp_path / "strategies.json"
    saved.write_text("before\n")
    process = subprocess.Popen(
        [sys.executable, "-m", "fixres_dist.bench.strategies", *TINY, "--ranks", "2", "--steps", "400", "--warmup", "1",
         "--layouts", "ddp,tensor:2", "--json", str(saved)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, env={**clean_env(), "TMPDIR": str(temp)}, cwd=ROOT, start_new_session=True)
    group = process.pid
    try:
        deadline = time.monotonic() + (0.5 if moment == "starting" else 180)
        while time.monotonic() < deadline and process.poll() is None:
            ranks = [pid for pid, parent in group_processes(group).items() if parent not in (group, 1)]
            if moment == "ranks running" and len(ranks) >= 2:  # forked by the forkserver
                time.sleep(1.5)
                break
            time.sleep(0.1)
        assert process.poll() is None, process.communicate()
        os.killpg(group, signal.SIGINT)
        out, err = process.communicate(timeout=60)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(group, signal.SIGKILL)
        left = sorted(p.name for p in temp.iterdir())
        shutil.rmtree(temp)
    assert process.returncode == 130, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert "stopped by SIGINT" in err and "nothing" in err, err
    for _ in range(50):  # no process of the group outlives it (not even the forkserver)
        if not group_processes(group):
            break
        time.sleep(0.1)
    assert group_processes(group) == {}
    assert left == [] and saved.read_text() == "before\n"
    assert [p.name for p in tmp_path.iterdir()] == ["strategies.json"]
