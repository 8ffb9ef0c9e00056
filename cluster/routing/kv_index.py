"""A router's copy of what one replica caches, kept from its KV-event batches (``cluster.engine.kv_events``
has the schema and the transport)."""
from __future__ import annotations

from cluster.engine.kv_events import decode_batch


class Gap(Exception):
    """A batch does not follow the last one applied: the consumer needs a snapshot."""


class KVIndex:
    """One replica's cached hashes, a set per KV-cache group, kept from its event batches."""

    def __init__(self):
        self.groups: list[set[bytes]] = []
        self.epoch: str | None = None
        self.seq: int | None = None        # last batch applied; None: nothing known (ask for a snapshot)
        self.batches = 0
        self.snapshots = 0

    @property
    def synced(self) -> bool:
        return self.seq is not None

    def cached(self, group: int) -> set[bytes] | frozenset:
        """The hashes group ``group`` caches (empty if no event named the group yet)."""
        return self.groups[group] if group < len(self.groups) else frozenset()

    def apply(self, seq: int, payload: bytes) -> None:
        """Apply the batch that follows the last one; raises ``Gap`` otherwise (nothing applied)."""
        if self.seq is None or seq != self.seq + 1:
            raise Gap(f"batch {seq} does not follow {self.seq}")
        self._apply(decode_batch(payload)[1])
        self.seq = seq
        self.batches += 1

    def load(self, epoch: str, seq: int, payload: bytes) -> None:
        """Start over from a snapshot (it begins with AllBlocksCleared)."""
        self.groups = []
        self._apply(decode_batch(payload)[1])
        self.epoch, self.seq = epoch, seq
        self.snapshots += 1

    def forget(self) -> None:
        """The replica is gone: know nothing until its next snapshot."""
        self.groups, self.epoch, self.seq = [], None, None

    def _apply(self, events: list[dict]) -> None:
        groups = self.groups
        for ev in events:
            kind = ev["type"]
            if kind == "AllBlocksCleared":
                for s in groups:
                    s.clear()
                continue
            g = ev.get("group_idx") or 0
            while len(groups) <= g:
                groups.append(set())
            if kind == "BlockStored":
                groups[g].update(ev["block_hashes"])
            elif kind == "BlockRemoved":
                groups[g].difference_update(ev["block_hashes"])
