"""Jobs started from the test process without a new Python interpreter.

Starting ``python main_scratch.py`` costs seconds of imports (torch, torchvision) before anything
the test is about happens, twice for ``--num-tasks N`` (the launcher, then its forkserver). The
tests start one only where the interpreter's start is the behaviour (:func:`conftest.run_script`:
the signal guard before torch loads, ``--help`` without torch, torchrun, SLURM, the README's
commands). Everywhere else they use these two, which run the scripts' own code:

* :func:`launch`: what ``main_<script>.py ARGS`` runs once its command line parsed
  (:func:`fixres_dist.entry.launch.main`: placement, preflight, then one rank in this process or
  ``--num-tasks N`` ranks spawned) *in this process*; spawned ranks are real processes, forked from
  this session's forkserver, which imported torch once.
* :func:`start`: ``main_<script>.py ARGS`` as a process of its own (its pid, signals, exit status),
  forked from that forkserver, running the scripts' entry point :func:`fixres_dist.entry.scripts.run_script`.
"""
from __future__ import annotations

import contextlib
import io
import multiprocessing
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

import attrs

from fixres_dist.distributed import placement
from fixres_dist.entry import cli, scripts
from fixres_dist.entry import launch as launcher
from fixres_dist.errors import FixresError
from fixres_dist.startup import INHERITED_IGNORED

# What launchers (torchrun, SLURM) tell a process about its place; no test job inherits them.
RANK_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
            "TORCHELASTIC_RUN_ID", "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NTASKS", "SLURM_JOB_ID",
            "SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE", "SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID",
            "SLURM_CPUS_PER_TASK")


@attrs.frozen
class Finished:
    """What a job left: its exit status and everything it and its ranks wrote (text)."""

    returncode: int
    stdout: str
    stderr: str


def launch(script: str, *args, env: dict | None = None, cwd=None) -> Finished:
    """Run ``main_<script>.py args`` and wait for its end; ``env``: variables set for the job (its
    ranks see them); ``cwd``: the folder it runs in. A failed job is a ``returncode``, not an exception.

    ``--num-tasks N`` jobs (and those that fail before any rank starts) run their launcher in this
    process, their ranks forked from the session's forkserver; a job that is one rank runs that rank
    in a process of its own (:func:`start`), as from a shell: nothing it sets stays in the tests'
    process, and a rank that kills itself (``--fault kill:...``) does not take the tests with it."""
    argv = [str(a) for a in args]
    with _environment(env or {}), _working_directory(cwd):
        spawns = _spawns_ranks(script, argv)
    if not spawns:
        started = start(script, *argv, env=env, cwd=cwd)
        started.wait()
        return Finished(started.returncode, started.stdout, started.stderr)
    with _environment(env or {}), _working_directory(cwd), _captured() as output:
        try:
            launcher.main(script, argv)
            status = 0
        except SystemExit as exc:
            status = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
    return Finished(status, *output)


def _spawns_ranks(script: str, argv: list[str]) -> bool:
    """Whether ``main_<script>.py argv`` spawns its ranks (placement source ``spawn``), or fails
    before placing any (a usage or placement error), rather than running one rank itself."""
    try:
        with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
            args = cli.build_parser(script).parse_args(argv)
        source = placement.resolve_placement(args.num_tasks, args.global_rank, args.local_rank,
                                             args.job_id, args.dist_url).source
    except (SystemExit, FixresError):
        return True
    return source == "spawn"


class Started:
    """``main_<script>.py args`` running as its own process (:func:`start`); the parts of
    :class:`subprocess.Popen` the tests use. Its output goes to files, read once it has exited."""

    def __init__(self, process: multiprocessing.Process, out: Path, err: Path):
        self.process, self._out, self._err = process, out, err

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def returncode(self) -> int | None:
        """The exit status; ``-N`` when killed by signal N; None while running."""
        return self.process.exitcode

    def poll(self) -> int | None:
        return self.process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        """The exit status; AssertionError if still running after ``timeout`` seconds. Left by that
        or any other exception (the test's time limit), it kills the process first: no job outlives
        its test."""
        try:
            self.process.join(timeout)
        except BaseException:
            self.kill()
            raise
        if self.process.exitcode is None:
            self.kill()
            raise AssertionError(f"main_*.py (pid {self.pid}) still running after {timeout} s; killed")
        return self.process.exitcode

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        """``(stdout, stderr)`` once it has exited (see :meth:`wait`)."""
        self.wait(timeout)
        return self.stdout, self.stderr

    @property
    def stdout(self) -> str:
        return self._out.read_text(errors="replace")

    @property
    def stderr(self) -> str:
        return self._err.read_text(errors="replace")

    def send_signal(self, signum: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signum)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)
        self.process.join()


