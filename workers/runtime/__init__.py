"""The device runtime: one pipeline stage of a model on one device (``worker``), its block-table mirrors,
step inputs, sampler and decode CUDA graphs; the step loop that feeds it from the engine's shared-memory
rings (``step_loop``). Runs without Ray; ``cluster.ray`` wraps it in an actor."""
