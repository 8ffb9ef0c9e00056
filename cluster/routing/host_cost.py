"""What a prefix hit found in a replica's host tier is worth to the router, from the step cost model.

A replica's manager grants a hit over both tiers (``kvmanager/host_tier.py``): every block the hit needs
(full attention: all before it; a sliding window: the last window; chunked: the current chunk) on the
device or on host, and it loads the blocks found on host only before the request computes. So a replica
whose hit reaches ``h_u`` tokens over device and host, of which the device alone grants ``h_d``, saves
the prefill of tokens ``h_d .. h_u`` and pays a load instead. The router counts those tokens at

    t_load    = sum over groups g of  B_g x (needed blocks of g for a hit of h_u on host only)  /  link
    t_prefill = StepCostModel.step([(h_d, h_u - h_d)]).time_s        (those tokens recomputed after h_d)
    h         = h_d + floor((h_u - h_d) x max(0, 1 - t_load / t_prefill))

``B_g`` is one block of group ``g`` on one device: its width in pool units x the unit's bytes
(``kv_layout``: a unit is the pages of ``S`` layers, sharded by tensor parallelism, one pipeline stage);
each device loads its own shard over its own host link, in parallel, so the time is one device's. ``link``
is the GPU preset's host<->device copy rate, one direction (``GpuPreset.host_link_bytes_per_s``: PCIe
one way at its measured efficiency, the rate the simulated workers charge copies at). The load replaces a prefill of ``h_u - h_d`` tokens: a token
found on host counts as a fraction ``1 - t_load / t_prefill`` of a device token (the load's time in
prefill tokens is taken off), and nothing when the load would take longer than recomputing. ``h`` is what
the prefix router ranks replicas by and estimates their wait with (``policies.PrefixAware``).

The bytes are window-aware because the loads are: a long sliding-window hit costs its last window only.
"""
from __future__ import annotations

from functools import lru_cache
from typing import Callable

from kvmanager.planning import as_full_attention, kv_layout
from workers.sim.cost_model import StepCostModel
from workers.sim.gpus import get_gpu
from workers.sim.presets import get_model_preset

class HostHitCost:
    """The discount of host-tier hits for one deployment (every replica the same model, GPU and split):
    ``block_bytes[g]``, one block of group ``g`` on one device; ``link_bytes_per_s``; ``prefill_s(start,
    n)``, the time to compute ``n`` tokens after ``start`` computed ones. ``for_deployment`` builds it from
    the presets and the step cost model."""

    def __init__(self, block_bytes, link_bytes_per_s: float, prefill_s: Callable[[int, int], float]):
        if not link_bytes_per_s > 0:
            raise ValueError(f"link_bytes_per_s must be > 0, got {link_bytes_per_s!r}")
        self.block_bytes = tuple(block_bytes)
        self.link_bytes_per_s = link_bytes_per_s
        self.prefill_s = prefill_s

    @classmethod
    def for_deployment(cls, model, gpu, block_size: int = 16, tensor_parallel_size: int = 1,
                       pipeline_parallel_size: int = 1, link_bytes_per_s: float | None = None,
                       sliding_as_full: bool = False) -> "HostHitCost":
        """From the model and GPU presets: ``kv_layout``'s blocks, the GPU's host link (unless given),
        ``StepCostModel``'s prefill time."""
        preset, gpu = get_model_preset(model), get_gpu(gpu)
        specs = preset.layer_specs(block_size)
        layout = kv_layout(as_full_attention(specs) if sliding_as_full else specs, pipeline_parallel_size,
                           tensor_parallel_size)
        model_cost = StepCostModel(preset, gpu, tensor_parallel_size, pipeline_parallel_size)

        @lru_cache(maxsize=4096)
        def prefill_s(start: int, num_tokens: int) -> float:
            return model_cost.step([(start, num_tokens)]).time_s

        link = link_bytes_per_s if link_bytes_per_s is not None else gpu.host_link_bytes_per_s
        return cls(tuple(w * layout.block_bytes for w in layout.group_widths), link, prefill_s)

    @classmethod
    def from_info(cls, info) -> "HostHitCost | None":
        """For the replica whose ``ready()`` info this is; None without a host tier, or on real workers: the
        cost model knows the presets' GPUs only, so a real deployment's router counts device hits alone."""
        if not info.get("num_host_blocks") or not info.get("simulated_gpu"):
            return None
        return cls.for_deployment(info["model_path"], info["simulated_gpu"], info["block_size"],
                                  info["tensor_parallel_size"], info["pipeline_parallel_size"],
                                  sliding_as_full=info.get("sliding_as_full", False))

    def load_s(self, host_blocks) -> float:
        """Time to load ``host_blocks[g]`` blocks of each group onto one device."""
        return sum(n * b for n, b in zip(host_blocks, self.block_bytes)) / self.link_bytes_per_s

    def worth(self, device_hit: int, tiered_hit: int, host_blocks) -> int:
        """The hit the router counts: ``h`` of the module's formula."""
        extra = tiered_hit - device_hit
        if extra <= 0:
            return device_hit
        ratio = self.load_s(host_blocks) / self.prefill_s(device_hit, extra)
        return device_hit + int(extra * max(0.0, 1.0 - ratio))
