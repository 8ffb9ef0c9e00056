"""A subscription's traffic through shared memory when the frontend runs on the engine's host.

A Ray message costs 2-4 ms between the engine's actor and the frontend's event loop on a 2-core machine
(gRPC and the core worker's threads on both sides), and a request's first token pays two: its add and the
record that carries the token. On one host both go through ``ShmBroadcast`` rings instead
(``workers/shm_channel.py``, the rings the workers' steps travel on), each read on its reader's event loop
(``LoopReader``: ``add_reader`` on the ring's wake-up socket):

- records, engine to frontend: the engine's loop copies each record in (``RecordWriter``; a thread takes
  over while the ring is full);
- adds, frontend to engine: the frontend writes a burst of adds when the ring has room for it
  (``try_send``; else it makes the Ray call), and their results come back in the next record, under the
  key ``ADDED``.

The Ray stream stays open for what Ray is good at: it carries the rings' handles, and its end tells the
frontend that the engine stopped or died. Backpressure is the Ray stream's: the record ring holds
``SLOTS`` records; while it is full the writer thread waits and the subscription's updates pile up and go
later as one record, so a frontend whose loop lags gets the steps it missed merged, and an engine never
queues one message per step for it. A reader that died or detached ends the subscription (its requests
are aborted).
"""
from __future__ import annotations

import asyncio
import pickle
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass

from workers.shm_channel import ChannelClosed, ChannelError, ChannelHandle, ShmBroadcast, ShmReader, ShmSegment

SLOTS = 4                   # records in flight before the writer waits (and the subscription merges)
SLOT_BYTES = 256 << 10      # a 256-stream step's record fits one slot; larger ones travel in fragments
ADD_SLOTS, ADD_SLOT_BYTES = 16, 64 << 10   # a burst that does not fit goes as a Ray call
DRAIN_POLL_S = 0.05         # how often a reader draining a ring after its stream ended checks on the writer
ADDED = -1                  # a record entry (ADDED, [(key, engine id or refusal), ...]): adds' results


@dataclass(frozen=True)
class RingHandles:
    """What the engine's stream sends first to a frontend on its host."""

    records: ChannelHandle
    adds: ChannelHandle


def host_id() -> str:
    """Which machine (and boot) this process runs on: a ring needs the frontend's /dev/shm to be the engine's."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "?"
    return f"{socket.gethostname()}/{boot}"


class RecordWriter:
    """The engine's end of the record ring. ``put(record)``, from the event loop, writes at once when the
    ring has room; else a thread writes what piled up as the reader frees slots (one message each time).
    Writing on the loop spares a handoff per record: a woken thread waits for the GIL, up to a switch
    interval (5 ms) while the core thread schedules. ``gone`` is set (and ``on_gone`` called on the thread)
    when the reader died or detached; ``on_sent`` after each message written."""

    def __init__(self, on_gone: Callable[[], None], on_sent: Callable[[], None]):
        self.ring = ShmBroadcast(1, slots=SLOTS, slot_bytes=SLOT_BYTES, spin_s=0.0, poll_s=0.5)
        self.handle: ChannelHandle = self.ring.handle
        self.gone: ChannelError | None = None
        self._on_gone, self._on_sent = on_gone, on_sent
        self._pending: list = []
        self._busy = False                # one side writes at a time: the loop's put or the thread
        self._closing = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="record-ring", daemon=True)
        self._thread.start()

    def put(self, record: list) -> None:
        with self._cond:
            if self._pending or self._busy or self._closing:
                self._pending.extend(record)
                self._cond.notify()
                return
            self._busy = True
        sent = False
        try:
            sent = self.ring.try_send(pickle.dumps(record, protocol=5))
        except ChannelError:              # closed: the thread found the reader gone
            pass
        finally:
            with self._cond:
                self._busy = False
                if not sent:
                    self._pending[:0] = record   # before what came meanwhile
                self._cond.notify()
        if sent:
            self._on_sent()

    def check_reader(self, attached_by_now: bool) -> None:
        """Set ``gone`` if the reader died or detached, or has not attached though it should have by now."""
        if self.ring.readers_gone():
            self.gone = ChannelError("the frontend's reader died or detached")
        elif attached_by_now and self.ring.readers_unattached():
            self.gone = ChannelError("the frontend never attached to its ring")

    def reader_attached(self) -> bool:
        return not self.ring.readers_unattached()

    def unlink(self) -> None:
        """Remove the ring's name from /dev/shm (its reader has mapped it): nothing is left there however
        the engine's process ends."""
        self.ring.unlink()

    def close(self) -> None:
        """Write what is pending, then close the ring (its reader drains it, then sees it closed)."""
        with self._cond:
            self._closing = True
            self._cond.notify()

    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    while self._busy or not (self._pending or self._closing):
                        self._cond.wait()
                    record, self._pending = self._pending, []
                    closing = self._closing
                    self._busy = bool(record)
                if record:
                    try:
                        self.ring.send(pickle.dumps(record, protocol=5))   # waits while the reader is SLOTS behind
                    finally:
                        with self._cond:
                            self._busy = False
                    self._on_sent()
                elif closing:
                    return
        except ChannelError as exc:   # the reader died or detached
            self.gone = exc
            self._on_gone()
        finally:
            with self._cond:
                while self._busy:         # a ``put`` on the loop is writing: closing under it would pull
                    self._cond.wait()     # the mapping from under its copy
                self._busy = True         # nothing writes to a closed ring
            self.ring.close()


class AddRing:
    """The engine's end of the add ring: it owns the segment (the frontend writes) and reads each burst of
    adds on its event loop."""

    def __init__(self, on_adds: Callable[[list], None]):
        self.segment = ShmSegment(1, slots=ADD_SLOTS, slot_bytes=ADD_SLOT_BYTES)
        self.handle: ChannelHandle = self.segment.handle
        self.reader = LoopReader(self.handle, on_adds)

    def unlink(self) -> None:
        """Remove the ring's name from /dev/shm (its writer has mapped it)."""
        self.segment.unlink()

    def close(self) -> None:
        self.reader.close()
        self.segment.close()


class LoopReader:
    """A ring's reader on the running event loop: each message, unpickled, to ``on_message`` as it arrives;
    ``done`` resolves once the writer closed the ring and every message was read (None), or with the error
    that ended it."""

    def __init__(self, handle: ChannelHandle, on_message: Callable[[object], None]):
        self.reader = ShmReader(handle, 0, spin_s=0.0, poll_s=1.0)
        self._on_message = on_message
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
                self._on_message(pickle.loads(data))

    async def drained(self, timeout: float) -> None:
        """After the engine's stream ended: wait (bounded) for the messages its writer sent before, then stop.
        Ray may end the stream of a killed engine before its process has exited: until the writer closes
        the ring or its process is gone, look again every ``DRAIN_POLL_S``."""
        deadline = self._loop.time() + timeout
        while not self.done.done() and self._loop.time() < deadline:
            if not self.reader.writer_alive():
                self._readable()          # a dead writer closes nothing: read what it left
                self._finish(ChannelError("the writer died"))
                break
            await asyncio.wait([self.done], timeout=DRAIN_POLL_S)
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


class AddWriter:
    """The frontend's end of the add ring, on its event loop: ``try_send(entries)`` is False when the ring
    has no room for them (the caller makes the Ray call instead)."""

    def __init__(self, handle: ChannelHandle):
        self.ring = ShmBroadcast.attach(handle, spin_s=0.0, poll_s=1.0)

    def try_send(self, entries: list) -> bool:
        return self.ring.try_send(pickle.dumps(entries, protocol=5))

    def close(self) -> None:
        self.ring.close()
