"""Shared fixtures: small real ImageFolders cut from the embedded Fashion-MNIST, clean environment."""
from __future__ import annotations

import json
import multiprocessing.forkserver
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fixres_dist import startup

startup.quiet_native_logs()  # before torch loads, as the scripts do (the jobs' output has no c10d warnings)

import torch

# One intra-op thread in the test processes: pytest-xdist's 4 workers and the ranks they start share the
# machine's cores, where OpenMP threads that wait by spinning would take turns with them (a test of 3 s
# alone took 73 s in the suite so); one thread also sums in the same order on any machine, whatever its
# core count. The jobs the tests start get one thread per rank too (OMP_NUM_THREADS, which the ranks and the
# predict command keep: fixres_dist.distributed.session): alone, a rank takes the node's cores shared by its
# ranks, which on 2 cores is 2 threads for a 1-rank job; beside 3 other workers' jobs, those threads took
# turns at every parallel region, and a resume on 1 rank took 52 s against 6 s on 3 ranks.
torch.set_num_threads(1)
os.environ.setdefault("OMP_NUM_THREADS", "1")

import launched  # imports torch
from fixres_dist.data.images import read_image
from fixres_dist.data.pipeline import ToUint8Tensor, embedded_data_path, image_folder
from fixres_dist.entry import launch as launcher
from fixres_dist.models.architectures import build_model
from fixres_dist.training.checkpoint import CHECKPOINT_FILE, load_checkpoint
from numeric import assert_near_reference, assert_settled_ranking, evaluation

ROOT = Path(__file__).resolve().parents[1]
pytest_plugins = ["jobs_fixtures"]  # session jobs several files share
# The scripts run by the tests start as from a terminal: with SIGINT's default action, even where
# pytest itself was started with it ignored (a background job of a non-interactive shell, as CI
# may run it), which they would inherit and, rightly, keep ignoring (fixres_dist.startup).
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
RANK_ENV = launched.RANK_ENV


@pytest.fixture(scope="session", autouse=True)
def forkserver():
    """The forkserver that forks every job and rank the tests start (torch imported once), started
    before any test: with this process's signal handling, which jobs started from it inherit."""
    if launcher.start_method() == "forkserver":
        multiprocessing.forkserver.ensure_running()


def pytest_unconfigure(config):
    """pytest's own process also ends only once no daemon thread of an in-process test is inside a
    store call (it would abort the interpreter's finalization: fixres_dist.distributed.store_threads)."""
    from fixres_dist.distributed import store_threads
    store_threads.settle(10.0)


STACKS_BEFORE_TIMEOUT_S = 45  # a test still running this long before pytest-timeout ends it: its stacks are taken


@pytest.fixture(autouse=True)
def stacks_of_a_hung_test(request, tmp_path_factory):
    """A test that hangs (the suite's ``timeout`` in pytest.ini is near) leaves the Python stacks of this
    process's threads and of every process it started (jobs, ranks, loader workers: py-spy) in
    ``<basetemp>/hung/<test>.txt``, named on stderr (shown with the failure): a flake is found from its stacks."""
    import threading

    from fixres_dist.distributed import stacks

    seconds = float(request.config.getini("timeout") or 0) - STACKS_BEFORE_TIMEOUT_S
    path = tmp_path_factory.getbasetemp() / "hung" / f"{request.node.name[:120]}.txt"

    def take() -> None:
        stacks.write_stacks(path, f"{request.node.nodeid}: still running after {seconds:.0f} s")
        print(f"stacks of the hung test and of every process it started: {path}", file=sys.stderr, flush=True)

    timer = threading.Timer(seconds, take) if seconds > 0 else None
    if timer is not None:
        timer.daemon = True
        timer.start()
    yield
    if timer is not None:
        timer.cancel()


