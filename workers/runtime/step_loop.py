"""A worker's step loop over shared-memory rings: how same-node workers take steps without Ray in the path.

The engine writes each encoded step once to one ring that every worker reads (``workers.shm_channel``:
readers sleep while idle, so an idle server burns no core). Each worker runs this loop in a thread:
read a step; on a later pipeline stage, read the earlier stage's hidden states from its link ring;
run the step; then rank 0 of the stage writes the hidden states to the next stage's link, or, on the
last stage, the encoded ``StepOutput`` to the reply ring the engine reads. Tensor-parallel ranks read
the same rings and meet in their collectives, as before.

Errors travel the same way, in order: a step a worker refuses (``RequestError``, raised before anything
changed) or fails goes down the links as the exception itself, the later stages skip the step, and the
last stage's rank 0 replies with it; the engine raises it, so it keeps its type and request id. A step
that asks for an acknowledgement (``ACK``: the engine's ``submit``, which must know the workers took the
step before it schedules the next) is acknowledged by the worker's ``execute`` once its checks passed
(``on_checked``), so a step is checked once, not checked and then run.

Late joiners (``JOIN``): a step the engine wrote while the step before it (a ``STEP_ACK``) waited in the ring,
holding the first chunks of requests that arrived meanwhile. A worker that finds it in the ring when it takes
that step runs both as one step (their chunks in one batch) and says so in the acknowledgement (its body:
the sequence numbers joined), then answers each with its own rows. One found later is dropped unread: the
engine learned from the acknowledgement that it did not join, and schedules its requests again. The
tensor-parallel ranks of a stage read the ring each at its own time, so one may find a joiner another
missed: rank 0, the one that acknowledges, decides, and tells the others how many it found on a ring of
their own (``decisions``, one small frame per step that may take joiners); a rank that found fewer reads
the rest from the step ring (every reader sees the same frames in the same order, and the engine writes
the next step only after the ack), one that found more drops them. Rank 0 never waits for the others, so
the ack is as early as with one worker. Pipeline stages take no joiners (the engine's choice).

Frames: a 9-byte header (kind, the engine's sequence number of the step) then the body. Plain Python,
no Ray: ``cluster.ray.worker_actor`` runs it in a worker actor.
"""
from __future__ import annotations

import dataclasses
import logging
import pickle
import struct
import time

import msgpack

from workers.protocol import StepInput, StepOutput
from workers.wire import decode_step, encode_output
from workers.shm_channel import ChannelClosed, ChannelError, ChannelHandle, ShmBroadcast, ShmReader

log = logging.getLogger("swakv.worker")

HEADER = struct.Struct("<BQ")
STEP, STEP_ACK, HIDDEN, ERROR, ACK, OUTPUT, JOIN, JOINED = range(1, 9)   # frame kinds
SPIN_S = 0.0        # spinning before sleeping does not pay when workers share cores (docs/performance.md)
POLL_S = 1.0        # a sleeping worker checks this often that the engine (or the stage before) is alive


def frame(kind: int, seq: int, body: bytes = b"") -> bytes:
    return HEADER.pack(kind, seq) + body


def unframe(message: bytes) -> tuple[int, int, memoryview]:
    kind, seq = HEADER.unpack_from(message)
    return kind, seq, memoryview(message)[HEADER.size:]


def dump_error(exc: BaseException, where: str) -> bytes:
    """The exception itself (``RequestError`` pickles as itself), else a RuntimeError saying what it was."""
    exc.add_note(f"raised by {where}")
    try:
        return pickle.dumps(exc)
    except Exception:  # noqa: BLE001 - an exception that does not pickle: its text does
        return pickle.dumps(RuntimeError(f"{type(exc).__name__}: {exc} (raised by {where})"))


def load_error(body) -> BaseException:
    try:
        exc = pickle.loads(body)
    except Exception as bad:  # noqa: BLE001
        return RuntimeError(f"a worker's error could not be read: {bad!r}")
    return exc if isinstance(exc, BaseException) else RuntimeError(f"a worker sent {exc!r} as its error")


