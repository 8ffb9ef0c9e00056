"""The OpenAI app as a Ray Serve deployment: for ``ray_configs/serve.yaml`` (``serve run`` / ``serve
deploy``), ``swakv serve --frontend serve`` and the load test. Serve adds its proxy and a replica hop
between the client and the engines (``docs/performance.md`` measures both); ``edge.py`` serves the same
routes without them, which is ``swakv serve``'s default."""
from __future__ import annotations

from ray import serve

from cluster.routing.policies import make_router

from .openai import DEFAULT_MAX_BODY_BYTES
from .server import OpenAIServer, make_app


@serve.deployment(max_ongoing_requests=256, ray_actor_options={"num_cpus": 0})
@serve.ingress()
class OpenAIDeployment(OpenAIServer):
    """An ``OpenAIServer`` per Serve replica; Serve asks it for its app once it is constructed."""

    def __serve_build_asgi_app__(self):
        return make_app(self)


def build_app(engine_names: str | list[str], namespace: str, model_name: str, tokenizer_dir: str | None = None,
              max_model_len: int = 4096, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, router: str = "prefix",
              ray_actor_options: dict | None = None):
    """A bound Serve application for ``serve.run``; the engine actors are found by name when needed.
    ``ray_actor_options``: where its replica runs, when not anywhere (the load test pins it to the head)."""
    make_router(router)   # an unknown router name fails here, before anything is deployed
    deployment = OpenAIDeployment.options(ray_actor_options=ray_actor_options) if ray_actor_options \
        else OpenAIDeployment
    return deployment.bind(engine_names, namespace, model_name, tokenizer_dir, max_model_len, max_body_bytes, router)


def run(app, host: str = "127.0.0.1", port: int = 8000, name: str = "swakv", proxy_location: str | None = None):
    """Serve ``app`` over HTTP on ``host:port`` (Ray must be initialised); returns the deployment handle.
    ``proxy_location``: Serve's (EveryNode by default; the load test keeps the proxy on its head node)."""
    serve.start(http_options={"host": host, "port": port},
                **({"proxy_location": proxy_location} if proxy_location else {}))
    return serve.run(app, name=name, route_prefix="/")
