"""Real gloo ranks on localhost: DDP steps, exact evaluation, separately started ranks, timeouts."""
from __future__ import annotations

import json
import socket
import stat
import subprocess
import sys

import attrs
import pytest
import torch
import torch.multiprocessing as mp

from conftest import FAST, clean_env, free_port, run_script, start_script, wait_for
from fixres_dist import Trainer, TrainerConfig
from fixres_dist.data import pipeline
from fixres_dist.distributed import collectives
from fixres_dist.entry.launch import start_method
from fixres_dist.models import architectures
from fixres_dist.training import engine
from numeric import assert_near_reference, assert_settled_ranking, evaluation

SMALL = [*FAST, "--architecture", "resnet20"]  # what the separately started ranks train: the model plays no part


def leave_stale_rendezvous(job, record: dict):
    """A crashed run's rendezvous file in the new job folder ``job``, readable by all (0644)."""
    job.mkdir(parents=True)
    (job / "rendezvous.json").write_text(json.dumps(record))
    (job / "rendezvous.json").chmod(0o644)


def wait_until_joining(job, rank):
    """Until ``rank``, started alone, is about to poll the job's rendezvous file: just before, it
    made the job folder owner-only, with what it holds (:func:`leave_stale_rendezvous`'s file)."""
    def joining():
        assert rank.poll() is None, rank.stderr[-3000:]
        return stat.S_IMODE((job / "rendezvous.json").stat().st_mode) == 0o600

    wait_for(joining, 240, "the joining rank to reach its rendezvous")


def connected(listener: socket.socket, rank) -> bool:
    """Whether a connection to ``listener`` (with a timeout) came, accepted and closed; ``rank`` must run."""
    assert rank.poll() is None, rank.stderr[-3000:]
    try:
        listener.accept()[0].close()
    except TimeoutError:
        return False
    return True


def _identical_after_step(rank, world, port, data_path, out):
    config = TrainerConfig(num_tasks=world, global_rank=rank, local_rank=rank, job_id="step",
                           dist_url=f"tcp://127.0.0.1:{port}", shared_folder_path=str(out), data_path=str(data_path),
                           architecture="resnet20", batch=8, workers=0, progress=False, dist_timeout=60)
    trainer = Trainer(config)
    trainer.build()  # each rank initialises with seed + rank: DDP must broadcast rank 0's weights
    before = torch.cat([p.detach().flatten() for p in trainer.model.parameters()]).clone()
    trainer.data.train_loader.batch_sampler.set_epoch(0)
    images, labels, _ = next(iter(trainer.data.train_loader))
    trainer.train_step(images, labels)
    after = torch.cat([p.detach().flatten() for p in trainer.model.parameters()])
    gathered = [torch.empty_like(after) for _ in range(world)]
    torch.distributed.all_gather(gathered, after)
    (out / f"rank{rank}.json").write_text(json.dumps({
        "identical": all(torch.equal(g, gathered[0]) for g in gathered),
        "moved": not torch.equal(before, after)}))
    trainer.close()


@pytest.mark.numeric
def test_ranks_hold_identical_parameters_after_one_ddp_step(tiny_data, tmp_path):
    mp.start_processes(_identical_after_step, args=(2, free_port(), tiny_data, tmp_path), nprocs=2,
                       start_method=start_method())
    for rank in range(2):
        assert json.loads((tmp_path / f"rank{rank}.json").read_text()) == {"identical": True, "moved": True}


def _evaluate_rank(rank, world, port, data_path, out):
    torch.set_num_threads(1)
    collectives.init_process_group("gloo", f"tcp://127.0.0.1:{port}", rank, world, 60)
    torch.manual_seed(0)
    model = architectures.build_model("resnet20", 5)
    val = pipeline.image_folder(data_path, "val")
    loader = pipeline.make_loader(val, pipeline.test_transform(32), batch_size=4, world_size=world, rank=rank,
                              shuffle=False, seed=0, workers=0)
    result = engine.evaluate(model, loader, torch.device("cpu"))
    (out / f"w{world}r{rank}.json").write_text(json.dumps(attrs.asdict(result)))
    collectives.destroy_process_group()


@pytest.mark.numeric
def test_exact_evaluation_is_independent_of_world_size(odd_val_data, tmp_path):
    """35 images on 1, 2 and 3 ranks in batches of 4 (uneven shares, uneven last batches): every image
    counted once, the same top-1 and top-5 (counts: exact, and the float64 evaluation's, no image of these
    being within rounding of changing class) and the same loss to rounding (summed in other groups:
    within :data:`numeric.FACTOR` of the 1-rank run's float32 error from float64)."""
    results = {}
    for world in (1, 2, 3):
        if world == 1:
            _evaluate_rank(0, 1, 0, odd_val_data, tmp_path)
        else:
            mp.start_processes(_evaluate_rank, args=(world, free_port(), odd_val_data, tmp_path), nprocs=world,
                               start_method=start_method())
        results[world] = [json.loads((tmp_path / f"w{world}r{r}.json").read_text()) for r in range(world)]
    torch.manual_seed(0)  # _evaluate_rank's model
    model = architectures.build_model("resnet20", 5)
    exact, plain = (evaluation(model, "resnet20", odd_val_data, "val", 32, dtype) for dtype in (torch.float64,
                                                                                                 torch.float32))
    assert_settled_ranking(exact["logits"], plain["logits"], "35 images at 32 px")
    reference = results[1][0]
    assert (reference["images"], reference["top1"], reference["top5"]) == (35, exact["top1"], exact["top5"])
    for world, per_rank in results.items():
        for r in per_rank:
            assert r["images"] == 35
            assert r["top1"] == reference["top1"] and r["top5"] == reference["top5"]
            if world > 1:
                assert_near_reference({"loss": r["loss"]}, {"loss": reference["loss"]}, {"loss": exact["loss"]},
                                      f"{world} ranks: loss")


