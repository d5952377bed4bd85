"""Distributed DLRM training throughput: our sharded engine over tpu_dist against TorchRec's DMP over gloo.

``python -m benchmarks.dlrm_distributed [--worlds 1,2] [--batch 2048] [--steps 8] [--quick]``

The model is benchmarks.dlrm's: 26 Criteo-Kaggle tables capped at 200,000 rows,
dim 64, dense arch 512-256-64, over arch 512-256-1, embeddings trained with
row-wise Adagrad and the dense part with Adagrad (lr 0.01 both). Throughput is
samples/s of the GLOBAL batch (``--batch``); each of the N processes feeds its
own contiguous slice of every global batch (the same synthetic batches as
benchmarks.dlrm, generated deterministically in every rank).

Sides, at every world size of ``--worlds`` (one launch of N spawned processes
per world size, ``tpu:<rank>`` each, all on 127.0.0.1):
  ours:<type>      models.dlrm.DLRM on tpu, its embeddings sharded by
                   ``sparsecore.distributed.shard`` over the ``tpu_dist`` world
                   group, the dense part under DDP summing gradients
                   (models.distributed.data_parallel; the loss is the rank's sum
                   over the global batch size). tpu precision "medium" (the
                   default), and "highest" for the best plan of each world
                   (skipped by --quick and --no-highest). One plan per type:
                     table_wise      table i on rank i % N
                     row_wise        every table over every rank
                     column_wise     every table split 32/32 over ranks 0, 1; at
                                     one process a single 64-wide column shard
                                     (two column shards on one rank are not
                                     supported under row-wise Adagrad)
                     table_row_wise  one host per rank (hosts ((0,), (1,)) at
                                     N = 2), tables alternating hosts
                     data_parallel   every table replicated on every rank
  torchrec:<type>  torchrec.models.dlrm.DLRM under DistributedModelParallel on
                   CPU over a plain gloo group (new_group(backend="gloo") via
                   ShardingEnv.from_process_group), its planner constrained to
                   table_wise, then to column_wise (ParameterConstraints; for
                   column_wise min_partition = 64 / N, so 32/32 over ranks 0, 1
                   as ours: its default, 128, keeps a dim-64 table whole, which
                   is table-wise in effect); CPU fp32 ("highest"), FBGEMM's
                   fused row-wise Adagrad. TorchRec on CPU/gloo does not support
                   row_wise (nor table_row_wise), so those have no anchor.

Method: one side at a time is built, warmed up, timed and freed (gc between
sides; the tables are 0.35 GiB of fp32 rows and a rank's process peaks near
1.1 GB RSS; the embedding collections are built on the meta device, so each
rank materializes only its own shards). Timing: warm-up
steps, then rounds of ``--steps`` steps, a barrier (on a separate gloo group)
before each round; a round's time is the max over ranks (all_reduce MAX); the
best round is reported as samples/s of the global batch. Intra-op threads per
rank: cores // N (``--threads``), the same for both sides.

Then a paired comparison: our three fastest sides and TorchRec's (up to three)
are built again, side by side in the same processes, and timed in interleaved
rounds (ABC, CBA, ...; 2 x ``--rounds`` each). Sides timed one after another
meet whatever speed this machine drifts to meanwhile (the same side's rounds
have differed by 1.5x within minutes), so the fastest side of each framework
is picked from these rounds, which meet the drift alike (picking by the rounds
above once paired TorchRec with a side whose fast rounds were the machine's).
Printed: best round against best round of the two fastest, the range and
median of their round-by-round ratios, and the other sides' best rounds.

Reported per (world, side): samples/s, all-to-all bytes per step per rank
(mean over ranks: ours from ShardedSparseCoreEmbeddingBagCollection.bytes_sent()
deltas over the timed steps; TorchRec's from counting what its
torch.distributed.all_to_all_single calls send to other ranks, which is also
done for ours as a cross-check; data_parallel's replica row-gradient exchange is
an all_gather and is not counted), the ratio to the best TorchRec side of that
world, and the scaling N-process / 1-process samples/s per side.

Target: at 2 processes, our best side >= 1.5x TorchRec DMP's best (printed
as met yes/NO), judged on the paired comparison (on the sides measured one
after another when TorchRec or our sides were not run). Our best side is the
fastest of any plan, loop and precision: TorchRec runs at fp32, which our
"highest" is too, while "medium" is the TPU's default and costs extra here
(its bf16 rounding is a pass of its own on a CPU). This development machine
has 2 cores, so 2 processes share them: scaling above 1 is not expected (the
per-process work halves, but so do the cores, and the exchanges are added).

The launcher has a deadline (``--timeout``, default 900 s): past it, or once a
rank fails, every rank is killed and the run exits non-zero. Rank 0 of each
world hands its rows to the launcher, which writes
``benchmarks/results/dlrm_distributed.{json,md}`` (benchmarks.report).
``--quick`` is a smoke run (2 steps, 1 round, 1 warm-up step, batch 1024).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import itertools
import json
import logging
import os
import resource
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torchrec import EmbeddingBagCollection
from torchrec.distributed import DistributedModelParallel
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
from torchrec.distributed.planner.types import ParameterConstraints
from torchrec.distributed.types import ShardingEnv
from torchrec.models import dlrm as torchrec_dlrm
from torchrec.optim import RowWiseAdagrad
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.keyed import KeyedOptimizerWrapper

import sparsecore
from benchmarks import report
from benchmarks.collectives import supervise
from benchmarks.dlrm import DENSE_ARCH, DIM, LR, OVER_ARCH, ROW_CAP, table_configs
from data import schema
from data.synthetic import SyntheticConfig, SyntheticCriteo
from models.distributed import data_parallel, shard_embeddings
from data.loader import Batch as LoaderBatch
from models.dlrm import DLRM, DLRMTrain
from models.train import dense_parameters
from sparsecore.distributed import ShardingPlan, TableSharding
from sparsecore.trace import StageTrace
from torch_tpu.distributed.local_ranks import free_port, start_local_ranks

OURS = ("table_wise", "row_wise", "column_wise", "table_row_wise", "data_parallel")
TORCHREC = ("table_wise", "column_wise")  # TorchRec's CPU/gloo sharders have no row_wise
TARGET = 1.5
"""Our best sharding / TorchRec DMP's best, at TARGET_WORLD processes."""
TARGET_WORLD = 2
PIPELINE_TARGET = 1.15
"""sparsecore.TrainPipeline / the plain loop, same plan and world."""
PAIRED_ROUNDS_PER_ROUND = 2
"""The paired comparison's rounds per side, as a multiple of ``--rounds``."""
PAIRED_CANDIDATES = 3
"""Sides per framework in the paired comparison: its fastest ones measured one after another."""
DATA_SEED = 1  # benchmarks.dlrm.batches' seed: the same synthetic batches

