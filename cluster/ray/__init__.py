"""The Ray runtime: the engine as an async actor (``engine_actor``), worker actors and the executor that
drives them (``executors``), and how a deployment's engine actors start and stop (``launch``). Thin shells
over ``cluster.engine`` and ``workers``; knows nothing of routing or HTTP."""
