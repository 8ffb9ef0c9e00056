"""One HTTP frontend's subscription to one engine: every request's updates arrive in one record per
engine step and are sorted here into per-request queues (``EngineService.subscribe``). On the engine's
host the records come through a shared-memory ring (``cluster/ray/record_ring.py``: a Ray stream item
costs milliseconds, the ring a fraction of one) and the Ray stream only says when the engine is gone;
elsewhere each record is an item of that stream.

Either way at most a few records wait unread (the ring's slots; Ray's generator backpressure, 1): when
the frontend falls behind (many streams on a busy host), the engine keeps stepping and merges the steps
it owes into its next record, so each stream gets one SSE event for several tokens instead of a queue
that grows (vLLM's stream interval, chosen by the load).

A request is added under a key this frontend picks, whose queue exists before the call goes out, so an
update can never arrive for a request nobody waits on. The adds of one turn of the event loop (a burst
of clients) travel together, in one ``add_requests`` call: one Ray message and one command between two
engine steps for the burst, not one each; each request gets its engine id back, or its own refusal,
raised before anything is queued for it. A request whose add call was cancelled (its
client left) is aborted as soon as its first update names it. When the subscription ends (the engine
process died, or Ray restarted it), every request waiting on it gets ``SubscriptionLost`` and the
frontend opens a new subscription at its next request.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import os
import socket
import uuid

import ray
from ray.exceptions import RayActorError

from cluster.engine.types import SamplingParams, StreamItem
from cluster.ray.record_ring import ADDED, AddWriter, LoopReader, RingHandles, host_id
from cluster.routing.prompt import PromptHashes
from workers.shm_channel import ChannelError

from .openai import RETRY_ELSEWHERE, APIError, engine_restarted, error_from_engine, error_from_item


log = logging.getLogger("swakv.serve")

RING_DRAIN_S = 5.0   # after the engine's stream ends, how long its ring's last records may take to be read


class SubscriptionLost(RuntimeError):
    """The engine's stream of updates ended: the engine is gone or restarted."""


