"""The planner's cost model fitted to measured runs, then checked against real sharded runs.

``python -m benchmarks.planner_calibration [--embedding-json PATH] [--collectives-json PATH]
[--batch 2048] [--world 2]``

1. Fit: the constants of ``sparsecore.planner.CostModel`` from the embedding
   benchmark's JSON (the SparseCore engine's step over 26 Criteo tables per
   cell: batch, pooling, dim, id distribution, optimizer) and the collectives
   benchmark's (tpu_dist all_to_all time by size), by
   ``sparsecore.planner.fit.fit_cost_model``. Written as
   ``results/cost_model.json``: ``sparsecore-plan --cost-model`` takes it.
2. Check: ``--world`` processes on this machine train the same tables (the
   MLPerf DLRM-DCNv2 preset's pooling factors, rows capped, dim 64, row-wise
   Adagrad, uniform ids) under several plans — the planner's and hand-made
   ones from balanced to lopsided. Per plan and rank: predicted vs measured
   SparseCore time (the rank's own lookups and updates on the ids the input
   distribution gave it, timed without the exchanges) and HBM (predicted
   bytes vs ``torch.tpu.max_memory_allocated()``); per plan: the slowest
   device's predicted step vs the measured step. Then whether the plans rank
   the same by prediction and by measurement (Kendall's tau; 1 = the same order).

Run the embedding and collectives benchmarks first, with the ranks' thread
count (1 per rank on a 2-core machine: ``OMP_NUM_THREADS=1 python -m
benchmarks.embedding ...``); a mismatch is reported. Writes
``results/planner_calibration.{json,md}`` and ``results/cost_model.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import logging
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import sparsecore
from benchmarks import report
from benchmarks.collectives import supervise
from sparsecore.distributed import COLUMN_WISE, DATA_PARALLEL, ROW_WISE, TABLE_WISE, ShardingPlan, TableSharding
from sparsecore.planner import CostModel, TableSpec, Topology, evaluate, parse_topology, plan_tables, read_preset
from sparsecore.planner.fit import ComputeSample, ExchangeSample, engine_step, fit_cost_model, predicted_seconds
from torch_tpu.chips import DEFAULT_CHIP
from torch_tpu.distributed.local_ranks import free_port, start_local_ranks

ROW_CAP = 100_000
DIM = 64
LR = 0.01
PHASE_OPTIMIZER = {"forward": None, "rowwise_adagrad": "rowwise_adagrad", "adam": "adam", "sgd": "sgd"}


# ---------------------------------------------------------------- 1. fit


def compute_samples(embedding: dict[str, Any]) -> list[ComputeSample]:
    """One sample per (cell, phase) of the embedding benchmark's JSON."""
    rows = embedding["config"]["table_rows"]
    samples = []
    for phase, cells in embedding["tables"].items():
        if phase not in PHASE_OPTIMIZER:
            continue
        for cell in cells:
            if "engine_ms" not in cell:
                continue
            alpha = None if cell["dist"] == "uniform" else float(cell["dist"].removeprefix("zipf"))
            tables = [TableSpec(name=f"t{i}", num_embeddings=n, embedding_dim=cell["dim"],
                                pooling_factor=float(cell["pooling"]), zipf_alpha=alpha,
                                optimizer=PHASE_OPTIMIZER[phase] or "sgd") for i, n in enumerate(rows)]
            samples.append(engine_step(tables, cell["batch"], cell["engine_ms"] / 1e3,
                                       training=PHASE_OPTIMIZER[phase] is not None))
    return samples


def exchange_samples(collectives: dict[str, Any]) -> list[ExchangeSample]:
    """One sample per all_to_all size of the collectives benchmark's JSON: what a rank sends
    to the others is (world - 1) / world of its buffer."""
    world = collectives["world_size"]
    return [ExchangeSample(sent_bytes=r["bytes"] * (world - 1) / world, seconds=r["tpu_dist_us"] / 1e6)
            for r in collectives["rows"] if r["collective"] == "all_to_all_single"]


def fit(embedding_path: Path, collectives_path: Path, topology: Topology) -> tuple[CostModel, list[dict], int]:
    """The fitted model, its per-sample errors, and the embedding benchmark's thread count."""
    try:
        embedding, collectives = json.loads(embedding_path.read_text()), json.loads(collectives_path.read_text())
    except OSError as error:
        raise SystemExit(f"{error}: run python -m benchmarks.embedding and python -m benchmarks.collectives "
                         "first (see this module's docstring)") from error
    compute, exchanges = compute_samples(embedding), exchange_samples(collectives)
    model = fit_cost_model(compute, exchanges, topology,
                           fitted_from=f"{embedding_path.name} ({len(compute)} engine steps, commit "
                                       f"{embedding.get('git', {}).get('head', '?')}), {collectives_path.name} "
                                       f"({len(exchanges)} all_to_all sizes)")
    errors = [{"sample": ("engine step" if isinstance(s, ComputeSample) else "all_to_all"),
               "measured_ms": s.seconds * 1e3, "predicted_ms": predicted_seconds(s, topology, model) * 1e3}
              for s in [*compute, *exchanges]]
    return model, errors, embedding["environment"]["cpu_threads"]


