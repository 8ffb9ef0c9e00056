"""swakv's cluster layer: engine, scheduler, Ray actors, Serve app, CLI.

``from cluster import LLM`` works; heavy imports (torch, transformers, Ray) happen on first use only.
"""


def __getattr__(name):
    if name == "LLM":
        from .llm import LLM
        return LLM
    raise AttributeError(f"module 'cluster' has no attribute {name!r}")


__all__ = ["LLM"]
