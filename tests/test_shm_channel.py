"""The shared-memory broadcast ring (``workers/shm_channel.py``): every reader gets every message in order,
whatever its size; an idle reader sleeps and wakes for the next message; a dead, detached or silent
peer is an error, never a hang; closing leaves nothing in /dev/shm. Readers and writers run in real
processes (spawned), as engine and workers do."""
from __future__ import annotations

import gc
import hashlib
import json
import multiprocessing as mp
import os
import random
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from workers.shm_channel import ChannelClosed, ChannelError, ChannelTimeout, ShmBroadcast, ShmReader, ShmSegment

CTX = mp.get_context("spawn")
CLK_TCK = os.sysconf("SC_CLK_TCK")


def _digest(data: bytes) -> tuple[int, str]:
    return len(data), hashlib.sha1(data).hexdigest()


def _collect(handle, index: int, count: int, out) -> None:
    with ShmReader(handle, index, poll_s=0.05) as reader:
        out.put((index, [_digest(reader.recv(timeout=60)) for _ in range(count)]))


def _echo_forever(handle, out) -> None:
    reader = ShmReader(handle, 0, poll_s=0.05)
    out.put("attached")
    while True:
        out.put(_digest(reader.recv()))


def _write_then_hang(out) -> None:
    writer = ShmBroadcast(1, slots=2, slot_bytes=64)
    out.put(writer.handle)
    time.sleep(600)


def _attach_send_then_hang(handle, messages, out) -> None:
    writer = ShmBroadcast.attach(handle, poll_s=0.05)
    for m in messages:
        writer.send(m, timeout=60)
    out.put("sent")
    time.sleep(600)


