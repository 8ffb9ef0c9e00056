"""The engine as an async Ray actor: a step loop that runs while there is work and sleeps when idle.

A thin shell over ``Engine``: ``schedule`` / ``apply`` run on the actor's event loop (as do
``add_request`` and ``abort``, so they never overlap). Everything that waits on Ray runs in a thread:
building the engine (Ray runs an async actor's ``__init__`` on its event loop, so the build starts at the
first call instead), each step, and a restart of the workers; the loop stays free to accept, stream and
answer ``health``. Ray's warning about ``ray.get`` in an async actor fires for any thread of the
process, so it is turned off here, as Ray Train does for its own async controller. Each request is
a Ray streaming generator under an id the engine makes unique (the caller's id is only its label), so a
retry that reuses a label can neither be aborted by its predecessor nor lose its stream. When a consumer
goes away its generator is closed and the request aborted.

Nothing one request does stops the loop (see ``cluster/engine/engine.py``). Its states, for readiness probes:
``starting``; ``ready``; ``restarting`` (workers being replaced; requests wait); ``no_workers`` (a restart failed:
requests are refused and it retries with back-off); ``stopping`` (shutdown: requests are refused and
streams told so). An error in the engine's own bookkeeping fails every request and starts it afresh.

KV-cache events (``cluster.engine.kv_events``): the manager's pool tells an ``EventPublisher`` what it caches and
evicts; after every step the pending events become a numbered batch, and ``kv_events`` hands routers the
batches they have not seen (long-polling), or a snapshot when they missed some, with the replica's load.
"""
from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import os

from kvmanager.hashing import split_hashes

from cluster.engine.engine import Engine
from cluster.engine.kv_events import EventPublisher, KVEventsReply
from cluster.engine.scheduler import SequenceUpdate
from cluster.engine.types import Load, ModelInfo, SamplingParams, StreamItem

log = logging.getLogger("swakv.engine")

ENGINE_ACTOR_NAME = "swakv-engine"
NAMESPACE = "swakv"

SHUTTING_DOWN = "the server is shutting down; the request can be retried once it is back"


class EngineUnavailable(RuntimeError):
    """The engine cannot take requests now (``status``: no_workers, stopping)."""

    def __init__(self, status: str, message: str):
        super().__init__(status, message)
        self.status, self.message = status, message

    def __str__(self) -> str:
        return self.message


