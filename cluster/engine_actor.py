"""The engine as an async Ray actor: a step loop that runs while there is work and sleeps when idle.

A thin shell over ``Engine``: ``schedule`` / ``apply`` run on the actor's event loop (as do
``add_request`` and ``abort``, so they never overlap); the workers' step runs in a thread, keeping the
loop free to accept and stream. Each request is a Ray streaming generator; when its consumer goes away
the generator is closed and the request aborted.
"""
from __future__ import annotations

import asyncio
import logging

from .engine import WorkerFailure
from .scheduler import SamplingParams

log = logging.getLogger("swakv.engine")

ENGINE_ACTOR_NAME = "swakv-engine"
NAMESPACE = "swakv"


class EngineService:
    """Wrap this with ``ray.remote`` (see ``start_engine_actor``); ``build`` returns (Engine, model info)."""

    def __init__(self, build, *build_args, **build_kwargs):
        self.engine, self.info = build(*build_args, **build_kwargs)
        self._streams: dict[str, asyncio.Queue] = {}
        self._wake = asyncio.Event()
        self._loop_task: asyncio.Task | None = None
        self._failed: BaseException | None = None

    async def ready(self) -> dict:
        return self.info

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: dict | None = None):
        """Yields ``{"token_ids": [...], "finished": bool, "finish_reason": str | None, "logprobs": [...] | None,
        "num_cached_tokens": int}`` (``logprobs``: per token, raw logprob, top ids, top logprobs)."""
        if self._failed is not None:
            raise RuntimeError(f"engine stopped after an unrecoverable error: {self._failed}")
        sampling = SamplingParams(**(params or {}))
        queue: asyncio.Queue = asyncio.Queue()
        self.engine.add_request(request_id, prompt_token_ids, sampling)  # ValueError: nothing queued
        self._streams[request_id] = queue
        self._ensure_loop()
        self._wake.set()
        finished = False
        try:
            while not finished:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item["finished"]
                yield item
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self.engine.abort(request_id)  # the consumer went away

    async def abort(self, request_id: str) -> bool:
        return self.engine.abort(request_id)

    async def stats(self) -> dict:
        return {**self.engine.stats(), "model": self.info.get("model")}

    def _ensure_loop(self) -> None:
        if self._loop_task is None or self._loop_task.done():
            self._loop_task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        engine = self.engine
        try:
            while True:
                if not engine.has_work():
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                plan = engine.schedule()
                if plan is None:
                    await asyncio.sleep(0.001)
                    continue
                try:
                    output = await asyncio.to_thread(engine.executor.execute, plan.step)
                except WorkerFailure as exc:
                    log.warning("worker failure, restarting workers: %s", exc)
                    engine.recover()  # rare; runs on the loop so it never overlaps add_request
                    continue
                for update in engine.apply(plan, output):
                    queue = self._streams.get(update.request_id)
                    if queue is not None:
                        queue.put_nowait({"token_ids": update.new_token_ids, "finished": update.finished,
                                          "finish_reason": update.finish_reason, "logprobs": update.logprobs,
                                          "num_cached_tokens": update.num_cached_tokens})
        except BaseException as exc:  # noqa: BLE001 - every waiting client must hear about it
            log.exception("engine loop stopped")
            self._failed = exc
            for queue in self._streams.values():
                queue.put_nowait(RuntimeError(f"engine loop stopped: {exc!r}"))
            raise
