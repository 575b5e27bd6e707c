"""What the cost model knows of a device: attainable matmul rate, memory and link bandwidths, memory, latencies.

Built-in profiles take public datasheet numbers (dense bf16 tensor-core peak, HBM bandwidth, NVLink bandwidth per
direction, one 400/200 Gb/s InfiniBand NIC per GPU) scaled by the fractions a well-tuned dense transformer attains
(``compute_efficiency``, ``bandwidth_efficiency``). ``spmd-rlhf calibrate`` measures the rates on the current machine
instead and writes them with efficiency 1: the measured rate is already what is attained.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path


def default_profile_path() -> Path:
    """Where ``spmd-rlhf calibrate`` writes and ``placement: auto`` looks first: ``$SPMD_RLHF_PROFILE`` as it is when
    asked, else ``~/.cache/spmd_rlhf/device_profile.json``."""
    return Path(os.environ.get("SPMD_RLHF_PROFILE", Path.home() / ".cache" / "spmd_rlhf" / "device_profile.json"))


@dataclass(frozen=True)
class DeviceProfile:
    """One device kind and the links between devices, in SI units (FLOP/s, bytes/s, bytes, seconds)."""

    name: str
    """What the numbers describe (``h100``, ``a100``, or the calibrated device's name)."""
    peak_flops: float
    """Dense matmul FLOP/s in the training dtype: datasheet peak, or the measured rate of a large matmul."""
    memory_bandwidth: float
    """Device-memory bytes/s (a copy moves each byte twice: read and write)."""
    intra_node_bandwidth: float
    """Bytes/s each device sends to the others of its node in a collective (NVLink per direction)."""
    inter_node_bandwidth: float
    """Bytes/s each device sends across nodes (its share of the network)."""
    device_memory: float
    """Bytes of device memory."""
    collective_latency: float
    """Seconds of fixed cost per step of a ring collective (a ring over g ranks takes g - 1 steps), paid however
    small the message."""
    op_latency: float
    """Seconds of fixed cost per kernel (launch, or the framework's per-op overhead on CPU); decode steps run many
    small kernels, so this bounds small-batch decoding."""
    shared_cores: int = 0
    """CPU profiles: the cores every rank of the machine shares (a rank is one single-thread process), so that more
    busy ranks than cores run proportionally slower; 0: every device computes on its own (GPUs)."""
    overlaps_communication: bool = True
    """Collectives run beside compute (GPUs: NCCL on its own stream, FSDP prefetching), so a micro-batch costs the
    larger of the two; false (CPU ranks with gloo): they add up."""
    compute_efficiency: float = 1.0
    """Fraction of ``peak_flops`` attained by large matmuls (1 for calibrated profiles)."""
    bandwidth_efficiency: float = 1.0
    """Fraction of the memory and link bandwidths attained (1 for calibrated profiles)."""
    source: str = "datasheet"
    """Where the numbers come from: ``datasheet`` or ``calibrated on <host>, <date>``."""

    def __post_init__(self) -> None:
        for key in ("peak_flops", "memory_bandwidth", "intra_node_bandwidth", "inter_node_bandwidth", "device_memory"):
            if not getattr(self, key) > 0:
                raise ValueError(f"device profile {self.name!r}: {key}={getattr(self, key)} must be > 0")
        for key in ("compute_efficiency", "bandwidth_efficiency"):
            if not 0 < getattr(self, key) <= 1:
                raise ValueError(f"device profile {self.name!r}: {key}={getattr(self, key)} must be in (0, 1]")

    @property
    def flops(self) -> float:
        """Attained matmul FLOP/s."""
        return self.peak_flops * self.compute_efficiency

    def link_bandwidth(self, *, across_nodes: bool) -> float:
        """Attained bytes/s each device sends in a collective within a node or across nodes."""
        raw = self.inter_node_bandwidth if across_nodes else self.intra_node_bandwidth
        return raw * self.bandwidth_efficiency

    @property
    def attained_memory_bandwidth(self) -> float:
        return self.memory_bandwidth * self.bandwidth_efficiency

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2) + "\n"

    def save(self, path: str | os.PathLike) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.to_json())


_GB = 1e9
BUILTIN_PROFILES = {
    # H100 SXM5 80 GB: 989 TFLOP/s dense bf16, 3.35 TB/s HBM3, NVLink 4 at 450 GB/s per direction, 400 Gb/s NDR IB.
    "h100": DeviceProfile(
        name="h100",
        peak_flops=989e12,
        memory_bandwidth=3350 * _GB,
        intra_node_bandwidth=450 * _GB,
        inter_node_bandwidth=50 * _GB,
        device_memory=80 * _GB,
        collective_latency=8e-6,
        op_latency=5e-6,
        compute_efficiency=0.6,
        bandwidth_efficiency=0.8,
    ),
    # A100 SXM4 80 GB: 312 TFLOP/s dense bf16, 2.04 TB/s HBM2e, NVLink 3 at 300 GB/s per direction, 200 Gb/s HDR IB.
    "a100": DeviceProfile(
        name="a100",
        peak_flops=312e12,
        memory_bandwidth=2039 * _GB,
        intra_node_bandwidth=300 * _GB,
        inter_node_bandwidth=25 * _GB,
        device_memory=80 * _GB,
        collective_latency=8e-6,
        op_latency=5e-6,
        compute_efficiency=0.6,
        bandwidth_efficiency=0.8,
    ),
}
"""Datasheet profiles by name (``spmd-rlhf plan --profile h100``)."""


def load_profile(name_or_path: str | os.PathLike) -> DeviceProfile:
    """A built-in profile by name (h100, a100) or one written by ``spmd-rlhf calibrate``."""
    key = str(name_or_path).lower()
    if key in BUILTIN_PROFILES:
        return BUILTIN_PROFILES[key]
    path = Path(name_or_path)
    if not path.is_file():
        raise FileNotFoundError(
            f"no device profile {str(name_or_path)!r}: name a built-in one ({', '.join(BUILTIN_PROFILES)}) or a JSON "
            f"file written by `spmd-rlhf calibrate --out FILE`"
        )
    fields = json.loads(path.read_text())
    known = {field.name for field in dataclasses.fields(DeviceProfile)}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise ValueError(f"device profile {path}: unknown keys {unknown}; re-run `spmd-rlhf calibrate`")
    return DeviceProfile(**fields)