@pytest.fixture(autouse=True)
def clean_rank_env(monkeypatch):
    """Tests run outside any launcher: no torchrun or SLURM variables leak in."""
    for name in RANK_ENV:
        monkeypatch.delenv(name, raising=False)


def make_subset(dest: Path, train_per_class: int, val_per_class: int, classes: int = 10) -> Path:
    """Copy the first images of the embedded data set into ``dest`` (ImageFolder layout)."""
    src = embedded_data_path()
    for split, count in (("train", train_per_class), ("val", val_per_class)):
        for folder in sorted((src / split).iterdir())[:classes]:
            (dest / split / folder.name).mkdir(parents=True)
            for image in sorted(folder.iterdir())[:count]:
                shutil.copy(image, dest / split / folder.name / image.name)
    return dest


def once_per_run(tmp_path_factory, name: str, make):
    """``make(folder)`` (a new folder ``name``), computed once per test run and shared by the session
    fixtures of every process that runs tests: this one, or each pytest-xdist worker, the first that
    needs it computing it while the others wait on a file lock and read its (pickled) result. Its files
    are the same for all: read them, copy them to change them."""
    if os.environ.get("PYTEST_XDIST_WORKER") is None:
        return make(tmp_path_factory.mktemp(name))
    import pickle

    import filelock

    shared = tmp_path_factory.getbasetemp().parent / "once"  # one per run, beside the workers' own
    shared.mkdir(exist_ok=True)
    done = shared / f"{name}.pickle"
    with filelock.FileLock(str(shared / f"{name}.lock")):
        if not done.exists():
            folder = shared / name
            shutil.rmtree(folder, ignore_errors=True)  # of a worker that failed to make it
            folder.mkdir()
            done.write_bytes(pickle.dumps(make(folder)))
        return pickle.loads(done.read_bytes())


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory) -> Path:
    """10 classes, 8 train and 3 val images per class (80 train, 30 val)."""
    return once_per_run(tmp_path_factory, "tiny", lambda folder: make_subset(folder, 8, 3))


@pytest.fixture(scope="session")
def odd_val_data(tmp_path_factory) -> Path:
    """5 classes with 7 val images each: 35 images, divisible by neither 2 nor 3."""
    return once_per_run(tmp_path_factory, "odd", lambda folder: make_subset(folder, 4, 7, classes=5))


# A short scratch run on tiny_data: 2 epochs of 5 steps (16 images a step on 2 ranks), loader workers.
SCRATCH = ["--input-size", "32", "--batch", "8", "--epochs", "2", "--workers", "1", "--no-progress"]


@pytest.fixture(scope="session")
def scratch_job(tiny_data, tmp_path_factory) -> Path:
    """The folder of a finished, never interrupted 2-rank job: resnet18 trained from scratch at 32 px
    on :func:`tiny_data` with :data:`SCRATCH` (job id ``straight``). Shared by the whole session:
    read it, copy it (``shutil.copytree``) to change or resume it, or pass its checkpoint.pth as
    ``--weight-path``."""
    def make(shared: Path) -> Path:
        result = run_script("scratch", "--num-tasks", 2, "--job-id", "straight", "--shared-folder-path", shared,
                            "--data-path", tiny_data, *SCRATCH)
        assert result.returncode == 0, result.stderr[-3000:]
        return shared / "straight"
    return once_per_run(tmp_path_factory, "scratch_job", make)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def clean_env(**extra) -> dict:
    """This process's environment without launcher variables or a recorded ignored-signal set
    (``fixres_dist.startup.INHERITED_IGNORED``), with the repository importable, and ``extra``."""
    return launched.clean_environ({"PYTHONPATH": ROOT, **extra})


FAST = ["--input-size", "32", "--batch", "8", "--epochs", "1", "--workers", "0", "--no-progress"]


def as_tensor(image) -> torch.Tensor:
    """A decoded image (uint8 tensor or PIL image) as a uint8 (3, H, W) tensor, to compare pixels."""
    return image if isinstance(image, torch.Tensor) else ToUint8Tensor()(image)


