"""A worker's share of the host KV tier: its layers' pages for ``num_units`` host units, and the copies.

Same layout as the device pool (``kvmanager/planning.py``): one K/V tensor pair per slot, a unit is the
slot tensors' row at one index, and a unit belongs to one (group, member) at a time. So copying a block
of group ``g`` is copying its units' rows in every slot: exactly this worker's layers of ``g``, nothing
more. A device block's units are its composite's (the compositions seen so far, kept here on the host so
that no copy reads the device to find them); unit ``u`` of the block goes to host unit ``u`` of the copy.
Consecutive units on both sides are copied as one run (a composite of fresh units is usually one run).

On CUDA the host tensors are pinned and the copies run on a side stream: it first waits for everything
queued on the compute stream so far (a store reads what earlier steps wrote; a load's target may be a
block an earlier step still reads: vLLM PR #47653's garbled output), and the compute of every later step
waits for it (``before_compute``). The step's own compute need not wait: it reads neither a store's
source (pinned by the manager) nor a load's target (its request is not computed until the load is
reported). On CPU everything runs in order on the calling thread.

A load from host units no store of this worker has filled since it started (its host memory was lost
with a restart the engine did not see) is not run and is reported failed; the request recomputes.
"""
from __future__ import annotations

import torch


class HostKVPool:
    def __init__(self, device_pairs: list[tuple[torch.Tensor, torch.Tensor]], num_units: int, widths: tuple[int, ...]):
        device = device_pairs[0][0].device
        cuda = device.type == "cuda"
        self.device_pairs = device_pairs
        self.num_units = num_units
        self.widths = widths
        self.pairs = [tuple(torch.zeros((num_units, *t.shape[1:]), dtype=t.dtype, pin_memory=cuda) for t in pair)
                      for pair in device_pairs]
        self.filled = bytearray(num_units)            # 1: a store of this worker wrote the unit
        self.composites: dict[int, dict[int, tuple[int, ...]]] = {g: {} for g, k in enumerate(widths) if k > 1}
        self.stream = torch.cuda.Stream(device) if cuda else None
        self._copied = None                           # the side stream's event after the latest copies

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for pair in self.pairs for t in pair)

    def compose(self, compositions: dict[int, dict[int, list[int]]]) -> None:
        """The step's compositions (``check_compositions``' result), applied before its copies."""
        for g, named in compositions.items():
            self.composites[g].update((block, tuple(units)) for block, units in named.items())

    def unknown_blocks(self, stores, loads, compositions: dict) -> list[tuple[int, int]]:
        """(group, block) of the copies whose wide-group device block no composition has named."""
        out = []
        for g, block in [(g, b) for g, b, _ in stores] + [(g, b) for g, _, b in loads]:
            if self.widths[g] > 1 and block not in self.composites[g] and block not in compositions.get(g, {}):
                out.append((g, block))
        return out

    def _units(self, g: int, block: int) -> tuple[int, ...]:
        return self.composites[g][block] if self.widths[g] > 1 else (block,)

    def run(self, stores, loads) -> tuple[list[int], list[int]]:
        """Queue the step's copies; returns the device block ids (done, failed)."""
        done, failed = [], []
        to_host, to_device = [], []
        for g, block, host in stores:
            to_host += zip(self._units(g, block), host)
            done.append(block)
        for g, host, block in loads:
            if all(self.filled[u] for u in host):
                to_device += zip(host, self._units(g, block))
                done.append(block)
            else:
                failed.append(block)
        if not to_host and not to_device:
            return done, failed
        if self.stream is None:
            self._copy(to_host, to_device)
        else:
            self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))
            with torch.cuda.stream(self.stream):
                self._copy(to_host, to_device)
            self._copied = self.stream.record_event()
        for _, u in to_host:
            self.filled[u] = 1
        return done, failed

    def _copy(self, to_host: list[tuple[int, int]], to_device: list[tuple[int, int]]) -> None:
        cuda = self.stream is not None
        for src_pairs, dst_pairs, pairs in ((self.device_pairs, self.pairs, to_host),
                                            (self.pairs, self.device_pairs, to_device)):
            for src, dst, n in _runs(pairs):
                for src_pair, dst_pair in zip(src_pairs, dst_pairs):
                    for s, d in zip(src_pair, dst_pair):
                        d[dst:dst + n].copy_(s[src:src + n], non_blocking=cuda)

    def before_compute(self) -> None:
        """The compute stream waits for the copies queued by earlier steps (CUDA; nothing on CPU)."""
        if self._copied is not None:
            torch.cuda.current_stream(self.stream.device).wait_event(self._copied)
            self._copied = None


def _runs(pairs: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """(source, destination) unit pairs, sorted, as (source start, destination start, count) runs."""
    out: list[list[int]] = []
    for s, d in sorted(pairs):
        if out and s == out[-1][0] + out[-1][2] and d == out[-1][1] + out[-1][2]:
            out[-1][2] += 1
        else:
            out.append([s, d, 1])
    return [tuple(r) for r in out]
