"""A plan for people (a table, or markdown) and for programs (JSON)."""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

from sparsecore.planner.search import PlanResult

GiB = 2**30


def summary(result: PlanResult) -> dict[str, Any]:
    step = result.device_step_s
    return {
        "devices": len(step),
        "max_step_ms": result.max_step_s * 1e3,
        "mean_step_ms": float(step.mean()) * 1e3,
        "imbalance": float(step.max() / step.mean()) if step.mean() > 0 else 1.0,
        "lower_bound_ms": result.lower_bound_s * 1e3,
        "gap_to_lower_bound": result.gap,
        "max_hbm_gib": float(result.device_bytes.max()) / GiB,
        "usable_hbm_gib": result.capacity_bytes / GiB,
        "planning_s": result.planning_s,
    }


def as_json(result: PlanResult) -> str:
    devices = [{"device": d, "hbm_bytes": int(result.device_bytes[d]), "compute_ms": result.device_compute_s[d] * 1e3,
                "comm_ms": result.device_comm_s[d] * 1e3} for d in range(len(result.device_bytes))]
    tables = [{"table": p.table, "sharding_type": p.sharding_type, "ranks": list(p.ranks),
               "hbm_bytes": p.hbm_bytes, "step_ms": p.step_s * 1e3}
              for p in result.placements]
    return json.dumps({"summary": summary(result), "plan": result.plan.to_dict(), "devices": devices,
                       "tables": tables}, indent=1)


def as_text(result: PlanResult, markdown: bool = False, most: int = 16) -> str:
    """Per device (HBM, compute and communication ms, shards by type), per table, the summary."""
    kinds: dict[int, Counter] = {d: Counter() for d in range(len(result.device_bytes))}
    for p in result.placements:
        for d in p.ranks:
            kinds[d][p.sharding_type] += 1
    device_rows = [[str(d), f"{result.device_bytes[d] / GiB:.2f} / {result.capacity_bytes / GiB:.2f}",
                    f"{result.device_compute_s[d] * 1e3:.3f}", f"{result.device_comm_s[d] * 1e3:.3f}",
                    ", ".join(f"{k} {n}" for k, n in sorted(kinds[d].items()))]
                   for d in range(len(result.device_bytes))]
    table_rows = [[p.table, p.sharding_type, _ranks(p.ranks), f"{p.hbm_bytes / GiB:.3f}", f"{p.step_s * 1e3:.3f}"]
                  for p in sorted(result.placements, key=lambda p: -p.step_s)]
    s = summary(result)
    out = [_grid(["device", "HBM GiB used / usable", "compute ms", "comm ms", "shards"],
                 _head(device_rows, most), markdown), "",
           _grid(["table", "sharding", "devices", "HBM GiB", "step ms (all shards)"], _head(table_rows, most),
                 markdown), "",
           f"slowest device {s['max_step_ms']:.3f} ms per step (mean {s['mean_step_ms']:.3f}, imbalance "
           f"{s['imbalance']:.2f}); lower bound {s['lower_bound_ms']:.3f} ms, gap {s['gap_to_lower_bound']:.1%}; "
           f"planned in {s['planning_s']:.2f} s"]
    return "\n".join(out)


def _ranks(ranks: tuple[int, ...]) -> str:
    if len(ranks) > 2 and list(ranks) == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}"
    return ",".join(map(str, ranks))


def _head(rows: list[list[str]], most: int) -> list[list[str]]:
    if len(rows) <= most:
        return rows
    return rows[:most] + [[f"... {len(rows) - most} more"] + [""] * (len(rows[0]) - 1)]


def _grid(header: list[str], rows: list[list[str]], markdown: bool) -> str:
    if markdown:
        lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])
    widths = [max(len(x) for x in column) for column in zip(header, *rows)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return "\n".join([fmt.format(*header), fmt.format(*("-" * w for w in widths))] + [fmt.format(*r) for r in rows])