Batch = tuple[torch.Tensor, Any, torch.Tensor]  # (dense, KJT, labels) of one rank's slice


@dataclasses.dataclass(frozen=True)
class Settings:
    """What every rank needs (picklable: it crosses the spawn)."""

    batch: int
    steps: int
    rounds: int
    warmup: int
    highest: bool
    threads: int
    """Intra-op threads per rank; 0: cores // world size."""
    ours: tuple[str, ...]
    pipelined: tuple[str, ...]
    """Our sharding types also run under sparsecore.TrainPipeline."""
    torchrec: tuple[str, ...]
    group_timeout_s: float
    out_file: str
    """Where rank 0 writes the world's rows (JSON) for the launcher."""


# ---------------------------------------------------------------- per rank: data and plans


def local_batches(global_batch: int, count: int, rank: int, world: int) -> tuple[list[Batch], tuple[int, ...]]:
    """This rank's contiguous slice of each of `count` global batches, and the table sizes.

    SyntheticCriteo draws rows in seeded blocks by row index, so generating the
    rank's rows is the same as generating the global batch and slicing it."""
    source = SyntheticCriteo(SyntheticConfig(row_cap=ROW_CAP, num_samples=global_batch * count, seed=DATA_SEED))
    local = global_batch // world
    out = []
    for i in range(count):
        start = i * global_batch + rank * local
        s = source.rows(start, start + local)
        out.append((torch.from_numpy(s.dense), s.kjt(), torch.from_numpy(s.labels)))
    return out, source.table_sizes


def our_plan(kind: str, tables: list[str], world: int) -> ShardingPlan:
    """The ShardingPlan of one sharding type (see the module docstring)."""
    everyone = tuple(range(world))
    hosts = tuple((r,) for r in everyone) if kind == "table_row_wise" else None

    def one(i: int) -> TableSharding:
        if kind == "table_wise":
            return TableSharding(sharding_type=kind, ranks=(i % world,))
        if kind == "column_wise":
            # Two column shards on one rank are refused under row-wise Adagrad: one whole-width shard at N = 1.
            ranks = (0, 1) if world > 1 else (0,)
            width = DIM // len(ranks)
            return TableSharding(sharding_type=kind, ranks=ranks, column_widths=(width,) * len(ranks))
        if kind == "table_row_wise":
            return TableSharding(sharding_type=kind, ranks=hosts[i % len(hosts)])
        if kind in ("row_wise", "data_parallel"):
            return TableSharding(sharding_type=kind, ranks=everyone)
        raise ValueError(f"unknown sharding type {kind!r}; choose from {', '.join(OURS)}")

    return ShardingPlan(world_size=world, hosts=hosts, tables={t: one(i) for i, t in enumerate(tables)})


# ---------------------------------------------------------------- per rank: the sides


