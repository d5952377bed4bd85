"""The embedding sharding planner: tables and a TPU slice in, a ``ShardingPlan`` out.

``read_tables`` (CSV, JSON, YAML), ``read_preset`` or ``tables_of(module)`` ->
``plan_tables(tables, topology, batch_size)`` (``plan(module, ...)`` for both)
-> ``PlanResult.plan`` (a ``sparsecore.distributed.ShardingPlan``). The cost
model (cost.py) prices each shard's HBM bytes and step time; the search
(search.py) balances the slowest device under the HBM limits. CLI:
``sparsecore-plan`` (``python -m sparsecore.planner``).
"""

from sparsecore.planner.cost import CostModel, ShardCost, distinct_ids, read_cost_model
from sparsecore.planner.search import Constraint, PlanningError, PlanResult, evaluate, plan, plan_tables
from sparsecore.planner.specs import SpecError, TableSpec, presets, read_preset, read_tables, tables_of
from sparsecore.planner.topology import Topology, parse_topology

__all__ = ["Constraint", "CostModel", "PlanResult", "PlanningError", "ShardCost", "SpecError", "TableSpec",
           "Topology", "distinct_ids", "evaluate", "parse_topology", "plan", "plan_tables", "presets", "read_cost_model",
           "read_preset", "read_tables", "tables_of"]
