"""The daemon threads that call the rendezvous store, and how a rank's script process ends.

A daemon thread that comes back from a torch C++ call (a ``TCPStore`` ``add``/``get``, which
releases the GIL) while the interpreter is finalizing is ended by CPython with ``pthread_exit``;
unwinding that through pybind11's GIL guard calls ``std::terminate``, and the whole process aborts
("terminate called without an active exception", SIGABRT, exit status 134 or -6 under a launcher)
after a run that succeeded. A heartbeat's ``add`` in flight at exit was enough (seen in CI under
torchrun); the same abort was seen once more from a rank started by hand whose store threads had all
finished, so some other native thread or destructor can do it too. A rank's script therefore never
finalizes the interpreter: it ends through :func:`end_process`, which gives the store threads
started here (:func:`start`) a moment to finish their call, flushes stdout and stderr, and ends the
process with ``os._exit`` and its exit status. Everything a run writes is closed (and fsynced where
it matters) before that; atexit handlers do not run.
"""
from __future__ import annotations

import os
import sys
import threading
import time
import weakref

SETTLE_S = 1.0  # at exit, how long the store threads may take to finish their call (seconds)

_threads: weakref.WeakSet[threading.Thread] = weakref.WeakSet()


def start(target, name: str) -> threading.Thread:
    """Start ``target()`` in a daemon thread named ``name`` that :func:`end_process` waits for."""
    thread = threading.Thread(target=target, daemon=True, name=name)
    _threads.add(thread)
    thread.start()
    return thread


def settle(seconds: float = SETTLE_S) -> bool:
    """Wait up to ``seconds`` in all for the store threads to end; whether none is left running."""
    deadline = time.monotonic() + seconds
    others = [thread for thread in list(_threads) if thread is not threading.current_thread()]
    for thread in others:
        thread.join(max(0.0, deadline - time.monotonic()))
    return not any(thread.is_alive() for thread in others)


def end_process(status: int | str | None) -> None:
    """End this process with ``status`` (as ``SystemExit`` takes it: None is 0; a string is printed
    to stderr and is 1) after the store threads settled (at most :data:`SETTLE_S`), with ``os._exit``:
    the interpreter is not finalized, so that no thread still in native code can abort it."""
    settle()
    if isinstance(status, str):
        print(status, file=sys.stderr)
    code = 0 if status is None else status if isinstance(status, int) else 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken pipe: nothing more to say
            pass
    os._exit(code)