def assert_holds_the_folder(folder: Path, dataset_of) -> None:
    """``dataset_of(split)`` (packed shards, a Hugging Face dataset) holds the image folder ``folder``'s
    samples, split by split, in its order: the same labels and the same decoded pixels."""
    for split in ("train", "val"):
        ours, files = dataset_of(split), image_folder(folder, split)
        assert len(ours) == len(files) and ours.targets == files.targets
        for index, (path, label) in enumerate(files.samples):
            image, our_label = ours[index]
            assert our_label == label
            assert torch.equal(as_tensor(image), as_tensor(read_image(path))), path


def run_on_other_data_as_scratch_job(scratch_job: Path, data: Path, tmp_path: Path, data_line: str) -> None:
    """:func:`scratch_job`'s run on ``data`` (the same images in another form: packed shards, a Hugging
    Face dataset), stopped after step 2 of epoch 1 (of 5 steps) and resumed: ``data_line`` logged, and
    the same losses, top-1 and final weights as the uninterrupted run on the folder, bit for bit (the
    same images in the same order; the training stream is a function of seed and epoch)."""
    common = ("--num-tasks", 2, "--job-id", "straight", "--shared-folder-path", tmp_path, "--data-path", data,
              *SCRATCH)
    stopped = run_script("scratch", *common, env={"FIXRES_FAULT": "signal:rank=1:step=2"})
    assert stopped.returncode == 3, stopped.stderr[-3000:]
    assert data_line in stopped.stdout, stopped.stdout[-3000:]
    resumed = run_script("scratch", *common)
    assert resumed.returncode == 0 and "image 48 of the epoch" in resumed.stdout, resumed.stderr[-3000:]

    def events(folder):
        return [{k: v for k, v in e.items() if k in ("event", "epoch", "loss", "top1", "top5", "images")}
                for e in job_events(folder) if e["event"] in ("train", "eval")]
    assert events(tmp_path / "straight") == events(scratch_job)
    ours, theirs = (load_checkpoint(f / CHECKPOINT_FILE)["model"] for f in (tmp_path / "straight", scratch_job))
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)


def evaluation_matches_scratch_job(scratch_job: Path, data: Path, tmp_path: Path, ranks: tuple[int, ...]) -> None:
    """``--eval-only`` of :func:`scratch_job`'s weights on ``data`` (its 30 validation images in another
    form) on each of ``ranks`` ranks, in batches of 4: every image once, the same top-1 as the folder's
    last evaluation of the same weights (a count: exact, and the float64 evaluation's, no image of these
    being within rounding of changing class) and the same loss to rounding (summed in other batches:
    :func:`numeric.assert_near_reference`)."""
    expected = [e for e in job_events(scratch_job) if e["event"] == "eval"][-1]
    state = load_checkpoint(scratch_job / CHECKPOINT_FILE)
    model = build_model(state["config"]["architecture"], 10)
    model.load_state_dict(state["model"])
    exact, plain = (evaluation(model, state["config"]["architecture"], state["config"]["data_path"], "val",
                               expected["resolution"], dtype) for dtype in (torch.float64, torch.float32))
    assert_settled_ranking(exact["logits"], plain["logits"], "the folder's validation images", ks=(1,))
    assert expected["top1"] == exact["top1"]
    for count in ranks:
        result = run_script("finetune", "--eval-only", "--num-tasks", count, "--job-id", f"eval{count}",
                            "--shared-folder-path", tmp_path, "--data-path", data, "--weight-path",
                            scratch_job / CHECKPOINT_FILE, "--test-sizes", 32, "--batch", 4, "--workers", 0,
                            "--no-progress")
        assert result.returncode == 0, result.stderr[-3000:]
        ours = [e for e in job_events(tmp_path / f"eval{count}") if e["event"] == "eval"][-1]
        assert (ours["images"], ours["top1"]) == (30, expected["top1"]), count
        assert_near_reference({"loss": ours["loss"]}, {"loss": expected["loss"]}, {"loss": exact["loss"]},
                              f"{count} rank(s): loss")