class StepLoop:
    """Worker ``index`` of the engine's step ring. ``upstream``: the link ring from the stage before
    (read as reader ``rank``); ``downstream``: the link to the next stage, ``replies``: the engine's reply
    ring (written by rank 0 only); ``decisions``: with tensor-parallel ranks, where rank 0 says how many
    joiners each step runs (it writes, rank ``r`` reads as reader ``r - 1``). Attach in the constructor, run
    ``run`` in a thread."""

    def __init__(self, worker, name: str, steps: ChannelHandle, index: int, *, rank: int = 0,
                 upstream: ChannelHandle | None = None, downstream: ChannelHandle | None = None,
                 replies: ChannelHandle | None = None, decisions: ChannelHandle | None = None):
        self.worker, self.name = worker, name
        self.ends: list = []
        try:
            self.steps = self._end(ShmReader(steps, index, spin_s=SPIN_S, poll_s=POLL_S))
            self.upstream = upstream and self._end(ShmReader(upstream, rank, spin_s=SPIN_S, poll_s=POLL_S))
            self.downstream = downstream and self._end(ShmBroadcast.attach(downstream, spin_s=SPIN_S, poll_s=POLL_S))
            self.replies = replies and self._end(ShmBroadcast.attach(replies, spin_s=SPIN_S, poll_s=POLL_S))
            self.decisions = decisions and self._end(
                ShmBroadcast.attach(decisions, spin_s=SPIN_S, poll_s=POLL_S) if rank == 0
                else ShmReader(decisions, rank - 1, spin_s=SPIN_S, poll_s=POLL_S))
        except BaseException:
            self.close()
            raise

    def _end(self, end):
        self.ends.append(end)
        return end

    def run(self) -> None:
        """Steps until the engine closes the ring (or dies, or a peer does: the engine sees it too)."""
        try:
            ahead = None                           # a message read while looking for joiners
            while True:
                message, ahead = ahead or self.steps.recv(), None
                if message[0] == JOIN:
                    continue                       # its step was taken without it: dropped (module doc)
                joiners = []
                if message[0] == STEP_ACK:
                    try:
                        while (later := self.steps.try_recv()) is not None:
                            if later[0] != JOIN:
                                ahead = later
                                break
                            joiners.append(later)
                    except ChannelClosed:          # the step was sent before the close: it still runs
                        pass
                self.step(message, joiners)
        except ChannelClosed:
            pass
        except ChannelError as exc:
            log.warning("%s: step loop ends: %s", self.name, exc)
        finally:
            self.close()

    def step(self, message: bytes, joiners: list[bytes] = ()) -> None:
        """Run one step (with the ``joiners`` found behind it, if they pass the checks with it)."""
        started = time.perf_counter()
        kind, seq, body = unframe(message)
        failed, hidden = None, None               # failed: the pickled error to pass on
        if self.upstream is not None:
            link_kind, link_seq, data = unframe(self.upstream.recv())
            if link_seq != seq:
                raise ChannelError(f"{self.name}: step {seq} met hidden states of step {link_seq}")
            if link_kind == ERROR:
                failed = bytes(data)               # an earlier stage refused or failed it: skip, pass it on
            else:
                hidden = self._hidden(data)
        if failed is None:
            try:
                step = decode_step(body)
                if kind == STEP_ACK and self.decisions is not None:   # every rank, at every such step
                    joiners = self._decided(seq, joiners)
                step, joined = self._join(step, joiners)
                ack = None
                if kind == STEP_ACK and self.replies is not None:   # once its checks pass; a refusal
                    ack = lambda: self.replies.send(frame(ACK, seq, msgpack.packb([s for s, _, _ in joined])))
                out = self.worker.execute(step, hidden, on_checked=ack)   # before it: the engine's submit raises it
            except Exception as exc:  # noqa: BLE001 - every failure goes to the engine, which decides
                failed = dump_error(exc, self.name)
        if failed is not None:
            for end in (self.downstream, self.replies):
                if end is not None:
                    end.send(frame(ERROR, seq, failed))
        elif self.downstream is not None:
            self.downstream.send(frame(HIDDEN, seq, b"" if isinstance(out, StepOutput) else _dump_tensor(out)))
        elif self.replies is not None:
            out.worker_time_s = time.perf_counter() - started   # what the engine predicts the next one from
            for join_seq, step_id, rows in joined:
                self.replies.send(frame(OUTPUT, join_seq, encode_output(_take_rows(out, rows, step_id))))
            self.replies.send(frame(OUTPUT, seq, encode_output(out)))

    def _decided(self, seq: int, joiners: list[bytes]) -> list[bytes]:
        """The joiners rank 0 runs with step ``seq``: rank 0 says how many it found; another rank drops what it
        found beyond them, or reads the rest from the step ring, where they come next (its search stopped at
        an empty ring, so it read nothing past them)."""
        if isinstance(self.decisions, ShmBroadcast):
            self.decisions.send(frame(JOINED, seq, msgpack.packb(len(joiners))))
            return joiners
        kind, decided, body = unframe(self.decisions.recv())
        if (kind, decided) != (JOINED, seq):
            raise ChannelError(f"{self.name}: rank 0 decided step {decided} (kind {kind}) for step {seq}")
        wanted = msgpack.unpackb(body)
        while len(joiners) < wanted:
            message = self.steps.recv()
            if message[0] != JOIN:
                raise ChannelError(f"{self.name}: rank 0 ran {wanted} joiners, the ring holds {len(joiners)}")
            joiners.append(message)
        return joiners[:wanted]

    def _join(self, step: StepInput, joiners: list[bytes]) -> tuple[StepInput, list[tuple[int, int, set[str]]]]:
        """``step`` with the joiners' chunks and compositions appended, if the worker's checks pass on that
        (else ``step`` alone: the joiners are dropped); and per joiner, its sequence number, step id and
        requests."""
        if not joiners or not hasattr(self.worker, "check"):
            return step, []
        merged, joined = step, []
        for message in joiners:
            _, join_seq, body = unframe(message)
            extra = decode_step(body)
            merged = dataclasses.replace(merged, chunks=merged.chunks + extra.chunks,
                                         compositions=merged.compositions + extra.compositions)
            joined.append((join_seq, extra.step_id, {c.request_id for c in extra.chunks}))
        try:
            self.worker.check(merged)
        except Exception:  # noqa: BLE001 - the step alone decides what the engine hears
            return step, []
        return merged, joined

    def _hidden(self, data):
        """An earlier stage's hidden states, on this worker's device; None from simulated stages."""
        if not len(data):
            return None
        tensor = pickle.loads(data)
        device = getattr(self.worker, "device", None)
        return tensor if device is None else tensor.to(device)

    def close(self) -> None:
        for end in self.ends:
            end.close()
        self.ends = []


def _take_rows(out: StepOutput, rows: set[str], step_id: int) -> StepOutput:
    """A joiner's answer: its requests' entries, moved out of the merged step's ``out``."""
    def take(d: dict) -> dict:
        return {rid: d.pop(rid) for rid in [r for r in d if r in rows]}
    return StepOutput(step_id, take(out.sampled), logprobs=take(out.logprobs), failed=take(out.failed),
                      prompt_logprobs=take(out.prompt_logprobs))


def _dump_tensor(tensor) -> bytes:
    return pickle.dumps(tensor.detach().cpu(), protocol=5)
