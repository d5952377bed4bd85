"""Planning time of ``sparsecore-plan`` (sparsecore.planner) as the table count grows.

``python -m benchmarks.planner [--counts 26,100,1000,5000] [--topology v5p:256] [--batch 65536]``

Tables are drawn reproducibly (seed 0) from Criteo-like shapes: rows from 10
to 40M (log-uniform), dims 32-256, pooling 1-50, Zipf alpha 1.05 on half of
them. For each count: planning time (best of ``--repeats``), the slowest
device's estimated step time, its gap to the planner's lower bound, and the
mix of sharding types chosen. Target: 1000 tables onto 256 chips in < 10 s.
Not yet here: the comparison with TorchRec's EmbeddingShardingPlanner at 26
and 100 tables, and the cost model's constants fitted from measured runs.
Writes ``benchmarks/results/planner.{json,md}``.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter

import numpy as np

from benchmarks import report
from sparsecore.planner import TableSpec, parse_topology, plan_tables

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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--counts", default="26,100,1000,5000")
    p.add_argument("--topology", default=f"v5p:{TARGET_CHIPS}")
    p.add_argument("--batch", type=int, default=65536)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", default=str(report.DEFAULT_DIR))
    a = p.parse_args(argv)
    topology = parse_topology(a.topology)
    rows = []
    for count in (int(c) for c in a.counts.split(",")):
        tables = random_tables(count)
        times, result = [], None
        for _ in range(a.repeats):
            started = time.perf_counter()
            result = plan_tables(tables, topology, a.batch)
            times.append(time.perf_counter() - started)
        kinds = Counter(pl.sharding_type for pl in result.placements)
        rows.append({"tables": count, "chips": topology.chips, "planning_s": min(times),
                     "max_step_ms": result.max_step_s * 1e3, "lower_bound_ms": result.lower_bound_s * 1e3,
                     "gap": result.gap, "max_hbm_gib": float(result.device_bytes.max()) / 2**30,
                     "sharding": ", ".join(f"{k} {n}" for k, n in sorted(kinds.items()))})
        print(f"{count} tables onto {topology.chips} chips: {min(times):.2f} s; slowest device "
              f"{rows[-1]['max_step_ms']:.3f} ms (gap {result.gap:.1%} to the lower bound); {rows[-1]['sharding']}",
              flush=True)
    target = next((r for r in rows if r["tables"] == TARGET_TABLES and r["chips"] == TARGET_CHIPS), None)
    line = (f"target: {TARGET_TABLES} tables onto {TARGET_CHIPS} chips in < {TARGET_S:.0f} s: "
            + ("not measured" if target is None else
               f"{target['planning_s']:.2f} s, met {'yes' if target['planning_s'] < TARGET_S else 'NO'}"))
    print(line)
    table = report.markdown_table(rows, ["tables", "chips", "planning_s", "max_step_ms", "lower_bound_ms", "gap",
                                         "max_hbm_gib", "sharding"])
    json_path, md_path = report.write("planner", {"config": vars(a), "rows": rows, "summary": line},
                                      f"{table}\n\n- {line}", out_dir=report.Path(a.out))
    print(f"wrote {json_path}, {md_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