class OurSide:
    """models.dlrm.DLRM on this rank's tpu: sharded embeddings, dense part under summing DDP; trained
    by the plain loop (forward, backward, step per batch) or by sparsecore.TrainPipeline."""

    def __init__(self, sizes: tuple[int, ...], global_batch: int, kind: str, device: torch.device,
                 world: int, precision: str, pipelined_over: list[Batch] | None = None,
                 trace: StageTrace | None = None):
        self.device, self.global_batch, self.precision = device, global_batch, precision
        # The id limits only check: a shard may see every id of the global batch (one id per feature).
        limit = global_batch * schema.NUM_SPARSE
        configs = table_configs(sizes)
        tables = [sparsecore.SparseCoreEmbeddingConfig(config=c, max_ids_per_partition=limit,
                                                       max_unique_ids_per_partition=limit) for c in configs]
        torch.manual_seed(0)
        # Meta: shard() then materializes only this rank's shards, not a full copy of every table first.
        ebc = sparsecore.SparseCoreEmbeddingBagCollection(tables, sparsecore.optim.RowWiseAdagrad(lr=LR),
                                                          device="meta")
        model = DLRM(ebc, schema.NUM_DENSE, DENSE_ARCH, OVER_ARCH)
        self.plan = our_plan(kind, [c.name for c in configs], world)
        shard_embeddings(model, self.plan)
        self.ebc = model.sparse_arch.embedding_bag_collection
        model = model.to(device)
        self.opt = torch.optim.Adagrad(dense_parameters(model), lr=LR)
        # The rank's sum over the global batch: with DDP summing, the global batch's mean loss.
        self.model = DLRMTrain(data_parallel(model), loss_divisor=global_batch)
        self.pipeline = None
        if pipelined_over is not None:
            self.pipeline = sparsecore.TrainPipeline(self.model, self.opt, device, trace=trace)
            self.batches = itertools.cycle([LoaderBatch(*b) for b in pipelined_over])

    def step(self, dense: torch.Tensor, kjt, labels: torch.Tensor) -> None:
        """One training step: of this batch (plain loop), or of the pipeline's next one (the
        pipeline reads its batches one ahead, cycling over the same data)."""
        with torch.tpu.precision(self.precision):
            if self.pipeline is not None:
                self.pipeline.progress(self.batches)
                return
            loss, _ = self.model(LoaderBatch(dense, kjt, labels).to(self.device))
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            self.opt.step()

    def bytes_sent(self) -> int:
        return sum(self.ebc.bytes_sent().values())

    def describe(self) -> str:
        kinds = sorted({t.sharding_type for t in self.plan.tables.values()})
        first = next(iter(self.plan.tables.items()))
        return f"{','.join(kinds)}; {first[0]}: {first[1].to_dict()}" + (
            f"; hosts {[list(h) for h in self.plan.hosts]}" if self.plan.hosts else "")


def constraint(kind: str, world: int) -> ParameterConstraints:
    """TorchRec's planner held to one sharding type. Column-wise: shards of DIM / N columns, as ours;
    by default (min_partition 128) it keeps a dim-64 table whole, which is table-wise in effect."""
    if kind == "column_wise":
        return ParameterConstraints(sharding_types=[kind], min_partition=DIM // min(world, 2))
    return ParameterConstraints(sharding_types=[kind])


class TorchRecSide:
    """TorchRec's DLRM under DistributedModelParallel on CPU, its planner held to one sharding type."""

    def __init__(self, sizes: tuple[int, ...], kind: str, group: dist.ProcessGroup, global_batch: int):
        world = dist.get_world_size(group)
        configs = table_configs(sizes)
        torch.manual_seed(0)
        ebc = EmbeddingBagCollection(tables=configs, device=torch.device("meta"))
        model = torchrec_dlrm.DLRM(ebc, schema.NUM_DENSE, DENSE_ARCH, OVER_ARCH)
        apply_optimizer_in_backward(RowWiseAdagrad, model.sparse_arch.parameters(), {"lr": LR})
        sharders = [EmbeddingBagCollectionSharder()]
        with warnings.catch_warnings():  # the planner's FutureWarnings about its storage heuristics
            warnings.simplefilter("ignore")
            planner = EmbeddingShardingPlanner(
                topology=Topology(world_size=world, local_world_size=world, compute_device="cpu"),
                batch_size=global_batch // world,
                constraints={c.name: constraint(kind, world) for c in configs},
                debug=False)
            plan = planner.collective_plan(model, sharders, group)
            self.model = DistributedModelParallel(model, env=ShardingEnv.from_process_group(group),
                                                  device=torch.device("cpu"), plan=plan, sharders=sharders)
        self.plan = plan
        dense = {n: p for n, p in self.model.named_parameters() if "sparse_arch" not in n}
        self.opt = KeyedOptimizerWrapper(dense, lambda p: torch.optim.Adagrad(p, lr=LR))

    def step(self, dense: torch.Tensor, kjt, labels: torch.Tensor) -> None:
        logits = self.model(dense, kjt).squeeze(-1)
        # The local mean: TorchRec's DDP averages the dense gradients over ranks.
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, labels)
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()

    def describe(self) -> str:
        """Sharding type and kernel, tables per rank, and the first table's shards."""
        per_rank: dict[int, int] = {}
        kinds, first = set(), None
        for module_plan in self.plan.plan.values():
            for name, p in module_plan.items():
                kinds.add(f"{p.sharding_type}/{p.compute_kernel}")
                for r in set(p.ranks or ()):
                    per_rank[r] = per_rank.get(r, 0) + 1
                if first is None and p.sharding_spec is not None:
                    shards = [f"r{s.placement.rank()}:{'x'.join(map(str, s.shard_sizes))}"
                              for s in p.sharding_spec.shards]
                    first = f"{name}: {' '.join(shards)}"
        return f"{','.join(sorted(kinds))}; tables per rank {dict(sorted(per_rank.items()))}; {first}"