class EngineService:
    """Wrap this with ``ray.remote`` (see ``start_engine_actors``); ``build`` returns (Engine, model info)."""

    def __init__(self, build, *build_args, rank: int = 0, **build_kwargs):
        """``rank``: this replica's number among the deployment's data-parallel replicas."""
        os.environ["RAY_WARN_BLOCKING_GET_INSIDE_ASYNC"] = "0"   # see the module's docstring
        self.rank = rank
        self._build = functools.partial(build, *build_args, **build_kwargs)
        self._building: asyncio.Future | None = None
        self.engine: Engine | None = None
        self.info: ModelInfo | None = None
        self._streams: dict[str, asyncio.Queue] = {}   # engine request id -> its consumer's queue
        self._ids = itertools.count(1)
        self._wake = asyncio.Event()
        self._loop_task: asyncio.Task | None = None
        self.status, self.detail = "starting", "loading the model and starting the workers"
        self.events: EventPublisher | None = None       # once the engine is built
        self._published = asyncio.Event()               # set (and replaced) at each new batch

    def _kick(self) -> None:
        if self._building is None:
            self._building = asyncio.ensure_future(asyncio.to_thread(self._build))

    async def _started(self) -> Engine:
        """The engine, built in a thread by the first call that needs it; a build error is every caller's."""
        if self.engine is None:
            self._kick()
            try:
                engine, info = await asyncio.shield(self._building)
            except Exception as exc:
                self.status, self.detail = "no_workers", f"the engine failed to start: {exc}"
                raise
            if self.engine is None:
                self.engine, self.info = engine, info
                self.events = EventPublisher(engine.manager.specs, self.rank)
                self.events.attach(engine.manager)
                self.info["replica"] = self.rank
                if self.status == "starting":
                    self.status, self.detail = "ready", ""
        return self.engine

    async def ready(self) -> ModelInfo:
        """Model info once the engine is built (starts it)."""
        await self._started()
        return self.info

    async def health(self) -> dict:
        """``{"status": starting | ready | restarting | no_workers | stopping, "detail": why}``; starts the
        engine if nothing has yet (a restarted actor is built again at its first call)."""
        self._kick()
        return {"status": self.status, "detail": self.detail}

    async def generate(self, label: str, prompt_token_ids: list[int], params: SamplingParams | dict | None = None,
                       block_hashes: dict[int, bytes] | None = None):
        """Yields ``StreamItem``s (``cluster.engine.types``); ``request_id`` is the engine's own
        (``label#n``), what ``abort`` takes. A request that fails ends with finish_reason "error", ``error``
        saying why and ``error_type`` one of request_failed, engine_unavailable, server_shutting_down.
        ``params``: ``SamplingParams`` (or a dict of its fields). ``block_hashes``: the prompt's leading
        block hashes per block size, concatenated, as a router computed them (``kvmanager.hashing.pack_hashes``)."""
        await self._started()
        if self.status in ("no_workers", "stopping"):
            raise EngineUnavailable(self.status, SHUTTING_DOWN if self.status == "stopping"
                                    else f"the engine has no workers ({self.detail}); it keeps trying to start them")
        sampling = params if isinstance(params, SamplingParams) else SamplingParams(**(params or {}))
        request_id = f"{label}#{next(self._ids)}"
        self.engine.add_request(request_id, prompt_token_ids, sampling,   # ValueError: nothing queued
                                block_hashes=split_hashes(block_hashes))
        queue: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = queue
        self._ensure_loop()
        self._wake.set()
        finished = False
        try:
            while not finished:
                item = await queue.get()
                finished = item["finished"]
                yield item
        finally:
            del self._streams[request_id]
            if not finished:
                self.engine.abort(request_id)  # the consumer went away

    async def abort(self, request_id: str) -> bool:
        """Finish a request now; its stream ends with finish_reason "abort". False if it is not running."""
        await self._started()
        aborted = self.engine.abort(request_id)
        if aborted:
            self._publish([SequenceUpdate(request_id, [], True, "abort")])
        return aborted

    async def stats(self) -> dict:
        await self._started()
        return {**self.engine.stats(), "model": self.info.get("model"), "status": self.status,
                "replica": self.rank, "kv_events_epoch": self.events.epoch, "kv_events_seq": self.events.seq,
                "prefix_cached_blocks": self.events.num_cached()}

    def _load(self) -> Load:
        return Load(status=self.status, **self.engine.load())

    async def kv_events(self, epoch: str | None = None, after: int = 0, wait_s: float = 0.0) -> KVEventsReply:
        """KV-cache events a consumer has not applied: ``{"epoch", "load", "batches": [(seq, msgpack
        batch), ...]}`` after batch ``after`` of ``epoch``, waiting up to ``wait_s`` for one if there is
        none yet; or ``{"epoch", "load", "snapshot": (seq, batch)}`` when the consumer missed some (its
        number is no longer kept, or it knew another epoch: this engine restarted). ``load``: a
        ``types.Load`` (``cluster.engine.kv_events`` has the batches' schema)."""
        await self._started()
        self._flush()
        batches = self.events.since(after) if epoch == self.events.epoch else None
        if batches == [] and wait_s > 0:
            try:
                await asyncio.wait_for(self._published.wait(), wait_s)
            except asyncio.TimeoutError:
                pass
            batches = self.events.since(after)
        reply = KVEventsReply(epoch=self.events.epoch, load=self._load())
        if batches is None:
            reply["snapshot"] = self.events.snapshot()
        else:
            reply["batches"] = batches
        return reply

    def _flush(self) -> None:
        """Pending KV events become a batch; wake the consumers waiting for one."""
        if self.events is not None and self.events.flush():
            self._published.set()
            self._published = asyncio.Event()

    async def shutdown(self) -> int:
        """Refuse new requests, end every stream with a "server is shutting down" error and stop the
        workers; returns how many requests were in flight. Called before the cluster is torn down (Ctrl-C,
        SIGTERM)."""
        if self.engine is None:
            self.status = "stopping"
            return 0
        self.status, self.detail = "stopping", "shutdown requested"
        updates = self.engine.fail_all(SHUTTING_DOWN)
        self._publish(updates, "server_shutting_down")
        await asyncio.to_thread(self.engine.executor.shutdown)   # the workers and their devices go back now
        return len(updates)

    # -- the step loop ----------------------------------------------------------------------------
    def _ensure_loop(self) -> None:
        if self._loop_task is None or self._loop_task.done():
            self._loop_task = asyncio.get_running_loop().create_task(self._run())

    def _publish(self, updates: list[SequenceUpdate], error_type: str = "request_failed") -> None:
        for u in updates:
            queue = self._streams.get(u.request_id)
            if queue is not None:
                queue.put_nowait(StreamItem(request_id=u.request_id, token_ids=u.new_token_ids, finished=u.finished,
                                            finish_reason=u.finish_reason, logprobs=u.logprobs,
                                            num_cached_tokens=u.num_cached_tokens, error=u.error,
                                            error_type=error_type if u.error else None,
                                            prompt_logprobs=u.prompt_logprobs))

    async def _run(self) -> None:
        while True:
            engine = self.engine
            try:
                if not engine.has_work() or self.status == "stopping":
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                plan = engine.schedule()
                if plan is None:
                    await asyncio.sleep(0.001)
                    continue
                await self._execute(engine, plan)
                self._flush()
            except Exception as exc:  # noqa: BLE001 - a bug in the engine's bookkeeping: start afresh
                log.exception("engine step failed outside the workers; failing every request and resetting")
                await self._reset(exc)
                self._flush()

    async def _execute(self, engine: Engine, plan) -> None:
        while True:
            try:
                output = await asyncio.to_thread(engine.executor.execute, plan.step)
            except Exception as exc:  # noqa: BLE001 - a request's fault, or the workers'
                if self.status == "stopping":
                    return   # the workers were stopped under this step on purpose
                failed = engine.isolate(plan, exc)
                if failed is not None:
                    log.warning("request %s failed a step; running the step without it: %s",
                                failed.request_id, failed.error)
                    self._publish([failed])
                    continue
                log.warning("step failed (%s: %s); restarting the workers", type(exc).__name__, exc)
                self._publish(engine.blame(plan))
                await self._restart_workers(engine)
                return
            self._publish(engine.apply(plan, output))
            return

    async def _restart_workers(self, engine: Engine) -> None:
        """Replace the workers (in a thread: it waits on Ray); if they cannot start, fail every request
        and try again with back-off while the status says so."""
        self.status, self.detail = "restarting", "replacing the workers after a failed step"
        delay = 1.0
        while True:
            try:
                await asyncio.to_thread(engine.executor.restart)
                break
            except Exception as exc:  # noqa: BLE001
                log.error("workers failed to start: %s; retrying in %.0f s", exc, delay)
                self.status, self.detail = "no_workers", f"workers failed to start: {exc}"
                self._publish(engine.fail_all(f"the engine lost its workers and cannot start new ones: {exc}"),
                              "engine_unavailable")
                await asyncio.sleep(delay)
                delay = min(2 * delay, 30.0)
        engine.after_restart()
        if self.status != "stopping":
            self.status, self.detail = "ready", ""

    async def _reset(self, exc: BaseException) -> None:
        """Fail every request, then a fresh scheduler and manager over restarted workers."""
        engine = self.engine
        message = f"the engine reset after an internal error: {exc!r}"
        self._publish([SequenceUpdate(rid, [], True, "error", error=message) for rid in self._streams],
                      "engine_unavailable")
        self.engine = Engine(engine.executor, engine.manager.specs, engine.manager.num_blocks, engine.config,
                             group_widths=engine.manager.widths)
        self.engine.metrics = engine.metrics
        self.events.attach(self.engine.manager)   # the new manager's cache is empty: AllBlocksCleared
        await self._restart_workers(self.engine)