def start(script: str, *args, env: dict | None = None, new_session: bool = False, cwd=None,
          before=None, log: Path | None = None) -> Started:
    """Start ``main_<script>.py args`` as a process of its own: forked from this session's forkserver,
    it runs what the script runs (:func:`fixres_dist.entry.scripts.run_script`). ``new_session``: the leader of
    a process group of its own, as a shell job or a SLURM step (``os.killpg(started.pid, ...)``).
    ``env``: variables set for it; ``before``: a picklable callable it runs first (entering a node's
    namespaces, say); ``log``: one file for its stdout and stderr (default: two files in a
    temporary folder)."""
    if log is None:
        folder = Path(tempfile.mkdtemp(prefix="started-"))
        out, err = folder / "stdout", folder / "stderr"
    else:
        out = err = Path(log)
    environ = clean_environ(env)
    process = multiprocessing.get_context(launcher.start_method()).Process(
        target=_run, args=(script, [str(a) for a in args], environ, str(out), str(err), cwd, new_session, before),
        name=f"main_{script}.py")
    process.start()
    return Started(process, out, err)


def _run(script: str, argv: list[str], environ: dict, out: str, err: str, cwd, new_session: bool, before) -> None:
    """In the started process: its session, environment, folder and output, then the script."""
    if new_session:
        os.setsid()
    if before is not None:
        before()
    os.environ.clear()
    os.environ.update(environ)
    if cwd is not None:
        os.chdir(cwd)
    for path, fd in ((out, 1), (err, 2)):
        file = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.dup2(file, fd)
        os.close(file)
    scripts.run_script(script, argv)


def wait_all(started: list[Started], timeout: float) -> list[int]:
    """The exit statuses of ``started``, waiting at most ``timeout`` seconds for all together."""
    deadline = time.monotonic() + timeout
    return [s.wait(max(0.0, deadline - time.monotonic())) for s in started]


def clean_environ(extra: dict | None = None) -> dict:
    """This process's environment without launcher variables (:data:`RANK_ENV`) or a recorded
    ignored-signal set (``fixres_dist.startup.INHERITED_IGNORED``), with ``extra`` (as strings)."""
    environ = {k: v for k, v in os.environ.items() if k not in (*RANK_ENV, INHERITED_IGNORED)}
    environ.update({k: str(v) for k, v in (extra or {}).items()})
    return environ


@contextlib.contextmanager
def _environment(extra: dict):
    """This process's environment cleaned with ``extra`` (:func:`clean_environ`); restored afterwards."""
    saved = dict(os.environ)
    cleaned = clean_environ(extra)
    os.environ.clear()
    os.environ.update(cleaned)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


@contextlib.contextmanager
def _working_directory(cwd):
    if cwd is None:
        yield
        return
    saved = os.getcwd()
    os.chdir(cwd)
    try:
        yield
    finally:
        os.chdir(saved)


@contextlib.contextmanager
def _captured():
    """Standard output and error of this process (file descriptors 1 and 2, which spawned ranks
    take over, and ``sys.stdout``/``sys.stderr``) into files; yields a list that holds their text
    once the block is left."""
    texts: list[str] = []
    files = [tempfile.TemporaryFile(), tempfile.TemporaryFile()]
    streams = sys.stdout, sys.stderr
    for stream in streams:
        stream.flush()
    saved = [os.dup(1), os.dup(2)]
    try:
        for file, fd in zip(files, (1, 2)):
            os.dup2(file.fileno(), fd)
        sys.stdout, sys.stderr = (io.TextIOWrapper(io.FileIO(fd, "w", closefd=False), write_through=True)
                                  for fd in (1, 2))
        yield texts
    finally:
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        sys.stdout, sys.stderr = streams
        for fd, original in zip((1, 2), saved):
            os.dup2(original, fd)
            os.close(original)
        for file in files:
            file.seek(0)
            texts.append(file.read().decode(errors="replace"))
            file.close()
