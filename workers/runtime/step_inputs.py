"""A step's integer inputs, packed on the host with vectorised ops into one buffer and uploaded in one copy.

Layout (int32) for ``T`` tokens, ``S`` sequences, table width ``W`` and ``G`` KV-cache groups::

    input ids [T] | positions [T] | sequence of each token [T] | seq lens [S] | query lens [S]
    | table of group g [S, W], for each g                       <- a decode graph reads up to here
    | rows whose logits are kept [L] | fed tokens: index in the step [F], row of the previous draws [F]
    | per group wider than one unit: composite ids [C_g], their units [C_g, k_g]

The head depends only on ``(T, S, W, G)``, so a decode step padded to a captured batch size lands at the
offsets its CUDA graph was captured with, in the same device buffer. On CUDA the host side is two pinned
buffers used in turn (one may still be feeding the previous step's copy, queued behind the running
step), and the copy is asynchronous: packing never waits for the device. On CPU the buffer is used in
place. Padding rows (``pad_to``) are sequences of one token at position 0 whose tables are all null
block: they write their (ignored) K/V into the null block and read only it.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np
import torch

from workers.runtime.mirrors import BlockTableMirrors

MIN_CAPACITY = 1 << 16           # int32 entries (256 KiB) a buffer starts with; it doubles when short


@dataclass(frozen=True)
class Layout:
    num_tokens: int
    num_seqs: int
    width: int
    num_groups: int
    num_logits: int = 0
    num_fed: int = 0
    compositions: tuple = ()     # (group, count, width) per group with compositions this step

    @property
    def tables(self) -> int:
        return 3 * self.num_tokens + 2 * self.num_seqs

    @property
    def head(self) -> int:
        """Entries a decode graph reads."""
        return self.tables + self.num_groups * self.num_seqs * self.width

    @property
    def size(self) -> int:
        return self.head + self.num_logits + 2 * self.num_fed + sum(c * (1 + k) for _, c, k in self.compositions)


@dataclass
class Inputs:
    """Views of one packed step (on the device): the model's inputs and what is applied before it runs."""

    input_ids: torch.Tensor          # [T] int32
    positions: torch.Tensor          # [T] int32
    seq_of_token: torch.Tensor       # [T] int32
    seq_lens: torch.Tensor           # [S] int32
    query_lens: torch.Tensor         # [S] int32
    tables: list[torch.Tensor]       # per group [S, W] int32, composite ids
    logits_indices: torch.Tensor | None = None     # [L] int32
    fed_at: torch.Tensor | None = None             # [F] int32: index in input_ids
    fed_from: torch.Tensor | None = None           # [F] int32: row of the previous step's draws
    compositions: dict = field(default_factory=dict)   # group -> (ids [C], units [C, k])
    num_real_seqs: int = 0           # sequences before the padding rows


def views(buffer: torch.Tensor, layout: Layout) -> Inputs:
    """The inputs of ``layout`` in ``buffer`` (no copy)."""
    T, S, W = layout.num_tokens, layout.num_seqs, layout.width
    at = itertools.accumulate([0, T, T, T, S, S] + [S * W] * layout.num_groups)
    o = list(at)
    tables = [buffer[o[5 + g]:o[6 + g]].view(S, W) for g in range(layout.num_groups)]
    out = Inputs(buffer[o[0]:o[1]], buffer[o[1]:o[2]], buffer[o[2]:o[3]], buffer[o[3]:o[4]], buffer[o[4]:o[5]],
                 tables, num_real_seqs=S)
    p = layout.head
    out.logits_indices = buffer[p:p + layout.num_logits]
    p += layout.num_logits
    out.fed_at, out.fed_from = buffer[p:p + layout.num_fed], buffer[p + layout.num_fed:p + 2 * layout.num_fed]
    p += 2 * layout.num_fed
    for g, count, k in layout.compositions:
        out.compositions[g] = (buffer[p:p + count], buffer[p + count:p + count * (1 + k)].view(count, k))
        p += count * (1 + k)
    return out


