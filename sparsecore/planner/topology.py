"""The slice a plan is for: chips, their HBM and bandwidths, hosts."""

from __future__ import annotations

import dataclasses
import math

from torch_tpu.chips import CHIPS


@dataclasses.dataclass(frozen=True, kw_only=True)
class Topology:
    chip: str
    """Chip name (torch_tpu.chips), e.g. ``"v5p"``."""
    chips: int
    """Devices (one rank each), e.g. ``64``."""
    hbm_bytes: int
    """HBM per chip, e.g. ``95 * 2**30``."""
    sparsecores_per_chip: int
    hbm_gbps: float
    ici_gbps: float
    chips_per_host: int = 4

    def __post_init__(self) -> None:
        for field in ("chips", "hbm_bytes", "sparsecores_per_chip", "chips_per_host"):
            if getattr(self, field) <= 0:
                raise ValueError(f"topology {field}={getattr(self, field)!r}; expected a positive number")
        for field in ("hbm_gbps", "ici_gbps"):
            if not 0 < getattr(self, field) < math.inf:
                raise ValueError(f"topology {field}={getattr(self, field)!r}; expected a positive number")

    @property
    def hosts(self) -> tuple[tuple[int, ...], ...]:
        size = min(self.chips_per_host, self.chips)
        return tuple(tuple(range(h, min(h + size, self.chips))) for h in range(0, self.chips, size))


def parse_topology(text: str, *, hbm_bytes: int | None = None, chips_per_host: int = 4) -> Topology:
    """``"<chip>:<count>"``, e.g. ``"v5p:64"``; ``hbm_bytes`` overrides the chip's HBM."""
    chip, _, count = text.partition(":")
    if chip not in CHIPS or not count.isdigit() or int(count) <= 0:
        raise ValueError(f"--topology {text!r}: expected <chip>:<chips> with chip one of {sorted(CHIPS)}, "
                         "e.g. v5p:64")
    profile = CHIPS[chip]
    # hbm_bytes=0 is an error (Topology says so), not the chip's default.
    return Topology(chip=chip, chips=int(count), hbm_bytes=profile.hbm_bytes if hbm_bytes is None else hbm_bytes,
                    sparsecores_per_chip=profile.sparsecores_per_chip, hbm_gbps=profile.hbm_gbps,
                    ici_gbps=profile.ici_gbps, chips_per_host=chips_per_host)
