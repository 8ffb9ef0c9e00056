"""The OpenAI HTTP edge on Ray Serve: request bodies and errors (``openai``), streaming (``streaming``),
``/metrics`` (``metrics``), the routes (``server``), and how the app is deployed
(``launch``; ``builder`` for ``ray_configs/serve.yaml``).

This package was one module, ``cluster/serve.py``, before the layout step: its public names still resolve
here, on first use (``OpenAIServer`` was the Serve deployment, now ``ray_serve.OpenAIDeployment``)."""

_OLD_NAMES = {
    "APIError": ("openai", "APIError"), "ChatBody": ("openai", "ChatBody"), "ChatMessage": ("openai", "ChatMessage"),
    "CompletionBody": ("openai", "CompletionBody"), "StreamOptions": ("openai", "StreamOptions"),
    "EventStream": ("streaming", "EventStream"), "prometheus_text": ("metrics", "prometheus_text"),
    "OpenAIServer": ("ray_serve", "OpenAIDeployment"), "build_app": ("ray_serve", "build_app"),
    "run": ("ray_serve", "run"),
}


def __getattr__(name):
    if name in _OLD_NAMES:
        import importlib
        module, attr = _OLD_NAMES[name]
        return getattr(importlib.import_module(f"{__name__}.{module}"), attr)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