def test_separately_started_ranks_meet_despite_a_stale_rendezvous_file(tiny_data, tmp_path):
    job = tmp_path / "shared" / "sep"
    # leftover of a crashed run: points at a port nobody listens on
    leave_stale_rendezvous(job, {"host": "127.0.0.1", "port": free_port(), "nonce": "old"})
    common = ["--num-tasks", 2, "--job-id", "sep", "--shared-folder-path", tmp_path / "shared",
              "--data-path", tiny_data, "--dist-timeout", 90, *SMALL]
    rank1 = start_script("scratch", "--global-rank", 1, "--local-rank", 1, *common)
    wait_until_joining(job, rank1)  # it finds the stale file before rank 0 replaces it
    rank0 = start_script("scratch", "--global-rank", 0, "--local-rank", 0, *common)
    out0, err0 = rank0.communicate(timeout=240)
    out1, err1 = rank1.communicate(timeout=60)
    assert rank0.returncode == 0, err0
    assert rank1.returncode == 0, err1
    # the stale address is probed with a plain socket first: no c10d connection errors on the console
    assert not [line for line in err1.splitlines() if line.startswith(("[W", "[E"))], err1[-3000:]
    events = [json.loads(line)["event"] for line in (job / "metrics.jsonl").read_text().splitlines()]
    assert events.count("eval") == 1 and events.count("train") == 1
    assert not (job / "rendezvous.json").exists()
    assert (job / "checkpoint.pth").exists()
    # issue 30: rank 1 announced this host and network namespace first, so the store listened on loopback only
    assert "2 ranks met at the store 127.0.0.1:" in out0, out0[-2000:]
    assert not list(job.glob("rendezvous.json.rank*"))  # the announcements, removed once the ranks met


def test_a_stale_rendezvous_address_taken_by_another_server_does_not_hang_a_rank(tiny_data, tmp_path):
    """The port of a crashed run's rank 0 now belongs to a server that accepts connections and never
    answers (a TCPStore handshake would wait forever): the joining rank gives up on it and meets the
    new rank 0."""
    job = tmp_path / "shared" / "taken"
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen(8)
        leave_stale_rendezvous(job, {"host": "127.0.0.1", "port": squatter.getsockname()[1], "nonce": "old",
                                     "hostname": "elsewhere", "pid": 1})
        common = ["--num-tasks", 2, "--job-id", "taken", "--shared-folder-path", tmp_path / "shared",
                  "--data-path", tiny_data, "--dist-timeout", 90, *SMALL]
        rank1 = start_script("scratch", "--global-rank", 1, *common)
        squatter.settimeout(0.2)
        # rank 1 has found the file and connects (a plain socket): it probes the squatter next
        wait_for(lambda: connected(squatter, rank1), 240, "rank 1 to connect to the squatter")
        rank0 = start_script("scratch", "--global-rank", 0, *common)
        _, err0 = rank0.communicate(timeout=240)
        _, err1 = rank1.communicate(timeout=60)
    assert (rank0.returncode, rank1.returncode) == (0, 0), err0[-2000:] + err1[-2000:]


@pytest.mark.parametrize("rank, message", [(1, "rank 0 did not open the rendezvous"),
                                           (0, "rank(s) 1 of 2 never arrived")])
def test_a_rank_whose_peers_never_arrive_times_out(tiny_data, tmp_path, rank, message):
    proc = run_script("scratch", "--num-tasks", 2, "--global-rank", rank, "--job-id", "alone",
                      "--shared-folder-path", tmp_path, "--data-path", tiny_data, "--dist-timeout", 4, *SMALL)
    assert proc.returncode == 1
    # it gave up after --dist-timeout, saying why
    assert f"{message} " in proc.stderr and " within 4 s " in proc.stderr and f"rank {rank}:" in proc.stderr, \
        proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


STORE_CALLS_AT_EXIT = """
import sys, threading, torch.distributed as dist
from fixres_dist.distributed import store_threads
store = dist.TCPStore("127.0.0.1", 0, 1, True, wait_for_workers=False)
def beat():  # a heartbeat that never stops: always in or about to enter a store call
    client = store.clone()
    while True:
        client.add("beat", 1)
for _ in range(4):
    store_threads.start(beat, "beat")
threading.Event().wait(0.3)
print("trained", flush=False)
store_threads.end_process(3)
"""


def test_a_store_call_in_flight_at_exit_does_not_abort_the_process():
    """A daemon thread that comes back from a TCPStore call while the interpreter finalizes aborts the
    process (SIGABRT, "terminate called without an active exception": a torchrun rank in CI, after a run
    that succeeded). A script's end (store_threads.end_process) keeps the exit status and the output
    instead; a new interpreter, since the exit is the behaviour."""
    proc = subprocess.run([sys.executable, "-c", STORE_CALLS_AT_EXIT], capture_output=True, text=True,
                          timeout=120, env=clean_env())
    assert (proc.returncode, proc.stdout) == (3, "trained\n"), proc.stderr[-2000:]
    assert "terminate called" not in proc.stderr
