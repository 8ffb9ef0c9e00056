"""What a load test needs, checked before anything starts (``LoadTestConfig.check`` names the bad field)."""
from __future__ import annotations

from dataclasses import dataclass, field

from kvmanager.checks import check_int, check_number

from cluster.engine.args import EngineArgs
from cluster.routing.policies import ROUTERS

from .workloads import WORKLOADS, load_trace

LAYOUTS = ("window_aware", "sliding_as_full")
HOST_TIER = "host_tier"        # window-aware with a host KV tier of ``kv_host_memory`` (compared with window_aware)
WORKLOAD_KNOBS = ("sessions", "turns", "rate", "system_tokens", "user_tokens", "max_tokens", "think_s",
                  "system_prompts", "documents", "popularity")

# A router comparison's workloads, unless overridden: enough sessions and arrivals to keep three replicas
# busy, and prefixes shared among sessions (a few apps' system prompts; a dozen documents), some more
# popular than others (Zipf-like, ``loadgen._popular``), as real traffic is.
ROUTER_WORKLOADS = {
    "chat": {"sessions": 48, "rate": 4.0, "system_prompts": 6, "popularity": 1.0},
    "qa": {"sessions": 80, "rate": 4.0, "documents": 12, "popularity": 1.0},
    "agent": {"sessions": 24, "rate": 2.0},
}


@dataclass
class LoadTestConfig:
    """Everything a load test needs; ``check`` names the field of any bad value."""

    model: str = "gemma-3-27b"
    gpu: str = "H100-80GB"
    real: bool = False                  # real tiny-model workers instead of simulated ones
    nodes: int = 3                      # head + (nodes - 1) worker nodes
    cpus_per_node: int = 2
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 2
    kv_memory: int | None = 6 << 30     # per device; None: what the GPU leaves (swakv plan's default)
    kv_host_memory: int | None = None   # the host_tier layout's host KV tier, per replica
    block_size: int = 16
    max_num_batched_tokens: int = 512
    sleep_factor: float = 1.0           # simulated step time slept by the workers, x this
    layouts: tuple[str, ...] = LAYOUTS
    workload: str = "chat"
    trace: str | None = None
    workload_args: dict = field(default_factory=dict)   # overrides of the workload's own defaults
    seed: int = 0
    duration_s: float = 20.0            # no new request after this
    drain_s: float = 30.0               # then this long for the ones in flight
    kill_worker_at: float | None = None
    kill_node_at: float | None = None
    port: int | None = None             # None: a free one
    out_dir: str | None = "loadtest-out"
    progress: bool = True
    data_parallel_size: int = 1         # engine replicas
    routers: tuple[str, ...] = ()       # non-empty: one run per router (same arrivals) instead of per layout
    kill_replica_at: float | None = None

    @property
    def runs(self) -> tuple[str, ...]:
        """What the runs compare: routers, or KV layouts."""
        return self.routers or self.layouts

    def check(self) -> LoadTestConfig:
        for name in ("nodes", "cpus_per_node", "tensor_parallel_size", "pipeline_parallel_size", "block_size",
                     "max_num_batched_tokens", "data_parallel_size"):
            check_int(name, getattr(self, name), 1)
        if self.nodes < 2:
            raise ValueError(f"nodes must be >= 2 (a head and at least one worker node), got {self.nodes}")
        workers = self.data_parallel_size * self.pipeline_parallel_size
        if (self.nodes - 1) * self.cpus_per_node < workers:
            raise ValueError(f"data_parallel_size={self.data_parallel_size} x pipeline_parallel_size="
                             f"{self.pipeline_parallel_size} needs {workers} worker CPUs; "
                             f"nodes={self.nodes} with cpus_per_node={self.cpus_per_node} give "
                             f"{(self.nodes - 1) * self.cpus_per_node}")
        if not isinstance(self.routers, tuple) or any(r not in ROUTERS for r in self.routers) \
                or len(set(self.routers)) != len(self.routers):
            raise ValueError(f"routers must be distinct names from {', '.join(ROUTERS)}, got {self.routers!r}")
        if self.routers and len(self.layouts) != 1:
            raise ValueError(f"a comparison of routers runs one KV layout, got layouts={self.layouts!r}")
        if self.kill_replica_at is not None:
            check_number("kill_replica_at", self.kill_replica_at, 0)
            if self.data_parallel_size < 2:
                raise ValueError("kill_replica_at needs data_parallel_size >= 2 (another replica to retry on)")
        if self.kv_memory is not None:
            check_int("kv_memory", self.kv_memory, 1)
        for name in ("sleep_factor", "duration_s", "drain_s"):
            check_number(name, getattr(self, name), 0, above=name == "duration_s")
        for name in ("kill_worker_at", "kill_node_at"):
            if getattr(self, name) is not None:
                check_number(name, getattr(self, name), 0)
        if self.kill_node_at is not None and (self.nodes - 2) * self.cpus_per_node < workers:
            raise ValueError(f"kill_node_at needs the worker nodes left after one dies to hold all "
                             f"{workers} workers: (nodes - 2) x cpus_per_node >= data_parallel_size x "
                             f"pipeline_parallel_size, got nodes={self.nodes}, cpus_per_node={self.cpus_per_node}")
        if not self.layouts or any(x not in LAYOUTS + (HOST_TIER,) for x in self.layouts):
            raise ValueError(f"layouts must be a non-empty subset of {LAYOUTS + (HOST_TIER,)}, got {self.layouts!r}")
        if self.kv_host_memory is not None:
            check_int("kv_host_memory", self.kv_host_memory, 1)
        if (HOST_TIER in self.layouts) != (self.kv_host_memory is not None):
            raise ValueError("the host_tier layout and kv_host_memory go together (the host tier's size), got "
                             f"layouts={self.layouts!r}, kv_host_memory={self.kv_host_memory!r}")
        if self.workload not in WORKLOADS:
            raise ValueError(f"workload must be one of {', '.join(WORKLOADS)}, got {self.workload!r}")
        unknown = sorted(set(self.workload_args) - set(WORKLOAD_KNOBS))
        if unknown:
            raise ValueError(f"workload_args: unknown field(s) {unknown}; known: {', '.join(WORKLOAD_KNOBS)}")
        if self.port is not None:
            check_int("port", self.port, 1)
        check_int("seed", self.seed, 0)
        return self

    def engine_args(self, layout: str) -> EngineArgs:
        """The engine of one replica for ``layout``: simulated workers timed as on ``gpu`` (real tiny-model
        ones with ``real``), stages spread over the worker nodes."""
        sim = {} if self.real else dict(simulated_gpu=self.gpu, sleep_factor=self.sleep_factor)
        return EngineArgs(model=self.model, tensor_parallel_size=self.tensor_parallel_size,
                          pipeline_parallel_size=self.pipeline_parallel_size, block_size=self.block_size,
                          max_num_batched_tokens=self.max_num_batched_tokens, kv_cache_memory=self.kv_memory,
                          spread_stages=True, seed=0, sliding_as_full=layout == "sliding_as_full",
                          kv_host_memory=self.kv_host_memory if layout == HOST_TIER else None, **sim)

    def sessions(self):
        """The workload (validated by its generator: a bad knob raises naming it)."""
        if self.trace:
            return load_trace(self.trace)
        return WORKLOADS[self.workload](seed=self.seed, **self.workload_args)
