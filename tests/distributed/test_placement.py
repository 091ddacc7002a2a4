"""Rank resolution: each source, the precedence between them, and conflicts."""
import pytest

from fixres_dist import FixresError
from fixres_dist.distributed import placement
from fixres_dist.distributed.placement import resolve_placement

TORCHRUN = {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "none"}
SLURM = {"SLURM_PROCID": "3", "SLURM_LOCALID": "1", "SLURM_NTASKS": "4", "SLURM_JOB_ID": "777",
         "SLURM_NTASKS_PER_NODE": "2"}


def test_explicit_flags():
    p = resolve_placement(4, 3, 1, "job", None, environ={})
    assert (p.source, p.num_tasks, p.global_rank, p.local_rank, p.job_id) == ("flags", 4, 3, 1, "job")


def test_explicit_flags_default_local_rank_and_agree_with_slurm():
    p = resolve_placement(4, 3, None, "job", None, environ=SLURM)
    assert (p.source, p.global_rank, p.local_rank, p.num_tasks, p.job_id) == ("flags", 3, 3, 4, "job")
    assert resolve_placement(4, 3, 1, None, None, environ=SLURM).job_id == "777"  # survives a requeue


def test_torchrun_env():
    p = resolve_placement(environ=TORCHRUN)
    assert (p.source, p.num_tasks, p.global_rank, p.local_rank, p.dist_url) == ("torchrun", 2, 1, 1, "env://")
    assert p.job_id is None  # derived from the configuration by the launcher, the same on every rank
    assert resolve_placement(environ={**TORCHRUN, "TORCHELASTIC_RUN_ID": "abc"}).job_id is None


def test_torchrun_inside_a_slurm_task_beats_slurm():
    p = resolve_placement(environ={**SLURM, **TORCHRUN})
    assert (p.source, p.global_rank, p.job_id) == ("torchrun", 1, "777")


def test_a_shell_inside_an_allocation_is_not_a_slurm_task():
    p = resolve_placement(2, environ={"SLURM_JOB_ID": "5", "SLURM_NTASKS": "1"})
    assert (p.source, p.num_tasks, p.job_id) == ("spawn", 2, None)


def test_slurm_env():
    p = resolve_placement(environ=SLURM)
    assert (p.source, p.num_tasks, p.global_rank, p.local_rank, p.job_id, p.local_world_size) == \
        ("slurm", 4, 3, 1, "777", 2)
    array = resolve_placement(environ={**SLURM, "SLURM_ARRAY_JOB_ID": "70", "SLURM_ARRAY_TASK_ID": "3"})
    assert array.job_id == "70_3"


def test_spawn_and_single():
    assert resolve_placement(3, environ={}).source == "spawn"
    single = resolve_placement(environ={})
    assert (single.source, single.num_tasks, single.global_rank) == ("single", 1, 0)
    assert resolve_placement(1, environ={}).source == "single"


@pytest.mark.parametrize("args, environ, message", [
    ((4,), TORCHRUN, r"--num-tasks 4 \(command line\) conflicts with WORLD_SIZE=2"),
    ((4, 0, 0, "j"), TORCHRUN, r"--num-tasks 4 \(command line\) conflicts with WORLD_SIZE=2"),
    ((2,), SLURM, r"--num-tasks 2 \(command line\) conflicts with SLURM_NTASKS=4"),
    ((None, 0), {}, "--global-rank needs --num-tasks"),
    ((2, None, 1, "j"), {}, "--local-rank needs --global-rank"),
    ((4, 0, 0), SLURM, r"--global-rank 0 \(command line\) conflicts with SLURM_PROCID=3 \(environment\)"),
    ((4, 3, 0), SLURM, "--local-rank 0 .* conflicts with SLURM_LOCALID=1"),
    ((4,), {"RANK": "0", "WORLD_SIZE": "2"}, "partial torchrun variables: RANK=0, WORLD_SIZE=2 set but LOCAL_RANK not"),
    ((1,), {"RANK": "0", "WORLD_SIZE": "2"}, "partial torchrun variables"),
    ((), {"LOCAL_RANK": "0"}, "partial torchrun variables: LOCAL_RANK=0 set but RANK, WORLD_SIZE not"),
    ((), {**TORCHRUN, "MASTER_PORT": ""}, "without MASTER_ADDR and MASTER_PORT"),
    ((), {"SLURM_PROCID": "0"}, "SLURM_PROCID=0 is set but SLURM_NTASKS is not"),
    ((), {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1",
          "SLURM_PROCID": "0", "SLURM_NTASKS": "1"},
     r"WORLD_SIZE=2 \(torchrun variables\) conflicts with SLURM_NTASKS=1 \(SLURM\)"),
    ((0,), {}, "--num-tasks must be >= 1"),
    ((), {**TORCHRUN, "RANK": "x"}, "RANK='x' is not an integer"),
])
def test_conflicts_and_incomplete(args, environ, message):
    with pytest.raises(FixresError, match=message):
        resolve_placement(*args, environ=environ)


