"""The Ray executor: one worker actor per device, each a thin shell over a worker (``make_worker``).

Same interface as ``cluster.engine.executor.LocalExecutor`` (``execute``, ``restart``, ``shutdown``;
``WorkerFailure`` when a worker is lost). Each step goes to the actors encoded (``workers.wire``), as a
Ray Compiled Graph when every worker shares this node, and pipeline stages hand hidden states on among
themselves.
"""
from __future__ import annotations

import os

from workers.protocol import StepInput, StepOutput

from cluster.engine.engine import WorkerFailure
from cluster.engine.executor import make_worker


class WorkerActor:
    """Ray actor shell over a worker: decodes the step, runs it, encodes the result.

    Built in two calls so that tensor-parallel ranks can first agree on a rendezvous: ``address`` (rank
    0's node and a free port), then ``setup`` on every rank at once.
    """

    def __init__(self, worker_kwargs: dict):
        self.worker_kwargs = worker_kwargs
        self.worker = None

    def address(self) -> tuple[str, int]:
        import socket

        import ray
        with socket.socket() as sock:
            sock.bind(("", 0))
            return ray.util.get_node_ip_address(), sock.getsockname()[1]

    def setup(self, rendezvous: dict | None = None) -> int:
        """``rendezvous``: world rank/size, address, and this stage's tensor-parallel ranks."""
        kwargs = dict(self.worker_kwargs)
        if rendezvous:
            import torch
            import torch.distributed as dist
            backend = "nccl" if torch.cuda.is_available() else "gloo"
            dist.init_process_group(backend, init_method=f"tcp://{rendezvous['address']}",
                                    rank=rendezvous["rank"], world_size=rendezvous["world_size"])
            groups = [dist.new_group(ranks) for ranks in rendezvous["stage_ranks"]]   # every rank, same order
            kwargs["tensor_parallel_group"] = groups[rendezvous["stage"]]
        self.worker = make_worker(kwargs)
        return os.getpid()

    def node_id(self) -> str:
        import ray
        return ray.get_runtime_context().get_node_id()

    def execute(self, payload: bytes, hidden=None):
        from workers.wire import decode_step, encode_output
        out = self.worker.execute(decode_step(payload), hidden)
        return encode_output(out) if isinstance(out, StepOutput) else out


def _owner() -> str:
    """``namespace.actor-name.`` of the named actor starting the workers (the engine), else ""."""
    import ray
    context = ray.get_runtime_context()
    actor = context.get_actor_name() if context.get_actor_id() else None
    return f"{context.namespace}.{actor}." if actor else ""


def _remove_stale_groups(owner: str, token: str) -> None:
    """Remove the placement groups a dead predecessor of this named engine left behind.

    A group outlives the actor that created it (Ray ties it to the job), so an engine that Ray restarts
    after a crash would find its predecessor's devices still reserved and could never place its own
    workers. An actor name is unique in its namespace, so a live group under this name and another
    process's token is a dead predecessor's."""
    import ray
    for info in ray.util.placement_group_table().values():
        name = info.get("name") or ""
        if f"-ranks-{owner}" in name and not name.endswith(f"-{token}") and info.get("state") != "REMOVED":
            ray.util.remove_placement_group(ray.util.get_placement_group(name))


