"""What a training step can take at the least on this machine: its matmul FLOPs at the
host's measured fp32 GEMM speed (the faster of ATen's BLAS on cpu and the tpu's kernels).

Every mode and compiler runs the same GEMMs at exact fp32, so no speed-up over Strict
can exceed Strict's time over that floor; what a fused or compiled mode can win lies
in the rest. The benchmarks print the floor beside their targets, measured in the same
process, so a target's distance from it is read off each run rather than argued.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

import torch
from torch.utils.flop_counter import FlopCounterMode

import torch_tpu  # noqa: F401 (the tpu device)

GEMM_PEAK_SIZES = (512, 1024, 2048)


def step_flops(step: Callable[[], None]) -> int:
    """The matmul-family FLOPs ``step`` runs (forward and backward alike), counted by
    ``torch.utils.flop_counter`` from the ops' shapes: a multiply and an add each."""
    with FlopCounterMode(display=False) as counter:
        step()
    return counter.get_total_flops()


def gemm_peak_gflops(sizes: tuple[int, ...] = GEMM_PEAK_SIZES, seconds_per_size: float = 0.2,
                     devices: tuple[str, ...] = ("cpu", "tpu")) -> float:
    """The best fp32 GEMM speed on the process's threads: square ``torch.mm`` at each size
    on each device, the fastest call of each, the best size and device. On tpu at highest
    precision (exact fp32), whose kernels may run another engine than ATen's BLAS."""
    best = 0.0
    for device in devices:
        for n in sizes:
            best = max(best, 2 * n**3 / _fastest_mm(n, device, seconds_per_size) / 1e9)
    return best


def _fastest_mm(n: int, device: str, seconds: float) -> float:
    """Seconds of the fastest ``n``-square fp32 mm on ``device`` in ``seconds`` of calls."""
    a, b = torch.randn(n, n).to(device), torch.randn(n, n).to(device)
    if device == "tpu":
        exact, sync = torch.tpu.precision("highest"), torch.tpu.synchronize
        mm = lambda: torch.mm(a, b)  # noqa: E731 (the caching allocator reuses the result's block)
    else:
        out = torch.empty(n, n)  # a fresh 16 MiB result would be new pages every call
        exact, sync = contextlib.nullcontext(), lambda: None
        mm = lambda: torch.mm(a, b, out=out)  # noqa: E731
    with exact:
        mm()  # warm: thread team up, pages touched
        sync()
        fastest = float("inf")
        deadline = time.perf_counter() + seconds
        while time.perf_counter() < deadline:
            start = time.perf_counter()
            mm()
            sync()
            fastest = min(fastest, time.perf_counter() - start)
    return fastest


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
