"""A shared-memory broadcast ring: one writer, N readers on one host, that sleeps when idle.

The engine's step goes to every worker of a node through this ring instead of through Ray: the writer
copies a message into the ring once and every reader copies it out; the only system calls are wake-ups
of readers that went to sleep. Ray's Compiled Graph channels wait by polling (a core per reader at 100%
while the server is idle); these readers spin for at most ``spin_s`` after a message, then sleep on a
socket until the writer wakes them.

Layout (native 64-bit words): a header (magic, sizes, the count of fragments written, closed flag,
writer pid, writer-waiting flag), per reader (fragments read, sleeping flag, pid, state), then ``slots``
slots of a 2-word fragment header (length, last-fragment flag) and ``slot_bytes`` of data. A message
larger than a slot travels as consecutive fragments; one larger than the ring streams through it, the
writer waiting for space. A slot is overwritten only once every reader has read it.

Ordering across processes rests on two facts: a counter is one aligned 8-byte store (memoryview of
"Q"), written after the data it publishes (x86-64 keeps stores in order); and between storing a
counter or a flag and reading the other side's, each side passes a full barrier (``_fence``: a lock's
acquire and release are atomic read-modify-writes), so a writer and a reader never both miss each
other's store (no lost wake-up). Sleeps are bounded by ``poll_s`` anyway, at which a sleeper checks that
the other side is alive.

Wake-ups are 1-byte datagrams on Linux abstract-namespace Unix sockets named after the segment: nothing
to pass between processes, nothing left on disk. Errors are raised, never waited out: a reader that
died, detached or lags past ``timeout`` makes ``send`` raise naming it; a writer that died makes
``recv`` raise (and unlink the segment, which the writer can no longer do; the writer's resource
tracker would too, and says so if it finds the name gone); ``recv`` after the writer closed raises
``ChannelClosed`` once the ring is drained. Linux only (abstract sockets, /dev/shm).

A third process may own the segment (``ShmSegment``): the engine makes the rings between its workers
(a pipeline stage's hidden states, the last stage's replies), whichever worker dies, and the writer
attaches (``ShmBroadcast.attach``). Once every end has mapped a segment its name has no more use: the
maker's ``unlink`` removes it early (the mappings stay valid, nothing can attach any more), so that no
way of ending the processes, SIGKILL included, leaves it in /dev/shm.
"""
from __future__ import annotations

import errno
import mmap
import os
import secrets
import select
import socket
import threading
import time
import warnings
from dataclasses import dataclass
from multiprocessing import shared_memory

MAGIC = 0x53574B5652494E47          # "SWKVRING"
HEADER_WORDS = 8                    # magic, readers, slots, slot_bytes, written, closed, writer pid, writer waiting
READER_WORDS = 4                    # read, sleeping, pid, state
SLOT_HEADER_BYTES = 16              # fragment length, last flag
LAST = 1
ATTACHED, DETACHED = 1, 2


class ChannelError(RuntimeError):
    """The other side is gone or the channel cannot be used."""


class ChannelClosed(ChannelError):
    """The writer closed the channel and every message was read."""


class ChannelTimeout(ChannelError, TimeoutError):
    """Nothing moved within the timeout (the message says who was waited for)."""