def job_events(folder: Path) -> list[dict]:
    """The events of a job's ``metrics.jsonl``."""
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


def run_interpreter(script: str, *args, timeout: float = 240, env: dict | None = None, cwd=None):
    """Run ``python main_<script>.py args`` as a new interpreter (for what happens as it starts:
    imports, the signal guard, ``--help``); returns CompletedProcess (text). Other tests use
    :func:`run_script`, which skips the interpreter's start."""
    cmd = [sys.executable, str(ROOT / f"main_{script}.py"), *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env or clean_env(), cwd=cwd)


def run_script(script: str, *args, env: dict | None = None, cwd=None) -> launched.Finished:
    """Run ``main_<script>.py args`` to its end without starting an interpreter
    (:func:`launched.launch`); ``env``: variables set for the job. A hang fails the test at the
    suite's time limit (pytest.ini)."""
    return launched.launch(script, *args, env=env, cwd=cwd)


def start_script(script: str, *args, env: dict | None = None, new_session: bool = False) -> launched.Started:
    """``main_<script>.py args`` as a process of its own, forked with torch imported
    (:func:`launched.start`)."""
    return launched.start(script, *args, env=env, new_session=new_session)


SLOWED_S = 0.4  # how much slower rank 2's steps and rank 3's batches are in slowed_job (seconds)


@pytest.fixture(scope="session")
def slowed_job(tiny_data, tmp_path_factory):
    """One 4-rank job shared by the tests of step times and of who can reach a job: spawned by the
    launcher (``--num-tasks 4``, all ranks on this host) on :func:`tiny_data`, 10 steps of 2 images
    per rank, rank 2's steps :data:`SLOWED_S` slower (a slow device) and rank 3's batches as much later
    (a slow loader). While it trains, its processes' listening sockets are read, and a foreign client
    connects to its rendezvous store, lists the keys, writes a fake arrival and junk, waits for rank
    0's refusal, and sees its connection ended. Returns a SimpleNamespace: ``folder``, ``stdout``, ``stderr``,
    ``store`` (``(host, port)``), ``listening`` (``{(address, port)}``), ``foreign_ports`` (the
    client's own ports), ``keys`` (what it listed), ``refused`` (whether rank 0 ended its connection)."""
    return once_per_run(tmp_path_factory, "slowed", lambda folder: run_slowed_job(tiny_data, folder))


def run_slowed_job(tiny_data: Path, folder: Path):
    """:func:`slowed_job`'s job, run in ``folder``."""
    import datetime
    import re
    import types

    import psutil
    import torch.distributed as dist

    job = start_script("scratch", "--num-tasks", 4, "--job-id", "slowed", "--shared-folder-path", folder,
                       "--data-path", tiny_data, "--architecture", "resnet20", "--input-size", 32, "--batch", 2,
                       "--epochs", 1, "--workers", 0, "--no-progress",
                       env=clean_env(FIXRES_FAULT=f"slow-step:rank=2:seconds={SLOWED_S},"
                                                  f"slow-data:rank=3:seconds={SLOWED_S}"))

    def output() -> str:
        try:
            return job.stdout
        except FileNotFoundError:  # not begun yet
            return ""

    try:
        met = wait_for(lambda: re.search(r"4 ranks met at the store ([\d.]+):(\d+)", output()), 120, "the ranks")
        host, port = met.group(1), int(met.group(2))
        ranks = psutil.Process(job.pid).children(recursive=True)
        listening = wait_for(lambda: {(c.laddr.ip.removeprefix("::ffff:"), c.laddr.port) for p in ranks
                                      for c in p.net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN},
                             30, "the listening sockets")
        foreign = dist.TCPStore(host, port, 2, False, datetime.timedelta(seconds=10))
        ports = [c.laddr.port for c in psutil.Process().net_connections(kind="tcp") if c.raddr and c.raddr.port == port]
        keys = foreign.list_keys()
        foreign.set("fixres/arrived/1", "1")  # an arrival without the proof counts for nothing
        foreign.set("fixres/junk", "x")
        wait_for(lambda: "warning: rendezvous store: refused a client at " in output(), 60, "the refusal")

        def ended() -> bool:  # rank 0 shut the store's end: ours is no longer established (torch's client may
            # reconnect on its next request, from another port, which the next look refuses again)
            return not any(c.laddr.port in ports and c.status == psutil.CONN_ESTABLISHED
                           for c in psutil.Process().net_connections(kind="tcp"))
        refused = bool(wait_for(ended, 10, "rank 0 to end the foreign client's connection"))
        assert job.wait(240) == 0, job.stderr[-3000:]
    finally:
        if job.returncode is None:
            job.kill()
    return types.SimpleNamespace(folder=folder / "slowed", stdout=job.stdout, stderr=job.stderr, store=(host, port),
                                 listening=listening, foreign_ports=ports, keys=keys, refused=refused)


