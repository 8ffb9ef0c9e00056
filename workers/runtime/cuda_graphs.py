"""Decode-only steps replayed from CUDA graphs, one per (batch size, table width) bucket.

Why: eagerly, a decode step launches some forty kernels per layer from Python; at small batch the GPU
finishes each one before the next is launched, so the step costs the host's launch time, not the GPU's.
A graph replays them all in one call.

What a graph holds: from the step's packed device buffer, read at the offsets of a decode layout padded to
the bucket (``workers.runtime.step_inputs``), the unit tables (the gather through the members), the slot
mapping, and the whole forward, embedding to LM head, every row's logits. Eagerly around it: before, the
upload, the compositions and the fed tokens (all into buffers the graph reads); after, the rows whose
logits are kept, and sampling. Padding rows write to and read only the null block.

Buckets: batch sizes ``BATCH_SIZES`` (a batch is padded up to the next; larger ones run eagerly), table
widths powers of two from ``MIN_WIDTH`` blocks. A bucket is captured on first use, or ahead of time with
``capture`` (largest first: all share one memory pool). A capture that fails is recorded in
``failures`` and its bucket runs eagerly from then on. Without CUDA (``capture=False``) the padded batch
runs eagerly: the padding and bucketing are then what the tests check.
"""
from __future__ import annotations

import logging
from collections.abc import Callable

import torch

log = logging.getLogger("swakv.worker")

BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256)
MIN_WIDTH = 16
MAX_WIDTH = 1 << 14


def bucket_batch(num_seqs: int, sizes=BATCH_SIZES) -> int | None:
    """The smallest batch size at least ``num_seqs``; None when it is larger than every bucket."""
    for size in sizes:
        if size >= num_seqs:
            return size
    return None


def bucket_width(width: int) -> int:
    """Table width of a bucket: the next power of two, at least ``MIN_WIDTH``."""
    return max(MIN_WIDTH, 1 << max(width - 1, 0).bit_length())


class DecodeGraphs:
    """``run(inputs)`` computes every row's logits from a padded decode layout; this replays it from graphs.

    ``pad_inputs(batch, width)`` uploads a batch of padding rows and returns its views (what a capture
    runs on); ``generation()`` tells when the device buffer moved, which invalidates every graph."""

    def __init__(self, run: Callable, pad_inputs: Callable, generation: Callable[[], int], *,
                 sizes=BATCH_SIZES, capture: bool = True):
        if not sizes or list(sizes) != sorted(set(sizes)) or sizes[0] < 1:
            raise ValueError(f"graph batch sizes must be increasing positive integers, got {sizes!r}")
        self.run, self.pad_inputs, self.generation = run, pad_inputs, generation
        self.sizes = tuple(sizes)
        self.capture_enabled = capture
        self.graphs: dict[tuple[int, int], tuple] = {}
        self.failures: dict[tuple[int, int], str] = {}
        self.runs = 0                      # padded decode steps, replayed or (no graph) run eagerly
        self.replays = 0                   # of which replayed from a graph
        self._pool = None
        self._generation = None

    def key(self, num_seqs: int, num_tokens: int, width: int) -> tuple[int, int] | None:
        """The bucket of a step, or None when it runs eagerly (not decode-only, or too large)."""
        if num_seqs == 0 or num_tokens != num_seqs or width > MAX_WIDTH:
            return None
        batch = bucket_batch(num_seqs, self.sizes)
        return None if batch is None else (batch, bucket_width(width))

    def prepare(self, key: tuple[int, int]) -> None:
        """Capture ``key``'s graph if needed: before the step is packed, since a capture runs on padding."""
        if not self.capture_enabled or key in self.failures:
            return
        if self._generation != self.generation():
            self.graphs.clear()            # captured against a device buffer that is gone
            self._generation = self.generation()
        if key not in self.graphs:
            self._capture(key)

    def replay(self, key: tuple[int, int], inputs) -> torch.Tensor:
        """Every row's logits for the packed (padded) step ``inputs``."""
        self.runs += 1
        entry = self.graphs.get(key)
        if entry is not None and self._generation != self.generation():   # this step's packing moved the buffer
            self.graphs.clear()
            entry = None
        if entry is None:
            return self.run(inputs)        # no CUDA, or the capture failed: the same padded batch, eagerly
        graph, out = entry
        graph.replay()
        self.replays += 1
        return out

    def capture(self, sizes=None, width: int = MIN_WIDTH) -> None:
        """Capture ahead of time, largest first (they share the memory pool)."""
        batches = {bucket_batch(b, self.sizes) for b in (sizes or self.sizes)} - {None}
        for batch in sorted(batches, reverse=True):
            self.prepare((batch, bucket_width(width)))

    def _capture(self, key: tuple[int, int]) -> None:
        batch, width = key
        try:
            inputs = self.pad_inputs(batch, width)
            if self._generation != self.generation():   # the padding upload grew the buffer
                self.graphs.clear()
                self._generation = self.generation()
            torch.cuda.synchronize()
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):             # compile the kernels, settle the allocator
                    self.run(inputs)
            torch.cuda.current_stream().wait_stream(side)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                out = self.run(inputs)
            self._pool = graph.pool()
            self.graphs[key] = (graph, out)
        except Exception as exc:  # noqa: BLE001 - recorded; the bucket runs eagerly
            self.failures[key] = f"{type(exc).__name__}: {exc}"
            log.warning("CUDA graph capture failed for batch %d, width %d; running it eagerly: %s",
                        batch, width, self.failures[key])
            torch.cuda.synchronize()
