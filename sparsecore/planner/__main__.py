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
import math
import sys
from pathlib import Path

from sparsecore.planner.cost import CostModel, read_cost_model
from sparsecore.planner.report import as_json, as_text
from sparsecore.planner.search import Constraint, PlanningError, plan_tables
from sparsecore.planner.specs import SpecError, presets, read_preset, read_tables
from sparsecore.planner.topology import parse_topology


CONSTRAINT_KEYS = ("sharding_types", "ranks")
MAX_BATCH_SIZE = 2**31
"""Far beyond any real global batch; larger ones overflow the byte counts (int64)."""
HBM_GIB_RANGE = (2**-10, 2**20)
"""1 MiB to 1 PiB per chip: below, not even one table fits; above, the byte counts overflow."""


def read_constraints(path: Path) -> dict[str, Constraint]:
    """``{"<table>": {"sharding_types": [...], "ranks": [...]}}``."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise SpecError(f"--constraints {path}: expected {{table: {{sharding_types, ranks}}}} JSON ({error})") from error
    if not isinstance(data, dict):
        raise SpecError(f"--constraints {path}: a JSON {type(data).__name__}; expected an object "
                        f"{{table: {{sharding_types, ranks}}}}")
    constraints = {}
    for name, c in data.items():
        if not isinstance(c, dict):
            raise SpecError(f"--constraints {path}: table {name!r}: {c!r}; expected an object with keys "
                            f"{list(CONSTRAINT_KEYS)}")
        # A misspelt key ("rank") would otherwise be dropped and the table planned unconstrained.
        unknown = sorted(set(c) - set(CONSTRAINT_KEYS))
        if unknown:
            raise SpecError(f"--constraints {path}: table {name!r}: unknown key(s) {unknown}; expected some of "
                            f"{list(CONSTRAINT_KEYS)}")
        try:
            constraints[name] = Constraint(sharding_types=c.get("sharding_types", Constraint().sharding_types),
                                           ranks=c.get("ranks"))
        except ValueError as error:
            raise SpecError(f"--constraints {path}: table {name!r}: {error}") from error
    return constraints


def check_options(a: argparse.Namespace) -> None:
    """Ranges of the numeric options: out of range they would overflow or be silently ignored."""
    if not 0 < a.batch_size <= MAX_BATCH_SIZE:
        raise SpecError(f"--batch-size {a.batch_size}: expected a positive integer at most {MAX_BATCH_SIZE}")
    low, high = HBM_GIB_RANGE
    if a.hbm_gib is not None and not (math.isfinite(a.hbm_gib) and low <= a.hbm_gib <= high):
        raise SpecError(f"--hbm-gib {a.hbm_gib}: expected a number of GiB per chip from {low} to {high}")
    if a.out is not None and (a.out.is_dir() or not a.out.parent.is_dir()):
        # Checked before planning, so a typo costs no planning time (save() still reports a late failure).
        raise SpecError(f"--out {a.out}: expected a file path in an existing folder"
                        + (" (it is a folder)" if a.out.is_dir() else f" ({a.out.parent} does not exist)"))


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
        check_options(a)
        topology = parse_topology(a.topology, hbm_bytes=None if a.hbm_gib is None else int(a.hbm_gib * 2**30),
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
        try:
            result.plan.save(a.out)
        except OSError as error:
            print(f"sparsecore-plan: error: --out {a.out}: cannot write the plan ({error.strerror or error}); "
                  f"expected a writable file path in an existing folder", file=sys.stderr)
            return 2
    print(as_json(result) if a.format == "json" else as_text(result, markdown=a.format == "markdown"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
