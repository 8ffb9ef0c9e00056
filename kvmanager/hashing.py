"""Chained block hashes that are equal on every process and machine.

A block's hash covers its parent's hash and its token ids, so equal hashes mean equal prefixes.
Request-level keys (cache salt, adapter name, ...) enter once, in the root every chain starts from.
SHA-256 from the standard library (hardware-accelerated on current CPUs, ~1 us a block): keyed by
nothing process-specific, 256-bit digests, so collisions are no practical concern.
"""
from __future__ import annotations

import sys
from array import array
from functools import lru_cache
from hashlib import sha256
from struct import Struct

TOKEN_BYTES = 8   # tokens are hashed as little-endian int64
HASH_BYTES = 32   # SHA-256 digests


def root_hash(extra_keys: tuple = ()) -> bytes:
    """The parent of a request's first block. ``extra_keys``: str, int, bytes, None or tuples of them.

    Cached on the encoding, not the keys: ``(1,)`` and ``(True,)`` are equal as keys of a dict but are
    different extra keys."""
    return _root(_encode(extra_keys))


@lru_cache(maxsize=1024)
def _root(encoded: bytes) -> bytes:
    return sha256(b"swakv-root\x00" + encoded).digest()


def _pack(token_ids) -> bytes:
    packed = array("q", token_ids)
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tobytes()


_ONE_BLOCK: dict[int, Struct] = {}   # block size -> its tokens' little-endian int64 layout


def hash_blocks(parent: bytes, token_ids, block_size: int) -> list[bytes]:
    """The chain of hashes of consecutive full blocks of ``token_ids``, starting after ``parent``."""
    if len(token_ids) == block_size:    # one block, a decode step's: packed without an array (twice as fast)
        layout = _ONE_BLOCK.get(block_size)
        if layout is None:
            layout = _ONE_BLOCK[block_size] = Struct(f"<{block_size}q")
        return [sha256(parent + layout.pack(*token_ids)).digest()]
    data = _pack(token_ids)
    step = block_size * TOKEN_BYTES
    out = []
    for start in range(0, len(data) - step + 1, step):
        parent = sha256(parent + data[start:start + step]).digest()
        out.append(parent)
    return out


def _encode(value) -> bytes:
    """A self-delimiting, type-tagged encoding, so that ("a", 1) and ("a1",) never collide."""
    if value is None:
        return b"N"
    if isinstance(value, bool):
        return b"T" if value else b"F"
    if isinstance(value, int):
        raw = str(value).encode()
        return b"i%d:" % len(raw) + raw
    if isinstance(value, str):
        raw = value.encode("utf-8")
        return b"s%d:" % len(raw) + raw
    if isinstance(value, bytes):
        return b"b%d:" % len(value) + value
    if isinstance(value, tuple):
        return b"(" + b"".join(_encode(v) for v in value) + b")"
    raise TypeError(f"extra keys must be str, int, bytes, None or tuples of them, got {type(value).__name__}")


def pack_hashes(chains: dict[int, list[bytes]]) -> dict[int, bytes]:
    """Chains of digests, per block size, as one byte string each: the form a router sends a prompt's
    hashes to the engine in (one bytes object is far cheaper to pickle than a list of digests)."""
    return {bs: b"".join(chain) for bs, chain in chains.items() if chain}


def split_hashes(packed: dict[int, bytes] | None) -> dict[int, list[bytes]] | None:
    """``pack_hashes`` undone: lists of digests per block size (None for nothing sent)."""
    if not packed:
        return None
    return {bs: [blob[i:i + HASH_BYTES] for i in range(0, len(blob), HASH_BYTES)] for bs, blob in packed.items()}
