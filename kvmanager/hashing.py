"""Chained block hashes that are equal on every process and machine.

A block's hash covers its parent's hash and its token ids, so equal hashes mean equal prefixes.
Request-level keys (cache salt, adapter name, ...) enter once, in the root every chain starts from.
BLAKE2b from the standard library: keyed by nothing process-specific, 128-bit digests, ~0.5 us a block.
"""
from __future__ import annotations

import struct
from functools import lru_cache
from hashlib import blake2b

DIGEST_SIZE = 16


@lru_cache(maxsize=64)
def _packer(n: int) -> struct.Struct:
    return struct.Struct(f"<{n}q")


@lru_cache(maxsize=1024)
def root_hash(extra_keys: tuple = ()) -> bytes:
    """The parent of a request's first block. ``extra_keys``: str, int, bytes, None or tuples of them."""
    return blake2b(b"swakv-root\x00" + _encode(extra_keys), digest_size=DIGEST_SIZE).digest()


def hash_block(parent: bytes, token_ids) -> bytes:
    """Hash of one full block: its parent's hash and its tokens, as little-endian int64."""
    return blake2b(parent + _packer(len(token_ids)).pack(*token_ids), digest_size=DIGEST_SIZE).digest()


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
