"""A prompt's chained block hashes, computed lazily and once, shared by every replica's scoring and sent
to the chosen engine with the request, so it does not hash the prompt again."""
from __future__ import annotations

from kvmanager.hashing import hash_blocks, pack_hashes, root_hash


class PromptHashes:
    """A prompt's chained block hashes per block size, computed on demand and once (``kvmanager.hashing``,
    no extra keys: the chain the engine's ``Request`` computes)."""

    __slots__ = ("token_ids", "_chains", "_text")

    def __init__(self, token_ids: list[int]):
        self.token_ids = token_ids
        self._chains: dict[int, list[bytes]] = {}
        self._text: str | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def upto(self, block_size: int, n: int) -> list[bytes]:
        """The chain, holding at least the first ``n`` full blocks' hashes (all there are if fewer)."""
        chain = self._chains.get(block_size)
        if chain is None:
            chain = self._chains[block_size] = []
        n = min(n, len(self.token_ids) // block_size)
        if len(chain) < n:
            parent = chain[-1] if chain else root_hash(())
            chain.extend(hash_blocks(parent, self.token_ids[len(chain) * block_size:n * block_size], block_size))
        return chain

    def for_engine(self) -> dict[int, bytes]:
        """What was hashed, per block size, as one byte string each (cheap to send)."""
        return pack_hashes(self._chains)

    @property
    def text(self) -> str:
        """One character per token id (for the text-prefix baseline)."""
        if self._text is None:
            self._text = "".join(map(chr, self.token_ids))
        return self._text
