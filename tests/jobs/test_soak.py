"""``scripts/soak.sh``: rounds of tests under load, each failing round reported with the failed tests and the
stacks its jobs left (a hung test's, a stalled job's)."""
from __future__ import annotations

import re
import subprocess

import shown_commands as shown
from conftest import ROOT

FLAKY = '''
from pathlib import Path

COUNT = Path(__file__).with_name("rounds")


def test_fails_in_its_second_round(tmp_path):
    """Passes, then fails once, as a flake does; the failing round's job left its stacks."""
    rounds = int(COUNT.read_text()) + 1 if COUNT.exists() else 1
    COUNT.write_text(str(rounds))
    stalls = tmp_path / "job" / "stalls"
    stalls.mkdir(parents=True)
    (stalls / "rank1.txt").write_text("rank 1: waiting for a batch from its loader workers")
    assert rounds != 2, "the flake"
'''


def test_a_failing_round_is_reported_with_its_tests_and_stacks(tmp_path):
    tests = tmp_path / "flaky" / "test_flaky.py"
    tests.parent.mkdir()
    tests.write_text(FLAKY)
    reports = tmp_path / "reports"
    done = subprocess.run(shown.argv(shown.command("bash scripts/soak.sh"), TESTS=f"-n 0 {tests}"), cwd=ROOT, text=True,
                          capture_output=True, timeout=300,
                          env=shown.shell_env(SOAK_LOAD="1", SOAK_DIR=str(reports)))
    assert done.returncode == 1, done.stdout + done.stderr
    out = done.stdout
    assert "round 1: 1 passed" in out and "round 2: 1 failed" in out, out
    assert re.search(r"FAILED \S*test_flaky::test_fails_in_its_second_round: AssertionError: the flake", out), out
    assert "soak: 2 round(s), 1 failed" in out, out
    copied = list((reports / "round2" / "stacks").iterdir())
    assert len(copied) == 1 and "waiting for a batch" in copied[0].read_text()
    assert not (reports / "round1" / "tmp").exists() and not (reports / "round1" / "stacks").exists()