class StepInputs:
    """Packs steps into a host buffer and uploads each in one copy to a device buffer of stable address."""

    def __init__(self, device: torch.device, block_size: int, num_groups: int):
        self.device, self.block_size, self.num_groups = torch.device(device), block_size, num_groups
        self.on_host = self.device.type == "cpu"
        self.pinned = self.device.type == "cuda"
        self.device_buffer: torch.Tensor | None = None
        self.generation = 0              # bumped when the device buffer is replaced (graphs must re-capture)
        self._host: list[torch.Tensor | None] = [None, None]
        self._events: list = [None, None]
        self._turn = 0

    # -- buffers ----------------------------------------------------------------------------------
    def reserve(self, size: int) -> None:
        """A device buffer of at least ``size`` entries (replacing it bumps ``generation``)."""
        if self.device_buffer is not None and self.device_buffer.numel() >= size:
            return
        capacity = max(MIN_CAPACITY, 1 << (size - 1).bit_length())
        if self.device_buffer is not None and self.pinned:
            torch.cuda.synchronize(self.device)      # nothing queued may still read the old one
        self.device_buffer = torch.zeros(capacity, dtype=torch.int32, device=self.device)
        self.generation += 1

    def _host_buffer(self, size: int) -> torch.Tensor:
        if self.on_host:
            self.reserve(size)
            return self.device_buffer
        self._turn ^= 1
        turn = self._turn
        if self._events[turn] is not None:
            self._events[turn].synchronize()      # its previous copy is done (it is two steps old)
        host = self._host[turn]
        if host is None or host.numel() < size:
            capacity = max(MIN_CAPACITY, 1 << (size - 1).bit_length())
            host = self._host[turn] = torch.zeros(capacity, dtype=torch.int32, pin_memory=self.pinned)
        return host

    def _upload(self, host: torch.Tensor, size: int) -> None:
        if self.on_host:
            return
        self.reserve(size)
        self.device_buffer[:size].copy_(host[:size], non_blocking=self.pinned)
        if self.pinned:
            event = self._events[self._turn] = torch.cuda.Event()
            event.record()

    # -- packing --------------------------------------------------------------------------------------
    def pack(self, chunks, rows: np.ndarray, mirrors: BlockTableMirrors, *, fed=((), ()), compositions=None,
             pad_to: int | None = None, width: int | None = None) -> Inputs:
        """Pack the chunks (their mirror ``rows``), the fed tokens (indices in the step, rows of the previous
        draws) and the compositions (group -> {id: units}); ``pad_to``/``width``: a padded decode batch."""
        S = len(chunks)
        q = np.fromiter((len(c.token_ids) for c in chunks), dtype=np.int64, count=S)
        starts = np.fromiter((c.start_pos for c in chunks), dtype=np.int64, count=S)
        T = int(q.sum())
        seq_lens = starts + q
        if T == S:
            seq_of_token, positions = np.arange(S), starts
        else:
            seq_of_token = np.repeat(np.arange(S), q)
            first_token = np.cumsum(q) - q
            positions = np.arange(T) - first_token[seq_of_token] + starts[seq_of_token]
        bs = self.block_size
        need = int(((seq_lens + bs - 1) // bs).max()) if S else 0
        W = max(need, width or 0)
        sample = np.fromiter((c.sample for c in chunks), dtype=bool, count=S)
        logits_rows = (np.cumsum(q) - 1)[sample]
        if pad_to is not None and (T != S or S > pad_to):
            raise ValueError(f"only a decode batch of at most {pad_to} sequences pads to {pad_to}, got {S} sequences "
                             f"of {T} tokens")
        Tp, Sp = (pad_to, pad_to) if pad_to is not None else (T, S)
        comps = [(g, len(c), len(next(iter(c.values())))) for g, c in sorted((compositions or {}).items()) if c]
        layout = Layout(Tp, Sp, W, self.num_groups, len(logits_rows), len(fed[0]), tuple(comps))
        host = self._host_buffer(layout.size)
        buf = host.numpy()
        o = 0
        ids = np.fromiter(itertools.chain.from_iterable(c.token_ids for c in chunks), dtype=np.int32, count=T)
        for values, n, pad in ((ids, Tp, 0), (positions, Tp, 0), (seq_of_token, Tp, None),
                               (seq_lens, Sp, 1), (q, Sp, 1)):
            buf[o:o + len(values)] = values
            if pad is None:
                buf[o + len(values):o + n] = np.arange(len(values), n)
            else:
                buf[o + len(values):o + n] = pad
            o += n
        for table in mirrors.gather(rows, W) if S else [np.zeros((0, W), np.int32)] * self.num_groups:
            region = buf[o:o + Sp * W].reshape(Sp, W)
            region[:S] = table
            region[S:] = 0
            o += Sp * W
        buf[o:o + len(logits_rows)] = logits_rows
        o += len(logits_rows)
        for values in fed:
            buf[o:o + len(values)] = values
            o += len(values)
        for g, count, k in comps:
            named = compositions[g]
            buf[o:o + count] = list(named)
            buf[o + count:o + count * (1 + k)] = np.array(list(named.values()), dtype=np.int32).reshape(-1)
            o += count * (1 + k)
        self._upload(host, layout.size)
        out = views(self.device_buffer, layout)
        out.num_real_seqs = S
        return out

    def padding_views(self, batch_size: int, width: int) -> Inputs:
        """A decode batch of padding rows only, packed and uploaded (for capturing a graph)."""
        layout = Layout(batch_size, batch_size, width, self.num_groups)
        host = self._host_buffer(layout.size)
        buf = host.numpy()
        n = batch_size
        buf[:layout.head] = 0
        buf[2 * n:3 * n] = np.arange(n)
        buf[3 * n:5 * n] = 1
        self._upload(host, layout.size)
        out = views(self.device_buffer, layout)
        out.num_real_seqs = 0
        return out
