"""KV-cache events: each replica's manager says what it caches and evicts, so a router can index it.

The schema is vLLM's (``vllm/distributed/kv_events.py``) where it fits, so a router written for vLLM's
events reads these. A batch is msgpack ``[ts, events, data_parallel_rank]``; each event is a map whose
``type`` names it:

- ``BlockStored``: ``block_hashes`` (consecutive blocks of one request), ``parent_block_hash`` (None for
  a request's first block), ``token_ids`` (the blocks' tokens, ``block_size`` per hash), ``block_size``,
  ``lora_id``, ``medium`` ("GPU": the device pool; "CPU": the host tier, ``kvmanager.host_tier``),
  ``lora_name``, ``group_idx``, ``kv_cache_spec_kind`` ("full_attention", "sliding_window",
  "chunked_local_attention"), ``kv_cache_spec_sliding_window``; and two fields of ours that vLLM's
  decoder ignores: ``block_index`` (the first hash's block in its request: tokens ``block_index *
  block_size ..``) and ``kv_cache_spec_attention_chunk_size``.
- ``BlockRemoved``: ``block_hashes``, ``medium``, ``group_idx``.
- ``AllBlocksCleared``: both media.

Each medium is a set of its own, as vLLM's offloading connector announces its CPU tier: a hash stored to
host is ``BlockStored`` with medium "CPU" (the same chain, index and tokens as the device block it was
copied from) while the device may still hold it, and a host eviction is ``BlockRemoved`` with medium
"CPU"; device events keep "GPU". A removal of a hash the publisher never announced in that medium (after a
reset) is not sent.

The hashes are swakv's own chained SHA-256 (``kvmanager.hashing``); ``token_ids`` lets a consumer with
its own hash (llm-d's, Dynamo's indexers) index the blocks its way. ``bench/kv_events_vllm.py`` checks
that vLLM 0.33's own event classes decode these batches. Difference from vLLM: events are per hash, not
per block: a
group's set of hashes gains one on its first block holding it and loses it when the last such block is
reused, so applying the events in order gives exactly the set the manager can hit. A block that a
request's window has left stays cached until it is reused: it makes no event.

Transport: the engine numbers its batches (``seq``, from 1, per engine incarnation ``epoch``), keeps
the last ``keep_batches`` and hands them to whoever asks with the last number it applied. A consumer
that missed some (its number fell out of the kept ones, or the engine restarted: a new epoch) gets a
**snapshot** instead: one batch, ``AllBlocksCleared`` then everything cached, numbered like the last
batch it covers, after which the numbered batches continue. vLLM carries the number in a ZeroMQ frame
beside the batch; here it travels beside the batch in the reply of a Ray call (``EngineService.kv_events``); a router keeps a replica's
index from them (``cluster.routing.kv_index``).
"""
from __future__ import annotations

import time
import uuid
from array import array
from collections import deque
from typing import TypedDict

from kvmanager.specs import AttentionSpec, spec_from_event

from .types import Load

MEDIUM = "GPU"          # the device pool's events
HOST = "CPU"            # the host tier's (``kvmanager.host_tier.HOST_MEDIUM``)
MEDIA = (MEDIUM, HOST)


def group_metadata(specs) -> list[dict]:
    """Each KV-cache group as vLLM's engine describes its groups (plus the chunk of chunked attention)."""
    out = []
    for g, s in enumerate(specs):
        bounds = s.kernel_bounds()
        out.append({"group_idx": g, "kind": s.event_kind, "block_size": s.block_size,
                    "sliding_window": bounds["window"], "attention_chunk_size": bounds["chunk_size"]})
    return out


def specs_from_metadata(groups: list[dict]) -> list[AttentionSpec]:
    """The attention specs back (their block and window rules; page sizes do not matter to a router)."""
    return [spec_from_event(m["kind"], m["block_size"], window=m["sliding_window"],
                            chunk_size=m["attention_chunk_size"]) for m in groups]


class _Reply(TypedDict):
    epoch: str
    load: Load


class KVEventsReply(_Reply, total=False):
    """``EngineService.kv_events``' reply: the engine incarnation, its load, and either the batches after
    the consumer's last or a snapshot."""

    batches: list[tuple[int, bytes]]    # (seq, msgpack batch), in order
    snapshot: tuple[int, bytes]         # (seq, one batch: AllBlocksCleared then everything cached)


