"""The survivors' record of a lost peer (:func:`fixres_dist.training.world_change.note_loss`): which
survivor's diagnosis the continuing run reads when several write theirs for the same failure."""
from __future__ import annotations

from fixres_dist.config import TrainerConfig
from fixres_dist.distributed.rendezvous import STORE_HOST, LostPeers
from fixres_dist.training import world_change

NAMED = LostPeers("ranks 2-3 on n2 (no heartbeat for 5 s: killed, or the host is cut off)")
STORE_ONLY = LostPeers(f"rank 0 on n1, {STORE_HOST} (it died, or the network to n1 is down)")


def _note(config: TrainerConfig, failure: LostPeers, step: int = 7) -> None:
    world_change.note_loss(config, 1, 16, step, str(failure), failure.only_the_store)


def test_a_survivor_that_saw_only_the_store_go_keeps_the_diagnosis_naming_the_lost_ranks(tmp_path):
    """torchrun's agent stops rank 0 once n2's ranks are lost; rank 1, diagnosing after, sees only the store
    go silent: the record that names ranks 2-3 on n2 stays (tests/jobs/test_multinode.py's elastic test saw
    the other one win, 2026-12-07)."""
    config = TrainerConfig(shared_folder_path=str(tmp_path), job_id="j", num_tasks=4)
    (tmp_path / "j").mkdir()
    assert NAMED.only_the_store is False and STORE_ONLY.only_the_store is True
    _note(config, NAMED)
    _note(config, STORE_ONLY)
    assert "ranks 2-3 on n2" in world_change.read_loss(config)["lost"]
    _note(config, STORE_ONLY, step=9)  # a later failure: its own record, whatever it names
    assert STORE_HOST in world_change.read_loss(config)["lost"]
    _note(config, NAMED, step=9)  # the named diagnosis of the same failure replaces the store-only one
    assert "ranks 2-3 on n2" in world_change.read_loss(config)["lost"]
