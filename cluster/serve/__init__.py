"""The OpenAI HTTP edge on Ray Serve: request bodies and errors (``openai``), streaming (``streaming``),
``/metrics`` (``metrics``), the routes (``server``), and how the app is deployed
(``launch``; ``builder`` for ``ray_configs/serve.yaml``)."""
