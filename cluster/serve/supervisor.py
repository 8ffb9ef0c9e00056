"""``swakv serve`` (and ``swakv loadtest``) as a supervisor and its child: a stop is bounded and complete
however the signal arrives.

The server runs in a child process in a session of its own, so a signal to the terminal's or a service
manager's process group (Ctrl-C, ``kill -TERM -PGID``, systemd's default) reaches only the supervisor,
which passes the first one on. Without this, a group's SIGTERM also reached Ray's GCS, raylet and agents
(they share the server's process group and block SIGINT, not SIGTERM): they died at once, under the
server's goodbyes, which then failed ("an engine did not take the shutdown"), so requests in flight were
never told; 30 s later the server, GCS and seven Ray workers were still running. And the main process
killed outright left Ray's dashboard and runtime-env agents behind (children of the raylet, not of it).

Now: the child's goodbyes are bounded (``GOODBYE_S``), after which it kills its whole process group
(itself, GCS, raylet, the agents; Ray's workers, each in a process group of its own, exit when their
raylet is gone); the supervisor sweeps that group again once the child ends. If the supervisor is killed
outright, the kernel signals the child (``PR_SET_PDEATHSIG``, Linux), which says its goodbyes as for
SIGTERM; Ray ties GCS and the raylet to the child the same way. Standard library only: the supervisor
imports neither Ray nor torch.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

GOODBYE_S = 20.0                  # the most a stop may take before everything left is killed (goal: 30 s)
SUPERVISED = "SWAKV_SUPERVISED"   # set in the server process a supervisor started


def supervised() -> bool:
    """This process is a server a supervisor started (else ``swakv serve`` should ``supervise``)."""
    return bool(os.environ.get(SUPERVISED))


def supervise(argv: list[str], *, as_sent: bool = False) -> int:
    """Run ``python -m cluster *argv`` (the server) as a child in its own session and process group, pass
    the first SIGINT / SIGTERM / SIGHUP on to it alone (as SIGTERM; ``as_sent``: as it came, for a child
    that reports which stopped it), and once it ends, kill whatever is left in its group; return its exit
    status."""
    parent = os.getpid()

    def in_child():   # after fork, before exec: die with the supervisor, even if it is already gone
        _die_with_parent(signal.SIGTERM)
        if os.getppid() != parent:
            os._exit(1)

    child = subprocess.Popen([sys.executable, "-m", "cluster", *argv], env={**os.environ, SUPERVISED: "1"},
                             start_new_session=True, preexec_fn=in_child)
    signalled = threading.Event()

    def forward(signum, frame):
        if not signalled.is_set():   # the first one starts the goodbyes; more must not cut them short
            signalled.set()
            _signal(child.pid, signum if as_sent else signal.SIGTERM, group=False)

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, forward)
    deadline = None
    try:
        while True:
            try:
                code = child.wait(timeout=1.0)
                break
            except subprocess.TimeoutExpired:
                if signalled.is_set():
                    deadline = deadline or time.monotonic() + GOODBYE_S + 5
                    if time.monotonic() > deadline:   # the child's own bound failed: end it all now
                        _signal(child.pid, signal.SIGKILL)
    finally:
        _signal(child.pid, signal.SIGKILL)   # what it left behind in its group, if anything
    return 0 if code == -signal.SIGTERM and signalled.is_set() else code


class StopRequested(KeyboardInterrupt):
    """A stop signal (``signum``), raised in the main thread wherever it is by ``raise_on_stop``. Not
    ``KeyboardInterrupt`` itself: under ``python -m``, CPython ends a process by SIGINT once a bare
    ``KeyboardInterrupt`` has left a string ``exec``/``eval`` (dataclasses and namedtuples build methods that
    way), even if it was caught, so a clean stop that landed there exited -2 (CI: status 254 from the
    supervisor)."""

    received: int | None = None     # the signal ``raise_on_stop``'s handler took, whatever became of its exception

    def __init__(self, signum: int = signal.SIGINT):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @classmethod
    def signal_of(cls, exc: KeyboardInterrupt) -> int:
        """The signal that stopped this process: the exception's own; else the one the handler took (a stop
        raised inside ``ray.get`` comes back out of Ray as a plain ``KeyboardInterrupt``); else SIGINT
        (Python's own ``KeyboardInterrupt``)."""
        return getattr(exc, "signum", None) or cls.received or signal.SIGINT

    @staticmethod
    def behind(exc: BaseException | None) -> "StopRequested | None":
        """The stop ``exc`` is or came of, else None: the code the handler's raise lands in may wrap what it
        catches (on Python 3.11 a class body's ``__set_name__`` re-raises it as ``RuntimeError``, and the stop
        landed there while the server imported httpx: CI, a clean stop that exited 1)."""
        seen: set[int] = set()
        while exc is not None and id(exc) not in seen:
            if isinstance(exc, StopRequested):
                return exc
            seen.add(id(exc))
            exc = exc.__cause__ or exc.__context__
        return None

    @classmethod
    def signal_behind(cls, exc: BaseException | None) -> int | None:
        """The signal that stopped what raised ``exc``: of a stop it is or came of (``behind``), or of a plain
        ``KeyboardInterrupt`` (``signal_of``); None when ``exc`` is no stop."""
        stop = cls.behind(exc)
        if stop is None and not isinstance(exc, KeyboardInterrupt):
            return None
        return cls.signal_of(stop or exc)


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def raise_on_stop(signums=STOP_SIGNALS) -> dict:
    """From now on the first of ``signums`` raises ``StopRequested`` in the main thread, and every later one
    is ignored (a second Ctrl-C must not cut the goodbyes short). Set it again after ``ray.init``: Ray's core
    worker puts its own SIGTERM handler in, which aborts the process with a stack dump. Returns the
    handlers it replaced."""
    def stop(signum, frame):
        for s in signums:
            signal.signal(s, signal.SIG_IGN)
        StopRequested.received = signum
        raise StopRequested(signum)

    return {s: signal.signal(s, stop) for s in signums}


def goodbye_deadline() -> None:
    """In a supervised server, once its goodbyes start: if they are not over in ``GOODBYE_S``, kill its whole
    process group (the server, GCS, raylet, the agents). The group is the server's own only when supervised."""
    if supervised() and os.getpgrp() == os.getpid():
        timer = threading.Timer(GOODBYE_S, os.killpg, (os.getpgrp(), signal.SIGKILL))
        timer.daemon = True
        timer.start()


def _signal(pid: int, sig: int, group: bool = True) -> None:
    try:
        os.killpg(pid, sig) if group else os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _die_with_parent(sig: int) -> None:
    """Linux: the kernel sends ``sig`` to this process when its parent ends (prctl PR_SET_PDEATHSIG)."""
    if sys.platform.startswith("linux"):
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(1, int(sig), 0, 0, 0)   # 1: PR_SET_PDEATHSIG
