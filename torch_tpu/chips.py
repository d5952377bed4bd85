"""TPU chip profiles and the emulated topology chosen from the environment.

``TORCH_TPU_CHIP`` picks a profile (default ``v5p``), ``TORCH_TPU_NUM_DEVICES``
the number of devices (default 1) and ``TORCH_TPU_HBM_BYTES`` overrides the
HBM capacity per device. Without the override the capacity is the chip's HBM,
capped to what this host can back: emulated HBM is host memory, and a v5p's
95 GiB on a smaller host would meet the kernel's OOM killer long before
``torch.OutOfMemoryError``.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping

GiB = 1 << 30

# Share of host RAM the emulated HBM of all devices may take together.
HOST_SHARE = 0.75


@dataclasses.dataclass(frozen=True, kw_only=True)
class ChipProfile:
    """Public figures of one TPU generation (approximate)."""

    name: str
    """Chip name, e.g. ``"v5p"``."""
    hbm_bytes: int
    """HBM per chip in bytes, e.g. ``95 * GiB``."""
    hbm_gbps: float
    """HBM bandwidth in GB/s, e.g. ``2765``."""
    sparsecores_per_chip: int
    """SparseCores per chip, e.g. ``4``."""
    bf16_tflops: float
    """Peak bf16 TFLOP/s of the TensorCores, e.g. ``459``."""
    ici_gbps: float
    """Inter-chip interconnect bandwidth per chip in GB/s, e.g. ``600``."""


CHIPS: dict[str, ChipProfile] = {
    p.name: p
    for p in (
        ChipProfile(name="v4", hbm_bytes=32 * GiB, hbm_gbps=1200, sparsecores_per_chip=4, bf16_tflops=275,
                    ici_gbps=300),
        ChipProfile(name="v5p", hbm_bytes=95 * GiB, hbm_gbps=2765, sparsecores_per_chip=4, bf16_tflops=459,
                    ici_gbps=600),
        ChipProfile(name="v6e", hbm_bytes=32 * GiB, hbm_gbps=1640, sparsecores_per_chip=2, bf16_tflops=918,
                    ici_gbps=448),
        ChipProfile(name="v7", hbm_bytes=192 * GiB, hbm_gbps=7370, sparsecores_per_chip=2, bf16_tflops=2300,
                    ici_gbps=1200),
    )
}

DEFAULT_CHIP = "v5p"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Topology:
    """The emulated devices of this process."""

    chip: ChipProfile
    """The chip every device emulates."""
    num_devices: int
    """Number of tpu devices, e.g. ``2`` for ``tpu:0`` and ``tpu:1``."""
    hbm_bytes: int
    """Emulated HBM capacity per device in bytes."""
    hbm_capped: bool
    """True when ``hbm_bytes`` is below the chip's HBM because of the host."""


def host_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _positive_int(environ: Mapping[str, str], name: str, default: int) -> int:
    raw = environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name} must be a positive integer, got {raw!r}") from None
    if value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {raw!r}")
    return value


def topology_from_env(environ: Mapping[str, str] | None = None) -> Topology:
    """Reads TORCH_TPU_CHIP, TORCH_TPU_NUM_DEVICES and TORCH_TPU_HBM_BYTES."""
    environ = os.environ if environ is None else environ
    chip_name = environ.get("TORCH_TPU_CHIP", DEFAULT_CHIP) or DEFAULT_CHIP
    if chip_name not in CHIPS:
        raise ValueError(f"TORCH_TPU_CHIP must be one of {sorted(CHIPS)}, got {chip_name!r}")
    chip = CHIPS[chip_name]
    num_devices = _positive_int(environ, "TORCH_TPU_NUM_DEVICES", 1)
    if num_devices > 64:
        raise ValueError(f"TORCH_TPU_NUM_DEVICES must be at most 64, got {num_devices}")
    host_cap = int(host_memory_bytes() * HOST_SHARE) // num_devices
    default_hbm = min(chip.hbm_bytes, host_cap)
    hbm_bytes = _positive_int(environ, "TORCH_TPU_HBM_BYTES", default_hbm)
    return Topology(chip=chip, num_devices=num_devices, hbm_bytes=hbm_bytes, hbm_capped=hbm_bytes < chip.hbm_bytes)
