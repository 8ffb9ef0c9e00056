"""The one step loop every engine runs, offline (``LLM``) or served (the engine actor).

``Engine.step`` handles what one step can go wrong with (a request's chunk refused, a worker lost: the
workers restart and running requests recompute), synchronously or with asynchronous scheduling.
``EngineCore`` adds what outlives a step: when new workers cannot be started, every request fails with
``engine_unavailable`` and the restart is retried with back-off (1 s doubling to 30 s) while the status
says ``no_workers``; an error in the engine's own bookkeeping fails every request and starts a fresh
scheduler and KV manager over restarted workers. ``step()`` never raises.

Served, ``run`` is the body of one long-lived engine-core thread: other threads never touch the engine;
they ``call`` (or ``post``) a function that runs on the core thread between two steps, so requests are
added, aborted and the engine shut down without locks, and a step is never handed from thread to thread.
After each step ``run`` gives its updates to ``emit`` at once, as one list. With a step in flight it
schedules the next one only when that is due (``step_clock``), taking requests until then.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from concurrent.futures import Future

from .engine import Engine, RestartFailed
from .scheduler import SequenceUpdate

log = logging.getLogger("swakv.engine")

RESTART_BACKOFF_S = (1.0, 30.0)        # first retry after a failed restart, and the longest wait


class EngineCore:
    """An engine, its fault handling across steps, and (served) its thread's inbox."""

    def __init__(self, engine: Engine, on_reset=None):
        """``on_reset(engine)``: told of the fresh engine that replaces one after an internal error."""
        self.engine = engine
        self.on_reset = on_reset
        self._status, self.detail = "ready", ""
        self._retry_at: float | None = None       # when to try starting workers again (no_workers)
        self._delay = RESTART_BACKOFF_S[0]
        self._live: set[str] = set()              # requests added and not finished (failed on a reset)
        self._inbox: deque = deque()
        self._wake = threading.Condition()
        self._closed = False
        engine.take_arrivals = self._take_arrivals

    @property
    def status(self) -> str:
        """ready | restarting (workers being replaced) | no_workers (retrying with back-off)."""
        return "restarting" if self.engine.restarting else self._status

    # -- requests (on the thread that drives the engine) ------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids, params=None, block_hashes=None) -> None:
        """``Engine.add_request``: ValueError, nothing queued, on bad input."""
        self.engine.add_request(request_id, prompt_token_ids, params, block_hashes=block_hashes)
        self._live.add(request_id)

    def abort(self, request_id: str) -> bool:
        self._live.discard(request_id)
        return self.engine.abort(request_id)

    def fail_all(self, message: str, error_type: str) -> list[SequenceUpdate]:
        self._live.clear()
        return self.engine.fail_all(message, error_type)

    def has_work(self) -> bool:
        return self._retry_at is not None or self.engine.has_work()

    # -- the loop -------------------------------------------------------------------------------------
    def step(self) -> list[SequenceUpdate]:
        """One step, every fault handled; the updates of every request it touched."""
        if self._retry_at is not None:
            return self._restart() if time.monotonic() >= self._retry_at else []
        try:
            updates = self.engine.step()
        except RestartFailed as exc:
            updates = exc.updates + self._no_workers(exc.cause)
        except Exception as exc:  # noqa: BLE001 - a bug in the engine's bookkeeping: start afresh
            log.exception("engine step failed outside the workers; failing every request and resetting")
            updates = self._reset(exc)
        for u in updates:
            if u.finished:
                self._live.discard(u.request_id)
        return updates

    def _no_workers(self, exc: BaseException) -> list[SequenceUpdate]:
        log.error("workers failed to start: %s; retrying in %.0f s", exc, self._delay)
        self._status, self.detail = "no_workers", f"workers failed to start: {exc}"
        updates = self.fail_all(f"the engine lost its workers and cannot start new ones: {exc}", "engine_unavailable")
        self._retry_at = time.monotonic() + self._delay
        self._delay = min(2 * self._delay, RESTART_BACKOFF_S[1])
        return updates

    def _restart(self) -> list[SequenceUpdate]:
        self.engine.restarting = True
        try:
            self.engine.executor.restart()
        except Exception as exc:  # noqa: BLE001
            return self._no_workers(exc)
        finally:
            self.engine.restarting = False
        self.engine.after_restart()
        self._retry_at, self._delay = None, RESTART_BACKOFF_S[0]
        self._status, self.detail = "ready", ""
        return []

    def _reset(self, exc: BaseException) -> list[SequenceUpdate]:
        """Fail every request, then a fresh scheduler and manager over restarted workers."""
        old = self.engine
        message = f"the engine reset after an internal error: {exc!r}"
        updates = [SequenceUpdate(rid, [], True, "error", error=message, error_type="engine_unavailable")
                   for rid in sorted(self._live)]
        self._live.clear()
        self.engine = Engine(old.executor, old.manager.specs, old.manager.num_blocks, old.config,
                             group_widths=old.manager.widths)
        self.engine.metrics = old.metrics
        self.engine.take_arrivals = self._take_arrivals
        if self.on_reset is not None:
            self.on_reset(self.engine)
        return updates + self._restart()

    # -- served: the engine-core thread ---------------------------------------------------------------
    def call(self, fn, *args, admit: bool = False) -> Future:
        """Run ``fn(*args)`` on the core thread between two steps; its result (or exception) in the future.
        ``admit``: ``fn`` only adds requests, so it may also run while a step waits for the workers (late
        joiners: ``Engine``), which is woken for it."""
        future: Future = Future()
        with self._wake:
            self._inbox.append((fn, args, future, admit))
            self._wake.notify()
        if admit and getattr(self.engine.executor, "supports_joins", False):
            self.engine.executor.nudge()
        return future

    def _take_arrivals(self) -> bool:
        """On the core thread, inside a step: run the adds at the head of the inbox (anything behind another
        command waits for it, so the order stays); whether there were any."""
        with self._wake:
            taken = []
            while self._inbox and self._inbox[0][3] and not self._closed:
                taken.append(self._inbox.popleft())
        self._run(taken)
        return bool(taken)

    @staticmethod
    def _run(commands) -> None:
        for fn, args, future, _ in commands:
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args))
                except BaseException as exc:  # noqa: BLE001 - the caller's to see
                    future.set_exception(exc)

    def close(self) -> None:
        """Stop ``run`` after the commands already posted."""
        with self._wake:
            self._closed = True
            self._wake.notify()

    def run(self, emit) -> None:
        """The core thread's body: apply commands, step while there is work, ``emit(updates)`` after each
        step that has any; sleeps while there is nothing to do, and, with a step in flight, until the next
        one is due (``Engine.next_step_due``: requests that come meanwhile make it into that step)."""
        while True:
            with self._wake:
                while not self._inbox and not self._closed:
                    idle = self._idle_for()
                    if idle == 0.0:
                        break
                    self._wake.wait(idle)
                commands, self._inbox = self._inbox, deque()
                closed = self._closed
            self._run(commands)
            if closed:
                return
            if self._idle_for() == 0.0:
                emit(self.step())

    def _idle_for(self) -> float | None:
        """How long the core thread may sleep before its next step: 0.0 to step now, None until a command."""
        if self._retry_at is not None:
            return max(0.0, self._retry_at - time.monotonic())
        if not self.engine.has_work():
            return None
        due = self.engine.next_step_due()
        return 0.0 if due is None else max(0.0, due - time.perf_counter())
