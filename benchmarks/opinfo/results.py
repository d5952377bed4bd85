"""Tallies of passing, failing and erroring samples: per dtype, op and run."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any


@dataclasses.dataclass
class Tally:
    passed: int = 0
    failed: int = 0
    errored: int = 0
    first_fail: str | None = None
    first_error: str | None = None

    @property
    def total(self) -> int:
        return self.passed + self.failed + self.errored

    def add(self, other: Tally) -> None:
        self.passed += other.passed
        self.failed += other.failed
        self.errored += other.errored
        self.first_fail = self.first_fail or other.first_fail
        self.first_error = self.first_error or other.first_error

    @property
    def first_message(self) -> str | None:
        if self.first_error:
            return f"[error] {self.first_error}"
        if self.first_fail:
            return f"[fail] {self.first_fail}"
        return None


@dataclasses.dataclass
class DtypeResult:
    forward: Tally = dataclasses.field(default_factory=Tally)
    backward: Tally = dataclasses.field(default_factory=Tally)
    cpu_errors: int = 0
    """Samples on which the CPU run raised (not counted)."""
    excluded_samples: int = 0
    """Samples left out by :data:`SAMPLE_RULES`."""
    no_tpu_input: int = 0
    """Samples with no tensor or device to move to the tpu (not counted)."""
    sample_error: str | None = None
    """Generating the samples raised (CPU side, nothing counted after it)."""
    seconds: float = 0.0


@dataclasses.dataclass
class OpResult:
    name: str
    category: str
    excluded: str | None = None
    dtypes: dict[str, DtypeResult] = dataclasses.field(default_factory=dict)

    @property
    def forward(self) -> Tally:
        return _summed(r.forward for r in self.dtypes.values())

    @property
    def backward(self) -> Tally:
        return _summed(r.backward for r in self.dtypes.values())


def _summed(tallies: Iterable[Tally]) -> Tally:
    total = Tally()
    for t in tallies:
        total.add(t)
    return total


@dataclasses.dataclass
class Results:
    ops: dict[str, OpResult] = dataclasses.field(default_factory=dict)
    excluded: dict[str, str] = dataclasses.field(default_factory=dict)
    """Excluded ops that were asked for, with their reasons."""
    excluded_backward: dict[str, str] = dataclasses.field(default_factory=dict)
    """Ops run forward only, with the reasons their backward is left out."""
    not_run: list[str] = dataclasses.field(default_factory=list)
    """Ops skipped because the time budget ran out."""
    seconds: float = 0.0

    def by_category(self) -> dict[str, tuple[Tally, Tally]]:
        out: dict[str, tuple[Tally, Tally]] = {}
        for r in self.ops.values():
            fwd, bwd = out.setdefault(r.category, (Tally(), Tally()))
            fwd.add(r.forward)
            bwd.add(r.backward)
        return out

    def totals(self) -> tuple[Tally, Tally]:
        per_category = self.by_category().values()
        return _summed(f for f, _ in per_category), _summed(b for _, b in per_category)

    def worst(self, n: int = 25) -> list[OpResult]:
        """Ops with the most failing or erroring samples (forward + backward)."""
        def bad(r: OpResult) -> int:
            f, b = r.forward, r.backward
            return f.failed + f.errored + b.failed + b.errored

        ranked = sorted((r for r in self.ops.values() if bad(r)), key=lambda r: (-bad(r), r.name))
        return ranked[:n]

    def to_json(self) -> dict[str, Any]:
        return {
            "seconds": round(self.seconds, 1),
            "excluded": self.excluded,
            "excluded_backward": self.excluded_backward,
            "not_run": self.not_run,
            "ops": {name: dataclasses.asdict(r) for name, r in self.ops.items()},
        }


def failures(result: OpResult) -> list[str]:
    """Human-readable failures of one op (for test assertions)."""
    out = []
    for dtype, r in result.dtypes.items():
        for direction, tally in (("forward", r.forward), ("backward", r.backward)):
            if tally.failed or tally.errored:
                out.append(
                    f"{result.name} {dtype} {direction}: {tally.failed} failed, {tally.errored} errored "
                    f"of {tally.total}; first: {tally.first_message}"
                )
    return out


def pct(tally: Tally) -> float:
    return 100.0 * tally.passed / tally.total if tally.total else float("nan")