class EngineFeed:
    def __init__(self, handle, subscriber: str):
        self.handle, self.subscriber = handle, subscriber
        self.queues: dict[int, asyncio.Queue | None] = {}    # key -> its request's queue; None: abort on sight
        self.error: BaseException | None = None
        self._keys = itertools.count()
        self._adding: list[tuple[tuple, asyncio.Future]] = []   # adds of this turn of the loop, not sent yet
        self._sending: set[asyncio.Task] = set()
        self._records: LoopReader | None = None               # the record ring, when the engine is on this host
        self._adds: AddWriter | None = None                   # the add ring, then
        self._ring_adds: dict[int, asyncio.Future] = {}       # adds sent through it, until their results come
        loop = asyncio.get_running_loop()
        self._opened = loop.create_future()
        self._task = loop.create_task(self._follow())

    @property
    def alive(self) -> bool:
        return self.error is None

    async def _follow(self) -> None:
        host, closed = host_id(), False
        try:
            while True:
                stream = self.handle.subscribe.options(
                    num_returns="streaming", _generator_backpressure_num_objects=1).remote(self.subscriber, host)
                first = await (await stream.__anext__())
                if not isinstance(first, RingHandles):
                    break
                try:   # the engine is on this host: records and adds go through shared memory from now on
                    self._records = LoopReader(first.records, self._sort)
                    self._adds = AddWriter(first.adds)
                    break
                except ChannelError as exc:   # this host's /dev/shm is not the engine's after all
                    log.warning("the engine's rings cannot be opened here (%s); using Ray messages", exc)
                    if self._records is not None:
                        self._records.close()
                        self._records = None
                    ray.cancel(stream)
                    host = None
            self._opened.set_result(None)
            while True:
                self._sort(await (await stream.__anext__()))
        except asyncio.CancelledError:
            error, closed = SubscriptionLost("the subscription was closed"), True
            if self._records is not None:
                self._records.close()
        except StopAsyncIteration:
            error = SubscriptionLost("the engine ended its stream")
        except RayActorError as exc:
            error = SubscriptionLost(f"the engine is gone ({type(exc).__name__})")
        except Exception as exc:  # noqa: BLE001 - whatever ends the stream ends every request on it
            error = SubscriptionLost(f"the engine's stream failed: {exc!r}")
        self.error = error                                # new requests go to a new subscription from now on
        if self._adds is not None:
            self._adds.close()
        if self._records is not None and not self._records.reader.closed:
            await self._records.drained(RING_DRAIN_S)    # what the engine wrote before its stream ended counts
        if not closed:
            log.warning("%s: %s", self.subscriber, error)
        for key, future in self._ring_adds.items():
            self._resolve(key, future, error)
        self._ring_adds.clear()
        if not self._opened.done():
            self._opened.set_exception(error)
            self._opened.exception()                         # retrieved: callers see it through ``add``
        for queue in self.queues.values():
            if queue is not None:
                queue.put_nowait(error)
        self.queues.clear()

    def _sort(self, record: list) -> None:
        """Each update of a record to its request's queue."""
        for key, item in record:
            if key == ADDED:
                for added, result in item:
                    future = self._ring_adds.pop(added, None)
                    if future is not None:
                        self._resolve(added, future, result)
                continue
            queue = self.queues.get(key, False)
            if queue is None:                         # its add call was cancelled: nobody waits
                del self.queues[key]
                if not item["finished"]:
                    self.handle.abort.remote(item["request_id"])
            elif queue is not False:
                queue.put_nowait(item)

    def close(self) -> None:
        """Stop following (the engine sees its stream end and aborts what is left)."""
        self._task.cancel()

    async def add(self, label: str, token_ids: list[int], params, block_hashes) -> tuple[str, int, asyncio.Queue]:
        """Queue a request on the engine; (its engine id, its key, the queue its items arrive on). Raises
        ``SubscriptionLost`` or the engine's refusal."""
        await asyncio.shield(self._opened)
        if self.error is not None:
            raise self.error
        key, queue = next(self._keys), asyncio.Queue()
        self.queues[key] = queue
        future = asyncio.get_running_loop().create_future()
        if not self._adding:
            asyncio.get_running_loop().call_soon(self._send_adds)
        self._adding.append(((key, label, token_ids, params, block_hashes), future))
        try:
            request_id = await future
        except asyncio.CancelledError:
            if key in self.queues:
                self.queues[key] = None                      # queued or not: abort it when it shows up
            raise
        except BaseException:
            self.queues.pop(key, None)
            raise
        return request_id, key, queue

    def _send_adds(self) -> None:
        batch, self._adding = self._adding, []
        entries = [entry for entry, _ in batch]
        if self._adds is not None and self.error is None and self._adds.try_send(entries):
            for (key, *_), future in batch:          # their results come in a record
                self._ring_adds[key] = future
            return
        try:
            ref = self.handle.add_requests.remote(self.subscriber, entries)
        except Exception as exc:  # noqa: BLE001 - each waiting add raises it
            ref = exc
        task = asyncio.get_running_loop().create_task(self._settle(ref, batch))
        self._sending.add(task)
        task.add_done_callback(self._sending.discard)

    async def _settle(self, ref, batch: list[tuple[tuple, asyncio.Future]]) -> None:
        """Each add's engine id, or its refusal; a failed call (the engine gone, or taking none) is every one's."""
        try:
            results = [ref] * len(batch) if isinstance(ref, BaseException) else await ref
        except Exception as exc:  # noqa: BLE001
            results = [exc] * len(batch)
        for ((key, *_), future), result in zip(batch, results):
            self._resolve(key, future, result)

    def _resolve(self, key: int, future: asyncio.Future, result) -> None:
        """An add's engine id or refusal to the caller waiting on it."""
        refused = isinstance(result, BaseException)
        if not future.done():
            (future.set_exception if refused else future.set_result)(result)
        elif refused and self.queues.get(key, False) is None:   # its client left, and nothing was queued
            del self.queues[key]

    def release(self, key: int, abort_id: str | None = None) -> None:
        """The request's consumer is done; ``abort_id``: the engine request to abort (it had not finished)."""
        self.queues.pop(key, None)
        if abort_id is not None and self.error is None:
            try:
                self.handle.abort.remote(abort_id)
            except RayActorError:
                pass  # the engine is gone, and the request with it


