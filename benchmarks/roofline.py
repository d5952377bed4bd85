"""What a training step can take at the least on this machine: its matmul FLOPs at the
host's measured fp32 GEMM speed.

Every mode and compiler runs the same GEMMs at exact fp32, so no speed-up over Strict
can exceed Strict's time over that floor; what a fused or compiled mode can win lies
in the rest. The benchmarks print the floor beside their targets, measured in the same
process, so a target's distance from it is read off each run rather than argued.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from torch.utils.flop_counter import FlopCounterMode

GEMM_PEAK_SIZES = (512, 1024, 2048)


def step_flops(step: Callable[[], None]) -> int:
    """The matmul-family FLOPs ``step`` runs (forward and backward alike), counted by
    ``torch.utils.flop_counter`` from the ops' shapes: a multiply and an add each."""
    with FlopCounterMode(display=False) as counter:
        step()
    return counter.get_total_flops()


def gemm_peak_gflops(sizes: tuple[int, ...] = GEMM_PEAK_SIZES, seconds_per_size: float = 0.2) -> float:
    """The best fp32 GEMM speed of the host's BLAS on the process's threads: square
    ``torch.mm`` on CPU at each size, the fastest call of each, the best size."""
    best = 0.0
    for n in sizes:
        a, b = torch.randn(n, n), torch.randn(n, n)
        out = torch.empty(n, n)
        torch.mm(a, b, out=out)  # warm: thread team up, pages touched
        fastest = float("inf")
        deadline = time.perf_counter() + seconds_per_size
        while time.perf_counter() < deadline:
            start = time.perf_counter()
            torch.mm(a, b, out=out)
            fastest = min(fastest, time.perf_counter() - start)
        best = max(best, 2 * n**3 / fastest / 1e9)
    return best


def floor_row(workload: str, flops: int, peak_gflops: float, strict_ms: float | None) -> dict:
    """The bound of one workload: its GFLOP a step, their time at ``peak_gflops``, and the
    most any mode could run faster than Strict's ``strict_ms`` if nothing but them took time."""
    floor_ms = flops / (peak_gflops * 1e9) * 1e3
    row = {"workload": workload, "gflop_per_step": flops / 1e9, "gemm_peak_gflops": peak_gflops,
           "gemm_floor_ms": floor_ms}
    if strict_ms is not None:
        row["strict_ms"] = strict_ms
        row["max_speedup_vs_strict"] = strict_ms / floor_ms
    return row
