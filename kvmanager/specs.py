"""Attention kinds: each says which earlier tokens a position still needs, and everything follows.

One rule per kind, ``first_needed_token(n)``: with ``n`` tokens computed, the next token never reads KV
before that position. The drop rule frees blocks lying entirely before it; the hit rule accepts a
prefix of length ``h`` when every block from ``first_needed_token(h)`` up to ``h`` is cached.

A spec also answers what the layers around the manager would otherwise work out from its class: the
bounds an attention kernel takes (``kernel_bounds``), how plans and logs name it (``label``) and the
name KV-cache events give its groups (``event_kind``, vLLM's). Adding a kind is one class here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from .checks import check_int

NEVER = 1 << 62   # a token count no request reaches

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1, "fp8": 1,
               "int8": 1}
_BY_EVENT_KIND: dict[str, type] = {}


@dataclass(frozen=True)
class AttentionSpec:
    """What a KV-cache group needs to know of its layers: block size and the size of one layer's page."""

    block_size: int
    num_kv_heads: int = 8
    head_size: int = 128
    dtype: str = "bfloat16"

    kind = "abstract"               # swakv's name of the kind
    event_kind = "abstract"         # vLLM's name, which KV-cache events carry

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if "event_kind" in cls.__dict__:          # a kind of its own, not a variant of its parent's
            _BY_EVENT_KIND[cls.event_kind] = cls

    def __post_init__(self) -> None:
        for name in ("block_size", "num_kv_heads", "head_size"):
            check_int(f"{type(self).__name__}: {name}", getattr(self, name), 1)
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"{type(self).__name__}: unknown dtype {self.dtype!r}; known: {sorted(DTYPE_BYTES)}")

    @property
    def page_size_bytes(self) -> int:
        """Bytes of K and V for one block of one layer."""
        return 2 * self.block_size * self.num_kv_heads * self.head_size * DTYPE_BYTES[self.dtype]

    def first_needed_token(self, num_computed: int) -> int:
        """Earliest position the token at ``num_computed`` (and every later one) may attend to."""
        raise NotImplementedError

    def computed_to_reach(self, token: int) -> int:
        """Fewest computed tokens ``n`` with ``first_needed_token(n) >= token``: when a drop will next happen."""
        raise NotImplementedError

    def longest_hit(self, is_cached: Callable[[int], bool] | None, max_blocks: int,
                    first_miss: Callable[[int, int], int] | None = None) -> int:
        """Largest ``e <= max_blocks`` such that the blocks a hit of ``e`` blocks needs are all cached.

        Scans candidates from the right. A candidate ``e`` needs blocks ``[first, e)``; they are tested
        left to right, so a miss at block ``i`` rules out every candidate whose run contains ``i`` and the
        next candidate is ``i`` itself: a cold search of a sliding window of ``R`` blocks tests about one
        block in ``R``. Blocks already known cached are not tested twice. ``first_miss(start, stop)``, if
        given, replaces the block-by-block test: the first block in ``[start, stop)`` not cached, else
        ``stop`` (a caller holding a set of hashes answers it at C speed; see ``cluster/routing/policies.py``).
        """
        if first_miss is None:
            def first_miss(i: int, stop: int) -> int:
                while i < stop and is_cached(i):
                    i += 1
                return i
        bs = self.block_size
        end = max_blocks
        known_from = end  # blocks [known_from, end) are known to be cached
        while end > 0:
            first = self.first_needed_token(end * bs) // bs
            i = first_miss(first, known_from) if first < known_from else first
            if i >= known_from:
                return end
            end, known_from = i, first
        return 0

    def kernel_bounds(self) -> dict[str, int | None]:
        """What an attention kernel takes to read no more than this kind needs: ``window`` (a query at ``p``
        reads keys from ``p - window + 1``) and ``chunk_size`` (from ``(p // chunk_size) * chunk_size``);
        None where the kind has no such bound."""
        return {"window": None, "chunk_size": None}

    @property
    def label(self) -> str:
        """How plans and logs name it: 'full', 'sliding(window=1024)', 'chunked_local(chunk=8192)'."""
        return self.kind

    @classmethod
    def from_kernel_bounds(cls, block_size: int, window: int | None = None,
                           chunk_size: int | None = None) -> AttentionSpec:
        """The spec back from its block size and bounds (what KV-cache events carry)."""
        bounds = {"window": window, "chunk_size": chunk_size}
        return cls(block_size=block_size, **{k: v for k, v in bounds.items() if v is not None})


@dataclass(frozen=True)
class FullAttention(AttentionSpec):
    kind = "full"
    event_kind = "full_attention"

    def first_needed_token(self, num_computed: int) -> int:
        return 0

    def computed_to_reach(self, token: int) -> int:
        return NEVER if token > 0 else 0


@dataclass(frozen=True)
class SlidingWindow(AttentionSpec):
    """Position ``p`` attends to ``max(0, p - window + 1) .. p``: ``window`` tokens, itself included."""

    window: int = 4096
    kind = "sliding"
    event_kind = "sliding_window"

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int("SlidingWindow: window", self.window, 1)

    def kernel_bounds(self) -> dict[str, int | None]:
        return {"window": self.window, "chunk_size": None}

    @property
    def label(self) -> str:
        return f"sliding(window={self.window})"

    def first_needed_token(self, num_computed: int) -> int:
        return max(0, num_computed - self.window + 1)

    def computed_to_reach(self, token: int) -> int:
        return token + self.window - 1 if token > 0 else 0


@dataclass(frozen=True)
class ChunkedLocalAttention(AttentionSpec):
    """Position ``p`` attends to ``(p // chunk_size) * chunk_size .. p`` (Llama-4's local layers)."""

    chunk_size: int = 8192
    kind = "chunked_local"
    event_kind = "chunked_local_attention"

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int("ChunkedLocalAttention: chunk_size", self.chunk_size, 1)

    def kernel_bounds(self) -> dict[str, int | None]:
        return {"window": None, "chunk_size": self.chunk_size}

    @property
    def label(self) -> str:
        return f"chunked_local(chunk={self.chunk_size})"

    def first_needed_token(self, num_computed: int) -> int:
        return (num_computed // self.chunk_size) * self.chunk_size

    def computed_to_reach(self, token: int) -> int:
        return -(-token // self.chunk_size) * self.chunk_size


def spec_from_event(event_kind: str, block_size: int, window: int | None = None,
                    chunk_size: int | None = None) -> AttentionSpec:
    """The spec a KV-cache event describes by its kind's name (``event_kind``), block size and bounds."""
    cls = _BY_EVENT_KIND.get(event_kind)
    if cls is None:
        raise ValueError(f"unknown KV-cache group kind {event_kind!r}")
    return cls.from_kernel_bounds(block_size, window=window, chunk_size=chunk_size)