# ---------------------------------------------------------------- per rank: counting and timing


class AllToAllBytes:
    """Bytes this rank sends to the other ranks through torch.distributed.all_to_all_single
    on one group, while active (TorchRec and sparsecore both call it by module attribute)."""

    def __init__(self, group: dist.ProcessGroup | None, rank: int, world: int):
        self.group, self.rank, self.world, self.bytes = group, rank, world, 0
        self._original: Callable | None = None

    def _count(self, output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
        if group is self.group and input.dim() > 0:
            rows = input_split_sizes or [input.shape[0] // self.world] * self.world
            row_bytes = input[0].numel() * input.element_size() if input.shape[0] else 0
            self.bytes += sum(n for r, n in enumerate(rows) if r != self.rank) * row_bytes
        return self._original(output, input, output_split_sizes, input_split_sizes, group=group, async_op=async_op)

    def __enter__(self) -> AllToAllBytes:
        self._original = dist.all_to_all_single
        dist.all_to_all_single = self._count
        return self

    def __exit__(self, *exc) -> None:
        dist.all_to_all_single = self._original


def max_over_ranks(values: list[float], anchor: dist.ProcessGroup) -> list[float]:
    """Elementwise max over ranks: a step is as slow as its slowest rank."""
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=anchor)
    return t.tolist()


def mean_over_ranks(value: float, anchor: dist.ProcessGroup) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, group=anchor)
    return t.item() / dist.get_world_size(anchor)


def warm_up(side: Any, data: list[Batch], settings: Settings) -> None:
    for i in range(settings.warmup):
        side.step(*data[i % len(data)])


def fastest(rows: list[dict[str, Any]], framework: str, count: int = 1) -> list[dict[str, Any]]:
    """The rows of ``framework``'s ``count`` sides with the most samples/s, fastest first."""
    return sorted((r for r in rows if r["framework"] == framework), key=lambda r: -r["samples_per_s"])[:count]


def side_name(row: dict[str, Any]) -> str:
    return f"{row['side']} ({row['precision']})"


def timed_rounds(step: Callable[..., None], data: list[Batch], settings: Settings,
                 anchor: dist.ProcessGroup) -> list[float]:
    """Seconds of each round of settings.steps steps, max over ranks (the same list on every rank)."""
    local = []
    gc.collect()
    gc.disable()  # a collection inside a round would land on one side only
    try:
        for r in range(settings.rounds):
            dist.barrier(group=anchor)
            start = time.perf_counter()
            for i in range(settings.steps):
                step(*data[(r * settings.steps + i) % len(data)])
            torch.tpu.synchronize()  # what a pipeline left queued counts in its round
            local.append(time.perf_counter() - start)
    finally:
        gc.enable()
    return max_over_ranks(local, anchor)


def free_side() -> None:
    """Drops what a freed side left: cycles, and the tpu allocator's cached blocks."""
    gc.collect()
    torch.tpu.empty_cache()


def traced_round(side: OurSide, data: list[Batch], settings: Settings, anchor: dist.ProcessGroup) -> dict[str, Any]:
    """One more round of the pipelined side with its stages traced: wall time against the sum
    of the stages' times (overlap is the difference), and rank 0's intervals for the plot."""
    trace = side.pipeline.trace
    dist.barrier(group=anchor)
    trace.clear()
    for i in range(settings.steps):
        side.step(*data[i % len(data)])
    torch.tpu.synchronize()
    return trace.summary(timeline=True) | {"steps": settings.steps}


