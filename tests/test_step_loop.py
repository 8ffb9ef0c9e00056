"""A worker's step loop over the rings, without Ray: a step that asks for an acknowledgement is acknowledged
once its checks pass and then runs, checked once; a refused one is answered with its error, no ACK, and
changes nothing on the worker. Late joiners found behind a step run in its batch and are answered apart;
one found later, or one that fails the checks with the step, is dropped. Tensor-parallel ranks that read the
ring at different times run the same batch: the joiners rank 0 found.

The engine's side is played by this process (the step ring's writer, the reply ring's reader); the loop
runs a real ``SimulatedWorker`` in a thread, as a worker actor does.
"""
from __future__ import annotations

import multiprocessing as mp
import threading
import time

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


def test_a_step_sent_just_before_the_ring_closes_still_runs():
    """The worker looks behind a step for joiners and finds the close there: the step was sent, so it runs."""
    worker = CountingWorker(HYBRID, 64, vocab_size=1000, seed=1)
    steps, replies = ShmBroadcast(1, spin_s=0.0, poll_s=0.2), ShmSegment(1)
    reader = ShmReader(replies.handle, 0, spin_s=0.0, poll_s=0.2)
    step_loop = StepLoop(worker, "w0", steps.handle, 0, replies=replies.handle)
    steps.send(frame(STEP_ACK, 5, encode_step(prefill(5))))
    steps.close()
    thread = threading.Thread(target=step_loop.run, daemon=True)
    thread.start()
    try:
        assert [unframe(reader.recv(timeout=10))[:2] for _ in range(2)] == [(ACK, 5), (OUTPUT, 5)]
        thread.join(10)
        assert not thread.is_alive() and worker.block_table("a") == [[1, 2], [3, 4]]
    finally:
        reader.close()
        replies.close()


def _tensor_parallel_rank(rank, steps, replies, decisions, go, out):
    """Rank ``rank`` of two on the same step ring; starts its loop once ``go`` is set and reports its mirrors
    when the ring closes."""
    worker = SimulatedWorker(HYBRID, 64, vocab_size=1000, seed=1)
    step_loop = StepLoop(worker, f"rank{rank}", steps, rank, rank=rank, replies=replies if rank == 0 else None,
                         decisions=decisions)
    go.wait(60)
    step_loop.run()
    out.put((rank, {rid: worker.block_table(rid) for rid in worker.request_ids}))


@pytest.mark.parametrize("first", [None, 0, 1], ids=["both-find-it", "rank0-takes-the-step-first",
                                                     "rank1-takes-the-step-first"])
def test_tensor_parallel_ranks_run_the_joiners_rank_0_found_whichever_rank_took_the_step_first(first):
    """A joiner written after one rank took the step but before the other did. Rank 0 found it: both ranks
    run it (rank 1 reads it from the ring after the step); rank 0 did not: neither runs it, and the ack
    names none. The ranks' batches must be the same: their collectives would mismatch. ``first``: the rank
    that takes the step before the joiner is written (None: neither, both find it)."""
    ctx = mp.get_context("spawn")
    steps, replies = ShmBroadcast(2, spin_s=0.0, poll_s=0.2), ShmSegment(1)
    decisions = ShmSegment(1, slots=64, slot_bytes=64)
    reader = ShmReader(replies.handle, 0, spin_s=0.0, poll_s=0.2)
    go, out = [ctx.Event(), ctx.Event()], ctx.Queue()
    ranks = [ctx.Process(target=_tensor_parallel_rank, daemon=True,
                         args=(r, steps.handle, replies.handle, decisions.handle, go[r], out)) for r in range(2)]
    for process in ranks:
        process.start()

    def send(kind, step):
        steps.send(frame(kind, step.step_id, encode_step(step)))

    def answer():
        kind, seq, body = unframe(reader.recv(timeout=60))
        return kind, seq, bytes(body)
    try:
        deadline = time.monotonic() + 120
        while steps.readers_unattached() and time.monotonic() < deadline:   # both ranks are on the ring
            time.sleep(0.05)
        send(STEP_ACK, prefill(5))
        if first == 0:
            go[0].set()
            kind, seq, body = answer()
            assert (kind, seq, msgpack.unpackb(body)) == (ACK, 5, [])   # it took step 5, nothing behind it
            assert answer()[:2] == (OUTPUT, 5)
        elif first == 1:
            go[1].set()
            while steps.unread(1) and time.monotonic() < deadline:        # it took step 5 and waits for rank
                time.sleep(0.01)                                           # 0's word: nothing behind it yet
            time.sleep(0.2)
        send(JOIN, prefill(6, "b", blocks=((5, 6), (7, 8))))
        for event in go:
            event.set()
        if first != 0:
            kind, seq, body = answer()
            assert (kind, seq, msgpack.unpackb(body)) == (ACK, 5, [6])
            assert sorted(answer()[:2] for _ in range(2)) == [(OUTPUT, 5), (OUTPUT, 6)]
            expected = {"a": [[1, 2], [3, 4]], "b": [[5, 6], [7, 8]]}
        else:
            send(STEP_ACK, StepInput(7, [ScheduledChunk("a", [9], 7, [[], []])]))
            kind, seq, body = answer()
            assert (kind, seq, msgpack.unpackb(body)) == (ACK, 7, [])
            assert answer()[:2] == (OUTPUT, 7)            # nothing for 6 from either rank
            expected = {"a": [[1, 2], [3, 4]]}
        steps.close()
        mirrors = dict(out.get(timeout=60) for _ in range(2))
        assert mirrors == {0: expected, 1: expected}
    finally:
        steps.close()
        for process in ranks:
            process.join(30)
            if process.is_alive():
                process.kill()
        reader.close()
        replies.close()
        decisions.close()
