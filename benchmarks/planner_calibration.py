"""The planner's cost model fitted to measured runs, then checked against other real sharded runs.

``python -m benchmarks.planner_calibration [--embedding-json PATH] [--collectives-json PATH]
[--batch 2048] [--world 2]``

1. Fit (``sparsecore.planner.fit.fit_cost_model``): the exchange constants
   (ICI efficiency, latency) from the collectives benchmark's JSON (tpu_dist
   all_to_all time by size); the compute constants (HBM efficiency, per id,
   per shard, per routed id and table, per gathered row, per row statistic)
   from the embedding benchmark's JSON (the engine's step over 26 Criteo
   tables per cell: batch, pooling, dim, id distribution, optimizer) and from
   ``--world`` processes training a fit set (criteo-kaggle's rows, seeded
   pooling factors 1-50) under six hand-made plans (each rank's SparseCore
   work timed alone, and each plan's step). Written as
   ``results/cost_model.json``: ``sparsecore-plan --cost-model`` takes it.
2. Check, on tables the fit never saw (the MLPerf DLRM-DCNv2 preset's rows
   and pooling factors; rows capped, dim 64, row-wise Adagrad, uniform ids):
   the planner's plan and the six hand-made ones, balanced to lopsided. Per
   plan and rank: predicted vs measured SparseCore time and HBM (predicted
   bytes vs ``torch.tpu.max_memory_allocated()``); per plan: the slowest
   device's predicted step vs the measured step. Then whether the plans rank
   alike (Kendall's tau; and of the pairs measured apart by more than their
   rounds' spread, how many the prediction orders alike).

Run the embedding benchmark first with the ranks' thread count (1 per rank
on this 2-core machine), and the collectives benchmark::

    OMP_NUM_THREADS=1 python -m benchmarks.embedding --dims 32,64,128 \
        --shapes 8192x1,8192x20,8192x100 --dists uniform,zipf1.05 \
        --phases forward,rowwise_adagrad,sgd --subset-shapes all --out benchmarks/results/one_thread
    python -m benchmarks.collectives

Writes ``results/planner_calibration.{json,md}`` and ``results/cost_model.json``.
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

import numpy as np
import torch
import torch.distributed as dist

import sparsecore
from benchmarks import report
from benchmarks.collectives import supervise
from sparsecore.distributed import COLUMN_WISE, DATA_PARALLEL, ROW_WISE, TABLE_WISE, ShardingPlan, TableSharding
from sparsecore.planner import CostModel, TableSpec, Topology, evaluate, parse_topology, plan_tables, read_preset
from sparsecore.planner.cost import Work, compute_seconds
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


def read_benchmarks(embedding_path: Path, collectives_path: Path) -> tuple[dict, dict]:
    try:
        return json.loads(embedding_path.read_text()), json.loads(collectives_path.read_text())
    except OSError as error:
        raise SystemExit(f"{error}: run python -m benchmarks.embedding and python -m benchmarks.collectives "
                         "first (see this module's docstring)") from error


def alone(work: Work) -> Work:
    """A rank's SparseCore work timed alone: without the routing (the input distribution's)."""
    return dataclasses.replace(work, routed_ids=0.0, routed_tables=0.0)


def run_samples(plans: dict[str, ShardingPlan], measured: list[dict], tables: list[TableSpec], topology: Topology,
                batch: int) -> list[ComputeSample]:
    """Per plan and rank, the rank's SparseCore work timed alone (its routing is not in it), and
    per plan the whole step of its busiest rank (exchanges and routing in)."""
    samples = []
    for name, plan in plans.items():
        work = evaluate(plan, tables, topology, batch).device_work
        for rank, rows in enumerate(measured):
            samples.append(ComputeSample(work=alone(work[rank]), seconds=rows[name]["sparsecore_ms"] / 1e3))
        slowest = max(range(len(measured)), key=lambda r: measured[r][name]["sparsecore_ms"])
        samples.append(ComputeSample(work=work[slowest], seconds=max(r[name]["step_ms"] for r in measured) / 1e3,
                                     with_exchanges=True))
    return [s for s in samples if s.seconds > 0 and s.work.shards > 0]


def errors_of(samples: list, topology: Topology, model: CostModel) -> list[dict]:
    return [{"sample": type(s).__name__, "measured_ms": s.seconds * 1e3,
             "predicted_ms": predicted_seconds(s, topology, model) * 1e3} for s in samples]


# ---------------------------------------------------------------- 2. the plans checked


def preset_tables(preset: str) -> list[TableSpec]:
    """A preset's 26 tables as this machine can hold them several times over."""
    return [dataclasses.replace(t, num_embeddings=min(t.num_embeddings, ROW_CAP), embedding_dim=DIM,
                                optimizer="rowwise_adagrad") for t in read_preset(preset)]