class EngineFeeds:
    """This frontend's subscription to each engine replica of a ``ReplicaSet``, under one subscriber name."""

    def __init__(self, replicas):
        self.replicas = replicas
        self.subscriber = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self._feeds: dict[str, EngineFeed] = {}

    def get(self, replica) -> EngineFeed:
        """The replica's feed, opened at the first request after none was or the last one ended (raises
        ValueError when no actor has its name)."""
        feed = self._feeds.get(replica.name)
        if feed is None or not feed.alive:
            feed = self._feeds[replica.name] = EngineFeed(self.replicas.handle(replica), self.subscriber)
        return feed

    def lost(self, replica, feed: EngineFeed) -> None:
        """The replica's engine is gone: route elsewhere, and subscribe afresh next time."""
        self.replicas.down(replica)
        if self._feeds.get(replica.name) is feed:
            del self._feeds[replica.name]
            feed.close()

    async def start(self, label: str, prompt: PromptHashes, params: SamplingParams, affinity=None):
        """(replica, feed, key, queue, first item) of a request: route, submit, and await the first item, so a refused request is an HTTP error, not a broken
        stream. A replica that is gone, or refuses (no workers, shutting down), or fails the request for
        its own reasons before a first token: the request goes to another replica, each tried once
        (nothing was streamed, so nothing is answered twice); the last error if none takes it."""
        tried: set[str] = set()
        last: APIError = engine_restarted()
        while True:
            candidates = self.replicas.candidates(prompt, affinity, tried)
            if not candidates:
                raise last
            replica, expected = candidates[0]
            if tried:
                self.replicas.retries += 1
            tried.add(replica.name)
            try:
                feed = self.get(replica)
            except ValueError:   # no actor of that name (yet)
                self.replicas.down(replica)
                continue
            self.replicas.acquire(replica, prompt)
            request_id = key = None
            try:
                request_id, key, queue = await feed.add(label, prompt.token_ids, params, prompt.for_engine())
                item = await next_item(queue)
            except (RayActorError, SubscriptionLost):
                self.replicas.release(replica, prompt)
                self.lost(replica, feed)
                continue
            except asyncio.CancelledError:  # the client left before the first token
                self.replicas.release(replica, prompt)
                if key is not None:
                    feed.release(key, request_id)
                raise
            except Exception as exc:  # noqa: BLE001 - the engine's own refusal
                self.replicas.release(replica, prompt)
                if key is not None:
                    feed.release(key)
                error = error_from_engine(exc)
                if error.type in RETRY_ELSEWHERE:
                    last = error
                    continue
                raise error from None
            self.replicas.first_token(replica, prompt)
            if item["finish_reason"] == "error" and item.get("error_type") in RETRY_ELSEWHERE \
                    and not item["token_ids"]:
                self.replicas.release(replica)
                feed.release(key)
                last = error_from_item(item)
                continue
            self.replicas.check_hit(expected, item.get("num_cached_tokens", 0))
            return replica, feed, key, queue, item


async def next_item(queue: asyncio.Queue) -> StreamItem:
    """The request's next item, with every item queued behind it merged in (a consumer that lags takes
    all its tokens at once); raises what the feed queued instead (``SubscriptionLost``)."""
    item = await queue.get()
    if isinstance(item, BaseException):
        raise item
    while not item["finished"] and not queue.empty():
        following = queue.get_nowait()
        if isinstance(following, BaseException):
            queue.put_nowait(following)   # the feed's end is always last: the next call raises it
            break
        item = merge(item, following)
    return item


def merge(a: StreamItem, b: StreamItem) -> StreamItem:
    """Two consecutive items of one request as one."""
    def cat(x, y):
        return None if x is None and y is None else (x or []) + (y or [])
    return StreamItem(request_id=b["request_id"], token_ids=a["token_ids"] + b["token_ids"], finished=b["finished"],
                      finish_reason=b["finish_reason"], logprobs=cat(a["logprobs"], b["logprobs"]),
                      num_cached_tokens=b["num_cached_tokens"], error=b["error"], error_type=b["error_type"],
                      prompt_logprobs=cat(a["prompt_logprobs"], b["prompt_logprobs"]))