class RayExecutor:
    """One worker actor per device, in one placement group named for what it holds (a bundle per stage).

    ``replica_set``: the name prefix the engines of one data-parallel deployment share; the group is then
    placed on nodes none of them uses, when the cluster has such nodes (``_place_apart``).

    ``stage_kwargs`` holds one entry per worker, stage-major: ``ranks_per_stage`` tensor-parallel ranks
    (with ``tensor_parallel_size`` / ``tensor_parallel_rank`` set) per pipeline stage. Ranks are packed; stages too unless
    ``spread_stages`` asks for different nodes. Each step's encoded deltas go to every actor; every rank
    of stage ``k`` receives rank 0 of stage ``k-1``'s hidden states, never passing through the engine.
    """

    in_process = False

    @classmethod
    def create(cls, stage_kwargs: list[dict], args, ranks_per_stage: int, *,
               replica_set: str | None = None) -> RayExecutor:
        """What ``build_engine`` calls: placed as the engine arguments (``EngineArgs``) say."""
        return cls(stage_kwargs, num_gpus_per_worker=args.num_gpus_per_worker,
                   num_cpus_per_worker=args.num_cpus_per_worker, spread_stages=args.spread_stages,
                   ranks_per_stage=ranks_per_stage, replica_set=replica_set)

    def __init__(self, stage_kwargs: list[dict], *, num_gpus_per_worker: float = 0.0, num_cpus_per_worker: float = 1.0,
                 spread_stages: bool = False, step_timeout_s: float = 300.0, start_timeout_s: float = 600.0,
                 placement_timeout_s: float = 120.0,
                 compiled: bool = True, ranks_per_stage: int = 1, replica_set: str | None = None,
                 spread_wait_s: float = 5.0):
        if len(stage_kwargs) % ranks_per_stage:
            raise ValueError(f"{len(stage_kwargs)} workers do not split into stages of {ranks_per_stage} ranks")
        self.stage_kwargs = stage_kwargs
        self.ranks_per_stage = ranks_per_stage
        self.compiled = compiled
        self._dag = None
        self.num_gpus = num_gpus_per_worker
        self.num_cpus = num_cpus_per_worker
        self.spread_stages = spread_stages
        self.step_timeout_s = step_timeout_s
        self.start_timeout_s = start_timeout_s
        self.placement_timeout_s = placement_timeout_s
        self.replica_set = replica_set      # engine-name prefix of data-parallel siblings to keep away from
        self.spread_wait_s = spread_wait_s
        self.last_payload_bytes = 0
        self.actors: list = []
        self._stages: list[list] = []
        self.worker_names: list[str] = []
        self.placement_group = None
        self._generation = 0
        self._start()

    def _start(self) -> None:
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self._generation += 1
        n = len(self.stage_kwargs)
        tp = self.ranks_per_stage
        pp = n // tp
        # One bundle per stage holding all its ranks' devices: a bundle lives on one node, so a stage's
        # tensor-parallel ranks are always packed; stages are packed, or spread when asked.
        bundle = {"CPU": self.num_cpus * tp, **({"GPU": self.num_gpus * tp} if self.num_gpus else {})}
        strategy = "SPREAD" if self.spread_stages and pp > 1 else "PACK"
        # Unique per start: a restarted engine must not meet the names of its dead predecessor's workers.
        token = f"{os.getpid()}-{self._generation}"
        owner = _owner()
        name = f"swakv-{pp}-stages-of-{tp}-ranks-{owner}{token}"
        if self._generation == 1 and owner:
            _remove_stale_groups(owner, token)
        self.placement_group = self._place_apart([dict(bundle) for _ in range(pp)], strategy, name)
        if self.placement_group is None:
            self.placement_group = placement_group([dict(bundle) for _ in range(pp)], strategy=strategy, name=name)
        try:
            ray.get(self.placement_group.ready(), timeout=self.placement_timeout_s)
        except ray.exceptions.GetTimeoutError:
            ray.util.remove_placement_group(self.placement_group)
            raise RuntimeError(f"placement group {name} ({pp} x {bundle}, {strategy}) could not be placed within "
                               f"{self.placement_timeout_s:.0f} s: the cluster lacks the resources") from None
        actor_cls = ray.remote(WorkerActor)
        env = {"env_vars": {"GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo"),
                            "OMP_WAIT_POLICY": "PASSIVE"}}   # ranks sharing cores must not spin
        self.worker_names = [self._name(kw, token) for kw in self.stage_kwargs]
        self.actors = [
            actor_cls.options(num_cpus=self.num_cpus, num_gpus=self.num_gpus, max_restarts=0, runtime_env=env, name=name,
                              scheduling_strategy=PlacementGroupSchedulingStrategy(
                                  placement_group=self.placement_group, placement_group_bundle_index=i // tp)
                              ).remote(kwargs)
            for i, (kwargs, name) in enumerate(zip(self.stage_kwargs, self.worker_names))]
        try:
            rendezvous = [None] * n
            if tp > 1:
                host, port = ray.get(self.actors[0].address.remote(), timeout=self.start_timeout_s)
                stage_ranks = [list(range(s, s + tp)) for s in range(0, n, tp)]
                rendezvous = [dict(address=f"{host}:{port}", rank=i, world_size=n, stage=i // tp,
                                   stage_ranks=stage_ranks) for i in range(n)]
            self.pids = ray.get([a.setup.remote(r) for a, r in zip(self.actors, rendezvous)],
                                timeout=self.start_timeout_s)
        except Exception as exc:  # noqa: BLE001 - a worker that cannot start is a start-up error
            self.shutdown()
            raise RuntimeError(f"worker actors failed to start: {exc}") from exc
        self._stages = [self.actors[s:s + tp] for s in range(0, n, tp)]
        # A Compiled Graph only when every worker shares this process's node: across nodes, Ray 2.60's
        # graph channels can crash a raylet when the graph is torn down (a worker lost, a restart).
        here = ray.get_runtime_context().get_node_id()
        nodes = ray.get([a.node_id.remote() for a in self.actors], timeout=self.start_timeout_s)
        if self.compiled and all(node == here for node in nodes):
            self._dag = self._compile()

    def _place_apart(self, bundles: list[dict], strategy: str, name: str):
        """The placement group on nodes holding no data-parallel sibling's workers, when there are such
        nodes big enough for a bundle and it is placed within ``spread_wait_s``; else None (place anywhere).
        Ray spreads the bundles of one group, not groups: siblings' nodes are read from their groups' names."""
        import ray
        from ray.util.placement_group import placement_group
        if not self.replica_set:
            return None
        fragment = f"-ranks-{ray.get_runtime_context().namespace}.{self.replica_set}-"
        taken = {node for info in ray.util.placement_group_table().values()
                 if fragment in (info.get("name") or "") and info.get("name") != name and info.get("state") == "CREATED"
                 for node in (info.get("bundles_to_node_id") or {}).values()}
        if not taken:
            return None
        room = [n for n in ray.nodes() if n.get("Alive") and n["NodeID"] not in taken
                and all(n.get("Resources", {}).get(k, 0) >= v for k, v in bundles[0].items())]
        if not room:
            return None
        selector = {"ray.io/node-id": f"!in({','.join(sorted(taken))})"}
        pg = placement_group(bundles, strategy=strategy, name=name, bundle_label_selector=[selector] * len(bundles))
        try:
            ray.get(pg.ready(), timeout=self.spread_wait_s)
            return pg
        except ray.exceptions.GetTimeoutError:   # those nodes are busy: anywhere will do
            ray.util.remove_placement_group(pg)
            return None

    @staticmethod
    def _name(kwargs: dict, token: str) -> str:
        stage = kwargs.get("stage", kwargs.get("pipeline_stage", 0)) or 0
        return f"swakv-worker-stage{stage}-rank{kwargs.get('tensor_parallel_rank', 0)}-{token}"

    @property
    def uses_compiled_graph(self) -> bool:
        return self._dag is not None

    def _compile(self):
        """The step as a Ray Compiled Graph: deltas in, each stage feeding the next (see docs/serving.md)."""
        from ray.dag import InputNode
        from ray.dag import MultiOutputNode
        with InputNode() as payload:
            outputs, hidden = [], None
            for ranks in self._stages:
                nodes = [a.execute.bind(payload, hidden) if hidden is not None else a.execute.bind(payload)
                         for a in ranks]
                outputs += nodes[1:]   # other ranks' results are not needed, but must be consumed
                hidden = nodes[0]
            return MultiOutputNode([hidden] + outputs).experimental_compile()

    def execute(self, step: StepInput) -> StepOutput:
        import ray

        from workers.wire import decode_output, encode_step
        payload = encode_step(step)
        self.last_payload_bytes = len(payload) * len(self.actors)
        try:
            if self._dag is not None:
                result = ray.get(self._dag.execute(payload), timeout=self.step_timeout_s)[0]
            else:
                refs, hidden = [], None
                for ranks in self._stages:
                    stage = [a.execute.remote(payload, hidden) for a in ranks]
                    refs += stage
                    hidden = stage[0]
                result = ray.get(refs, timeout=self.step_timeout_s)[-len(self._stages[-1])]
            return decode_output(result)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError, ray.exceptions.ObjectLostError,
                ray.exceptions.RayChannelError) as exc:
            raise WorkerFailure(f"step {step.step_id}: {type(exc).__name__}: {exc}") from exc

    def restart(self) -> None:
        self.shutdown()
        self._start()

    def shutdown(self) -> None:
        import threading

        import ray
        if self._dag is not None:   # teardown can wait on a dead actor: bounded, then kill
            t = threading.Thread(target=self._dag.teardown, kwargs={"kill_actors": True}, daemon=True)
            t.start()
            t.join(30)
            self._dag = None
        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        self.actors = []
        if self.placement_group is not None:
            ray.util.remove_placement_group(self.placement_group)
            self.placement_group = None
