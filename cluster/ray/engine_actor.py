"""The engine as an async Ray actor: one engine-core thread steps while there is work and sleeps when idle.

A thin shell over ``EngineCore`` (``cluster/engine/core.py``: the step loop the offline ``LLM`` runs too,
with its fault handling). The core thread builds the engine (Ray runs an async actor's ``__init__`` on its
event loop, so the build starts at the first call instead), then runs the loop; ``add_request``, ``abort``
and ``shutdown`` reach it through its inbox and run between two steps, so nothing touches the engine
concurrently, and the event loop stays free to accept requests and answer ``health``, ``stats`` and
``kv_events`` while a step runs. After each step the thread hands the loop one list of every update
(``call_soon_threadsafe``), which the loop sorts to its consumers. Ray's warning about ``ray.get`` in an
async actor fires for any thread of the process, so it is turned off here, as Ray Train does for its own
async controller.

Consumers. An HTTP frontend ``subscribe``s once (one long-lived Ray stream) and adds requests with
``add_request``: each record it receives holds every update of its requests since the last one, so the
engine sends one message per step per frontend, however many requests run: through a shared-memory ring
to a frontend on this host (``record_ring.py``), as a Ray stream item elsewhere (few records wait unread,
so a frontend that lags gets the steps it missed merged in one record: ``feed.py``).
``generate`` streams one request (tests, scripts). The engine names each request itself, uniquely (the
caller's id is only its label), so a retry that reuses a label can neither be aborted by its predecessor
nor lose its stream. A consumer that goes away (a closed ``generate``, a subscription whose frontend died)
aborts its requests.

Nothing one request does stops the loop. Its states, for readiness probes: ``starting``; ``ready``;
``restarting`` (workers being replaced; requests wait); ``no_workers`` (a restart failed: requests are
refused and it retries with back-off); ``stopping`` (shutdown: requests are refused and streams told
so). An error in the engine's own bookkeeping fails every request and starts it afresh.

KV-cache events (``cluster.engine.kv_events``): the manager's pool tells an ``EventPublisher`` what it caches and
evicts; after every step the core thread makes the pending events a numbered batch, and ``kv_events``
hands routers the batches they have not seen (long-polling), or a snapshot (taken on the core thread)
when they missed some, with the replica's load.
"""
from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import os
import threading

from kvmanager.hashing import split_hashes

from cluster.engine.core import EngineCore
from cluster.engine.engine import Engine
from cluster.engine.kv_events import EventPublisher, KVEventsReply
from cluster.engine.scheduler import SequenceUpdate
from cluster.engine.types import Load, ModelInfo, SamplingParams, StreamItem

from .heap import freeze_startup_heap
from .record_ring import ADDED, AddRing, RecordWriter, RingHandles, host_id

log = logging.getLogger("swakv.engine")

ENGINE_ACTOR_NAME = "swakv-engine"
NAMESPACE = "swakv"

RING_CHECK_S = 1.0    # how often a subscription over a ring checks that its reader lives
RING_ATTACH_S = 30.0  # a ring's reader that has not attached by then is taken for gone

SHUTTING_DOWN = "the server is shutting down; the request can be retried once it is back"


class EngineUnavailable(RuntimeError):
    """The engine cannot take requests now (``status``: no_workers, stopping)."""

    def __init__(self, status: str, message: str):
        super().__init__(status, message)
        self.status, self.message = status, message

    def __str__(self) -> str:
        return self.message


def stream_item(u: SequenceUpdate) -> StreamItem:
    return StreamItem(request_id=u.request_id, token_ids=u.new_token_ids, finished=u.finished,
                      finish_reason=u.finish_reason, logprobs=u.logprobs, num_cached_tokens=u.num_cached_tokens,
                      error=u.error, error_type=(u.error_type or "request_failed") if u.error else None,
                      prompt_logprobs=u.prompt_logprobs)


class _Subscriber:
    """One frontend's subscription: its pending (key, item) pairs and what wakes its stream."""

    def __init__(self):
        self.pending: list[tuple[int, StreamItem]] = []
        self.wake = asyncio.Event()
        self.requests: set[str] = set()          # engine ids of its unfinished requests
        self.replaced = False                    # a newer subscription took its name: its stream ends
        self.watch: asyncio.TimerHandle | None = None   # the periodic check of its ring's reader


