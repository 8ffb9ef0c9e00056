"""A request as the manager sees it: its tokens, how many are computed, and its block hashes."""
from __future__ import annotations

from .hashing import HASH_BYTES, hash_blocks, root_hash


MAX_TOKEN_ID = (1 << 63) - 1   # tokens are hashed as int64


def _check_token_ids(token_ids, what: str) -> list[int]:
    """A list of ints in [0, 2**63), checked at C speed (a 128k-token prompt costs a few ms)."""
    ids = list(token_ids)
    if ids and (set(map(type, ids)) != {int} or min(ids) < 0 or max(ids) > MAX_TOKEN_ID):
        bad = next(t for t in ids if type(t) is not int or not 0 <= t <= MAX_TOKEN_ID)
        raise ValueError(f"{what} must be integers in [0, 2**63), got {bad!r}")
    return ids


def _check_hashes(request_id: str, block_hashes, num_tokens: int) -> dict[int, list[bytes]]:
    """Given hashes: block size -> at most one 32-byte digest per full block (checked at C speed)."""
    if block_hashes is None:
        return {}
    ok = isinstance(block_hashes, dict) and all(
        type(bs) is int and bs >= 1 and isinstance(hs, list) and len(hs) <= num_tokens // bs  # noqa: E721
        and (not hs or (set(map(type, hs)) == {bytes} and set(map(len, hs)) == {HASH_BYTES}))
        for bs, hs in block_hashes.items())
    if not ok:
        raise ValueError(f"request {request_id!r}: block_hashes must map block sizes to at most one "
                         f"{HASH_BYTES}-byte hash per full block of the prompt")
    return {bs: list(hs) for bs, hs in block_hashes.items()}


class Request:
    """Tokens of one sequence. The caller advances ``num_computed_tokens`` after each step.

    ``extra_keys`` (e.g. a cache salt or an adapter name) make its blocks distinct from another
    request's with the same tokens. Block hashes are computed lazily, once per full block and block size.
    ``block_hashes`` (block size -> leading hashes) hands over hashes a caller already computed from these
    tokens and keys with ``hashing`` (a router that scored the prompt), so they are not computed twice;
    they are trusted, as the tokens are: only their shape is checked.
    """

    __slots__ = ("request_id", "prompt_token_ids", "output_token_ids", "all_token_ids",
                 "num_computed_tokens", "extra_keys", "finished", "_hashes", "lru_hit", "sparse_hit",
                 "reuse_gap")

    def __init__(self, request_id: str, prompt_token_ids, *, extra_keys: tuple = (),
                 block_hashes: dict[int, list[bytes]] | None = None):
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
        prompt = _check_token_ids(prompt_token_ids, "prompt_token_ids")
        if not prompt:
            raise ValueError(f"request {request_id!r}: prompt_token_ids is empty")
        if not isinstance(extra_keys, tuple):
            raise TypeError(f"request {request_id!r}: extra_keys must be a tuple, got {type(extra_keys).__name__}")
        root_hash(extra_keys)  # validates the keys now, not at the first hash
        self.request_id = request_id
        self.prompt_token_ids = prompt
        self.output_token_ids: list[int] = []
        self.all_token_ids = list(prompt)
        self.num_computed_tokens = 0
        self.extra_keys = extra_keys
        self.finished = False
        self._hashes: dict[int, list[bytes]] = _check_hashes(request_id, block_hashes, len(prompt))
        self.lru_hit = -1     # the hit plain LRU would have granted at its last lookup (``kvmanager.floor``)
        self.sparse_hit = -1  # the same for the sparse LRU, where a group drops blocks
        self.reuse_gap = 0    # the age of the finished chain its hit took back (``FreeQueue.last_reuse``)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    def append_output_token_ids(self, token_ids) -> None:
        if (type(token_ids) is tuple or type(token_ids) is list) and len(token_ids) == 1:  # the decode path,
            token = token_ids[0]                                                            # checked cheaply
            if type(token) is int and 0 <= token <= MAX_TOKEN_ID:
                self.output_token_ids.append(token)
                self.all_token_ids.append(token)
                return
        ids = _check_token_ids(token_ids, "output token ids")
        self.output_token_ids.extend(ids)
        self.all_token_ids.extend(ids)

    def block_hashes(self, block_size: int, num_blocks: int | None = None) -> list[bytes]:
        """Hashes of the full blocks of ``block_size`` tokens: at least the first ``num_blocks`` (all known
        ones by default), computed once each and kept. Lookups ask only for what they test, so a cold
        lookup that fails at block 0 of a full-attention group hashes nothing more."""
        hashes = self._hashes.get(block_size)
        if hashes is None:
            hashes = self._hashes[block_size] = []
        n_full = len(self.all_token_ids) // block_size
        want = n_full if num_blocks is None else min(num_blocks, n_full)
        if len(hashes) < want:
            parent = hashes[-1] if hashes else root_hash(self.extra_keys)
            tokens = self.all_token_ids[len(hashes) * block_size:want * block_size]
            hashes.extend(hash_blocks(parent, tokens, block_size))
        return hashes

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, finished={self.finished})")
