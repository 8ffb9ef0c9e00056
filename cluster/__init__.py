"""swakv's cluster layer: everything above the workers, one sub-package per concern (docs/design.md).

``from cluster import LLM`` works; heavy imports (torch, transformers, Ray) happen on first use only.

Modules that moved in the layout step keep their old paths (``moved``).
"""
from . import moved

moved.install()


def __getattr__(name):
    if name == "LLM":
        from .engine.llm import LLM
        return LLM
    raise AttributeError(f"module 'cluster' has no attribute {name!r}")


__all__ = ["LLM"]
