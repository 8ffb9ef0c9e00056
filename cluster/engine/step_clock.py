"""When a served engine schedules its next step: as late as the step in flight allows, so arrivals make it.

With asynchronous scheduling the engine schedules step N+1 while step N runs. Scheduled as soon as N is
launched, N+1 is fixed a whole step before the workers reach it, and a request that arrives while N runs
waits for N+2: under load, one more step of time to first token for most arrivals. Served, the engine-core
thread instead keeps taking requests until shortly before N is due to end (``due``), then schedules N+1.

Only decode steps are timed and waited on. A step with a prompt chunk or host-tier copies in it is followed
at once, as before: its time varies with what it holds, and waiting past its end would hold back its
prompts' first tokens, the figure this is for (the engine collects a step after it launches the next).

The due time is the moment the workers took N (their acknowledgement) plus N's predicted time, less a lead.
The prediction is the *shortest* of the last ``HISTORY`` decode steps of N's size class (sequences, by powers
of two), as the workers timed them (``worker_time_s``). The lead covers what happens between the due time and
the workers reading the step: ``LEAD_FLOOR_S``, twice the longest of the engine's last ``HISTORY``
schedule-and-send times, and the latest the core thread woke past a due time in its last ``2 x HISTORY``
waits (``woke``; a busy host delays it: serving the bundled model on this project's 2-core machine, 0.18 ms
at the median, 0.63 at p90, 1.7 at p99). Wake-ups older than ``LATE_MEMORY_STEPS`` steps are forgotten, so
a host that was busy for a while is tried again. A step whose lead would be more than ``LEAD_SHARE`` of its
predicted time is followed at once, as before, and so is a class never timed (the first steps, workers that
do not report): on the bundled model's 3-5 ms CPU decode steps waiting made ITL 6-12% slower and TTFT no
faster; on decode steps of GPU length (modelled H100s, 15 ms, Poisson arrivals) it cut TTFT p50 by a quarter
to a third at the same ITL (``docs/performance.md``, "Arrivals into the next step").

What it can cost: a guess too early is scheduling at once. The workers wait only when N runs faster than
each of the last ``HISTORY`` steps of its class by more than the lead, or the core thread wakes later than
the lead allows; then for that difference, after which the histories hold the new figure. A host whose
wake-ups stay late keeps its leads long, and its steps are scheduled at once except one in about
``LATE_MEMORY_STEPS`` that tries again.
"""
from __future__ import annotations

from collections import deque

HISTORY = 4            # decode steps remembered per size class, and schedule-and-send times
LEAD_FLOOR_S = 1e-3    # the core thread's wake-up and the step's trip to the workers
LEAD_SHARE = 0.25      # the most of a predicted step its lead may be; above it, schedule at once
LATE_MEMORY_STEPS = 256   # steps after which a late wake-up no longer lengthens the lead


class StepClock:
    """The workers' step times per size class, the engine's own, and when the step in flight is due."""

    def __init__(self):
        self._times: dict[int, deque[float]] = {}
        self._host: deque[float] = deque(maxlen=HISTORY)
        self._late: deque[tuple[int, float]] = deque(maxlen=2 * HISTORY)   # (step, how late past ``due``)
        self._steps = 0
        self.due: float | None = None      # ``time.perf_counter()`` to schedule the next step by; None: now

    @staticmethod
    def size_class(decodes: int) -> int:
        return int(decodes).bit_length()

    def lead(self) -> float:
        return LEAD_FLOOR_S + 2 * max(self._host, default=0.0) + max((late for _, late in self._late), default=0.0)

    def woke(self, now: float) -> None:
        """The engine starts scheduling the next step at ``now``; past ``due``, it waited for it and woke this late."""
        self._steps += 1
        if self.due is not None and now >= self.due:
            self._late.append((self._steps, now - self.due))
        while self._late and self._late[0][0] <= self._steps - LATE_MEMORY_STEPS:
            self._late.popleft()

    def launched(self, decodes: int | None, taken_at: float, host_s: float) -> None:
        """A step of ``decodes`` sequences (None: not a decode step) was taken by the workers at ``taken_at``;
        scheduling and sending it took the engine ``host_s``."""
        self._host.append(host_s)
        times = self._times.get(self.size_class(decodes)) if decodes else None
        predicted, lead = (min(times) if times else 0.0), self.lead()
        self.due = taken_at + predicted - lead if lead <= LEAD_SHARE * predicted else None

    def ran(self, decodes: int | None, worker_time_s: float) -> None:
        """A step of ``decodes`` sequences (None: not a decode step) took the workers ``worker_time_s`` (0: they
        do not say)."""
        if decodes and worker_time_s > 0:
            self._times.setdefault(self.size_class(decodes), deque(maxlen=HISTORY)).append(worker_time_s)