class EngineService:
    """Wrap this with ``ray.remote`` (see ``start_engine_actors``); ``build`` returns (Engine, model info)."""

    def __init__(self, build, *build_args, rank: int = 0, **build_kwargs):
        """``rank``: this replica's number among the deployment's data-parallel replicas."""
        os.environ["RAY_WARN_BLOCKING_GET_INSIDE_ASYNC"] = "0"   # see the module's docstring
        self.rank = rank
        self._build = functools.partial(build, *build_args, **build_kwargs)
        self._building: asyncio.Future | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.core: EngineCore | None = None
        self.info: ModelInfo | None = None
        self._sinks: dict[str, object] = {}            # engine request id -> where its items go
        self._subscribers: dict[str, _Subscriber] = {}
        self._ids = itertools.count(1)
        self.records = 0                                # subscription records sent (Ray items or ring messages)
        self._records_lock = threading.Lock()           # ring writers count from their threads
        self.add_calls = 0                              # add_requests calls (a frontend's burst is one)
        self._adding: set[asyncio.Task] = set()         # adds read from rings, until their results are queued
        self._status, self._detail = "starting", "loading the model and starting the workers"
        self.events: EventPublisher | None = None       # once the engine is built
        self._published = asyncio.Event()               # set (and replaced) at each new batch

    @property
    def engine(self) -> Engine | None:
        return self.core.engine if self.core is not None else None

    @property
    def status(self) -> str:
        if self._status == "ready" and self.core is not None:
            return self.core.status
        return self._status

    @property
    def detail(self) -> str:
        if self._status == "ready" and self.core is not None:
            return self.core.detail
        return self._detail

    # -- the engine-core thread -------------------------------------------------------------------
    def _kick(self) -> None:
        if self._building is None:
            self._loop = asyncio.get_running_loop()
            self._building = self._loop.create_future()
            threading.Thread(target=self._core_thread, name="engine-core", daemon=True).start()

    def _core_thread(self) -> None:
        """Build the engine, then run the step loop until shutdown."""
        try:
            engine, info = self._build()
            events = EventPublisher(engine.manager.specs, self.rank)
            events.attach(engine.manager)
            core = EngineCore(engine, on_reset=lambda fresh: events.attach(fresh.manager))   # empty: AllBlocksCleared
        except Exception as exc:  # noqa: BLE001 - every caller's, through the future
            self._loop.call_soon_threadsafe(self._built, None, exc)
            return
        self._loop.call_soon_threadsafe(self._built, (core, info, events), None)
        try:
            core.run(self._emit)
        except BaseException:  # never expected: say so loudly rather than stop stepping in silence
            log.exception("the engine-core thread stopped")
            self._status, self._detail = "no_workers", "the engine-core thread stopped (see the actor's log)"
            raise

    def _built(self, result, exc) -> None:
        if exc is not None:
            self._status, self._detail = "no_workers", f"the engine failed to start: {exc}"
            self._building.set_exception(exc)
            return
        self.core, self.info, self.events = result
        self.info["replica"] = self.rank
        if self._status == "starting":
            self._status, self._detail = "ready", ""
        freeze_startup_heap()
        self._building.set_result(None)

    def _emit(self, updates: list[SequenceUpdate]) -> None:
        """On the core thread, after a step or a command: this step's KV events become a batch, and the
        loop gets the updates in one call."""
        flushed = self.events.flush()
        if updates or flushed:
            self._loop.call_soon_threadsafe(self._deliver, updates, flushed)

    def _deliver(self, updates: list[SequenceUpdate], flushed: bool = False) -> None:
        """On the loop: each update to its request's consumer; wake the subscriptions and KV followers."""
        woken = set()
        for u in updates:
            sink = self._sinks.get(u.request_id)
            if sink is None:
                continue
            if u.finished:
                del self._sinks[u.request_id]
            woken.add(sink(u))
        for subscriber in woken:
            if subscriber is not None:
                subscriber.wake.set()
        if flushed:
            self._published.set()
            self._published = asyncio.Event()

    async def _started(self) -> EngineCore:
        """The engine core, built on its thread by the first call that needs it; a build error is every caller's."""
        if self.core is None:
            self._kick()
            await asyncio.shield(self._building)
        return self.core

    async def _on_core(self, fn, *args, admit: bool = False):
        """``fn(*args)`` on the core thread, between two steps (``admit``: adds only, see ``EngineCore.call``)."""
        return await asyncio.wrap_future(self.core.call(fn, *args, admit=admit))

    def _post(self, fn, *args) -> None:
        self.core.call(fn, *args)

    # -- requests ---------------------------------------------------------------------------------
    async def ready(self) -> ModelInfo:
        """Model info once the engine is built (starts it)."""
        await self._started()
        return self.info

    async def health(self) -> dict:
        """``{"status": starting | ready | restarting | no_workers | stopping, "detail": why}``; starts the
        engine if nothing has yet (a restarted actor is built again at its first call)."""
        self._kick()
        return {"status": self.status, "detail": self.detail}

    async def _add(self, label: str, prompt_token_ids, params, block_hashes, sink) -> str:
        """Queue a request on the core thread; its updates go to ``sink(update)``. Raises as ``add_request``."""
        result, = await self._add_many([(label, prompt_token_ids, params, block_hashes, sink)])
        if isinstance(result, BaseException):
            raise result
        return result

    async def _add_many(self, entries: list[tuple]) -> list:
        """Queue requests ``(label, prompt ids, params, block hashes, sink)`` on the core thread in one
        command; per request, its engine id or the exception that refused it (nothing queued for that one).
        Raises ``EngineUnavailable`` for all of them when the engine takes none."""
        await self._started()
        status = self.status
        if status in ("no_workers", "stopping"):
            raise EngineUnavailable(status, SHUTTING_DOWN if status == "stopping"
                                    else f"the engine has no workers ({self.detail}); it keeps trying to start them")
        results: list = []
        staged = []
        for label, prompt_token_ids, params, block_hashes, sink in entries:
            try:
                sampling = params if isinstance(params, SamplingParams) else SamplingParams(**(params or {}))
                hashes = split_hashes(block_hashes)
            except (TypeError, ValueError) as exc:
                results.append(exc)
                continue
            request_id = f"{label}#{next(self._ids)}"
            self._sinks[request_id] = sink     # before the core can step it
            staged.append((len(results), request_id, prompt_token_ids, sampling, hashes))
            results.append(request_id)

        def add_all() -> list:
            refused = []
            for _, request_id, prompt_token_ids, sampling, hashes in staged:
                try:
                    self.core.add_request(request_id, prompt_token_ids, sampling, hashes)
                    refused.append(None)
                except (TypeError, ValueError) as exc:   # bad input: nothing queued for this one
                    refused.append(exc)
            return refused
        try:
            refused = await self._on_core(add_all, admit=True) if staged else []
        except BaseException:
            for _, request_id, *_ in staged:
                self._sinks.pop(request_id, None)
            raise
        for (i, request_id, *_), exc in zip(staged, refused):
            if exc is not None:
                self._sinks.pop(request_id, None)
                results[i] = exc
        return results

    async def subscribe(self, subscriber: str, host: str | None = None):
        """A frontend's one stream of this engine's updates (``num_returns="streaming"``): first an empty
        record once it is registered, then one record per step (or several steps merged, if the frontend
        lags) of ``[(key, StreamItem), ...]`` for the requests it added with ``add_request(subscriber,
        key, ...)``. A frontend on this engine's host (``host``: its ``record_ring.host_id()``) gets two rings'
        handles first instead (``record_ring``): every record comes through one, and adds may go in through
        the other (their results come back in a record). A second subscription
        under the same name ends the first. When the stream ends (its frontend died or cancelled it), the
        frontend's unfinished requests are aborted."""
        await self._started()
        old = self._subscribers.get(subscriber)
        if old is not None:
            self._abort_all(old)
            old.replaced = True
            old.wake.set()
        sub = self._subscribers[subscriber] = _Subscriber()
        ring = adds = None
        if host is not None and host == host_id():
            loop = asyncio.get_running_loop()
            ring = RecordWriter(on_gone=lambda: loop.call_soon_threadsafe(sub.wake.set), on_sent=self._count_record)
            adds = AddRing(lambda batch: self._add_from_ring(subscriber, sub, batch))
            sub.watch = loop.call_later(RING_CHECK_S, self._watch_ring, ring, sub, loop.time() + RING_ATTACH_S)
        named = ring is not None          # the rings' names are still in /dev/shm
        try:
            yield [] if ring is None else RingHandles(ring.handle, adds.handle)
            while True:
                await sub.wake.wait()
                if ring is not None and ring.gone is not None:
                    return
                sub.wake.clear()
                if sub.replaced:
                    return
                if not sub.pending:
                    continue
                record, sub.pending = sub.pending, []
                if ring is None:
                    self._count_record()
                    yield record
                else:
                    if named and ring.reader_attached():
                        # both rings are mapped at both ends by now (the frontend attaches both before it
                        # adds anything, and records answer adds): their names may go, so that however
                        # this process or the frontend's ends, SIGKILL included, nothing stays in /dev/shm
                        named = False
                        ring.unlink()
                        adds.unlink()
                    ring.put(record)
        finally:
            if ring is not None:
                sub.watch.cancel()
                adds.close()
                ring.close()
            if self._subscribers.get(subscriber) is sub:
                del self._subscribers[subscriber]
            self._abort_all(sub)

    def _add_from_ring(self, subscriber: str, sub: _Subscriber, batch: list) -> None:
        """A burst of adds from the add ring: as ``add_requests``; the results go back in the next record."""
        async def add() -> None:
            try:
                results = await self.add_requests(subscriber, batch)
            except Exception as exc:  # noqa: BLE001 - every add of the burst is refused with it
                results = [exc] * len(batch)
            sub.pending.append((ADDED, [(entry[0], result) for entry, result in zip(batch, results)]))
            sub.wake.set()
        task = asyncio.get_running_loop().create_task(add())
        self._adding.add(task)
        task.add_done_callback(self._adding.discard)

    def _watch_ring(self, ring: RecordWriter, sub: _Subscriber, attach_by: float) -> None:
        """Every ``RING_CHECK_S``: a reader that died while nothing was sent, or never attached, ends the
        subscription (the writer finds a dead reader itself only when it waits on it)."""
        loop = asyncio.get_running_loop()
        if ring.gone is None:
            ring.check_reader(attached_by_now=loop.time() > attach_by)
        if ring.gone is not None:
            sub.wake.set()
        else:
            sub.watch = loop.call_later(RING_CHECK_S, self._watch_ring, ring, sub, attach_by)

    def _count_record(self) -> None:
        with self._records_lock:
            self.records += 1

    def _abort(self, request_ids) -> None:
        """Nobody will read these requests any more: drop their sinks and abort them on the core thread."""
        for request_id in request_ids:
            self._sinks.pop(request_id, None)
            self._post(self.core.abort, request_id)

    def _abort_all(self, sub: _Subscriber) -> None:
        self._abort(sub.requests)
        sub.requests = set()

    async def add_request(self, subscriber: str, key: int, label: str, prompt_token_ids: list[int],
                          params: SamplingParams | dict | None = None, block_hashes: dict[int, bytes] | None = None) -> str:
        """Queue a request whose updates travel on ``subscriber``'s stream under ``key``; returns the
        engine's id for it (``label#n``, what ``abort`` takes). Raises before anything is queued:
        ``EngineUnavailable`` (no workers, stopping, or no such subscription: the engine restarted),
        ``ValueError`` (bad input)."""
        result, = await self.add_requests(subscriber, [(key, label, prompt_token_ids, params, block_hashes)])
        if isinstance(result, BaseException):
            raise result
        return result

    async def add_requests(self, subscriber: str, batch: list) -> list:
        """``add_request`` for several requests ``(key, label, prompt ids, params, block hashes)`` in one
        Ray message and one command to the core thread (a frontend's adds of one moment): per request, its
        engine id or the exception that refused it. Raises ``EngineUnavailable`` when none is taken."""
        self.add_calls += 1
        sub = self._subscribers.get(subscriber)
        if sub is None:
            raise EngineUnavailable("restarting", f"no subscription {subscriber!r} (the engine restarted); "
                                    "the request can be retried")
        if not isinstance(batch, (list, tuple)) or not all(isinstance(e, (list, tuple)) and len(e) == 5 for e in batch):
            raise TypeError("add_requests takes a list of (key, label, prompt_token_ids, params, block_hashes)")

        def sink_for(key):
            def sink(u: SequenceUpdate):
                sub.pending.append((key, stream_item(u)))
                if u.finished:
                    sub.requests.discard(u.request_id)
                return sub
            return sink
        results = await self._add_many([(label, ids, params, hashes, sink_for(key))
                                        for key, label, ids, params, hashes in batch])
        added = [r for r in results if isinstance(r, str)]
        if self._subscribers.get(subscriber) is sub:
            sub.requests.update(added)
        else:   # the subscription ended (or was replaced) while they were queued: nobody will read them
            self._abort(added)
        return results

    async def generate(self, label: str, prompt_token_ids: list[int], params: SamplingParams | dict | None = None,
                       block_hashes: dict[int, bytes] | None = None):
        """One request's ``StreamItem``s (``cluster.engine.types``); ``request_id`` is the engine's own
        (``label#n``), what ``abort`` takes. A request that fails ends with finish_reason "error", ``error``
        saying why and ``error_type`` one of request_failed, engine_unavailable, server_shutting_down.
        ``params``: ``SamplingParams`` (or a dict of its fields). ``block_hashes``: the prompt's leading
        block hashes per block size, concatenated, as a router computed them (``kvmanager.hashing.pack_hashes``)."""
        queue: asyncio.Queue = asyncio.Queue()
        request_id = await self._add(label, prompt_token_ids, params, block_hashes,
                                     lambda u: queue.put_nowait(stream_item(u)))
        finished = False
        try:
            while not finished:
                item = await queue.get()
                finished = item["finished"]
                yield item
        finally:
            if not finished:                                    # the consumer went away
                self._abort([request_id])

    async def abort(self, request_id: str) -> bool:
        """Finish a request now; its stream ends with finish_reason "abort". False if it is not running."""
        core = await self._started()

        def abort():
            aborted = core.abort(request_id)
            if aborted:
                self._emit([SequenceUpdate(request_id, [], True, "abort")])
            return aborted
        return await self._on_core(abort)

    async def stats(self) -> dict:
        await self._started()
        return {**self.engine.stats(), "model": self.info.get("model"), "status": self.status,
                "replica": self.rank, "kv_events_epoch": self.events.epoch, "kv_events_seq": self.events.seq,
                "prefix_cached_blocks": self.events.num_cached(), "stream_records": self.records,
                "add_calls": self.add_calls}

    def _load(self) -> Load:
        return Load(status=self.status, **self.engine.load())

    async def kv_events(self, epoch: str | None = None, after: int = 0, wait_s: float = 0.0) -> KVEventsReply:
        """KV-cache events a consumer has not applied: ``{"epoch", "load", "batches": [(seq, msgpack
        batch), ...]}`` after batch ``after`` of ``epoch``, waiting up to ``wait_s`` for one if there is
        none yet; or ``{"epoch", "load", "snapshot": (seq, batch)}`` when the consumer missed some (its
        number is no longer kept, or it knew another epoch: this engine restarted). ``load``: a
        ``types.Load`` (``cluster.engine.kv_events`` has the batches' schema)."""
        await self._started()
        batches = self.events.since(after) if epoch == self.events.epoch else None
        if batches == [] and wait_s > 0:
            try:
                await asyncio.wait_for(self._published.wait(), wait_s)
            except asyncio.TimeoutError:
                pass
            batches = self.events.since(after)
        reply = KVEventsReply(epoch=self.events.epoch, load=self._load())
        if batches is None:
            def snapshot():   # the manager's cache, read between steps
                self.events.flush()
                return self.events.snapshot()
            reply["snapshot"] = await self._on_core(snapshot)
        else:
            reply["batches"] = batches
        return reply

    async def shutdown(self) -> int:
        """Refuse new requests, end every stream with a "server is shutting down" error and stop the
        workers; returns how many requests were in flight. Called before the cluster is torn down (Ctrl-C,
        SIGTERM)."""
        if self.core is None:
            self._status = "stopping"
            return 0
        self._status, self._detail = "stopping", "shutdown requested"
        core = self.core

        def stop():
            updates = core.fail_all(SHUTTING_DOWN, "server_shutting_down")
            self._emit(updates)
            core.engine.executor.shutdown()   # the workers and their devices go back now
            return len(updates)
        return await self._on_core(stop)