@pytest.mark.parametrize("environ, message", [
    ({**TORCHRUN, "RANK": "-1"}, "RANK=-1 must be >= 0"),
    ({**TORCHRUN, "WORLD_SIZE": "0"}, "WORLD_SIZE=0 must be >= 1"),
    ({**TORCHRUN, "RANK": "2"}, "RANK=2 must be < WORLD_SIZE=2"),
    ({**TORCHRUN, "LOCAL_RANK": "2"}, "LOCAL_RANK=2 must be < LOCAL_WORLD_SIZE=2"),
    ({**SLURM, "SLURM_LOCALID": "5"}, "SLURM_LOCALID=5 must be < the tasks on this node"),
    ({**SLURM, "SLURM_PROCID": "4"}, "SLURM_PROCID=4 must be < SLURM_NTASKS=4"),
    ({**TORCHRUN, "TORCHELASTIC_RUN_ID": "", **SLURM, "SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0"},
     r"LOCAL_RANK=1 \(torchrun variables\) conflicts with SLURM_LOCALID=0"),
])
def test_rank_variables_out_of_range_are_named(environ, message):
    environ = {k: v for k, v in environ.items() if not (k == "TORCHELASTIC_RUN_ID" and v == "")}
    with pytest.raises(FixresError, match=message):
        resolve_placement(environ=environ)


def test_torchrun_elastic_with_the_store_it_shares_is_named():
    """A torchrun worker that its agent may restart while the agent shares its rendezvous store with
    the workers: a node that joins later would hang, so the scripts warn (docs/cluster.md)."""
    shared = {"TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_MAX_RESTARTS": "3"}
    assert placement.elastic_shared_store(shared)
    assert not placement.elastic_shared_store({**shared, "TORCHELASTIC_MAX_RESTARTS": "0"})
    assert not placement.elastic_shared_store({**shared, "TORCHELASTIC_USE_AGENT_STORE": "False"})
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in placement.ELASTIC_SHARED_STORE


@pytest.mark.parametrize("environ, num_tasks, threads", [
    ({}, 1, 8), ({}, 2, 4), ({}, 3, 2), ({}, 16, 1),  # spawned ranks: the node's cores shared out
    ({"LOCAL_WORLD_SIZE": "4"}, 16, 2),  # torchrun: this node's ranks, not the job's
    ({"SLURM_NTASKS": "8", "SLURM_NTASKS_PER_NODE": "2"}, 8, 4),
    ({"SLURM_NTASKS": "8", "SLURM_TASKS_PER_NODE": "4(x2)"}, 8, 2),
    ({"SLURM_NTASKS": "8", "SLURM_TASKS_PER_NODE": "4(x2)", "SLURM_CPUS_PER_TASK": "3"}, 8, 3),  # SLURM's say
])
def test_a_rank_takes_the_cores_of_its_node_shared_by_the_ranks_on_it(monkeypatch, environ, num_tasks, threads):
    """``threads_per_rank`` on a node of 8 usable cores. (The jobs the tests start keep one thread each through
    OMP_NUM_THREADS, tests/conftest.py, which the ranks respect: this is where the share itself is checked.)"""
    monkeypatch.setattr(placement.os, "sched_getaffinity", lambda pid: set(range(8)))
    assert placement.threads_per_rank(num_tasks, environ) == threads
