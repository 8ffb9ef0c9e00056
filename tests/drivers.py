"""Small drivers of the real manager and engine that several test files share (no logic under test here)."""
from __future__ import annotations

from workers.simulated import SimulatedWorker


def ids(hit):
    """A hit's block ids, per group."""
    return [[b.block_id for b in g] for g in hit]


def run_step(mgr, req, n):
    """Allocate ``n`` tokens for ``req`` (which must fit) and mark them computed, as the scheduler does."""
    new = mgr.allocate_slots(req, n)
    assert new is not None
    req.num_computed_tokens += n
    return new


def decode(mgr, req, token):
    """One decode step: the sampled ``token`` appended, then its slot allocated."""
    req.append_output_token_ids([token])
    return run_step(mgr, req, 1)


class SimulatedExecutor:
    """The executor interface over one simulated worker, which checks every step's block tables strictly
    (what ``LocalExecutor`` does for a preset); ``restart`` is a worker failure that loses its cache."""

    def __init__(self, specs, num_blocks, widths, vocab_size):
        self.specs, self.num_blocks, self.widths, self.vocab_size = specs, num_blocks, widths, vocab_size
        self.restart()

    def execute(self, step):
        return self.worker.execute(step)

    def restart(self):
        self.worker = SimulatedWorker(self.specs, self.num_blocks, vocab_size=self.vocab_size, widths=self.widths)
