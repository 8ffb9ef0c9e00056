"""The Ray runtime: the engine as an async actor (``engine_actor``), worker actors and the executor that
drives them (``executors``), how a deployment's engine actors start and stop (``launch``), and a port for a
server beside them that Ray's own processes never take (``ports``). Thin shells over ``cluster.engine`` and
``workers``; knows nothing of routing or HTTP."""