def run_two_ranks_and_one(script: str, *args):
    """Run ``main_<script>.py`` as 2 ranks x 8 images per step (job ``two``), as 1 process x 16 (job
    ``one``) and as that again with the other memory format (job ``one-other``, ``--channels-last``: the
    same computation in another summation order, for :func:`numeric.assert_within_spread`), same other
    ``args``; all must succeed. Returns ``(two, one)`` (:class:`launched.Finished`)."""
    two = run_script(script, "--num-tasks", 2, "--batch", 8, "--job-id", "two", *args)
    assert two.returncode == 0, two.stderr[-3000:]
    one = run_script(script, "--batch", 16, "--job-id", "one", *args)
    assert one.returncode == 0, one.stderr[-3000:]
    other = run_script(script, "--batch", 16, "--job-id", "one-other", "--channels-last", *args)
    assert other.returncode == 0, other.stderr[-3000:]
    return two, one


def run_main(capsys, script: str, *args) -> tuple[int, str]:
    """``main_<script>.py`` in this process, for a run that must fail before any rank starts (argparse,
    config or preflight): no interpreter to start. Returns ``(exit status, stderr)``."""
    from fixres_dist.entry.launch import main
    with pytest.raises(SystemExit) as exit_info:
        main(script, [str(a) for a in args])
    return exit_info.value.code, capsys.readouterr().err


