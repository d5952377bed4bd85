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
   model ``benchmarks.planner_calibration`` fitted, ``--cost-model``), then
   trained by ``--measure-world`` processes: measured step time of each plan;
   and the first count's draws with one table of ``--measure-big-rows`` rows,
   too big for one device's HBM (set to 60% of all the tables' bytes):
   TorchRec's planner on CPU cannot split it (no row-wise; column slices of
   128 at least).

Writes ``benchmarks/results/planner.{json,md}``.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections import Counter

import numpy as np
from torchrec.distributed.planner.types import PlannerError

from benchmarks import report
from benchmarks.planner_calibration import measure_plans
from benchmarks.torchrec_planner import plan_with_torchrec
from sparsecore.planner.report import summary
from sparsecore.planner.cost import storage_bytes
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
        s = summary(result)
        row = {"tables": count, "chips": topology.chips, "planning_s": min(times), "max_step_ms": s["max_step_ms"],
               "lower_bound_ms": s["lower_bound_ms"], "gap": s["gap_to_lower_bound"], "max_hbm_gib": s["max_hbm_gib"],
               "sharding": kinds(result)}
        line = (f"{count} tables onto {topology.chips} chips: {min(times):.2f} s; slowest device "
                f"{row['max_step_ms']:.3f} ms (gap {result.gap:.1%} to the lower bound); {row['sharding']}")
        if count in torchrec_counts:
            theirs, seconds = plan_with_torchrec(tables, topology, batch)
            priced = evaluate(theirs, tables, topology, batch)
            theirs_summary = summary(priced)
            row.update({"torchrec_planning_s": seconds, "torchrec_max_step_ms": theirs_summary["max_step_ms"],
                        "torchrec_max_hbm_gib": theirs_summary["max_hbm_gib"],
                        "torchrec_sharding": kinds(priced),
                        "x_step": priced.max_step_s / result.max_step_s, "x_planning": seconds / min(times)})
            line += (f"\n  TorchRec: {seconds:.2f} s ({row['x_planning']:.0f}x ours); its plan's slowest device under "
                     f"our model {row['torchrec_max_step_ms']:.3f} ms ({row['x_step']:.2f}x ours); {row['torchrec_sharding']}")
        print(line, flush=True)
        rows.append(row)
    return rows


def measured_cases(counts: list[int], row_cap: int, big_rows: int) -> list[tuple[str, list[TableSpec], float]]:
    """(label, tables, HBM per device as a share of the tables' total) of the measured runs:
    the capped draws with room to spare, and the 26 with one table too big for one device."""
    def capped(count: int) -> list[TableSpec]:
        return [dataclasses.replace(t, num_embeddings=min(t.num_embeddings, row_cap),
                                    embedding_dim=min(t.embedding_dim, 128), zipf_alpha=None)
                for t in random_tables(count)]

    cases = [(f"{count} tables, rows <= {row_cap:,}", capped(count), 0.0) for count in counts]
    if counts:
        lopsided = capped(counts[0])
        lopsided[0] = dataclasses.replace(lopsided[0], num_embeddings=big_rows)
        cases.append((f"{counts[0]} tables, one of {big_rows:,} rows over one device's HBM", lopsided, 0.6))
    return cases


