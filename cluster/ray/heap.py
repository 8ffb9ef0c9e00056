"""Keep CPython's full garbage collections off the serving path.

A long-lived actor's heap is mostly what it built at start-up: Ray, uvicorn, transformers' modules, the
engine and its pool. A full (generation 2) collection walks all of it, 45-100 ms in the engine, edge and
worker actors measured here (``gc.callbacks``), and one lands every few seconds while the heap still
grows: a burst of requests that meets one waits that long for its first token. Freezing the start-up heap
moves it out of the collector's reach (``gc.freeze``), so later collections walk only what serving
allocated. Garbage made before the freeze is collected first; cycles made after it are still found.
"""
from __future__ import annotations

import gc


def freeze_startup_heap() -> None:
    """Collect once, then freeze what is left."""
    gc.collect()
    gc.freeze()