def measure_side(framework: str, kind: str, precision: str, build: Callable[[], Any], data: list[Batch],
                 settings: Settings, anchor: dist.ProcessGroup, counted_group: dist.ProcessGroup | None,
                 rank: int, world: int) -> dict[str, Any]:
    """Builds one side, times it, frees it; returns its row (the same on every rank)."""
    torch.tpu.reset_peak_memory_stats()
    tpu_before = torch.tpu.memory_allocated()
    started = time.perf_counter()
    side = build()
    build_s = max_over_ranks([time.perf_counter() - started], anchor)[0]
    warm_up(side, data, settings)
    bytes_before = side.bytes_sent() if framework == "ours" else 0
    with AllToAllBytes(counted_group, rank, world) as counter:
        rounds = timed_rounds(side.step, data, settings, anchor)
    timed_steps = settings.steps * settings.rounds
    loop = "pipeline" if getattr(side, "pipeline", None) is not None else "plain"
    row: dict[str, Any] = {
        "world": world, "side": f"{framework}{'+pipeline' if loop == 'pipeline' else ''}:{kind}",
        "framework": framework, "sharding": kind, "loop": loop,
        "precision": precision, "samples_per_s": settings.steps * settings.batch / min(rounds),
        "round_s": rounds, "build_s": build_s,
        "a2a_counted_bytes_per_step": mean_over_ranks(counter.bytes / timed_steps, anchor),
        "peak_tpu_gb": max_over_ranks([(torch.tpu.max_memory_allocated() - tpu_before) / 2**30], anchor)[0],
        "plan": side.describe(),
    }
    if framework == "ours":
        per_step = (side.bytes_sent() - bytes_before) / timed_steps
        row["a2a_bytes_per_step"] = mean_over_ranks(per_step, anchor)
        row["a2a_bytes_per_step_max_rank"] = max_over_ranks([per_step], anchor)[0]
    else:
        row["a2a_bytes_per_step"] = row["a2a_counted_bytes_per_step"]
    if loop == "pipeline":
        row["trace"] = traced_round(side, data, settings, anchor)
    del side
    free_side()
    dist.barrier(group=anchor)
    return row


def measure_pair(builds: dict[str, Callable[[], Any]], data: list[Batch], settings: Settings,
                 anchor: dist.ProcessGroup) -> dict[str, list[float]]:
    """Round times (max over ranks) of sides built side by side, their rounds interleaved
    (ABC, CBA, ...): a paired comparison, which the machine's drifting speed moves alike."""
    sides = {name: build() for name, build in builds.items()}
    for side in sides.values():
        warm_up(side, data, settings)
    one_round = dataclasses.replace(settings, rounds=1)
    times: dict[str, list[float]] = {name: [] for name in sides}
    for r in range(PAIRED_ROUNDS_PER_ROUND * settings.rounds):
        for name in (list(sides) if r % 2 == 0 else list(sides)[::-1]):
            times[name] += timed_rounds(sides[name].step, data, one_round, anchor)
    del sides
    free_side()
    dist.barrier(group=anchor)
    return times


