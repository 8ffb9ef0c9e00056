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

Frames: a 9-byte header (kind, the engine's sequence number of the step) then the body. Plain Python,
no Ray: ``cluster.ray.worker_actor`` runs it in a worker actor.
"""
from __future__ import annotations

import logging
import pickle
import struct
import time

from workers.protocol import StepOutput
from workers.wire import decode_step, encode_output
from workers.shm_channel import ChannelClosed, ChannelError, ChannelHandle, ShmBroadcast, ShmReader

log = logging.getLogger("swakv.worker")

HEADER = struct.Struct("<BQ")
STEP, STEP_ACK, HIDDEN, ERROR, ACK, OUTPUT = range(1, 7)   # frame kinds
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
    ring (written by rank 0 only). Attach in the constructor, run ``run`` in a thread."""

    def __init__(self, worker, name: str, steps: ChannelHandle, index: int, *, rank: int = 0,
                 upstream: ChannelHandle | None = None, downstream: ChannelHandle | None = None,
                 replies: ChannelHandle | None = None):
        self.worker, self.name = worker, name
        self.ends: list = []
        try:
            self.steps = self._end(ShmReader(steps, index, spin_s=SPIN_S, poll_s=POLL_S))
            self.upstream = upstream and self._end(ShmReader(upstream, rank, spin_s=SPIN_S, poll_s=POLL_S))
            self.downstream = downstream and self._end(ShmBroadcast.attach(downstream, spin_s=SPIN_S, poll_s=POLL_S))
            self.replies = replies and self._end(ShmBroadcast.attach(replies, spin_s=SPIN_S, poll_s=POLL_S))
        except BaseException:
            self.close()
            raise

    def _end(self, end):
        self.ends.append(end)
        return end

    def run(self) -> None:
        """Steps until the engine closes the ring (or dies, or a peer does: the engine sees it too)."""
        try:
            while True:
                self.step(self.steps.recv())
        except ChannelClosed:
            pass
        except ChannelError as exc:
            log.warning("%s: step loop ends: %s", self.name, exc)
        finally:
            self.close()

    def step(self, message: bytes) -> None:
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
                ack = None
                if kind == STEP_ACK and self.replies is not None:   # once its checks pass; a refusal
                    ack = lambda: self.replies.send(frame(ACK, seq))   # before it: the engine's submit raises it
                out = self.worker.execute(step, hidden, on_checked=ack)
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
            self.replies.send(frame(OUTPUT, seq, encode_output(out)))

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


def _dump_tensor(tensor) -> bytes:
    return pickle.dumps(tensor.detach().cpu(), protocol=5)