def wait_for(predicate, timeout: float, what: str, poll: float = 0.2, shown=None):
    """Poll ``predicate()`` until it returns something true (returned); AssertionError naming
    ``what`` after ``timeout`` seconds, with ``shown()`` (for instance a job's log) where given."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}" + (f"\n{shown()}" if shown else ""))


def read_only_folder(folder: Path):
    """Make ``folder`` (which exists) one this process cannot write to while the generator is
    suspended: a read-only tmpfs mounted on it for root, mode 0500 otherwise; skips the test where
    neither works. For fixtures: ``yield from read_only_folder(folder)``."""
    if os.geteuid() != 0:
        folder.chmod(0o500)
        yield folder
        folder.chmod(0o700)
        return
    yield from tmpfs(folder, "ro,size=1m", "a read-only folder")


def tmpfs(folder: Path, options: str, what: str):
    """A tmpfs mounted on ``folder`` (which exists) with ``options`` (``size=64k``: a small disk that
    fills up) while the generator is suspended; skips the test, naming ``what`` it needed, where it
    cannot be mounted (not root). For fixtures: ``yield from tmpfs(...)``."""
    mount = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(folder)], capture_output=True,
                           text=True)
    if mount.returncode != 0:
        pytest.skip(f"cannot mount {what} here (a tmpfs: root is needed): {mount.stderr.strip()}")
    yield folder
    subprocess.run(["umount", str(folder)], capture_output=True)


# Tests of the clusters this machine runs: the local SLURM (one node, its 2 CPUs shared by the jobs of
# test_slurm.py and the srun line of the README), and the nodes of network namespaces with their own
# slurmctld (test_multinode.py). Each cluster's tests run in one pytest-xdist worker, one after the other.
# The two clusters run side by side where the local SLURM is up when the run starts (as .ci/run starts it):
# otherwise test_slurm.py may start it and stop it again, and the nodes' SLURM borrows its munged and
# slurmdbd, so all of them run in one worker.
CLUSTERS = {"slurm": ("test_slurm.py::", "test_readme.py::test_every_launcher_shown"),
            "multinode": ("test_multinode.py::",)}
CLUSTERS_APART = "FIXRES_TEST_CLUSTERS_APART"  # set by the controlling process, read by its workers


def cluster_of(item) -> str | None:
    """The cluster a test runs on (a key of :data:`CLUSTERS`), or None."""
    return next((name for name, parts in CLUSTERS.items() if any(part in item.nodeid for part in parts)), None)


def local_slurm_up() -> bool:
    try:
        out = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=15)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.returncode == 0 and bool(out.stdout.split())


def pytest_itemcollected(item):
    """Under pytest-xdist (``--dist loadgroup``, pytest.ini) each file's tests run in one worker, in order,
    sharing its module fixtures; the cluster tests (:data:`CLUSTERS`) in one worker per cluster, or in one
    together. (The group is set as each test is collected: pytest-xdist reads it in its own modifyitems
    hook. It is part of the test's id, so every worker must choose the same: the controlling process
    decides once, :func:`pytest_configure`.)"""
    if item.get_closest_marker("xdist_group") is not None:  # a test's own group (one that runs for minutes alone)
        return
    cluster = cluster_of(item)
    if cluster is not None and os.environ.get(CLUSTERS_APART) != "1":
        cluster = "cluster"
    item.add_marker(pytest.mark.xdist_group(cluster or Path(item.nodeid.split("::")[0]).stem))


def pytest_configure(config):
    """Refuse to run side by side where pytest-xdist's groups are lost (pytest 9.2: xdist issue 1386), rather
    than run the cluster tests in two workers at once. Decide whether the two clusters' tests run apart."""
    side_by_side = config.getoption("dist", "no") == "loadgroup" and config.getoption("numprocesses", None)
    if side_by_side and tuple(map(int, pytest.__version__.split(".")[:2])) >= (9, 2):
        raise pytest.UsageError(f"pytest {pytest.__version__} loses pytest-xdist's test groups (xdist issue 1386): "
                                "run bash scripts/setup.sh (it installs pytest < 9.2), or add -n 0")
    if side_by_side and not hasattr(config, "workerinput"):  # the controlling process; its workers inherit
        os.environ[CLUSTERS_APART] = "1" if local_slurm_up() else "0"


def pytest_collection_modifyitems(config, items):
    """``slow`` tests (minutes on 2 CPU cores) run only with FIXRES_RUN_SLOW=1, by hand
    (``FIXRES_RUN_SLOW=1 pytest -q -m slow``, docs/testing.md). The cluster tests first: the
    longest group (SLURM's and the nodes' latencies) starts at once. (Handing out the files of 4-rank jobs
    first as well was tried and not kept: in its one CI run the numeric pass took 292 s against 173 s the run
    before, as if those jobs' ranks, all at once, waited on each other's collectives.)"""
    items.sort(key=lambda item: cluster_of(item) is None)
    if os.environ.get("FIXRES_RUN_SLOW") == "1":
        return
    skip = pytest.mark.skip(reason="slow on a 2-core CPU; run with FIXRES_RUN_SLOW=1")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
