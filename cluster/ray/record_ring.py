"""A subscription's records through shared memory when the frontend runs on the engine's host.

A Ray stream item costs 2-4 ms from the engine's ``yield`` to the frontend's loop on a 2-core machine
(gRPC and the core worker's threads on both sides), and every streamed token waits for one. On one host
the records go through a one-reader ``ShmBroadcast`` ring instead (``workers/shm_channel.py``, the ring
the workers' steps travel on): the engine's writer thread copies a record in and wakes the frontend's
event loop through the ring's socket, which ``add_reader`` watches. The Ray stream stays open for what
Ray is good at: it carries the ring's handle, and its end tells the frontend that the engine stopped or
died.

Backpressure is the Ray stream's: the ring holds ``SLOTS`` records; while it is full the writer thread
waits and the subscription's updates pile up and go later as one record, so a frontend whose loop lags
gets the steps it missed merged, and an engine never queues one message per step for it. A writer waiting
on a reader that died, or a reader that detached, ends the subscription (its requests are aborted).
"""
from __future__ import annotations

import asyncio
import pickle
import socket
import threading
from collections.abc import Callable

from workers.shm_channel import ChannelClosed, ChannelError, ChannelHandle, ShmBroadcast, ShmReader

SLOTS = 4                   # records in flight before the writer waits (and the subscription merges)
SLOT_BYTES = 256 << 10      # a 256-stream step's record fits one slot; larger ones travel in fragments


def host_id() -> str:
    """Which machine (and boot) this process runs on: a ring needs the frontend's /dev/shm to be the engine's."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "?"
    return f"{socket.gethostname()}/{boot}"


class RecordWriter:
    """The engine's end: ``put(record)`` from the event loop; a thread writes what piled up, one message
    per ring slot freed. ``gone`` is set (and ``on_gone`` called on the thread) when the reader died or
    detached; ``on_sent`` after each message written."""

    def __init__(self, on_gone: Callable[[], None], on_sent: Callable[[], None]):
        self.ring = ShmBroadcast(1, slots=SLOTS, slot_bytes=SLOT_BYTES, spin_s=0.0, poll_s=0.5)
        self.handle: ChannelHandle = self.ring.handle
        self.gone: ChannelError | None = None
        self._on_gone, self._on_sent = on_gone, on_sent
        self._pending: list = []
        self._closing = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="record-ring", daemon=True)
        self._thread.start()

    def put(self, record: list) -> None:
        with self._cond:
            self._pending.extend(record)
            self._cond.notify()

    def check_reader(self, attached_by_now: bool) -> None:
        """Set ``gone`` if the reader died or detached, or has not attached though it should have by now."""
        if self.ring.readers_gone():
            self.gone = ChannelError("the frontend's reader died or detached")
        elif attached_by_now and self.ring.readers_unattached():
            self.gone = ChannelError("the frontend never attached to its ring")

    def close(self) -> None:
        """Write what is pending, then close the ring (its reader drains it, then sees it closed)."""
        with self._cond:
            self._closing = True
            self._cond.notify()

    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    while not self._pending and not self._closing:
                        self._cond.wait()
                    record, self._pending = self._pending, []
                    closing = self._closing
                if record:
                    self.ring.send(pickle.dumps(record, protocol=5))   # waits while the reader is SLOTS behind
                    self._on_sent()
                elif closing:
                    return
        except ChannelError as exc:   # the reader died or detached
            self.gone = exc
            self._on_gone()
        finally:
            self.ring.close()


class RecordReader:
    """The frontend's end, on its event loop: each record to ``on_record`` as it arrives; ``done`` resolves
    once the writer closed the ring and every record was read (None), or with the error that ended it."""

    def __init__(self, handle: ChannelHandle, on_record: Callable[[list], None]):
        self.reader = ShmReader(handle, 0, spin_s=0.0, poll_s=1.0)
        self._on_record = on_record
        self._loop = asyncio.get_running_loop()
        self.done: asyncio.Future = self._loop.create_future()
        self.reader.arm()
        self._loop.add_reader(self.reader.fileno(), self._readable)
        self._readable()                  # what came before the loop watched the socket

    def _readable(self) -> None:
        self.reader.drain_wakeups()
        while not self.done.done():
            try:
                data = self.reader.try_recv()
            except ChannelClosed:
                self._finish(None)
            except ChannelError as exc:
                self._finish(exc)
            else:
                if data is None:
                    return
                self._on_record(pickle.loads(data))

    async def drained(self, timeout: float) -> None:
        """After the engine's stream ended: wait (bounded) for the records it wrote before, then stop."""
        if not self.done.done() and not self.reader.writer_alive():
            self._readable()              # a dead writer closes nothing: read what it left
            self._finish(ChannelError("the engine died"))
        try:
            await asyncio.wait_for(asyncio.shield(self.done), timeout)
        except (asyncio.TimeoutError, ChannelError):
            pass
        self.close()

    def _finish(self, error: BaseException | None) -> None:
        if not self.done.done():
            if error is None:
                self.done.set_result(None)
            else:
                self.done.set_exception(error)
                self.done.exception()     # retrieved: ``drained`` may never be awaited
        self._loop.remove_reader(self.reader.fileno())

    def close(self) -> None:
        if not self.reader.closed:
            self._finish(ChannelError("closed"))
            self.reader.close()
