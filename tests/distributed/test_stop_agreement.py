"""The per-step stop check (issue 14): ranks agree one step late, in the background, so that a step
never waits for a network round trip, yet they all act after the same step; before a checkpoint
they agree on the current state. Real gloo ranks; the Trainer-level behaviour (the checkpoint step
and the bit-identical resume) is tested in test_resume.py, the non-finite loss in test_nonfinite.py."""
from __future__ import annotations

import json
import signal

import torch.multiprocessing as mp

from conftest import free_port
from fixres_dist.distributed import collectives
from fixres_dist.distributed.preemption import Agreed, StepAgreement, StopSignals
from fixres_dist.entry.launch import start_method

STEPS = 8


def _run(agreement: StepAgreement, stops: StopSignals, rank: int, signal_at=None, bad_at=None, drain_at=()):
    """Steps 1..STEPS: rank ``signal_at[0]`` gets SIGUSR2 during step ``signal_at[1]``; ``bad_at``
    maps a rank to (the step after which it knows, its first step with a non-finite loss: earlier
    on CUDA, whose flag is read a step late); steps in ``drain_at`` agree at once (a checkpoint
    step). Returns ``(step acted on, stop signal name, bad step named)``."""
    first_bad = None
    for step in range(1, STEPS + 1):
        if signal_at == (rank, step):
            signal.raise_signal(signal.SIGUSR2)  # to this process: recorded by ``stops``, installed
        if (bad_at or {}).get(rank, (None,))[0] == step:
            first_bad = bad_at[rank][1]
        agreed = agreement.now(first_bad) if step in drain_at else agreement.after_step(first_bad)
        if not agreed.go_on:
            return step, agreed.stop and agreed.stop.name, agreed.bad_step
    return None, None, agreement.now(first_bad).bad_step


CASES = {
    "signal, pipelined": {"signal_at": (1, 3)},
    "signal, drained at a checkpoint step": {"signal_at": (1, 3), "drain_at": (3,)},
    "signal, pending result dropped by a drain": {"signal_at": (0, 2), "drain_at": (3,)},
    "non-finite loss, pipelined": {"bad_at": {0: (5, 5)}},
    "non-finite loss, drained at a checkpoint step": {"bad_at": {1: (3, 3)}, "drain_at": (3,)},
    "non-finite losses on both ranks, the earliest named": {"bad_at": {0: (5, 4), 1: (5, 5)}},
    "nothing": {},
}


def _agreement_rank(rank: int, port: int, out):
    collectives.init_process_group("gloo", f"tcp://127.0.0.1:{port}", rank, 2, 60)
    results = {}
    for name, case in CASES.items():
        with StopSignals() as stops:
            results[name] = _run(StepAgreement(stops, collectives.control_group()), stops, rank, **case)
    (out / f"rank{rank}.json").write_text(json.dumps(results))
    collectives.destroy_process_group()


def test_two_ranks_act_on_the_same_step_at_most_one_step_late(tmp_path):
    mp.start_processes(_agreement_rank, args=(free_port(), tmp_path), nprocs=2, start_method=start_method())
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert ranks[0] == ranks[1]  # every rank acts after the same step, on the same result
    assert ranks[0] == {
        "signal, pipelined": [4, "SIGUSR2", None],  # arrived during step 3: acted on after step 4
        "signal, drained at a checkpoint step": [3, "SIGUSR2", None],  # at once
        "signal, pending result dropped by a drain": [3, "SIGUSR2", None],  # nothing lost
        "non-finite loss, pipelined": [6, None, 5],  # the diverged step is still the one named
        "non-finite loss, drained at a checkpoint step": [3, None, 3],  # before the checkpoint is written
        "non-finite losses on both ranks, the earliest named": [6, None, 4],
        "nothing": [None, None, None],
    }


def test_one_process_agrees_at_once():
    with StopSignals() as stops:
        agreement = StepAgreement(stops)
        assert agreement.after_step(None) == Agreed()
        signal.raise_signal(signal.SIGTERM)  # recorded, not acted on
        signal.raise_signal(signal.SIGUSR2)  # the preemption signal wins
        assert agreement.after_step(7) == Agreed(signal.SIGUSR2, 7)
