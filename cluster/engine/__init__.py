"""The serving engine without Ray: the scheduler, the KV-cache manager and an executor of steps
(``engine``), how one is built from a model and its arguments (``build``), the in-process executor
(``executor``), the offline ``LLM`` facade (``llm``), text <-> token ids (``tokenizer``) and the
KV-event schema a router reads
(``kv_events``). Nothing here imports Ray, the router or the HTTP edge."""

# This package was one module, ``cluster/engine.py``, before the layout step: its names resolve here on first use.
_OLD_NAMES = ("Engine", "EngineConfig", "EngineMetrics", "WorkerFailure")


def __getattr__(name):
    if name in _OLD_NAMES:
        from . import engine
        return getattr(engine, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
