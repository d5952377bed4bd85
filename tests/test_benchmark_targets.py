"""benchmarks.compile's target verdicts: a ratio to Strict must hold on the best rounds
and on the paired per-round median (benchmarks.eager_modes.paired_ratio)."""

import pytest

from benchmarks.compile import check_targets
from benchmarks.eager_modes import paired_ratio


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
    assert verdict(checked, "tpu compiled never slower than Strict on the DLRM step") == "not measured"
