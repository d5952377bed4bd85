"""benchmarks.compile's target verdicts: a ratio to Strict must hold on the best rounds
and on the paired per-round median (benchmarks.eager_modes.paired_ratio); the GEMM floor
the benchmarks print beside them (benchmarks.roofline)."""

import pytest

from benchmarks import roofline
from benchmarks.compile import check_targets
from benchmarks.eager_modes import WORKLOADS, make_step, paired_ratio
from benchmarks.roofline import floor_row, step_flops


def test_paired_ratio_is_the_median_of_same_round_ratios():
    # Rounds 2 and 3 ran on a slow host for both sides: best/best would say 8/4 = 2.0.
    strict = [8.0, 12.0, 12.0]
    compiled = [4.0, 10.0, 8.0]
    assert paired_ratio(strict, compiled) == pytest.approx(1.5)  # median of 2.0, 1.2, 1.5


def test_paired_ratio_needs_the_same_rounds():
    with pytest.raises(ValueError):
        paired_ratio([1.0, 2.0], [1.0])


def rows(best: float, paired: float) -> list[dict]:
    return [{"workload": "small_ops_256", "variant": "tpu compiled", "speedup_vs_strict": best,
             "speedup_vs_strict_paired": paired, "over_cpu_inductor": 0.9}]


def verdict(checked: list[dict], description: str) -> str:
    return next(c["verdict"] for c in checked if c["target"] == description)


SMALL_OP = "tpu compiled >= 1.3x Strict on the small-op MLP step"


@pytest.mark.parametrize(("best", "paired", "expected"), [
    (1.45, 1.32, "MET"),
    (1.45, 1.25, "NOT MET on the paired median"),
    (1.25, 1.35, "NOT MET"),
])
def test_a_ratio_to_strict_is_met_only_on_both_figures(best, paired, expected):
    assert verdict(check_targets(rows(best, paired)), SMALL_OP) == expected


def test_targets_without_a_paired_figure_are_judged_on_the_best_rounds():
    checked = check_targets(rows(1.45, 1.32))
    inductor = verdict(checked, "tpu compiled within 1.1x of CPU Inductor on small_ops_256")
    assert inductor == "MET"
    assert verdict(checked, "tpu compiled never slower than Strict on dlrm_train_step") == "not measured"


def test_step_flops_count_the_small_op_steps_eleven_gemms():
    # 4 Linear(256) layers at batch 256: 4 GEMMs forward; backward, a weight gradient per
    # layer and an input gradient for all but the first (its input needs none): 11 in all,
    # each 256^3 multiply-adds.
    step, _ = make_step(WORKLOADS["small_ops_256"], "cpu eager")
    assert step_flops(step) == 11 * 2 * 256**3


def test_floor_row_is_flops_at_the_peak_and_strict_over_it():
    row = floor_row("w", 2 * 10**9, peak_gflops=100.0, strict_ms=30.0)
    assert row["gflop_per_step"] == pytest.approx(2.0)
    assert row["gemm_floor_ms"] == pytest.approx(20.0)
    assert row["max_speedup_vs_strict"] == pytest.approx(1.5)
    assert "max_speedup_vs_strict" not in floor_row("w", 10**9, 100.0, None)


def test_gemm_peak_is_the_fastest_size_and_bounded_by_the_timed_calls(monkeypatch):
    # With a clock that advances 1 ms per reading, every mm is timed at 1 ms: the peak is
    # the largest size's 2 n^3 FLOPs in that millisecond.
    ticks = iter(range(10**6))
    monkeypatch.setattr(roofline.time, "perf_counter", lambda: next(ticks) * 1e-3)
    assert roofline.gemm_peak_gflops(sizes=(8, 16), seconds_per_size=0.01) == pytest.approx(2 * 16**3 / 1e-3 / 1e9)


def test_gemm_peak_is_the_faster_devices(monkeypatch):
    # The tpu's kernels may run a faster GEMM engine than ATen's BLAS (oneDNN off Intel
    # CPUs): the floor is set by whichever device multiplies faster.
    seconds = {"cpu": 2e-3, "tpu": 1e-3}
    monkeypatch.setattr(roofline, "_fastest_mm", lambda n, device, budget: seconds[device])
    assert roofline.gemm_peak_gflops(sizes=(16,)) == pytest.approx(2 * 16**3 / 1e-3 / 1e9)
    assert roofline.gemm_peak_gflops(sizes=(16,), devices=("cpu",)) == pytest.approx(2 * 16**3 / 2e-3 / 1e9)