def measured_rows(counts: list[int], world: int, batch: int, row_cap: int, big_rows: int,
                  model: CostModel) -> list[dict]:
    """Both planners' plans of each case, trained here by ``world`` processes."""
    rows = []
    chips = parse_topology(f"v5p:{world}")
    for label, tables, hbm_share in measured_cases(counts, row_cap, big_rows):
        topology = chips
        if hbm_share:  # a device holds this share of all the tables' weights and state, with reserve
            total = sum(storage_bytes(t, t.num_embeddings, t.embedding_dim) for t in tables)
            topology = dataclasses.replace(topology, hbm_bytes=int(hbm_share * total / (1 - model.reserved_fraction)))
        ours = plan_tables(tables, topology, batch, model=model)
        plans = {"ours": ours.plan}
        try:
            plans["torchrec"] = plan_with_torchrec(tables, topology, batch)[0]
        except PlannerError as error:  # what TorchRec's planner says when it finds no plan
            failure = error.error_type.name
            print(f"{label}: TorchRec finds no plan ({failure})", flush=True)
        # Plans may differ by little: more rounds, and two passes (neither plan always goes first).
        measured = measure_plans(plans, tables, world, batch, steps=6, rounds=5, passes=2)
        if measured is None:
            raise SystemExit(f"the sharded runs of {label} failed")
        step = {name: max(rank[name]["step_ms"] for rank in measured) for name in plans}
        priced = {name: ours if name == "ours" else evaluate(plan, tables, topology, batch, model=model)
                  for name, plan in plans.items()}  # ours: plan_tables priced it already
        row = {"case": label, "world": world, "batch": batch, "hbm_gib": topology.hbm_bytes / 2**30,
               "ours_step_ms": step["ours"], "ours_predicted_ms": priced["ours"].max_step_s * 1e3,
               "ours_sharding": kinds(priced["ours"])}
        if "torchrec" in plans:
            row.update({"torchrec_step_ms": step["torchrec"], "x_measured": step["torchrec"] / step["ours"],
                        "torchrec_predicted_ms": priced["torchrec"].max_step_s * 1e3,
                        "torchrec_sharding": kinds(priced["torchrec"])})
        else:
            row["torchrec_sharding"] = f"no plan ({failure})"
        print(f"{label} on {world} processes here: step {step['ours']:.1f} ms with our plan"
              + (f", {step['torchrec']:.1f} ms with TorchRec's ({row['x_measured']:.2f}x)" if "torchrec" in plans
                 else "; TorchRec: no plan"), flush=True)
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
    p.add_argument("--measure-big-rows", type=int, default=3_000_000,
                   help="rows of the one table too big for a device in the last measured case")
    p.add_argument("--cost-model", type=report.Path, default=report.DEFAULT_DIR / "cost_model.json",
                   help="for the measured runs' plans (benchmarks.planner_calibration writes it; if absent: the priors)")
    p.add_argument("--out", default=str(report.DEFAULT_DIR))
    a = p.parse_args(argv)
    topology = parse_topology(a.topology)
    counts = [int(c) for c in a.counts.split(",")]
    torchrec_counts = [int(c) for c in a.torchrec_counts.split(",") if c]
    rows = planning_rows(counts, set(torchrec_counts), topology, a.batch, a.repeats)
    model = read_cost_model(a.cost_model) if a.cost_model.exists() else CostModel()
    measured = (measured_rows(torchrec_counts, a.measure_world, a.measure_batch, a.measure_rows, a.measure_big_rows,
                              model)
                if a.measure_world > 1 and torchrec_counts else [])
    target = next((r for r in rows if r["tables"] == TARGET_TABLES and r["chips"] == TARGET_CHIPS), None)
    lines = [f"target: {TARGET_TABLES} tables onto {TARGET_CHIPS} chips in < {TARGET_S:.0f} s: "
             + ("not measured" if target is None else
                f"{target['planning_s']:.2f} s, met {'yes' if target['planning_s'] < TARGET_S else 'NO'}")]
    lines += [f"{r['tables']} tables: TorchRec plans in {r['torchrec_planning_s']:.2f} s ({r['x_planning']:.0f}x ours); "
              f"its slowest device {r['x_step']:.2f}x ours under our cost model"
              for r in rows if "torchrec_planning_s" in r]
    lines += [f"{r['case']}, measured on {r['world']} processes: " + (
              f"TorchRec's plan {r['x_measured']:.2f}x our plan's step time" if "x_measured" in r else
              f"TorchRec finds no plan; ours ({r['ours_sharding']}) trains at {r['ours_step_ms']:.1f} ms a step")
              for r in measured]
    lines.append(f"cost model of the measured plans: {model.fitted_from or 'the TPU priors (no fit found)'}")
    for line in lines:
        print(line)
    table = report.markdown_table(rows, ["tables", "chips", "planning_s", "max_step_ms", "lower_bound_ms", "gap",
                                         "max_hbm_gib", "sharding", "torchrec_planning_s", "torchrec_max_step_ms",
                                         "x_step", "torchrec_sharding"])
    if measured:
        table += "\n\n" + report.markdown_table(measured, ["case", "world", "batch", "hbm_gib", "ours_step_ms",
                                                           "torchrec_step_ms", "x_measured", "ours_predicted_ms",
                                                           "torchrec_predicted_ms", "ours_sharding",
                                                           "torchrec_sharding"])
    config = {k: str(v) for k, v in vars(a).items()}
    json_path, md_path = report.write("planner", {"config": config, "rows": rows, "measured": measured,
                                                  "cost_model": model.to_dict(), "summary": lines},
                                      table + "\n\n" + "\n".join(f"- {l}" for l in lines),
                                      out_dir=report.Path(a.out))
    print(f"wrote {json_path}, {md_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