def fit_tables() -> list[TableSpec]:
    """The criteo-kaggle preset's tables with 1 to 50 ids per sample (seeded), unlike the
    check set's rows and pooling factors."""
    pooling = np.random.default_rng(1).choice([1, 2, 5, 10, 20, 50], 26)
    return [dataclasses.replace(t, pooling_factor=float(p)) for t, p in zip(preset_tables(FIT_PRESET), pooling)]


FIT_PRESET = "criteo-kaggle"  # its rows; pooling factors drawn by fit_tables
CHECK_PRESET = "dlrm-dcnv2-criteo1tb"  # multi-hot: 1 to 100 ids per table and sample


def candidate_plans(tables: list[TableSpec], topology: Topology, batch: int,
                    model: CostModel | None) -> dict[str, ShardingPlan]:
    """Hand-made plans, balanced to lopsided, and (given a model) the planner's."""
    world = topology.chips
    everyone = tuple(range(world))

    def plan(sharding) -> ShardingPlan:
        return ShardingPlan(world_size=world, tables={t.name: sharding(i, t) for i, t in enumerate(tables)})

    def table_wise(rank_of) -> ShardingPlan:
        return plan(lambda i, t: TableSharding(sharding_type=TABLE_WISE, ranks=(rank_of(i, t),)))

    by_ids = sorted(tables, key=lambda t: -t.pooling_factor)
    heavy = {t.name for t in by_ids[:len(tables) // 4]}
    plans = {} if model is None else {"planner": plan_tables(tables, topology, batch, model=model).plan}
    return plans | {
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
    passes: int = 1


def local_features(tables, batch: int, rank: int, step: int):
    """This rank's samples of one step: ``pooling_factor`` uniform ids per sample and table."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    g = torch.Generator().manual_seed(1000 * step + rank)
    lengths = torch.cat([torch.full((batch,), int(t.pooling_factor)) for t in tables])
    values = torch.cat([torch.randint(0, t.num_embeddings, (batch * int(t.pooling_factor),), generator=g)
                        for t in tables])
    return KeyedJaggedTensor(keys=[t.name for t in tables], values=values, lengths=lengths)


def timed(fn, steps: int, rounds: int, anchor: dist.ProcessGroup) -> tuple[float, float]:
    """Seconds per call of ``fn`` (best round) and the rounds' spread (slowest / best - 1),
    every rank starting each round together."""
    times = []
    for _ in range(rounds):
        dist.barrier(group=anchor)
        started = time.perf_counter()
        for step in range(steps):
            fn(step)
        torch.tpu.synchronize()
        times.append((time.perf_counter() - started) / steps)
    return min(times), max(times) / min(times) - 1


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
    step_s, spread = timed(step, settings.steps, settings.rounds, anchor)
    peak = torch.tpu.max_memory_allocated() - base
    # The rank's own SparseCore work alone: its shards on the ids the input distribution
    # brought it, its replicas on its own samples (their row exchange still runs: every rank
    # has the same replicas, so it stays in step).
    parts = []
    distributed = [sharded._input_dist(d)[0] for d in data]  # a collective: every rank, tables or not
    if sharded.engine is not None:
        parts.append((sharded.engine, distributed))
    if sharded.replicas is not None:
        names = [f for c in sharded.replicas._configs for f in c.feature_names]
        own = []
        for d in data:
            jagged = d.to_dict()
            own.append(type(d).from_jt_dict({f: jagged[f] for f in names}))
        parts.append((sharded.replicas, own))

    def sparsecore_only(i: int) -> None:
        for engine, batches in parts:
            engine(batches[i % len(batches)]).values().sum().backward()

    for i in range(settings.warmup):
        sparsecore_only(i)
    sparsecore_s, _ = timed(sparsecore_only, settings.steps, settings.rounds, anchor)  # every rank: the barriers must pair
    sharded.close()
    return {"step_ms": step_s * 1e3, "step_spread": spread, "sparsecore_ms": sparsecore_s * 1e3, "peak_bytes": peak}


def run_rank(rank: int, world: int, port: int, settings: Settings) -> None:
    logging.getLogger("torch.fx._symbolic_trace").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message=".*is_fx_tracing")
    dist.init_process_group("tpu_dist", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
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
    plans = {name: ShardingPlan.from_json(text) for name, text in settings.plans.items()}
    for _ in range(settings.passes):  # several passes over the plans: none gains from going first or last
        for name, plan in plans.items():
            row = measure_plan(plan, configs, data, settings, anchor)
            if name not in rows or row["step_ms"] < rows[name]["step_ms"]:
                rows[name] = row
            if rank == 0:
                print(f"  measured {name}", flush=True)
    gathered = [None] * world
    dist.all_gather_object(gathered, rows, group=anchor)
    if rank == 0:
        Path(settings.out_file).write_text(json.dumps(gathered))
    dist.destroy_process_group()


def measure_plans(plans: dict[str, ShardingPlan], tables: list[TableSpec], world: int, batch: int, *, steps: int = 4,
                  rounds: int = 3, warmup: int = 2, passes: int = 1, timeout_s: float = 1200.0) -> list[dict] | None:
    """Per rank, per plan: step_ms, sparsecore_ms (the rank's own lookups and updates alone) and
    peak_bytes, from ``world`` processes on this machine (the best of ``passes`` passes over
    the plans); None if a rank failed."""
    with tempfile.TemporaryDirectory(prefix="planner_measure") as tmp:
        settings = Settings(tables=tuple(tables), plans={k: v.to_json() for k, v in plans.items()}, batch=batch,
                            steps=steps, rounds=rounds, warmup=warmup, out_file=str(Path(tmp) / "rows.json"),
                            passes=passes)
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


def separated_pairs(predicted: list[float], measured: list[float], spread: list[float]) -> tuple[int, int]:
    """(pairs the measurement orders beyond its noise, of those the ones the prediction orders
    alike): a pair is separated when the slower is slower by more than either's round spread."""
    separated = agreeing = 0
    for i in range(len(measured)):
        for j in range(i + 1, len(measured)):
            low, high = sorted((measured[i], measured[j]))
            if high / low - 1 > max(spread[i], spread[j]):
                separated += 1
                agreeing += (predicted[i] - predicted[j]) * (measured[i] - measured[j]) > 0
    return separated, agreeing


def compare(plans: dict[str, ShardingPlan], measured: list[dict], tables: list[TableSpec], topology: Topology,
            batch: int, model: CostModel) -> tuple[list[dict], list[dict]]:
    """(per plan and rank rows, per plan rows) of predicted vs measured."""
    per_rank, per_plan = [], []
    for name, plan in plans.items():
        predicted = evaluate(plan, tables, topology, batch, model=model)
        for rank, ranks_rows in enumerate(measured):
            m = ranks_rows[name]
            per_rank.append({"plan": name, "rank": rank,
                             "pred_sparsecore_ms": compute_seconds(alone(predicted.device_work[rank]), topology,
                                                                   model) * 1e3,
                             "meas_sparsecore_ms": m["sparsecore_ms"],
                             "pred_mib": predicted.device_bytes[rank] / 2**20, "meas_mib": m["peak_bytes"] / 2**20,
                             "mem_error": predicted.device_bytes[rank] / m["peak_bytes"] - 1})
        per_plan.append({"plan": name, "pred_step_ms": predicted.max_step_s * 1e3,
                         "meas_step_ms": max(r[name]["step_ms"] for r in measured),
                         "round_spread": max(r[name]["step_spread"] for r in measured),
                         "pred_slowest_sparsecore_ms": max(r["pred_sparsecore_ms"] for r in per_rank[-len(measured):]),
                         "meas_slowest_sparsecore_ms": max(r[name]["sparsecore_ms"] for r in measured)})
    return per_rank, per_plan


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--embedding-json", type=Path, default=report.DEFAULT_DIR / "one_thread" / "embedding.json")
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
    embedding, collectives = read_benchmarks(a.embedding_json, a.collectives_json)
    bench_threads = embedding["environment"]["cpu_threads"]
    if bench_threads != 1:
        print(f"note: the embedding benchmark ran with {bench_threads} threads; the ranks here run 1 each")

    def measure(tables: list[TableSpec], plans: dict[str, ShardingPlan]) -> list[dict]:
        print(f"{len(plans)} plans of {len(tables)} tables, {a.world} ranks, global batch {a.batch}", flush=True)
        measured = measure_plans(plans, tables, a.world, a.batch, steps=a.steps, rounds=a.rounds, warmup=a.warmup,
                                 timeout_s=a.timeout)
        if measured is None:
            raise SystemExit("the sharded runs failed; nothing written")
        return measured

    # Fit: the engine alone, all_to_all alone, and sharded runs of one table set...
    fitting = fit_tables()
    fit_plans = candidate_plans(fitting, topology, a.batch, None)
    fit_measured = measure(fitting, fit_plans)
    engine = compute_samples(embedding)
    compute = engine + run_samples(fit_plans, fit_measured, fitting, topology, a.batch)
    exchanges = exchange_samples(collectives)
    model = fit_cost_model(compute, exchanges, topology, fitted_from=(
        f"{a.embedding_json.name} ({len(engine)} engine steps, commit "
        f"{embedding.get('git', {}).get('head', '?')}), {a.collectives_json.name} ({len(exchanges)} all_to_all sizes), "
        f"{len(fit_plans)} sharded plans of {FIT_PRESET} on {a.world} processes"))
    errors = errors_of([*compute, *exchanges], topology, model)
    fit_error = statistics.median(abs(e["predicted_ms"] / e["measured_ms"] - 1) for e in errors)
    print(f"fitted on {topology.chip}:{a.world}: {json.dumps(model.to_dict())}")
    print(f"median error of the fit on its own {len(errors)} samples: {fit_error:.1%}")
    # ... checked on another: the planner's plan of it and hand-made ones.
    tables = preset_tables(CHECK_PRESET)
    plans = candidate_plans(tables, topology, a.batch, model)
    measured = measure(tables, plans)
    per_rank, per_plan = compare(plans, measured, tables, topology, a.batch, model)
    tau = kendall_tau([r["pred_step_ms"] for r in per_plan], [r["meas_step_ms"] for r in per_plan])
    tau_sc = kendall_tau([r["pred_slowest_sparsecore_ms"] for r in per_plan],
                         [r["meas_slowest_sparsecore_ms"] for r in per_plan])
    order_pred = [r["plan"] for r in sorted(per_plan, key=lambda r: r["pred_step_ms"])]
    order_meas = [r["plan"] for r in sorted(per_plan, key=lambda r: r["meas_step_ms"])]
    worst_mem = max(abs(r["mem_error"]) for r in per_rank)
    separated, agreeing = separated_pairs([r["pred_step_ms"] for r in per_plan], [r["meas_step_ms"] for r in per_plan],
                                          [r["round_spread"] for r in per_plan])
    lines = [f"step time: Kendall tau {tau:.2f} over {len(per_plan)} plans; orders "
             + ("agree" if order_pred == order_meas else "differ")
             + f"; of the {separated} plan pairs measured apart by more than their rounds' spread, the prediction "
               f"orders {agreeing} alike",
             f"slowest device's SparseCore time: Kendall tau {tau_sc:.2f}",
             f"HBM: worst per-device error {worst_mem:.1%} (predicted vs max_memory_allocated)",
             f"fit ({FIT_PRESET} tables, checked on {CHECK_PRESET}'s): median error {fit_error:.1%} on its "
             f"{len(errors)} samples; threads: benchmark {bench_threads}, ranks 1",
             "predicted order: " + " < ".join(order_pred),
             "measured order:  " + " < ".join(order_meas)]
    table = (report.markdown_table(per_plan, ["plan", "pred_step_ms", "meas_step_ms", "round_spread",
                                              "pred_slowest_sparsecore_ms",
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
        "fit_runs": fit_measured, "fit_plans": {k: v.to_dict() for k, v in fit_plans.items()},
        "per_plan": per_plan, "per_rank": per_rank, "kendall_tau_step": tau, "kendall_tau_sparsecore": tau_sc,
        "summary": lines, "wall_time_s": time.monotonic() - started}, table, out_dir=a.out)
    print(f"wrote {json_path}, {md_path}, {a.out / 'cost_model.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
