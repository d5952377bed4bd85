"""``sparsecore-plan`` (sparsecore.planner) against TorchRec's EmbeddingShardingPlanner.

``python -m benchmarks.planner [--counts 26,100,1000,5000] [--torchrec-counts 26,100]
[--topology v5p:256] [--batch 65536] [--measure-world 2]``

Tables are drawn reproducibly (seed 0) from Criteo-like shapes: rows from 10
to 40M (log-uniform), dims 32-256, pooling 1-50, Zipf alpha 1.05 on half of
them.

1. Planning onto ``--topology``: for each count, our planning time (best of
   ``--repeats``), the slowest device's estimated step time, its gap to the
   planner's lower bound, and the mix of sharding types. Target: 1000 tables
   onto 256 chips in < 10 s. For ``--torchrec-counts``, TorchRec's planner on
   the same tables, same run: its planning time, and its plan priced by our
   cost model (slowest device, HBM) beside ours.
2. Measured where both plans fit this machine: for ``--torchrec-counts``, the
   same draws with rows capped at ``--measure-rows`` and dims at 128, planned
   by both planners for ``--measure-world`` emulated chips (ours with the cost
   model ``benchmarks.planner_calibration`` fitted, when
   results/cost_model.json exists), then trained by ``--measure-world``
   processes: measured step time of each plan.

Writes ``benchmarks/results/planner.{json,md}``.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections import Counter

import numpy as np

from benchmarks import report
from benchmarks.planner_calibration import measure_plans
from benchmarks.torchrec_planner import plan_with_torchrec
from sparsecore.planner import (
    CostModel,
    PlanResult,
    TableSpec,
    evaluate,
    parse_topology,
    plan_tables,
    read_cost_model,
)

TARGET_S = 10.0
TARGET_TABLES, TARGET_CHIPS = 1000, 256


def random_tables(count: int, seed: int = 0) -> list[TableSpec]:
    rng = np.random.default_rng(seed)
    rows = np.exp(rng.uniform(np.log(10), np.log(40_000_000), count)).astype(int)
    dims = rng.choice([32, 64, 128, 256], count)
    pooling = rng.choice([1, 1, 2, 5, 10, 50], count)
    skewed = rng.random(count) < 0.5
    return [TableSpec(name=f"t{i}", num_embeddings=int(rows[i]), embedding_dim=int(dims[i]),
                      pooling_factor=float(pooling[i]), zipf_alpha=1.05 if skewed[i] else None)
            for i in range(count)]


def kinds(result: PlanResult) -> str:
    counts = Counter(pl.sharding_type for pl in result.placements)
    return ", ".join(f"{k} {n}" for k, n in sorted(counts.items()))


def planning_rows(counts: list[int], torchrec_counts: set[int], topology, batch: int, repeats: int) -> list[dict]:
    rows = []
    for count in counts:
        tables = random_tables(count)
        times, result = [], None
        for _ in range(repeats):
            started = time.perf_counter()
            result = plan_tables(tables, topology, batch)
            times.append(time.perf_counter() - started)
        row = {"tables": count, "chips": topology.chips, "planning_s": min(times),
               "max_step_ms": result.max_step_s * 1e3, "lower_bound_ms": result.lower_bound_s * 1e3,
               "gap": result.gap, "max_hbm_gib": float(result.device_bytes.max()) / 2**30, "sharding": kinds(result)}
        line = (f"{count} tables onto {topology.chips} chips: {min(times):.2f} s; slowest device "
                f"{row['max_step_ms']:.3f} ms (gap {result.gap:.1%} to the lower bound); {row['sharding']}")
        if count in torchrec_counts:
            theirs, seconds = plan_with_torchrec(tables, topology, batch)
            priced = evaluate(theirs, tables, topology, batch)
            row.update({"torchrec_planning_s": seconds, "torchrec_max_step_ms": priced.max_step_s * 1e3,
                        "torchrec_max_hbm_gib": float(priced.device_bytes.max()) / 2**30,
                        "torchrec_sharding": kinds(priced),
                        "x_step": priced.max_step_s / result.max_step_s, "x_planning": seconds / min(times)})
            line += (f"\n  TorchRec: {seconds:.2f} s ({row['x_planning']:.0f}x ours); its plan's slowest device under "
                     f"our model {row['torchrec_max_step_ms']:.3f} ms ({row['x_step']:.2f}x ours); {row['torchrec_sharding']}")
        print(line, flush=True)
        rows.append(row)
    return rows


def measured_rows(counts: list[int], world: int, batch: int, row_cap: int, model: CostModel) -> list[dict]:
    """Both planners' plans of the capped tables, trained here by ``world`` processes."""
    topology = parse_topology(f"v5p:{world}")
    rows = []
    for count in counts:
        tables = [dataclasses.replace(t, num_embeddings=min(t.num_embeddings, row_cap),
                                      embedding_dim=min(t.embedding_dim, 128), zipf_alpha=None)
                  for t in random_tables(count)]
        ours = plan_tables(tables, topology, batch, model=model)
        theirs, _ = plan_with_torchrec(tables, topology, batch)
        plans = {"ours": ours.plan, "torchrec": theirs}
        measured = measure_plans(plans, tables, world, batch)
        if measured is None:
            raise SystemExit(f"the sharded runs of {count} tables failed")
        step = {name: max(rank[name]["step_ms"] for rank in measured) for name in plans}
        priced = {name: evaluate(plan, tables, topology, batch, model=model) for name, plan in plans.items()}
        row = {"tables": count, "world": world, "batch": batch, "row_cap": row_cap,
               "ours_step_ms": step["ours"], "torchrec_step_ms": step["torchrec"],
               "x_measured": step["torchrec"] / step["ours"],
               "ours_predicted_ms": priced["ours"].max_step_s * 1e3,
               "torchrec_predicted_ms": priced["torchrec"].max_step_s * 1e3,
               "ours_sharding": kinds(priced["ours"]), "torchrec_sharding": kinds(priced["torchrec"])}
        print(f"{count} tables (rows <= {row_cap:,}) on {world} processes here: step {step['ours']:.1f} ms with our "
              f"plan, {step['torchrec']:.1f} ms with TorchRec's ({row['x_measured']:.2f}x)", flush=True)
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--counts", default="26,100,1000,5000")
    p.add_argument("--torchrec-counts", default="26,100", help="counts also planned by TorchRec ('' for none)")
    p.add_argument("--topology", default=f"v5p:{TARGET_CHIPS}")
    p.add_argument("--batch", type=int, default=65536)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--measure-world", type=int, default=2, help="processes for the measured runs (0: none)")
    p.add_argument("--measure-batch", type=int, default=1024)
    p.add_argument("--measure-rows", type=int, default=50_000, help="row cap of the measured tables")
    p.add_argument("--out", default=str(report.DEFAULT_DIR))
    a = p.parse_args(argv)
    topology = parse_topology(a.topology)
    counts = [int(c) for c in a.counts.split(",")]
    torchrec_counts = [int(c) for c in a.torchrec_counts.split(",") if c]
    rows = planning_rows(counts, set(torchrec_counts), topology, a.batch, a.repeats)
    fitted = report.Path(a.out) / "cost_model.json"
    model = read_cost_model(fitted) if fitted.exists() else CostModel()
    measured = (measured_rows(torchrec_counts, a.measure_world, a.measure_batch, a.measure_rows, model)
                if a.measure_world > 1 and torchrec_counts else [])
    target = next((r for r in rows if r["tables"] == TARGET_TABLES and r["chips"] == TARGET_CHIPS), None)
    lines = [f"target: {TARGET_TABLES} tables onto {TARGET_CHIPS} chips in < {TARGET_S:.0f} s: "
             + ("not measured" if target is None else
                f"{target['planning_s']:.2f} s, met {'yes' if target['planning_s'] < TARGET_S else 'NO'}")]
    lines += [f"{r['tables']} tables: TorchRec plans in {r['torchrec_planning_s']:.2f} s ({r['x_planning']:.0f}x ours); "
              f"its slowest device {r['x_step']:.2f}x ours under our cost model"
              for r in rows if "torchrec_planning_s" in r]
    lines += [f"{r['tables']} tables measured on {r['world']} processes: TorchRec's plan {r['x_measured']:.2f}x "
              f"our plan's step time" for r in measured]
    lines.append(f"cost model of the measured plans: {model.fitted_from or 'the TPU priors (no fit found)'}")
    for line in lines:
        print(line)
    table = report.markdown_table(rows, ["tables", "chips", "planning_s", "max_step_ms", "lower_bound_ms", "gap",
                                         "max_hbm_gib", "sharding", "torchrec_planning_s", "torchrec_max_step_ms",
                                         "x_step", "torchrec_sharding"])
    if measured:
        table += "\n\n" + report.markdown_table(measured, ["tables", "world", "batch", "row_cap", "ours_step_ms",
                                                           "torchrec_step_ms", "x_measured", "ours_predicted_ms",
                                                           "torchrec_predicted_ms", "ours_sharding",
                                                           "torchrec_sharding"])
    json_path, md_path = report.write("planner", {"config": vars(a), "rows": rows, "measured": measured,
                                                  "cost_model": model.to_dict(), "summary": lines},
                                      table + "\n\n" + "\n".join(f"- {l}" for l in lines),
                                      out_dir=report.Path(a.out))
    print(f"wrote {json_path}, {md_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
