"""A worker's step loop over the rings, without Ray: a step that asks for an acknowledgement is acknowledged
once its checks pass and then runs, checked once; a refused one is answered with its error, no ACK, and
changes nothing on the worker. Late joiners found behind a step run in its batch and are answered apart;
one found later, or one that fails the checks with the step, is dropped.

The engine's side is played by this process (the step ring's writer, the reply ring's reader); the loop
runs a real ``SimulatedWorker`` in a thread, as a worker actor does.
"""
from __future__ import annotations

import threading

import msgpack
import pytest

from kvmanager import FullAttention, SlidingWindow
from workers.protocol import RequestError, ScheduledChunk, StepInput
from workers.runtime.step_loop import ACK, ERROR, JOIN, OUTPUT, STEP, STEP_ACK, StepLoop, frame, load_error, unframe
from workers.shm_channel import ShmBroadcast, ShmReader, ShmSegment
from workers.sim.simulated import SimulatedWorker
from workers.wire import decode_output, encode_step

HYBRID = [FullAttention(4), SlidingWindow(4, window=8)]


class CountingWorker(SimulatedWorker):
    """The simulated worker, counting how often it checks a step against its mirrors (``_apply`` is where
    both ``check`` and ``execute`` validate)."""

    applied = 0

    def _apply(self, step, undo):
        self.applied += 1
        return super()._apply(step, undo)


@pytest.fixture
def paused_loop():
    """The loop, its thread started by ``start()``: what is sent before waits in the ring, as a step the
    engine wrote while the worker was busy."""
    worker = CountingWorker(HYBRID, 64, vocab_size=1000, seed=1)
    steps = ShmBroadcast(1, spin_s=0.0, poll_s=0.2)
    replies = ShmSegment(1)
    reader = ShmReader(replies.handle, 0, spin_s=0.0, poll_s=0.2)
    step_loop = StepLoop(worker, "w0", steps.handle, 0, replies=replies.handle)
    thread = threading.Thread(target=step_loop.run, daemon=True)

    def send(kind, step):
        steps.send(frame(kind, step.step_id, encode_step(step)))

    def answer():
        kind, seq, body = unframe(reader.recv(timeout=10))
        return kind, seq, bytes(body)

    yield worker, send, answer, thread.start
    steps.close()
    if thread.ident is not None:              # started
        thread.join(10)
        assert not thread.is_alive()
    reader.close()
    replies.close()


@pytest.fixture
def loop(paused_loop):
    worker, send, answer, start = paused_loop
    start()
    return worker, send, answer


def prefill(step_id: int, rid: str = "a", blocks=((1, 2), (3, 4))) -> StepInput:
    return StepInput(step_id, [ScheduledChunk(rid, list(range(1, 8)), 0, [list(b) for b in blocks])])


def test_a_step_with_ack_is_acknowledged_then_answered_and_checked_once(loop):
    worker, send, answer = loop
    send(STEP_ACK, prefill(5))
    assert answer()[:2] == (ACK, 5)
    kind, seq, body = answer()
    assert (kind, seq) == (OUTPUT, 5)
    assert decode_output(body).sampled == {"a": worker.sample(prefill(5).chunks[0])}
    assert worker.applied == 1                      # checked once: not checked, then checked again to run
    assert worker.block_table("a") == [[1, 2], [3, 4]]
    send(STEP, StepInput(6, [ScheduledChunk("a", [9], 7, [[], []])]))
    assert answer()[:2] == (OUTPUT, 6)              # a step without ACK gets its output alone
    assert worker.applied == 2


def test_a_refused_step_with_ack_gets_its_error_no_ack_and_changes_nothing(loop):
    worker, send, answer = loop
    send(STEP_ACK, prefill(1))
    assert [answer()[0] for _ in range(2)] == [ACK, OUTPUT]
    # "a" continues at position 3, but its last step computed 0..6; "b" is new and well formed
    bad = StepInput(2, [ScheduledChunk("b", [1, 2], 0, [[5], [6]]), ScheduledChunk("a", [9], 3, [[], []])])
    send(STEP_ACK, bad)
    kind, seq, body = answer()
    assert (kind, seq) == (ERROR, 2)
    error = load_error(body)
    assert isinstance(error, RequestError) and error.request_id == "a"
    assert worker.request_ids == ["a"] and worker.block_table("a") == [[1, 2], [3, 4]]   # "b" rolled back
    send(STEP_ACK, StepInput(3, [ScheduledChunk("a", [9], 7, [[], []])]))
    assert [answer()[:2] for _ in range(2)] == [(ACK, 3), (OUTPUT, 3)]   # the worker goes on


def test_a_joiner_behind_a_step_runs_in_its_batch_and_is_answered_apart(paused_loop):
    worker, send, answer, start = paused_loop
    send(STEP_ACK, prefill(5))
    send(JOIN, prefill(6, "b", blocks=((5, 6), (7, 8))))
    start()
    kind, seq, body = answer()
    assert (kind, seq, msgpack.unpackb(body)) == (ACK, 5, [6])          # the ack names the joiner it took
    answers = {seq: decode_output(body) for kind, seq, body in (answer(), answer())}
    assert answers[6].sampled == {"b": worker.sample(prefill(6, "b", ((5, 6), (7, 8))).chunks[0])}
    assert answers[5].sampled == {"a": worker.sample(prefill(5).chunks[0])}
    assert worker.applied == 2                      # one batch: checked with the step, then run
    assert worker.block_table("b") == [[5, 6], [7, 8]] and worker.block_table("a") == [[1, 2], [3, 4]]


def test_a_joiner_read_after_its_step_was_taken_is_dropped_unanswered(loop):
    worker, send, answer = loop
    send(STEP_ACK, prefill(5))
    assert [answer()[:2] for _ in range(2)] == [(ACK, 5), (OUTPUT, 5)]
    send(JOIN, prefill(6, "b", blocks=((5, 6), (7, 8))))
    send(STEP_ACK, StepInput(7, [ScheduledChunk("a", [9], 7, [[], []])]))
    kind, seq, body = answer()
    assert (kind, seq, msgpack.unpackb(body)) == (ACK, 7, [])
    assert answer()[:2] == (OUTPUT, 7)              # nothing for 6: the engine withdrew it at the ack of 5
    assert worker.request_ids == ["a"]


def test_a_joiner_that_fails_the_checks_with_its_step_is_dropped_and_the_step_runs_alone(paused_loop):
    worker, send, answer, start = paused_loop
    send(STEP_ACK, prefill(5))
    send(JOIN, prefill(6, "a", blocks=((5, 6), (7, 8))))     # "a" twice in one batch
    start()
    kind, seq, body = answer()
    assert (kind, seq, msgpack.unpackb(body)) == (ACK, 5, [])
    kind, seq, body = answer()
    assert (kind, seq) == (OUTPUT, 5) and decode_output(body).sampled == {"a": worker.sample(prefill(5).chunks[0])}
    assert worker.block_table("a") == [[1, 2], [3, 4]]
