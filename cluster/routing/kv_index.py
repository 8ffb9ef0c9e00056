"""A router's copy of what one replica caches, kept from its KV-event batches (``cluster.engine.kv_events``
has the schema and the transport): per KV-cache group, the hashes on the device and, apart, those in its
host tier (medium "CPU"); a hash may be in both."""
from __future__ import annotations

from cluster.engine.kv_events import HOST, MEDIUM, decode_batch


class Gap(Exception):
    """A batch does not follow the last one applied: the consumer needs a snapshot."""


class KVIndex:
    """One replica's cached hashes, a set per KV-cache group and medium, kept from its event batches."""

    def __init__(self):
        self.groups: list[set[bytes]] = []       # on the device (medium "GPU", or none given)
        self.host: list[set[bytes]] = []         # in the host tier (medium "CPU")
        self.epoch: str | None = None
        self.seq: int | None = None        # last batch applied; None: nothing known (ask for a snapshot)
        self.batches = 0
        self.snapshots = 0

    @property
    def synced(self) -> bool:
        return self.seq is not None

    def cached(self, group: int) -> set[bytes] | frozenset:
        """The hashes group ``group`` caches on the device (empty if no event named the group yet)."""
        return self.groups[group] if group < len(self.groups) else frozenset()

    def on_host(self, group: int) -> set[bytes] | frozenset:
        """The hashes group ``group`` holds in the host tier."""
        return self.host[group] if group < len(self.host) else frozenset()

    def apply(self, seq: int, payload: bytes) -> None:
        """Apply the batch that follows the last one; raises ``Gap`` otherwise (nothing applied)."""
        if self.seq is None or seq != self.seq + 1:
            raise Gap(f"batch {seq} does not follow {self.seq}")
        self._apply(decode_batch(payload)[1])
        self.seq = seq
        self.batches += 1

    def load(self, epoch: str, seq: int, payload: bytes) -> None:
        """Start over from a snapshot (it begins with AllBlocksCleared)."""
        self.groups, self.host = [], []
        self._apply(decode_batch(payload)[1])
        self.epoch, self.seq = epoch, seq
        self.snapshots += 1

    def forget(self) -> None:
        """The replica is gone: know nothing until its next snapshot."""
        self.groups, self.host, self.epoch, self.seq = [], [], None, None

    def _apply(self, events: list[dict]) -> None:
        for ev in events:
            kind = ev["type"]
            if kind == "AllBlocksCleared":
                for s in self.groups + self.host:
                    s.clear()
                continue
            medium = ev.get("medium") or MEDIUM
            if medium == MEDIUM:
                sets = self.groups
            elif medium == HOST:
                sets = self.host
            else:           # a tier this router does not score (vLLM's "STORAGE")
                continue
            g = ev.get("group_idx") or 0
            for both in (self.groups, self.host):     # one length for both media: a group exists in both
                while len(both) <= g:
                    both.append(set())
            if kind == "BlockStored":
                sets[g].update(ev["block_hashes"])
            elif kind == "BlockRemoved":
                sets[g].difference_update(ev["block_hashes"])
