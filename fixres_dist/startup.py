"""The seconds before a script listens for stop signals, and the moments after it stopped listening.

``python main_scratch.py`` parses its command line, then spends seconds importing torch and checking
its inputs before the launcher forwards stop signals or the Trainer records them
(:mod:`fixres_dist.distributed.preemption`).
A SIGINT, SIGTERM or SIGUSR2 then (Ctrl-C, ``timeout``, ``scancel``) ends the script with one line
and the usual status (130 for SIGINT, else 3) instead of a traceback out of torch's import or a
silent death: nothing has been written yet. Once the job is over, late ones are ignored, so that a
signal to the whole job arriving as it exits cannot change its status or print a traceback.
This module imports nothing heavy: the scripts install :func:`guard_signals` before torch.
"""
import os
import signal
import sys

SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR2)
# The stop signals that the job's first process found ignored, as signal numbers "2,15", passed to
# every process it starts through the environment.
INHERITED_IGNORED = "FIXRES_IGNORED_SIGNALS"


def inherited_ignored() -> frozenset[int]:
    """Stop signals this job was started with ignored, which it keeps ignoring: a shell script's
    background job (``cmd &``) starts with SIGINT ignored, so that a Ctrl-C meant for the script
    does not stop it. The first process of a job records them (in :data:`INHERITED_IGNORED`), so
    that the ranks it starts, whose own disposition the launcher has changed, know them too."""
    if INHERITED_IGNORED not in os.environ:
        ignored = [str(int(s)) for s in SIGNALS if signal.getsignal(s) is signal.SIG_IGN]
        os.environ[INHERITED_IGNORED] = ",".join(ignored)
    return frozenset(int(s) for s in os.environ[INHERITED_IGNORED].split(",") if s.strip().isdigit())


def _stopped_while_starting(signum, frame) -> None:
    sys.stderr.write(f"fixres_dist: stopped by {signal.Signals(signum).name} while starting; nothing was "
                     "written\n")
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    # Not SystemExit: raised by a handler in the middle of an import, it can be swallowed by C code
    # that clears errors (the job then trained on) or leave a module half-imported (numpy's
    # RecursionError, exit 1). Nothing was written yet, so there is nothing to clean up.
    os._exit(130 if signum == signal.SIGINT else 3)


def is_guard(handler) -> bool:
    """Whether ``handler`` is this module's (a stop handler chaining to it must not call it)."""
    return handler is _stopped_while_starting


def guard_signals() -> None:
    """Until the launcher or Trainer installs its own handlers: stop at once, with one line (signals
    the job was started with ignored stay ignored: :func:`inherited_ignored`)."""
    ignored = inherited_ignored()
    for signum in SIGNALS:
        if signum not in ignored:
            signal.signal(signum, _stopped_while_starting)


def ignore_signals() -> None:
    """After the job: ignore the stop signals for the rest of this process's life."""
    for signum in SIGNALS:
        signal.signal(signum, signal.SIG_IGN)


def quiet_native_logs() -> None:
    """Show only errors from torch's C++ log (``TORCH_CPP_LOG_LEVEL=ERROR``) unless the user chose a
    level; to take effect it must run before torch is imported. c10d logs a warning with a page of
    C++ stack frames for every store connection that breaks when a peer or node goes away, and one
    for every client address without a reverse DNS name; this package reports those events itself,
    in one line naming the ranks and hosts (:mod:`fixres_dist.distributed.rendezvous`)."""
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")


PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _load_prctl():
    """libc's ``prctl``, loaded once as this module is imported (None where there is none: not Linux). Not in a
    worker just forked from a rank (:func:`die_with_parent`): loading takes time during which the worker can be
    stopped or orphaned before its request, and the dynamic loader's lock, which a thread of the rank may have
    held at the fork."""
    import ctypes
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_PRCTL = _load_prctl()


def prctl(option: int, *args) -> bool:
    """Linux's ``prctl(option, *args)`` (integers or ctypes references); whether it succeeded (False where
    there is no ``prctl``: not Linux)."""
    return _PRCTL is not None and _PRCTL(option, *args) == 0


def die_with_parent(signum: int = signal.SIGTERM, parent: int | None = None) -> None:
    """Ask Linux to send this process ``signum`` when its parent exits (best effort, Linux only): a
    worker process must not run on as an orphan when its parent is killed. ``parent``: the process id
    the parent had; where it is no longer this process's parent (it ended between the fork and this
    call, when Linux would not signal), ``signum`` is sent at once. One call into the libc loaded at
    import; what the window before it still leaves (a worker stopped or killed before this call) the
    launcher ends (:mod:`fixres_dist.distributed.orphans`)."""
    prctl(PR_SET_PDEATHSIG, int(signum))
    if parent is not None and os.getppid() != parent:
        os.kill(os.getpid(), signum)