# ---------------------------------------------------------------- 2. the plans checked


def check_tables() -> list[TableSpec]:
    """The DLRM-DCNv2 preset's 26 tables as this machine can hold them several times over."""
    return [dataclasses.replace(t, num_embeddings=min(t.num_embeddings, ROW_CAP), embedding_dim=DIM,
                                optimizer="rowwise_adagrad") for t in read_preset("dlrm-dcnv2-criteo1tb")]


def candidate_plans(tables: list[TableSpec], topology: Topology, batch: int, model: CostModel) -> dict[str, ShardingPlan]:
    """The planner's plan and hand-made ones, balanced to lopsided."""
    world = topology.chips
    everyone = tuple(range(world))

    def plan(sharding) -> ShardingPlan:
        return ShardingPlan(world_size=world, tables={t.name: sharding(i, t) for i, t in enumerate(tables)})

    def table_wise(rank_of) -> ShardingPlan:
        return plan(lambda i, t: TableSharding(sharding_type=TABLE_WISE, ranks=(rank_of(i, t),)))

    by_ids = sorted(tables, key=lambda t: -t.pooling_factor)
    heavy = {t.name for t in by_ids[:len(tables) // 4]}
    return {
        "planner": plan_tables(tables, topology, batch, model=model).plan,
        "table_wise round robin": table_wise(lambda i, t: i % world),
        "table_wise, multi-hot tables on rank 0": table_wise(lambda i, t: 0 if t.name in heavy else 1 + i % (world - 1)),
        "table_wise, all on rank 0": table_wise(lambda i, t: 0),
        "row_wise": plan(lambda i, t: TableSharding(sharding_type=ROW_WISE, ranks=everyone)),
        "column_wise": plan(lambda i, t: TableSharding(sharding_type=COLUMN_WISE, ranks=everyone,
                                                       column_widths=(DIM // world,) * world)),
        "data_parallel": plan(lambda i, t: TableSharding(sharding_type=DATA_PARALLEL, ranks=everyone)),
    }


# ---------------------------------------------------------------- measured on the ranks


@dataclasses.dataclass(frozen=True)
class Settings:
    tables: tuple[TableSpec, ...]
    plans: dict[str, str]  # name -> plan JSON
    batch: int
    steps: int
    rounds: int
    warmup: int
    out_file: str


def local_features(tables, batch: int, rank: int, step: int):
    """This rank's samples of one step: ``pooling_factor`` uniform ids per sample and table."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    g = torch.Generator().manual_seed(1000 * step + rank)
    lengths = torch.cat([torch.full((batch,), int(t.pooling_factor)) for t in tables])
    values = torch.cat([torch.randint(0, t.num_embeddings, (batch * int(t.pooling_factor),), generator=g)
                        for t in tables])
    return KeyedJaggedTensor(keys=[t.name for t in tables], values=values, lengths=lengths)


def timed(fn, steps: int, rounds: int, anchor: dist.ProcessGroup) -> float:
    """Seconds per call of ``fn`` (best round), every rank starting each round together."""
    best = float("inf")
    for _ in range(rounds):
        dist.barrier(group=anchor)
        started = time.perf_counter()
        for step in range(steps):
            fn(step)
        torch.tpu.synchronize()
        best = min(best, (time.perf_counter() - started) / steps)
    return best


def measure_plan(plan: ShardingPlan, configs, data, settings: Settings, anchor: dist.ProcessGroup) -> dict[str, float]:
    gc.collect()
    torch.tpu.reset_peak_memory_stats()
    base = torch.tpu.memory_allocated()
    module = sparsecore.SparseCoreEmbeddingBagCollection(configs, sparsecore.optim.RowWiseAdagrad(lr=LR), device="meta")
    sharded = sparsecore.distributed.shard(module, plan)

    def step(i: int) -> None:
        sharded(data[i % len(data)]).values().sum().backward()

    for i in range(settings.warmup):
        step(i)
    step_s = timed(step, settings.steps, settings.rounds, anchor)
    peak = torch.tpu.max_memory_allocated() - base
    # The rank's own SparseCore work alone: its shards on the ids the input distribution
    # brought it, its replicas on its own samples (their row exchange still runs: every rank
    # has the same replicas, so it stays in step).
    parts = []
    if sharded.engine is not None:
        parts.append((sharded.engine, [sharded._input_dist(d)[0] for d in data]))
    if sharded.replicas is not None:
        names = [f for c in sharded.replicas._configs for f in c.feature_names]
        parts.append((sharded.replicas, [type(d).from_jt_dict({f: d.to_dict()[f] for f in names}) for d in data]))

    def alone(i: int) -> None:
        for engine, batches in parts:
            engine(batches[i % len(batches)]).values().sum().backward()

    for i in range(settings.warmup):
        alone(i)
    sparsecore_s = timed(alone, settings.steps, settings.rounds, anchor) if parts else 0.0
    sharded.close()
    del sharded, module
    return {"step_ms": step_s * 1e3, "sparsecore_ms": sparsecore_s * 1e3, "peak_bytes": peak}


def run_rank(rank: int, world: int, port: int, settings: Settings) -> None:
    logging.getLogger("torch.fx._symbolic_trace").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message=".*is_fx_tracing")
    dist.init_process_group("tpu_dist", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    anchor = dist.new_group(backend="gloo")
    torch.set_num_threads(1)
    tables = list(settings.tables)
    limit = settings.batch * int(sum(t.pooling_factor for t in tables))  # the limits only check
    from torchrec.modules.embedding_configs import EmbeddingBagConfig

    configs = [sparsecore.SparseCoreEmbeddingConfig(
        config=EmbeddingBagConfig(name=t.name, num_embeddings=t.num_embeddings, embedding_dim=t.embedding_dim,
                                  feature_names=[t.name]),
        max_ids_per_partition=limit, max_unique_ids_per_partition=limit) for t in tables]
    data = [local_features(tables, settings.batch // world, rank, s) for s in range(4)]
    rows = {}
    for name, text in settings.plans.items():
        rows[name] = measure_plan(ShardingPlan.from_dict(json.loads(text)), configs, data, settings, anchor)
        if rank == 0:
            print(f"  measured {name}", flush=True)
    gathered = [None] * world
    dist.all_gather_object(gathered, rows, group=anchor)
    if rank == 0:
        Path(settings.out_file).write_text(json.dumps(gathered))
    dist.destroy_process_group()


def measure_plans(plans: dict[str, ShardingPlan], tables: list[TableSpec], world: int, batch: int, *, steps: int = 4,
                  rounds: int = 3, warmup: int = 2, timeout_s: float = 1200.0) -> list[dict] | None:
    """Per rank, per plan: step_ms, sparsecore_ms (the rank's own lookups and updates alone) and
    peak_bytes, from ``world`` processes on this machine; None if a rank failed."""
    with tempfile.TemporaryDirectory(prefix="planner_measure") as tmp:
        settings = Settings(tables=tuple(tables), plans={k: v.to_json() for k, v in plans.items()}, batch=batch,
                            steps=steps, rounds=rounds, warmup=warmup, out_file=str(Path(tmp) / "rows.json"))
        procs = start_local_ranks(run_rank, world, (world, free_port(), settings))
        if supervise(procs, timeout_s) != 0:
            return None
        return json.loads(Path(settings.out_file).read_text())


# ---------------------------------------------------------------- comparison (launcher)


def kendall_tau(a: list[float], b: list[float]) -> float:
    """Rank agreement of two scores of the same items: 1 same order, -1 reversed."""
    pairs = [(i, j) for i in range(len(a)) for j in range(i + 1, len(a))]
    agree = sum(1 if (a[i] - a[j]) * (b[i] - b[j]) > 0 else -1 for i, j in pairs)
    return agree / len(pairs)


def compare(plans: dict[str, ShardingPlan], measured: list[dict], tables: list[TableSpec], topology: Topology,
            batch: int, model: CostModel) -> tuple[list[dict], list[dict]]:
    """(per plan and rank rows, per plan rows) of predicted vs measured."""
    per_rank, per_plan = [], []
    for name, plan in plans.items():
        predicted = evaluate(plan, tables, topology, batch, model=model)
        for rank, ranks_rows in enumerate(measured):
            m = ranks_rows[name]
            per_rank.append({"plan": name, "rank": rank,
                             "pred_sparsecore_ms": predicted.device_compute_s[rank] * 1e3,
                             "meas_sparsecore_ms": m["sparsecore_ms"],
                             "pred_mib": predicted.device_bytes[rank] / 2**20, "meas_mib": m["peak_bytes"] / 2**20,
                             "mem_error": predicted.device_bytes[rank] / m["peak_bytes"] - 1})
        per_plan.append({"plan": name, "pred_step_ms": predicted.max_step_s * 1e3,
                         "meas_step_ms": max(r[name]["step_ms"] for r in measured),
                         "pred_slowest_sparsecore_ms": float(predicted.device_compute_s.max()) * 1e3,
                         "meas_slowest_sparsecore_ms": max(r[name]["sparsecore_ms"] for r in measured)})
    return per_rank, per_plan


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--embedding-json", type=Path, default=report.DEFAULT_DIR / "embedding.json")
    p.add_argument("--collectives-json", type=Path, default=report.DEFAULT_DIR / "collectives.json")
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--batch", type=int, default=2048, help="global batch")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--timeout", type=float, default=1200.0)
    p.add_argument("--out", type=Path, default=report.DEFAULT_DIR)
    a = p.parse_args(argv)
    started = time.monotonic()
    topology = parse_topology(f"{DEFAULT_CHIP}:{a.world}")
    model, errors, bench_threads = fit(a.embedding_json, a.collectives_json, topology)
    print(f"fitted on {topology.chip}:{a.world}: {json.dumps(model.to_dict())}")
    fit_error = statistics.median(abs(e["predicted_ms"] / e["measured_ms"] - 1) for e in errors)
    print(f"median error of the fit on its own samples: {fit_error:.1%}")
    if bench_threads != 1:
        print(f"note: the embedding benchmark ran with {bench_threads} threads; the ranks here run 1 each")
    tables = check_tables()
    plans = candidate_plans(tables, topology, a.batch, model)
    print(f"{len(plans)} plans of {len(tables)} tables, {a.world} ranks, global batch {a.batch}", flush=True)
    measured = measure_plans(plans, tables, a.world, a.batch, steps=a.steps, rounds=a.rounds, warmup=a.warmup,
                             timeout_s=a.timeout)
    if measured is None:
        print("the sharded runs failed; nothing written", file=sys.stderr)
        return 1
    per_rank, per_plan = compare(plans, measured, tables, topology, a.batch, model)
    tau = kendall_tau([r["pred_step_ms"] for r in per_plan], [r["meas_step_ms"] for r in per_plan])
    tau_sc = kendall_tau([r["pred_slowest_sparsecore_ms"] for r in per_plan],
                         [r["meas_slowest_sparsecore_ms"] for r in per_plan])
    order_pred = [r["plan"] for r in sorted(per_plan, key=lambda r: r["pred_step_ms"])]
    order_meas = [r["plan"] for r in sorted(per_plan, key=lambda r: r["meas_step_ms"])]
    worst_mem = max(abs(r["mem_error"]) for r in per_rank)
    lines = [f"step time: Kendall tau {tau:.2f} over {len(per_plan)} plans; orders "
             + ("agree" if order_pred == order_meas else "differ"),
             f"slowest device's SparseCore time: Kendall tau {tau_sc:.2f}",
             f"HBM: worst per-device error {worst_mem:.1%} (predicted vs max_memory_allocated)",
             f"fit: median error {fit_error:.1%} on its {len(errors)} samples; threads: benchmark {bench_threads}, "
             f"ranks 1",
             "predicted order: " + " < ".join(order_pred),
             "measured order:  " + " < ".join(order_meas)]
    table = (report.markdown_table(per_plan, ["plan", "pred_step_ms", "meas_step_ms", "pred_slowest_sparsecore_ms",
                                              "meas_slowest_sparsecore_ms"])
             + "\n\n" + report.markdown_table(per_rank, ["plan", "rank", "pred_sparsecore_ms", "meas_sparsecore_ms",
                                                         "pred_mib", "meas_mib", "mem_error"])
             + "\n\nCost model: `" + json.dumps(model.to_dict()) + "`\n\n" + "\n".join(f"- {l}" for l in lines))
    print()
    print(table)
    a.out.mkdir(parents=True, exist_ok=True)
    report.write_atomically(a.out / "cost_model.json", json.dumps(model.to_dict(), indent=2))
    json_path, md_path = report.write("planner_calibration", {
        "config": {k: str(v) for k, v in vars(a).items()}, "cost_model": model.to_dict(), "fit_samples": errors,
        "per_plan": per_plan, "per_rank": per_rank, "kendall_tau_step": tau, "kendall_tau_sparsecore": tau_sc,
        "summary": lines, "wall_time_s": time.monotonic() - started}, table, out_dir=a.out)
    print(f"wrote {json_path}, {md_path}, {a.out / 'cost_model.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
