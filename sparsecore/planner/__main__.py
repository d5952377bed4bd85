"""``sparsecore-plan`` / ``python -m sparsecore.planner``: plan tables onto a TPU slice.

    sparsecore-plan --tables tables.csv --topology v5p:64 --batch-size 65536 --out plan.json

Prints the plan (per device, per table, the slowest device against a lower
bound) and writes a ``sparsecore.distributed.ShardingPlan`` that
``shard()`` and ``models.train --plan`` take. Exit status 2 when no plan fits
or the input is bad, with a message naming what and why.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from sparsecore.planner.cost import CostModel, read_cost_model
from sparsecore.planner.report import as_json, as_text
from sparsecore.planner.search import Constraint, PlanningError, plan_tables
from sparsecore.planner.specs import SpecError, presets, read_preset, read_tables
from sparsecore.planner.topology import parse_topology


def read_constraints(path: Path) -> dict[str, Constraint]:
    """``{"<table>": {"sharding_types": [...], "ranks": [...]}}``."""
    try:
        data = json.loads(path.read_text())
        return {name: Constraint(sharding_types=tuple(c.get("sharding_types", Constraint().sharding_types)),
                                 ranks=tuple(c["ranks"]) if c.get("ranks") is not None else None)
                for name, c in data.items()}
    except (OSError, ValueError, AttributeError, TypeError) as error:
        raise SpecError(f"--constraints {path}: expected {{table: {{sharding_types, ranks}}}} JSON ({error})") from error


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="sparsecore-plan", description=__doc__.split("\n\n")[0])
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--tables", type=Path, help="CSV, JSON or YAML: name, num_embeddings, "
                        "embedding_dim[, pooling_factor, zipf_alpha, optimizer, data_type]")
    source.add_argument("--model", help=f"a model preset: {', '.join(presets())}")
    p.add_argument("--topology", default="v5p:8", help="<chip>:<chips>, e.g. v5p:64")
    p.add_argument("--hbm-gib", type=float, default=None, help="HBM per chip (default: the chip's)")
    p.add_argument("--chips-per-host", type=int, default=4)
    p.add_argument("--sparsecores-per-chip", type=int, default=None, help="default: the chip's")
    p.add_argument("--hbm-gbps", type=float, default=None, help="HBM bandwidth per chip (default: the chip's)")
    p.add_argument("--ici-gbps", type=float, default=None, help="ICI bandwidth per chip (default: the chip's)")
    p.add_argument("--batch-size", type=int, default=65536, help="global batch")
    p.add_argument("--constraints", type=Path, default=None, help="JSON: {table: {sharding_types, ranks}}")
    p.add_argument("--cost-model", type=Path, default=None,
                   help="cost model JSON (fitted by benchmarks/planner_calibration.py; default: TPU priors)")
    p.add_argument("--out", type=Path, default=None, help="write the ShardingPlan JSON here")
    p.add_argument("--format", choices=["table", "json", "markdown"], default="table")
    a = p.parse_args(argv)
    try:
        if a.batch_size <= 0:
            raise SpecError(f"--batch-size {a.batch_size}: expected a positive integer")
        topology = parse_topology(a.topology, hbm_bytes=int(a.hbm_gib * 2**30) if a.hbm_gib else None,
                                  chips_per_host=a.chips_per_host)
        explicit = {k: v for k, v in (("sparsecores_per_chip", a.sparsecores_per_chip), ("hbm_gbps", a.hbm_gbps),
                                      ("ici_gbps", a.ici_gbps)) if v is not None}
        topology = dataclasses.replace(topology, **explicit)  # Topology checks every value
        tables = read_tables(a.tables) if a.tables is not None else read_preset(a.model)
        constraints = read_constraints(a.constraints) if a.constraints else None
        model = read_cost_model(a.cost_model) if a.cost_model else CostModel()
        result = plan_tables(tables, topology, a.batch_size, constraints=constraints, model=model)
    except (SpecError, PlanningError, ValueError) as error:
        print(f"sparsecore-plan: error: {error}", file=sys.stderr)
        return 2
    if a.out is not None:
        result.plan.save(a.out)
    print(as_json(result) if a.format == "json" else as_text(result, markdown=a.format == "markdown"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