class EventPublisher:
    """The manager's event sink (``BlockPool.events``) and the replica's numbered batches.

    Runs on the engine's event loop (the manager changes only there), so batches and snapshots are
    consistent with one another without locks."""

    def __init__(self, specs, rank: int = 0, keep_batches: int = 4096):
        self.rank = rank
        self.epoch = uuid.uuid4().hex
        self.seq = 0                          # number of the last batch; 0: none yet
        self.groups = group_metadata(specs)
        # per medium, per group: hash -> (parent, block index, its tokens), for snapshots
        self._known: dict[str, list[dict[bytes, tuple[bytes | None, int, array]]]] = {}
        self._reset_known()
        self._pending: list[dict] = []
        self._batches: deque[tuple[int, bytes]] = deque(maxlen=keep_batches)

    def attach(self, manager) -> None:
        """Listen to ``manager`` from now on (a fresh one after an engine reset: its cache is empty)."""
        self.groups = group_metadata(manager.specs)
        self._reset_known()
        self.cleared()
        manager.pool.events = self

    def _reset_known(self) -> None:
        self._known = {m: [{} for _ in self.groups] for m in MEDIA}

    def num_cached(self, medium: str = MEDIUM) -> list[int]:
        """Hashes each group holds now in ``medium`` (what a consumer's index should hold once up to date)."""
        return [len(known) for known in self._known[medium]]

    # -- the sink ---------------------------------------------------------------------------------
    def stored(self, group: int, block_hash: bytes, parent: bytes | None, index: int, token_ids=(),
               medium: str = MEDIUM) -> None:
        self._known[medium][group][block_hash] = (parent, index, array("q", token_ids))
        last = self._pending[-1] if self._pending else None
        same = (last is not None and last["type"] == "BlockStored" and last["group_idx"] == group
                and last["medium"] == medium)
        if same and last["block_hashes"][-1] == parent and last["block_index"] + len(last["block_hashes"]) == index:
            last["block_hashes"].append(block_hash)     # the next block of the same request
            last["token_ids"] += token_ids
        elif same and index >= 0 and last["parent_block_hash"] == block_hash and last["block_index"] == index + 1:
            last["block_hashes"].insert(0, block_hash)  # the block before (host stores are fenced tail first)
            last["token_ids"][:0] = token_ids
            last["parent_block_hash"], last["block_index"] = parent, index
        else:
            self._pending.append(self._stored(group, [block_hash], parent, index, list(token_ids), medium))

    def copied(self, group: int, block_hash: bytes, medium: str) -> None:
        """The block the device caches under ``block_hash`` now has a copy in ``medium``: announced with
        the device block's chain, index and tokens."""
        parent, index, tokens = self._known[MEDIUM][group].get(block_hash, (None, -1, array("q")))
        self.stored(group, block_hash, parent, index, tokens.tolist(), medium)

    def removed(self, group: int, block_hash: bytes, medium: str = MEDIUM) -> None:
        if self._known[medium][group].pop(block_hash, None) is None:
            return              # never announced in this medium (or since a reset): nothing to take back
        last = self._pending[-1] if self._pending else None
        if (last is not None and last["type"] == "BlockRemoved" and last["group_idx"] == group
                and last["medium"] == medium):
            last["block_hashes"].append(block_hash)
        else:
            self._pending.append({"type": "BlockRemoved", "block_hashes": [block_hash], "medium": medium,
                                  "group_idx": group})

    def cleared(self) -> None:
        for groups in self._known.values():
            for known in groups:
                known.clear()
        self._pending = [{"type": "AllBlocksCleared"}]   # what was pending before is moot

    def _stored(self, group: int, hashes: list[bytes], parent: bytes | None, index: int, token_ids: list[int],
                medium: str = MEDIUM) -> dict:
        m = self.groups[group]
        return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent, "token_ids": token_ids,
                "block_size": m["block_size"], "lora_id": None, "medium": medium, "lora_name": None,
                "group_idx": group, "kv_cache_spec_kind": m["kind"],
                "kv_cache_spec_sliding_window": m["sliding_window"],
                "kv_cache_spec_attention_chunk_size": m["attention_chunk_size"], "block_index": index}

    # -- batches ----------------------------------------------------------------------------------
    def flush(self) -> bool:
        """Pending events become the next numbered batch; False when there were none."""
        if not self._pending:
            return False
        self.seq += 1
        self._batches.append((self.seq, self._pack(self._pending)))
        self._pending = []
        return True

    def since(self, after: int) -> list[tuple[int, bytes]] | None:
        """The batches numbered above ``after``, in order; None when some are no longer kept (or ``after``
        is not a number this publisher gave): the consumer needs a snapshot."""
        if after == self.seq:
            return []
        first = self._batches[0][0] if self._batches else self.seq + 1
        if not 0 <= after < self.seq or after + 1 < first:
            return None
        return list(self._batches)[after + 1 - first:]

    def snapshot(self) -> tuple[int, bytes]:
        """Everything cached now, as one batch numbered like the last one it covers."""
        self.flush()
        events: list[dict] = [{"type": "AllBlocksCleared"}]
        for medium in MEDIA:
            for g, known in enumerate(self._known[medium]):
                run = None
                for block_hash, (parent, index, tokens) in known.items():   # insertion order keeps chains together
                    if run is not None and run["block_hashes"][-1] == parent \
                            and run["block_index"] + len(run["block_hashes"]) == index:
                        run["block_hashes"].append(block_hash)
                        run["token_ids"] += tokens
                    else:
                        run = self._stored(g, [block_hash], parent, index, tokens.tolist(), medium)
                        events.append(run)
        return self.seq, self._pack(events)

    def _pack(self, events: list[dict]) -> bytes:
        import msgpack   # here, not at import: build_engine reads this module's metadata on GPU machines without it
        return msgpack.packb([time.time(), events, self.rank], use_bin_type=True)


def decode_batch(payload: bytes) -> tuple[float, list[dict], int | None]:
    import msgpack
    ts, events, rank = msgpack.unpackb(payload, raw=False)
    return ts, events, rank