def _segments() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith("swakv-")}


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def _wait_for(predicate, seconds: float = 20.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


def _stop(*procs) -> None:
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join(10)


def _broadcast(messages: list[bytes], readers: int, slot_bytes: int) -> dict[int, list]:
    """Send ``messages`` through a 4-slot ring to ``readers`` reader processes: each one's digests, by reader."""
    out = CTX.Queue()
    with ShmBroadcast(readers, slots=4, slot_bytes=slot_bytes, poll_s=0.05) as writer:
        procs = [CTX.Process(target=_collect, args=(writer.handle, i, len(messages), out)) for i in range(readers)]
        for p in procs:
            p.start()
        try:
            for m in messages:
                writer.send(m, timeout=60)
            return dict(out.get(timeout=60) for _ in procs)
        finally:
            _stop(*procs)


def test_three_readers_in_other_processes_get_every_message_in_order_across_wraps_and_fragments():
    rng = random.Random(7)
    messages = [rng.randbytes(rng.choice([0, 1, 8, 1023, 1024, 1025, rng.randrange(3 * 1024)])) for _ in range(300)]
    expected = [_digest(m) for m in messages]
    assert _broadcast(messages, readers=3, slot_bytes=1024) == {0: expected, 1: expected, 2: expected}


def test_messages_larger_than_the_ring_stream_through_it_whole():
    sizes = [5 << 20, 4 * 4096, 4096, 4095, 0, 3 * 4096 + 1]
    messages = [random.Random(s).randbytes(s) for s in sizes]
    expected = [_digest(m) for m in messages]
    assert _broadcast(messages, readers=2, slot_bytes=4096) == {0: expected, 1: expected}


def test_a_reader_on_an_event_loop_sleeps_on_its_socket_and_gets_every_message_whole():
    """``arm`` + ``fileno`` + ``try_recv``: what an asyncio frontend does. Every wake-up is a readable socket
    (select never times out while messages are due), ``try_recv`` never waits, and a message larger than
    the ring comes whole over several wake-ups, in order with the others."""
    messages = [b"a" * 10, random.Random(1).randbytes(1000), b"", b"b" * 64, b"c" * 65]   # the ring holds 256 B
    out = CTX.Queue()
    with ShmSegment(1, slots=4, slot_bytes=64) as segment:
        reader = ShmReader(segment.handle, 0)
        reader.arm()
        assert reader.try_recv() is None                         # nothing yet: None, at once
        writer = CTX.Process(target=_attach_send_then_hang, args=(segment.handle, messages, out))
        writer.start()
        got, wakeups = [], 0
        try:
            while len(got) < len(messages):
                readable, _, _ = select.select([reader.fileno()], [], [], 30)
                assert readable, f"no wake-up for message {len(got)}"
                wakeups += 1
                reader.drain_wakeups()
                while (data := reader.try_recv()) is not None:
                    got.append(data)
            assert out.get(timeout=30) == "sent"
            assert reader.try_recv() is None
        finally:
            _stop(writer)
            reader.close()
    assert got == messages
    assert 2 <= wakeups <= 21       # the ring holds less than all of it; at most one per fragment (1+16+1+1+2)


def test_try_recv_drains_what_a_closed_writer_sent_then_says_closed():
    with ShmBroadcast(1, slots=4, slot_bytes=64) as writer:
        reader = ShmReader(writer.handle, 0)
        writer.send(b"one")
        writer.send(b"two")
        writer.close()
        assert [reader.try_recv(), reader.try_recv()] == [b"one", b"two"]
        with pytest.raises(ChannelClosed):
            reader.try_recv()
        reader.close()


def test_try_send_writes_a_message_only_when_all_of_it_fits_now():
    with ShmBroadcast(1, slots=4, slot_bytes=64) as writer:
        reader = ShmReader(writer.handle, 0)
        assert writer.try_send(b"x" * 64 * 3)                 # three slots of four
        assert not writer.try_send(b"y" * 65)                 # two more needed: nothing written
        assert writer.try_send(b"z" * 64)
        assert not writer.try_send(b"")                       # even an empty message needs a slot
        assert reader.try_recv() == b"x" * 192
        assert writer.try_send(b"y" * 65)
        assert [reader.try_recv(), reader.try_recv(), reader.try_recv()] == [b"z" * 64, b"y" * 65, None]
        reader.close()


def test_a_writer_tells_readers_that_never_attached_from_those_that_died():
    out = CTX.Queue()
    with ShmBroadcast(1, slots=2, slot_bytes=64) as writer:
        assert (writer.readers_unattached(), writer.readers_gone()) == ([0], [])
        reader = CTX.Process(target=_echo_forever, args=(writer.handle, out))
        reader.start()
        try:
            assert out.get(timeout=60) == "attached"
            assert (writer.readers_unattached(), writer.readers_gone()) == ([], [])
            reader.kill()
            reader.join(10)
            assert writer.readers_gone() == [0]
        finally:
            _stop(reader)


def test_an_idle_reader_sleeps_without_burning_cpu_and_wakes_for_the_next_message():
    out = CTX.Queue()
    with ShmBroadcast(1, slots=4, slot_bytes=256, poll_s=0.05) as writer:
        reader = CTX.Process(target=_echo_forever, args=(writer.handle, out))
        reader.start()
        try:
            assert out.get(timeout=60) == "attached"
            writer.send(b"first", timeout=10)
            assert out.get(timeout=10) == _digest(b"first")
            assert _wait_for(lambda: writer.readers_sleeping() == [True])
            cpu0 = _cpu_s(reader.pid)
            time.sleep(2.0)
            idle_cpu = _cpu_s(reader.pid) - cpu0
            writer.send(b"after a while", timeout=10)
            assert out.get(timeout=10) == _digest(b"after a while")
        finally:
            _stop(reader)
    assert idle_cpu <= 0.2    # a polling reader would have used about 2 s of CPU in those 2 s


def test_a_reader_that_dies_makes_send_raise_naming_it_instead_of_waiting():
    out = CTX.Queue()
    with ShmBroadcast(2, slots=2, slot_bytes=64, poll_s=0.05) as writer:
        readers = [CTX.Process(target=_echo_forever, args=(writer.handle, out)) for _ in range(1)]
        alive = ShmReader(writer.handle, 1)
        readers[0].start()
        try:
            assert out.get(timeout=60) == "attached"
            pid = readers[0].pid
            os.kill(pid, signal.SIGKILL)
            readers[0].join(10)
            writer.send(b"a", timeout=30)
            writer.send(b"b", timeout=30)       # the ring holds two: both fit whatever the readers do
            alive.recv(timeout=5), alive.recv(timeout=5)
            with pytest.raises(ChannelError, match=rf"reader 0 \(pid {pid}\) died"):
                writer.send(b"c", timeout=30)
        finally:
            alive.close()
            _stop(*readers)


def test_a_reader_that_detached_makes_send_raise_and_a_silent_one_times_out():
    with ShmBroadcast(2, slots=2, slot_bytes=64, poll_s=0.05) as writer:
        first, second = ShmReader(writer.handle, 0), ShmReader(writer.handle, 1)
        writer.send(b"1")
        writer.send(b"2")
        assert second.recv(timeout=1) == b"1" and second.recv(timeout=1) == b"2"
        with pytest.raises(ChannelTimeout, match=r"reader\(s\) \[0\] did not read for the timeout; their pids"):
            writer.send(b"3", timeout=0.3)
        first.close()
        with pytest.raises(ChannelError, match="reader 0 .* detached with messages unread"):
            writer.send(b"3", timeout=30)
        second.close()


def test_a_reader_that_never_attached_is_named_when_send_times_out():
    with ShmBroadcast(2, slots=2, slot_bytes=64) as writer:
        with ShmReader(writer.handle, 1) as present:
            writer.send(b"1")
            writer.send(b"2")
            assert present.recv(timeout=1) == b"1" and present.recv(timeout=1) == b"2"
            with pytest.raises(ChannelTimeout, match=r"reader\(s\) \[0\] did not read .*\(\[0\] never attached\)"):
                writer.send(b"3", timeout=0.3)


def test_recv_times_out_when_nothing_comes_and_the_channel_stays_usable():
    with ShmBroadcast(1, slots=2, slot_bytes=64) as writer:
        with ShmReader(writer.handle, 0) as reader:
            t0 = time.monotonic()
            with pytest.raises(ChannelTimeout, match="no message"):
                reader.recv(timeout=0.2)
            assert time.monotonic() - t0 < 5
            writer.send(b"late")
            assert reader.recv(timeout=5) == b"late"


def test_a_writer_that_dies_makes_recv_raise_and_its_segment_is_reclaimed():
    out = CTX.Queue()
    writer = CTX.Process(target=_write_then_hang, args=(out,))
    writer.start()
    try:
        handle = out.get(timeout=60)
        reader = ShmReader(handle, 0, poll_s=0.05)
        os.kill(writer.pid, signal.SIGKILL)
        writer.join(10)
        with pytest.raises(ChannelError, match=rf"the writer \(pid {writer.pid}\) died"):
            reader.recv(timeout=30)
        reader.close()
    finally:
        _stop(writer)
    assert handle.name not in _segments()     # the reader that saw the writer die unlinked its segment


def test_a_segment_owned_by_a_third_process_outlives_its_dead_writer_only_until_the_owner_closes_it():
    """The engine's rings between workers: the engine owns them, a worker writes, another reads."""
    out = CTX.Queue()
    owner = ShmSegment(1, slots=2, slot_bytes=64)
    reader = ShmReader(owner.handle, 0, poll_s=0.05)
    writer = CTX.Process(target=_attach_send_then_hang, args=(owner.handle, [b"a", b"b" * 200], out))
    writer.start()
    try:
        # 200 bytes: 4 fragments through 2 slots: the writer waits for room while this reader reads
        assert [reader.recv(timeout=30) for _ in range(2)] == [b"a", b"b" * 200]
        assert out.get(timeout=60) == "sent"
        os.kill(writer.pid, signal.SIGKILL)
        writer.join(10)
        with pytest.raises(ChannelError, match=rf"the writer \(pid {writer.pid}\) died"):
            reader.recv(timeout=30)
        reader.close()
    finally:
        _stop(writer)
    owner.close()                               # the reader unlinked it already: no error, nothing left
    assert owner.handle.name not in _segments()


def test_a_readers_check_raising_ends_its_wait():
    with ShmSegment(1, slots=2, slot_bytes=64) as owner:
        reader = ShmReader(owner.handle, 0, poll_s=0.01)
        with pytest.raises(KeyError, match="a peer died"):
            reader.recv(timeout=30, check=lambda: (_ for _ in ()).throw(KeyError("a peer died")))
        assert not any(reader._ring.words[reader._sleeping:reader._sleeping + 1])   # not left marked asleep
        reader.close()
        name = owner.handle.name
    assert name not in _segments()


def test_close_unlinks_the_segment_readers_drain_then_see_closed_and_nothing_is_left_in_dev_shm():
    before = _segments()
    writer = ShmBroadcast(2, slots=4, slot_bytes=64)
    readers = [ShmReader(writer.handle, i) for i in range(2)]
    for m in (b"x", b"y" * 100, b""):
        writer.send(m)
    writer.close()
    assert writer.handle.name not in _segments()
    for r in readers:
        assert [r.recv(timeout=1) for _ in range(3)] == [b"x", b"y" * 100, b""]
        with pytest.raises(ChannelClosed):
            r.recv(timeout=1)
        r.close()
    with pytest.raises(ChannelError, match="does not exist"):
        ShmReader(writer.handle, 0)
    with pytest.raises(ChannelError, match="closed"):
        writer.send(b"z")
    for _ in range(10):
        with ShmBroadcast(3, slots=2, slot_bytes=64) as w:
            ShmReader(w.handle, 2).close()
    assert _segments() == before


def test_a_writer_dropped_unclosed_warns_closes_and_its_reader_sees_the_close(monkeypatch):
    """An end nobody closed (an engine torn down by an exception) goes to the collector: it says so, as an
    unclosed file does, and closes, so its reader is not left waiting and the name leaves /dev/shm; and
    the writer's ``SharedMemory`` does not fail there on views of its mapping still open (such an error,
    reported mid-``ast.parse`` on CPython 3.11, broke a CI run)."""
    reported = []
    monkeypatch.setattr(sys, "unraisablehook", reported.append)
    writer = ShmBroadcast(1, slots=2, slot_bytes=64)
    name = writer.handle.name
    reader = ShmReader(writer.handle, 0)
    writer.send(b"x")
    with pytest.warns(ResourceWarning, match=f"ShmBroadcast of channel {name} was never closed"):
        del writer
        gc.collect()
    assert [(u.exc_type, str(u.exc_value)) for u in reported] == []
    assert name not in _segments()
    assert reader.recv(timeout=1) == b"x"
    with pytest.raises(ChannelClosed):
        reader.recv(timeout=1)
    reader.close()


def test_a_ring_unlinked_once_its_ends_attached_goes_on_and_nothing_can_attach_any_more():
    """The maker removes the name once every end has mapped the segment (so no way of ending a process can
    leave it in /dev/shm): messages still flow both through a writer's own segment and through a segment a
    third party owns; a new reader or writer finds nothing; a second unlink and close are no-ops."""
    before = _segments()
    writer = ShmBroadcast(1, slots=4, slot_bytes=64)
    reader = ShmReader(writer.handle, 0)
    writer.unlink()
    writer.unlink()
    assert writer.handle.name not in _segments()
    for m in (b"a", b"b" * 200, b"c"):                     # fragments, and wraps the 4-slot ring
        writer.send(m)
        assert reader.recv(timeout=1) == m
    with pytest.raises(ChannelError, match="does not exist"):
        ShmReader(writer.handle, 0)
    owner = ShmSegment(1, slots=2, slot_bytes=64)
    seg_reader, seg_writer = ShmReader(owner.handle, 0), ShmBroadcast.attach(owner.handle)
    owner.unlink()
    with pytest.raises(ChannelError, match="only the writer that made the segment"):
        seg_writer.unlink()
    seg_writer.send(b"through a third party's segment")
    assert seg_reader.recv(timeout=1) == b"through a third party's segment"
    with pytest.raises(ChannelError, match="does not exist"):
        ShmBroadcast.attach(owner.handle)
    writer.close()
    seg_writer.close()
    owner.close()
    with pytest.raises(ChannelClosed):
        reader.recv(timeout=1)
    reader.close()
    seg_reader.close()
    assert _segments() == before


def test_bad_arguments_are_refused_before_any_segment_exists():
    before = _segments()
    for kwargs in (dict(num_readers=0), dict(num_readers=1, slots=1), dict(num_readers=1, slot_bytes=12),
                   dict(num_readers=True), dict(num_readers=1, spin_s=-1.0), dict(num_readers=1, poll_s=0)):
        with pytest.raises(ValueError):
            ShmBroadcast(**kwargs)
    assert _segments() == before
    with ShmBroadcast(2, slots=2, slot_bytes=64) as writer:
        with pytest.raises(ValueError, match=r"reader index must lie in \[0, 2\)"):
            ShmReader(writer.handle, 2)
        first = ShmReader(writer.handle, 0)
        with pytest.raises(ChannelError, match="reader 0 is attached already"):
            ShmReader(writer.handle, 0)
        first.close()


OUT_OF_DESCRIPTORS = """
import json, os, resource
from multiprocessing import resource_tracker
from workers.shm_channel import ShmBroadcast
resource_tracker.ensure_running()                # its pipe is not what runs out
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
base = len(os.listdir("/proc/self/fd")) - 1      # open now, less the listing's own
outcomes = []
for limit in range(base - 1, base + 8):
    resource.setrlimit(resource.RLIMIT_NOFILE, (limit, hard))
    try:
        writer, error = ShmBroadcast(1), None
    except OSError as exc:
        writer, error = None, type(exc).__name__
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    left = [n for n in os.listdir("/dev/shm") if n.startswith(f"swakv-{os.getpid()}-")]
    outcomes.append([error, len(left)])
    if writer is not None:
        writer.close()
print(json.dumps(outcomes))
"""


def test_a_writer_that_runs_out_of_descriptors_while_opening_leaves_no_segment_behind():
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "-c", OUT_OF_DESCRIPTORS], cwd=root, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(root)}, timeout=60)
    assert proc.returncode == 0, proc.stderr
    outcomes = json.loads(proc.stdout)
    failed = [left for error, left in outcomes if error is not None]
    opened = [left for error, left in outcomes if error is None]
    assert len(failed) >= 2 and opened            # it failed at more than one step of opening, then opened
    assert failed == [0] * len(failed)            # a failed writer's segment is gone at once
    assert opened == [1] * len(opened)            # an open one's is there until it closes