def run_rank(rank: int, world: int, port: int, settings: Settings) -> None:
    """A spawned rank: joins the groups, measures every side of this world; rank 0 writes the rows."""
    # Quiet: TorchRec's planner logs, and torch.fx's one-time is_fx_tracing notice (TorchRec calls it).
    for name in ("torchrec", "torch.fx._symbolic_trace"):
        logging.getLogger(name).setLevel(logging.ERROR)
    dist.init_process_group("tpu_dist", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=settings.group_timeout_s))
    anchor = dist.new_group(backend="gloo")  # the benchmark's own barriers and reductions
    torchrec_group = dist.new_group(backend="gloo")  # TorchRec's DMP: plain gloo on CPU tensors
    torch.set_num_threads(settings.threads or max(1, (os.cpu_count() or 1) // world))
    torch.set_float32_matmul_precision("highest")  # the CPU side: exact fp32
    # Asking for tpu "highest" is deliberate here: its cost warning would only clutter the output.
    warnings.filterwarnings("ignore", message="tpu matmul precision 'highest' costs")
    device = torch.device("tpu", torch.tpu.current_device())  # tpu:<LOCAL_RANK>, set by tpu_dist
    data, sizes = local_batches(settings.batch, max(settings.steps, 4), rank, world)
    rows = []

    def record(row: dict[str, Any]) -> None:
        rows.append(row)
        if rank == 0:
            print(progress_line(row), flush=True)

    for kind in settings.ours:
        record(measure_side("ours", kind, "medium",
                            lambda: OurSide(sizes, settings.batch, kind, device, world, "medium"),
                            data, settings, anchor, None, rank, world))
        if kind in settings.pipelined:  # right after the plain loop of the same plan: a paired comparison
            record(measure_side("ours", kind, "medium",
                                lambda: OurSide(sizes, settings.batch, kind, device, world, "medium",
                                                pipelined_over=data, trace=StageTrace()),
                                data, settings, anchor, None, rank, world))
    for kind in settings.torchrec:
        record(measure_side("torchrec", kind, "highest",
                            lambda: TorchRecSide(sizes, kind, torchrec_group, settings.batch),
                            data, settings, anchor, torchrec_group, rank, world))
    if settings.highest and settings.ours:
        best = fastest(rows, "ours")[0]["sharding"]
        record(measure_side("ours", best, "highest",
                            lambda: OurSide(sizes, settings.batch, best, device, world, "highest"),
                            data, settings, anchor, None, rank, world))
    paired = None
    if settings.ours and settings.torchrec:
        # Our fastest sides (plan, loop and precision) and TorchRec's, again, side by side with
        # their rounds interleaved: the sides above ran one after another, over minutes of drift,
        # so which is fastest is decided here too, under the same conditions for all.
        candidates = fastest(rows, "ours", PAIRED_CANDIDATES) + fastest(rows, "torchrec", PAIRED_CANDIDATES)

        def build(row: dict[str, Any]) -> Callable[[], Any]:
            if row["framework"] == "torchrec":
                return lambda: TorchRecSide(sizes, row["sharding"], torchrec_group, settings.batch)
            pipelined = data if row["loop"] == "pipeline" else None
            return lambda: OurSide(sizes, settings.batch, row["sharding"], device, world, row["precision"],
                                   pipelined_over=pipelined)

        times = measure_pair({side_name(r): build(r) for r in candidates}, data, settings, anchor)
        best = {framework: min((side_name(r) for r in candidates if r["framework"] == framework),
                               key=lambda name: min(times[name])) for framework in ("ours", "torchrec")}
        paired = {"world": world, "ours": best["ours"], "torchrec": best["torchrec"],
                  "samples_per_round": settings.steps * settings.batch, "round_s": times}
        if rank == 0:
            print(paired_line(paired), flush=True)
    dist.barrier(group=anchor)
    if rank == 0:
        peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
        Path(settings.out_file).write_text(json.dumps({"world": world, "rows": rows, "paired": paired,
                                                       "rank0_peak_rss_gb": peak_rss,
                                                       "threads_per_rank": torch.get_num_threads()}))
    dist.destroy_process_group()


# ---------------------------------------------------------------- results (launcher)


def progress_line(row: dict[str, Any]) -> str:
    return (f"world {row['world']} {row['side']:>24} ({row['precision']}): {row['samples_per_s']:9,.0f} samples/s, "
            f"a2a {row['a2a_bytes_per_step'] / 1e6:7.3f} MB/step/rank, built in {row['build_s']:.1f} s, "
            f"peak tpu {row['peak_tpu_gb']:.2f} GB")


def paired_ratios(paired: dict[str, Any]) -> tuple[float, list[float]]:
    """Ours over TorchRec in samples/s: best round against best round, and round by round."""
    ours, theirs = paired["round_s"][paired["ours"]], paired["round_s"][paired["torchrec"]]
    return min(theirs) / min(ours), [t / o for o, t in zip(ours, theirs)]


def paired_line(paired: dict[str, Any]) -> str:
    best, per_round = paired_ratios(paired)
    n, rounds = paired["samples_per_round"], paired["round_s"]
    others = ", ".join(f"{name} {n / min(t):,.0f}" for name, t in rounds.items()
                       if name not in (paired["ours"], paired["torchrec"]))
    line = (f"world {paired['world']}, paired (built side by side, {len(per_round)} interleaved rounds each): "
            f"{paired['ours']} {n / min(rounds[paired['ours']]):,.0f} samples/s = {best:.2f}x "
            f"{paired['torchrec']} {n / min(rounds[paired['torchrec']]):,.0f} (round by round "
            f"{min(per_round):.2f}-{max(per_round):.2f}x, median {statistics.median(per_round):.2f}x)"
            + (f"; the other sides of those rounds: {others}" if others else ""))
    if paired["world"] == TARGET_WORLD:
        line += f"; target >= {TARGET}x: met {'yes' if best >= TARGET else 'NO'}"
    return line


def add_comparisons(rows: list[dict[str, Any]], paired: list[dict[str, Any]] = ()) -> list[str]:
    """Ratio to the best TorchRec side of the same world, scaling to 1 process; returns the summary
    lines. The target is judged on the paired comparison of a world when there is one (``paired``:
    run_rank's), else on the sides measured one after another."""
    best_torchrec = {}
    for r in rows:
        if r["framework"] == "torchrec":
            best_torchrec[r["world"]] = max(best_torchrec.get(r["world"], 0.0), r["samples_per_s"])
    one_process = {(r["side"], r["precision"]): r["samples_per_s"] for r in rows if r["world"] == 1}
    for r in rows:
        anchor = best_torchrec.get(r["world"])
        r["x_best_torchrec"] = r["samples_per_s"] / anchor if anchor else None
        base = one_process.get((r["side"], r["precision"]))
        r["scaling_vs_1"] = r["samples_per_s"] / base if base and r["world"] != 1 else None
    lines = []
    for world in sorted({r["world"] for r in rows}):
        ours = [r for r in rows if r["world"] == world and r["framework"] == "ours"]
        if not ours or world not in best_torchrec:
            continue
        best = max(ours, key=lambda r: r["samples_per_s"])
        ratio = best["samples_per_s"] / best_torchrec[world]
        line = (f"world {world}: our best {best['side']} ({best['precision']}) {best['samples_per_s']:,.0f} "
                f"samples/s = {ratio:.2f}x "
                f"TorchRec DMP's best {best_torchrec[world]:,.0f} (sides measured one after another)")
        pair = next((p for p in paired if p["world"] == world), None)
        if world == TARGET_WORLD and pair is None:
            line += f"; target >= {TARGET}x: met {'yes' if ratio >= TARGET else 'NO'}"
        lines.append(line)
        if pair is not None:
            lines.append(paired_line(pair))
    if not any(r["world"] == TARGET_WORLD for r in rows):
        lines.append(f"target (world {TARGET_WORLD}) not measured")
    plain = {(r["world"], r["sharding"], r["precision"]): r["samples_per_s"]
             for r in rows if r["framework"] == "ours" and r["loop"] == "plain"}
    pipelined = [r for r in rows if r.get("loop") == "pipeline"]
    for r in rows:
        base = plain.get((r["world"], r["sharding"], r["precision"])) if r.get("loop") == "pipeline" else None
        r["x_plain_loop"] = r["samples_per_s"] / base if base else None
    if pipelined:
        met = [r for r in pipelined if r["x_plain_loop"] is not None and r["x_plain_loop"] >= PIPELINE_TARGET]
        lines.append(f"exact pipeline / plain loop (target >= {PIPELINE_TARGET}x): " + ", ".join(
            f"world {r['world']} {r['sharding']} {r['x_plain_loop']:.2f}x "
            f"(stages {r['trace']['sum_of_stages_s'] / r['trace']['wall_s']:.2f}x the wall time)" for r in pipelined)
            + f"; met in {len(met)} of {len(pipelined)}")
    scaled = [r for r in rows if r["scaling_vs_1"] is not None]
    if scaled:
        lines.append("scaling (N-process / 1-process samples/s): " + ", ".join(
            f"{r['side']}{'' if r['precision'] == 'medium' else ' ' + r['precision']} {r['scaling_vs_1']:.2f}"
            for r in scaled))
    return lines


def render(rows: list[dict[str, Any]], lines: list[str], meta: dict[str, Any]) -> str:
    def fmt(value: float | None, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    shown = [{
        "world": r["world"], "side": r["side"], "precision": r["precision"],
        "samples/s": f"{r['samples_per_s']:,.0f}",
        "a2a MB/step/rank": ("n/a" if r["a2a_bytes_per_step"] is None else f"{r['a2a_bytes_per_step'] / 1e6:.3f}"),
        "x best TorchRec": fmt(r["x_best_torchrec"], ".2f"), "scaling vs 1": fmt(r["scaling_vs_1"], ".2f"),
        "x plain loop": fmt(r.get("x_plain_loop"), ".2f"),
        "peak tpu GB/rank": f"{r['peak_tpu_gb']:.2f}", "build s": f"{r['build_s']:.1f}",
    } for r in rows]
    columns = ["world", "side", "precision", "samples/s", "a2a MB/step/rank", "x best TorchRec", "scaling vs 1",
               "x plain loop", "peak tpu GB/rank", "build s"]
    head = (f"global batch {meta['batch']}, best of {meta['rounds']} round(s) x {meta['steps']} steps after "
            f"{meta['warmup']} warm-up step(s); a round's time is the max over ranks; threads per rank "
            f"{meta['threads_per_rank']}; ours: tpu, TorchRec: CPU fp32 over gloo; a2a: bytes a rank sends to the "
            f"others per step (mean over ranks; data_parallel's all_gather of row gradients not counted)"
            + ("; --quick (a smoke run: too few steps to judge the target)" if meta["quick"] else ""))
    plans = "\n".join(f"- world {r['world']} {r['side']}: {r['plan']}" for r in rows
                      if r["framework"] == "torchrec" or r["precision"] == "medium")
    body = f"{head}\n\n{report.markdown_table(shown, columns)}\n\n" + "\n".join(f"- {s}" for s in lines)
    return body + f"\n\nplans:\n\n{plans}\n\nwall time {meta['wall_time_s']:.0f} s"


def plot_traces(rows: list[dict[str, Any]], path: Path, steps: int = 3) -> None:
    """Rank 0's stages over the first ``steps`` traced steps of each pipelined side, one lane per thread."""
    if not rows:
        return
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed in the venv: skipping the plot")
        return
    lanes = ["reader", "main", "sparsecore", "input dist"]
    colors = {}
    fig, axes = plt.subplots(len(rows), 1, figsize=(11, 1.6 + 1.1 * len(rows)), squeeze=False)
    for ax, r in zip(axes[:, 0], rows):
        trace = r["trace"]
        horizon = trace["wall_s"] * steps / trace["steps"]
        for stage, lane, start, end in trace["intervals"]:
            if start > horizon:
                continue
            color = colors.setdefault(stage, f"C{len(colors)}")
            ax.barh(lanes.index(lane), (end - start) * 1e3, left=start * 1e3, color=color, edgecolor="black",
                    linewidth=0.3, label=stage)
        ax.set_yticks(range(len(lanes)), lanes)
        ax.invert_yaxis()
        ax.set_title(f"world {r['world']} {r['sharding']}: {r['x_plain_loop'] or 0:.2f}x the plain loop; "
                     f"sum of stages {trace['sum_of_stages_s'] / trace['wall_s']:.2f}x the wall time", fontsize=9)
    axes[-1, 0].set_xlabel("ms (rank 0)")
    handles, labels = axes[0, 0].get_legend_handles_labels()
    unique = dict(zip(labels, handles))
    for ax in axes[1:, 0]:
        for h, l in zip(*ax.get_legend_handles_labels()):
            unique.setdefault(l, h)
    fig.legend(unique.values(), unique.keys(), loc="upper right", fontsize=8, ncol=4)
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")


# ---------------------------------------------------------------- launcher


def parse_kinds(text: str, allowed: tuple[str, ...], parser: argparse.ArgumentParser) -> tuple[str, ...]:
    kinds = tuple(k for k in text.split(",") if k)
    unknown = sorted(set(kinds) - set(allowed))
    if unknown:
        parser.error(f"unknown sharding type(s) {unknown}; choose from {', '.join(allowed)}")
    return kinds


def run_world(world: int, settings: Settings, deadline: float) -> dict[str, Any] | None:
    """One launch of `world` ranks; their rows, or None on failure or past the deadline."""
    procs = start_local_ranks(run_rank, world, (world, free_port(), settings))
    if supervise(procs, max(1.0, deadline - time.monotonic())) != 0:
        return None
    return json.loads(Path(settings.out_file).read_text())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smoke run: 2 steps, 1 round, 1 warm-up, batch 1024")
    parser.add_argument("--worlds", default="1,2", help="comma-separated process counts")
    parser.add_argument("--batch", type=int, help="global batch (default 2048; --quick 1024)")
    parser.add_argument("--steps", type=int, help="steps per timed round (default 8; --quick 2)")
    parser.add_argument("--rounds", type=int, help="timed rounds per side (default 3; --quick 1)")
    parser.add_argument("--warmup", type=int, help="warm-up steps per side (default 3; --quick 1)")
    parser.add_argument("--ours", default=",".join(OURS), help="our sharding types to run")
    parser.add_argument("--pipelined", default="table_wise,row_wise",
                        help="our sharding types also run under sparsecore.TrainPipeline (a subset of --ours)")
    parser.add_argument("--torchrec", default=",".join(TORCHREC), help="TorchRec sharding types to run")
    parser.add_argument("--no-highest", action="store_true", help="skip our best plan at tpu precision highest")
    parser.add_argument("--threads", type=int, default=0, help="intra-op threads per rank (default cores // N)")
    parser.add_argument("--timeout", type=float, default=900.0, help="deadline for the whole run, seconds")
    parser.add_argument("--out", type=Path, default=report.DEFAULT_DIR)
    args = parser.parse_args(argv)
    quick = args.quick
    pick = lambda value, full, smoke: value if value is not None else (smoke if quick else full)  # noqa: E731
    worlds = [int(w) for w in args.worlds.split(",")]
    batch = pick(args.batch, 2048, 1024)
    if any(w < 1 or batch % w for w in worlds):
        parser.error(f"every world size must be >= 1 and divide the global batch {batch}")
    with tempfile.TemporaryDirectory(prefix="dlrm_distributed") as tmp:
        settings = Settings(batch=batch, steps=pick(args.steps, 8, 2), rounds=pick(args.rounds, 3, 1),
                            warmup=pick(args.warmup, 3, 1), highest=not (quick or args.no_highest),
                            threads=args.threads, ours=parse_kinds(args.ours, OURS, parser),
                            pipelined=parse_kinds(args.pipelined, OURS, parser),
                            torchrec=parse_kinds(args.torchrec, TORCHREC, parser), group_timeout_s=300.0,
                            out_file=str(Path(tmp) / "rows.json"))
        started = time.monotonic()
        deadline = started + args.timeout
        print(f"worlds {worlds}, global batch {batch}, {settings.rounds} round(s) x {settings.steps} steps; "
              f"deadline {args.timeout:.0f} s", flush=True)
        results = []
        for world in worlds:
            result = run_world(world, settings, deadline)
            if result is None:
                print(f"world {world} failed or ran past the deadline: no results written", file=sys.stderr)
                return 1
            results.append(result)
    rows = [r for res in results for r in res["rows"]]
    paired = [res["paired"] for res in results if res.get("paired")]
    lines = add_comparisons(rows, paired)
    meta = {**dataclasses.asdict(settings), "quick": quick, "worlds": worlds,
            "threads_per_rank": {res["world"]: res["threads_per_rank"] for res in results},
            "rank0_peak_rss_gb": {res["world"]: res["rank0_peak_rss_gb"] for res in results},
            "wall_time_s": time.monotonic() - started}
    meta.pop("out_file")
    table = render(rows, lines, meta)
    print()
    print(table)
    plot_traces([r for r in rows if r.get("loop") == "pipeline"], args.out / "dlrm_distributed_pipeline.png")
    json_path, md_path = report.write("dlrm_distributed", {"config": meta, "target": TARGET, "rows": rows,
                                                           "paired": paired, "summary": lines}, table,
                                      out_dir=args.out)
    print(f"wrote {json_path}, {md_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