@dataclass(frozen=True)
class ChannelHandle:
    """What a reader needs to attach (picklable: send it to the reader's process)."""

    name: str
    num_readers: int
    slots: int
    slot_bytes: int


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` still runs (a zombie, exited but not reaped, does not)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:   # a zombie (killed, not yet reaped) has exited
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


_FENCE = threading.Lock()


def _fence() -> None:
    """A full memory barrier: acquiring and releasing a lock are atomic read-modify-writes."""
    _FENCE.acquire()
    _FENCE.release()


def _unlink(name: str) -> None:
    try:
        os.unlink(f"/dev/shm/{name}")
    except FileNotFoundError:
        pass


def _address(name: str, who: str) -> bytes:
    return f"\0swakv-shm/{name}/{who}".encode()


def _unclosed(end, closed: bool) -> None:
    """An end the collector found open (its owner forgot ``close``, or died of an exception): say so, as
    an unclosed file does, then close it, so that readers see the close and the name leaves /dev/shm."""
    if closed:
        return
    try:
        warnings.warn(f"{type(end).__name__} of channel {end.handle.name} was never closed", ResourceWarning,
                      source=end)
        end.close()
    except Exception:  # noqa: BLE001 - at interpreter exit the modules it needs may be gone
        pass


class _Ring:
    """The mapped segment and its word view; shared by both ends. ``owner``: the writer's
    ``SharedMemory`` (registered with its process's resource tracker, which unlinks it if the writer
    dies), else None: a reader maps the segment itself, so no tracker of its own ever unlinks it.
    Both ends map it here: the owner's own mapping is closed at once, so that an end never closed and
    left to the collector cannot make ``SharedMemory.__del__`` fail on views still open (which, run
    mid-``ast.parse`` on CPython 3.11, broke a CI run)."""

    def __init__(self, handle: ChannelHandle, owner: shared_memory.SharedMemory | None = None):
        self.handle, self.owner = handle, owner
        try:
            fd = os.open(f"/dev/shm/{handle.name}", os.O_RDWR)
        except FileNotFoundError:
            raise ChannelError(f"channel {handle.name} does not exist (closed, or never created)") from None
        try:
            self._map = mmap.mmap(fd, os.fstat(fd).st_size)
        finally:
            os.close(fd)
        if owner is not None:
            owner.close()                  # kept only to unlink the name
        self.buf = memoryview(self._map)
        self.words = self.buf.cast("Q")
        self.stride = SLOT_HEADER_BYTES + handle.slot_bytes
        self.slots_at = 8 * (HEADER_WORDS + READER_WORDS * handle.num_readers)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.setblocking(False)      # stays so: ``sleep`` waits in poll, not in a timed recv
        self.poller = select.poll()
        self.poller.register(self.sock, select.POLLIN)

    @staticmethod
    def size(num_readers: int, slots: int, slot_bytes: int) -> int:
        return 8 * (HEADER_WORDS + READER_WORDS * num_readers) + slots * (SLOT_HEADER_BYTES + slot_bytes)

    def reader_word(self, reader: int, field: int) -> int:
        return HEADER_WORDS + READER_WORDS * reader + field

    def drain(self) -> bool:
        """Read pending wake-ups, so that the next sleep waits for a new one; whether there was any."""
        woke = False
        while True:
            try:
                self.sock.recv(64)
                woke = True
            except (BlockingIOError, InterruptedError):
                return woke

    def sleep(self, seconds: float) -> None:
        """Until a wake-up arrives (left queued: the caller's next ``drain`` reads it) or ``seconds`` pass."""
        self.poller.poll(max(seconds, 1e-4) * 1e3)

    def wake(self, who: str) -> None:
        try:
            self.sock.sendto(b"w", _address(self.handle.name, who))
        except (ConnectionRefusedError, FileNotFoundError, BlockingIOError):
            pass   # not listening yet (it will see the counter), or already has wake-ups queued
        except OSError as exc:
            if exc.errno not in (errno.ECONNREFUSED, errno.ENOENT, errno.EAGAIN):
                raise

    def release(self) -> None:
        self.sock.close()
        self.words.release()
        self.buf.release()
        self._map.close()
        self.buf = self.words = None


def _check_timing(spin_s: float, poll_s: float) -> None:
    if not (spin_s >= 0 and poll_s > 0):
        raise ValueError(f"spin_s must be >= 0 and poll_s > 0, got {spin_s!r}, {poll_s!r}")


def _create(num_readers: int, slots: int, slot_bytes: int) -> tuple[ChannelHandle, shared_memory.SharedMemory]:
    """A new segment with its header written (writer pid: this process, until a writer attaches)."""
    for what, value, low in (("num_readers", num_readers, 1), ("slots", slots, 2), ("slot_bytes", slot_bytes, 8)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{what} must be an integer >= {low}, got {value!r}")
    if slot_bytes % 8:
        raise ValueError(f"slot_bytes must be a multiple of 8, got {slot_bytes}")
    name = f"swakv-{os.getpid()}-{secrets.token_hex(4)}"
    handle = ChannelHandle(name, num_readers, slots, slot_bytes)
    shm = shared_memory.SharedMemory(name, create=True, size=_Ring.size(num_readers, slots, slot_bytes))
    words = shm.buf.cast("Q")
    words[1], words[2], words[3], words[6] = num_readers, slots, slot_bytes, os.getpid()
    words[0] = MAGIC
    words.release()
    return handle, shm


def _unlink_owned(shm: shared_memory.SharedMemory) -> None:
    """Unlink a segment this process made, also when a reader already unlinked it (its writer died)."""
    try:
        shm.unlink()
    except FileNotFoundError:
        from multiprocessing import resource_tracker
        resource_tracker.unregister(shm._name, "shared_memory")   # else the tracker warns at exit


class ShmSegment:
    """A ring's segment owned by a process that neither writes nor reads it: ``close`` unlinks it (so does
    the owner's resource tracker if the owner dies). Hand ``handle`` to the writer and the readers."""

    def __init__(self, num_readers: int, *, slots: int = 8, slot_bytes: int = 64 << 10):
        self.handle, self._shm = _create(num_readers, slots, slot_bytes)
        self._named = True

    def unlink(self) -> None:
        """Remove the segment's name now, once its writer and readers have mapped it (``ShmBroadcast.unlink``)."""
        if self._named and self._shm is not None:
            self._named = False
            _unlink_owned(self._shm)

    def close(self) -> None:
        if self._shm is not None:
            shm, self._shm = self._shm, None
            shm.close()
            if self._named:
                _unlink_owned(shm)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        _unclosed(self, getattr(self, "_shm", None) is None)


class ShmBroadcast:
    """The writing end: ``send(bytes)`` reaches every reader, in order. Create it, hand ``handle`` to the
    readers' processes, ``close()`` when done (unlinks the segment)."""

    def __init__(self, num_readers: int, *, slots: int = 8, slot_bytes: int = 64 << 10, spin_s: float = 1e-4,
                 poll_s: float = 1.0):
        _check_timing(spin_s, poll_s)
        handle, shm = _create(num_readers, slots, slot_bytes)
        try:
            ring = _Ring(handle, owner=shm)
            try:
                self._open(ring, spin_s, poll_s)
            except BaseException:
                ring.release()
                raise
        except BaseException:   # out of descriptors, say: nobody else knows the name, so it goes now
            shm.close()
            _unlink_owned(shm)
            raise

    @classmethod
    def attach(cls, handle: ChannelHandle, *, spin_s: float = 1e-4, poll_s: float = 1.0) -> ShmBroadcast:
        """Write to a segment another process made (``ShmSegment``; it unlinks it, not this writer)."""
        _check_timing(spin_s, poll_s)
        ring = _Ring(handle)
        if tuple(ring.words[:4]) != (MAGIC, handle.num_readers, handle.slots, handle.slot_bytes):
            ring.release()
            raise ChannelError(f"channel {handle.name}: the segment does not match its handle")
        self = cls.__new__(cls)
        self._open(ring, spin_s, poll_s)
        return self

    def _open(self, ring: _Ring, spin_s: float, poll_s: float) -> None:
        self.handle, self._ring = ring.handle, ring
        ring.sock.bind(_address(ring.handle.name, "w"))
        ring.words[6] = os.getpid()
        self.spin_s, self.poll_s = spin_s, poll_s
        self.closed = False
        self._named = ring.owner is not None     # this writer made the segment and its name is still there

    def send(self, data: bytes | bytearray | memoryview, timeout: float | None = None) -> None:
        """Publish ``data`` to every reader; waits (spinning, then sleeping) while the slowest reader is a
        ring behind. Raises ``ChannelError`` if a reader died or detached, ``ChannelTimeout`` after
        ``timeout`` seconds without room."""
        if self.closed:
            raise ChannelError("send on a closed channel")
        ring, h = self._ring, self.handle
        view = memoryview(data).cast("B")
        deadline = None if timeout is None else time.monotonic() + timeout
        offset, total = 0, len(view)
        while True:
            size = min(h.slot_bytes, total - offset)
            seq = ring.words[4]
            self._wait_for_room(seq, deadline)
            at = ring.slots_at + (seq % h.slots) * ring.stride
            ring.buf[at + SLOT_HEADER_BYTES:at + SLOT_HEADER_BYTES + size] = view[offset:offset + size]
            slot = at // 8
            offset += size
            ring.words[slot] = size
            ring.words[slot + 1] = LAST if offset >= total else 0
            ring.words[4] = seq + 1          # publish
            _fence()                         # before reading the sleeping flags
            for r in range(h.num_readers):
                if ring.words[ring.reader_word(r, 1)]:
                    ring.wake(f"r{r}")
            if offset >= total:
                return

    def try_send(self, data: bytes | bytearray | memoryview) -> bool:
        """``send`` if the whole message fits in the slots free now, else False with nothing written: for a
        writer on an event loop, which must not wait."""
        if self.closed:
            raise ChannelError("send on a closed channel")
        ring, h = self._ring, self.handle
        fragments = max(1, -(-memoryview(data).nbytes // h.slot_bytes))
        behind = ring.words[4] - min(ring.words[ring.reader_word(r, 0)] for r in range(h.num_readers))
        if behind + fragments > h.slots:
            return False
        self.send(data)
        return True

    def _wait_for_room(self, seq: int, deadline: float | None) -> None:
        ring, h = self._ring, self.handle
        words, reads = ring.words, [ring.reader_word(r, 0) for r in range(h.num_readers)]
        if seq - min(words[i] for i in reads) < h.slots:
            return
        spin_until = time.monotonic() + self.spin_s
        while time.monotonic() < spin_until:
            if seq - min(words[i] for i in reads) < h.slots:
                return
        while True:
            words[7] = 1
            _fence()
            ring.drain()
            if seq - min(words[i] for i in reads) < h.slots:
                words[7] = 0
                return
            self._check_readers(seq)
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                words[7] = 0
                lagging = [r for r, i in enumerate(reads) if seq - words[i] >= h.slots]
                absent = [r for r in lagging if words[ring.reader_word(r, 3)] != ATTACHED]
                raise ChannelTimeout(f"channel {h.name}: reader(s) {lagging} did not read for the timeout"
                                     + (f" ({absent} never attached)" if absent else "")
                                     + f"; their pids {[words[ring.reader_word(r, 2)] for r in lagging]}")
            ring.sleep(self.poll_s if deadline is None else min(self.poll_s, deadline - now))

    def _check_readers(self, seq: int) -> None:
        """Raise ``ChannelError`` naming a reader that ``seq`` waits on and that is gone."""
        ring, h = self._ring, self.handle
        for r in range(h.num_readers):
            if seq - ring.words[ring.reader_word(r, 0)] >= h.slots and (why := self._reader_gone(r)):
                raise ChannelError(f"channel {h.name}: reader {r} (pid {ring.words[ring.reader_word(r, 2)]}) {why}")

    def _reader_gone(self, r: int) -> str | None:
        """Why reader ``r`` will read no more ("detached with messages unread", "died"), or None."""
        ring = self._ring
        state = ring.words[ring.reader_word(r, 3)]
        if state == DETACHED:
            return "detached with messages unread"
        if state == ATTACHED and not process_alive(ring.words[ring.reader_word(r, 2)]):
            return "died"
        return None

    def readers_gone(self) -> list[int]:
        """Readers that detached, or attached and died (``send`` finds them only when it waits on them)."""
        return [r for r in range(self.handle.num_readers) if self._reader_gone(r)]

    def readers_unattached(self) -> list[int]:
        ring = self._ring
        return [r for r in range(self.handle.num_readers) if ring.words[ring.reader_word(r, 3)] == 0]

    def readers_sleeping(self) -> list[bool]:
        ring = self._ring
        return [bool(ring.words[ring.reader_word(r, 1)]) for r in range(self.handle.num_readers)]

    def unread(self, reader: int) -> int:
        """Slots sent that ``reader`` has not taken yet (a message up to ``slot_bytes`` is one slot)."""
        ring = self._ring
        return ring.words[4] - ring.words[ring.reader_word(reader, 0)]

    def unlink(self) -> None:
        """Remove the segment's name from /dev/shm once every reader has mapped it. The mappings stay valid
        (sending and reading go on as before, until ``close``), and no way of ending the processes, SIGKILL
        included, can leave the segment behind; nothing can attach from then on. Only for a segment this
        writer made; a no-op after the first call."""
        if self._ring.owner is None:
            raise ChannelError(f"channel {self.handle.name}: only the writer that made the segment unlinks it")
        if self._named:
            self._named = False
            _unlink_owned(self._ring.owner)

    def close(self) -> None:
        """Readers get what was sent, then ``ChannelClosed``; the segment is unlinked now if this writer
        made it (readers keep their mapping until they close)."""
        if self.closed:
            return
        self.closed = True
        ring = self._ring
        try:
            ring.words[5] = 1
            _fence()
            for r in range(self.handle.num_readers):
                ring.wake(f"r{r}")
        finally:                                 # a wake-up that failed must not leave the segment behind
            shm = ring.owner
            ring.release()
            if shm is not None and self._named:  # else unlinked already, or its owner does (``ShmSegment``)
                self._named = False
                _unlink_owned(shm)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        _unclosed(self, getattr(self, "closed", True))


class ShmReader:
    """Reader ``index`` of a broadcast ring (attach in the reader's own process)."""

    def __init__(self, handle: ChannelHandle, index: int, *, spin_s: float = 1e-4, poll_s: float = 1.0):
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < handle.num_readers:
            raise ValueError(f"reader index must lie in [0, {handle.num_readers}), got {index!r}")
        _check_timing(spin_s, poll_s)
        ring = _Ring(handle)
        w = ring.words
        if (w[0], w[1], w[2], w[3]) != (MAGIC, handle.num_readers, handle.slots, handle.slot_bytes):
            ring.release()
            raise ChannelError(f"channel {handle.name}: the segment does not match its handle")
        holder = w[ring.reader_word(index, 2)]
        if w[ring.reader_word(index, 3)] == ATTACHED and process_alive(holder):
            ring.release()
            raise ChannelError(f"channel {handle.name}: reader {index} is attached already (pid {holder})")
        ring.sock.bind(_address(handle.name, f"r{index}"))
        w[ring.reader_word(index, 2)] = os.getpid()
        w[ring.reader_word(index, 3)] = ATTACHED
        self.handle, self.index, self._ring = handle, index, ring
        self._read, self._sleeping = ring.reader_word(index, 0), ring.reader_word(index, 1)
        self.spin_s, self.poll_s = spin_s, poll_s
        self.closed = False
        self._parts: list[bytes] = []    # fragments of a message not yet whole

    def recv(self, timeout: float | None = None, check=None) -> bytes:
        """The next message. Raises ``ChannelClosed`` once the writer closed and all was read,
        ``ChannelError`` if the writer died, ``ChannelTimeout`` after ``timeout`` seconds without one.
        ``check``: called at each ``poll_s`` wake-up while waiting; what it raises, ``recv`` raises (the
        engine checks there that every worker of the step is alive, not only the one that answers)."""
        if self.closed:
            raise ChannelError("recv on a closed reader")
        words = self._ring.words
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            seq = words[self._read]
            if words[4] == seq:
                self._wait(seq, deadline, check)
            message = self._take(seq)
            if message is not None:
                return message

    def try_recv(self) -> bytes | None:
        """The next message if all of it is there, else None; never waits. For a reader on an event loop,
        which sleeps on ``fileno()`` after ``arm()`` instead (a message larger than the ring arrives over
        several calls). Raises ``ChannelClosed`` once the writer closed and all was read."""
        if self.closed:
            raise ChannelError("recv on a closed reader")
        words = self._ring.words
        while True:
            seq = words[self._read]
            if words[4] == seq:
                if words[5]:
                    raise ChannelClosed(f"channel {self.handle.name} was closed by its writer")
                return None
            message = self._take(seq)
            if message is not None:
                return message

    def _take(self, seq: int) -> bytes | None:
        """Fragment ``seq`` (published) off the ring; the whole message once this was its last fragment."""
        ring, h, words = self._ring, self.handle, self._ring.words
        at = ring.slots_at + (seq % h.slots) * ring.stride
        size, flags = words[at // 8], words[at // 8 + 1]
        self._parts.append(bytes(ring.buf[at + SLOT_HEADER_BYTES:at + SLOT_HEADER_BYTES + size]))
        words[self._read] = seq + 1      # the slot is free for the writer
        _fence()                         # before reading the writer's waiting flag
        if words[7]:
            ring.wake("w")
        if not flags & LAST:
            return None
        parts, self._parts = self._parts, []
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def fileno(self) -> int:
        """The socket the writer's wake-ups arrive on, readable once ``arm()`` was called and a message came."""
        return self._ring.sock.fileno()

    def arm(self) -> None:
        """Sleep on ``fileno()`` from now on: the writer wakes it at every message until ``close``. Call
        ``try_recv`` until it returns None after each wake-up (and once after arming): the flag and the
        counter are read in the order that loses no wake-up, so a message either is there or wakes it."""
        self._ring.words[self._sleeping] = 1
        _fence()

    def drain_wakeups(self) -> None:
        """Read the wake-ups queued on ``fileno()`` (before ``try_recv``, so that none is left for a message read)."""
        self._ring.drain()

    def writer_alive(self) -> bool:
        return process_alive(self._ring.words[6])

    def nudge(self) -> None:
        """Wake a ``recv`` waiting in this process (from another thread): it calls its ``check`` at once, as at
        a ``poll_s`` wake-up, and goes on waiting."""
        self._ring.wake(f"r{self.index}")

    def _wait(self, seq: int, deadline: float | None, check=None) -> None:
        ring, words = self._ring, self._ring.words
        spin_until = time.monotonic() + self.spin_s
        while time.monotonic() < spin_until:
            if words[4] != seq:
                return
        slept = False      # the writer's liveness and ``check`` wait for the first wake-up without a message:
        while True:        # a reader that gets its message at once (every step of a busy server) pays neither
            words[self._sleeping] = 1
            _fence()                          # between the flag and the counter (see the docstring)
            woke = ring.drain()               # a ``nudge`` read here still gets its ``check`` below
            if words[4] != seq:
                words[self._sleeping] = 0
                return
            if words[5]:
                words[self._sleeping] = 0
                raise ChannelClosed(f"channel {self.handle.name} was closed by its writer")
            if slept and not process_alive(words[6]):
                words[self._sleeping] = 0
                _unlink(self.handle.name)     # nobody else will: the name must not outlive the writer
                raise ChannelError(f"channel {self.handle.name}: the writer (pid {words[6]}) died")
            if (slept or woke) and check is not None:
                try:
                    check()
                except BaseException:
                    words[self._sleeping] = 0
                    raise
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                words[self._sleeping] = 0
                raise ChannelTimeout(f"channel {self.handle.name}: no message for the timeout (reader {self.index})")
            ring.sleep(self.poll_s if deadline is None else min(self.poll_s, deadline - now))
            slept = True

    def close(self) -> None:
        """Detach: a writer waiting on this reader then raises instead of waiting."""
        if self.closed:
            return
        self.closed = True
        ring = self._ring
        ring.words[ring.reader_word(self.index, 3)] = DETACHED
        ring.words[self._sleeping] = 0
        if ring.words[7]:
            ring.wake("w")
        ring.release()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        _unclosed(self, getattr(self, "closed", True))
