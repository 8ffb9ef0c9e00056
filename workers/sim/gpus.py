"""GPU presets from NVIDIA's datasheets, and the KV memory a model leaves on one.

``default_kv_memory`` is what ``swakv plan`` and the simulated engine assume when no KV budget is given:

    kv_memory = memory x (1 - ACTIVATION_RESERVE) - weight_bytes / (TP x PP)

ACTIVATION_RESERVE (10% of device memory, as vLLM's default gpu_memory_utilization=0.9 leaves) covers
activations of a prefill chunk, the CUDA context, communication buffers, CUDA graphs and fragmentation.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

ACTIVATION_RESERVE = 0.10
_B = 10**9
# Host <-> device copies (the host KV tier) reach about 86% of a PCIe link's one-way datasheet rate: 128b/130b
# line coding and TLP/DLLP framing at 256-byte payloads leave about 90%, DMA setup the rest; NVIDIA's
# nvbandwidth host_to_device_memcpy_ce is commonly reported at about 55 GB/s on PCIe Gen5 x16 H100s
# (64 GB/s one way) and about 26 GB/s on Gen4 x16 A100s (32 GB/s).
PCIE_EFFICIENCY = 0.86


# --------------------------------------------------------------------------------------------------
# GPU presets (NVIDIA datasheets). Memory in decimal bytes as the datasheet states it (nvidia-smi shows
# a little more: the planner stays on the safe side). bf16 figures are dense (the datasheets' headline
# numbers are "with sparsity", twice these). Interconnect: one direction of the link, which is what a
# ring all-reduce or a pipeline send uses (the datasheets quote both directions together).
# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class GpuPreset:
    name: str
    memory_bytes: int
    hbm_bytes_per_s: float
    bf16_flops_per_s: float
    interconnect_bytes_per_s: float
    interconnect: str
    source: str
    host_link_bytes_per_s: float = 0.0   # effective host <-> device copy rate, one way (0: unknown)


GPU_PRESETS: dict[str, GpuPreset] = {g.name: g for g in (
    # NVIDIA H100 Tensor Core GPU datasheet, H100 SXM column: 80 GB HBM3, 3.35 TB/s; BF16 Tensor Core
    # 1,979 TFLOPS with sparsity -> 989.5 dense; NVLink 900 GB/s (both directions) -> 450 GB/s.
    # Host link: PCIe Gen5 x16, 128 GB/s both directions -> 64 GB/s one way, x PCIE_EFFICIENCY.
    GpuPreset("H100-80GB", 80 * _B, 3.35e12, 989.5e12, 450e9, "NVLink 4 (SXM5)",
              "NVIDIA H100 datasheet, SXM", 64e9 * PCIE_EFFICIENCY),
    # NVIDIA H200 datasheet, H200 SXM: 141 GB HBM3e, 4.8 TB/s; BF16 1,979 TFLOPS sparse -> 989.5 dense;
    # NVLink 900 GB/s -> 450 GB/s one way.
    # Host link: PCIe Gen5 x16 (128 GB/s both directions) -> 64 GB/s one way, x PCIE_EFFICIENCY.
    GpuPreset("H200", 141 * _B, 4.8e12, 989.5e12, 450e9, "NVLink 4 (SXM)", "NVIDIA H200 datasheet, SXM",
              64e9 * PCIE_EFFICIENCY),
    # NVIDIA A100 datasheet, A100 80GB SXM: 80 GB HBM2e, 2,039 GB/s; BF16 Tensor Core 312 TFLOPS dense;
    # NVLink 600 GB/s -> 300 GB/s one way.
    # Host link: PCIe Gen4 x16 (64 GB/s both directions) -> 32 GB/s one way, x PCIE_EFFICIENCY.
    GpuPreset("A100-80GB", 80 * _B, 2.039e12, 312e12, 300e9, "NVLink 3 (SXM4)", "NVIDIA A100 datasheet, 80GB SXM",
              32e9 * PCIE_EFFICIENCY),
    # NVIDIA L40S datasheet: 48 GB GDDR6, 864 GB/s; BF16 Tensor Core 362.05 TFLOPS dense (733 sparse);
    # no NVLink: PCIe Gen4 x16, 64 GB/s both directions -> 32 GB/s one way.
    # Host link: the same PCIe Gen4 x16, x PCIE_EFFICIENCY.
    GpuPreset("L40S", 48 * _B, 864e9, 362.05e12, 32e9, "PCIe Gen4 x16", "NVIDIA L40S datasheet",
              32e9 * PCIE_EFFICIENCY),
)}


def get_gpu(name: Any) -> GpuPreset:
    if isinstance(name, GpuPreset):
        return name
    if name not in GPU_PRESETS:
        raise ValueError(f"unknown GPU {name!r}; known: {', '.join(GPU_PRESETS)}")
    return GPU_PRESETS[name]




def default_kv_memory(model, gpu, tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1) -> int:
    """KV bytes per device once weights (split over TP x PP) and the activation reserve are taken."""
    weights = model.weight_bytes / (tensor_parallel_size * pipeline_parallel_size)
    usable = gpu.memory_bytes * (1 - ACTIVATION_RESERVE)
    kv = int(usable - weights)
    if kv <= 0:
        raise ValueError(f"{model.name} weights take {format_size(weights)} per device with TP={tensor_parallel_size} x "
                         f"PP={pipeline_parallel_size}, more than the {format_size(usable)} one {gpu.name} leaves after "
                         f"its {ACTIVATION_RESERVE:.0%} activation reserve; raise --tensor-parallel-size / "
                         "--pipeline-parallel-size or give --kv-memory")
    return kv


def format_size(n: float) -> str:
    """Bytes in the largest binary unit that keeps the figure >= 1: '2.91 GiB'."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):,.2f} {unit}"
    return f"{n:,.0f} B"
