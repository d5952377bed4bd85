"""Embedding lookups and fused updates: the SparseCore engine against ATen and FBGEMM.

``python -m benchmarks.embedding [--quick] [--dims 64] [--shapes 8192x20] [--dists uniform]
[--cells 'd64/*/zipf*'] [--phases forward,adam]``

One run, the same inputs for every system, side by side. The engine is
``SparseCoreEmbeddingBagCollection`` on the tpu device (emulated on host
memory, the chip's 4 SparseCores, fp32 tables, fp32 output, host
preprocessing inside the timed region); the anchors run on CPU in the same
process: ATen ``torch.nn.functional.embedding_bag`` (mode sum), FBGEMM's CPU
``SplitTableBatchedEmbeddingBagsCodegen`` (fp32), and for Adam
``torch.nn.EmbeddingBag(sparse=True)`` + ``torch.optim.SparseAdam``.

Grid: 26 Criteo-Kaggle-shaped tables (each capped at 1,000,000 rows), one
feature per table, fixed-length bags; dims 64 and 128; batch 8192 with
pooling 1, 20, 100 and batch 65536 with pooling 1, 20; ids uniform or Zipf
(alpha 1.05 and 1.2: inverse-CDF sampling of the truncated Zipf law with a
fixed seed, the id space of every table randomly permuted so hot ids are
scattered). Phases: forward; forward+backward+row-wise Adagrad (engine vs
FBGEMM EXACT_ROWWISE_ADAGRAD); Adam (engine vs EmbeddingBag(sparse) +
SparseAdam); SGD (engine vs FBGEMM EXACT_SGD; in --quick, else opt-in with
--phases, as the full grid would pass 10 minutes with it). Adam and SGD run
on batch 8192, pooling 1 and 20 by default (``--subset-shapes``; ``all`` for
every shape): the SparseAdam anchor alone takes ~1 s per million ids here.
The full grid takes about 5 minutes on the 2-core development machine (--quick: 40 s).

The forward is an inference lookup (``torch.inference_mode``; FBGEMM's
training TBE, which has no kernel in that mode, under ``torch.no_grad``):
the engine validates the ids and checks the SparseCore limits inside the
timed region but builds no COO buffers, which no backward will read
(sparsecore.inference). "engine COO path" is the engine's forward under
``torch.no_grad`` instead: the host preprocessing into COO buffers that a
training step's forward does, then the lookup of those buffers.

Per cell: ms/iteration (min over interleaved rounds after one warm-up;
large cells get fewer rounds, see ``--cell-budget``), lookups/s, GB/s of
gathered rows (total ids x dim x 4 B / time), the unique/total id ratio,
and speedups as anchor_ms / engine_ms. This machine's memory-copy
bandwidth is measured and printed as a yardstick.

Targets (printed beside the numbers):
  forward                       >= 1.0x ATen embedding_bag and >= 2.0x FBGEMM
  fwd+bwd+row-wise Adagrad      >= 2.0x FBGEMM
  fwd+bwd+Adam                  >= 3.0x EmbeddingBag(sparse) + SparseAdam
  with Zipf ids the backward cost should follow the unique ids (the
  "backward vs unique ids" table: backward time and unique ids, Zipf over uniform)

Memory (``--mem-budget-gb``, 17 of this machine's 24 GiB): tables are built
once per dim and pass, freed before the next; ATen reads the FBGEMM module's
tables (per-table views of its one buffer). Engine and anchor run
interleaved, cell by cell, when the estimated peak of both fits the budget
(dims 64 and 128: run apart, the anchors' timings moved by up to 4x between
runs with the memory state they met); otherwise the
engine runs all cells of the pass, is freed, then the anchor does (Adam at
dim 128, whose two dense moments per row triple the tables). Each pass
prints its estimated peak; the measured peak RSS is in the results.

Before timing, a small case checks that the engine's forward equals ATen's
and FBGEMM's on the same weights and that one step of each optimizer
equals its anchor's, so the benchmark cannot silently compare different things.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import fnmatch
import gc
import math
import resource
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from benchmarks import report
from data import schema

ROW_CAP = 1_000_000
TABLE_ROWS = [min(n, ROW_CAP) for n in schema.KAGGLE_TABLE_SIZES]
DIMS = [64, 128]
SHAPES = [(8192, 1), (8192, 20), (8192, 100), (65536, 1), (65536, 20)]
DISTS = ["uniform", "zipf1.05", "zipf1.2"]
SUBSET_SHAPES = [(8192, 1), (8192, 20)]
PHASES = ["forward", "rowwise_adagrad", "adam", "sgd"]
DEFAULT_PHASES = ["forward", "rowwise_adagrad", "adam"]  # --quick adds sgd

# (phase, anchor) -> minimum speedup anchor_ms / engine_ms.
TARGETS = {
    ("forward", "aten"): 1.0,
    ("forward", "fbgemm"): 2.0,
    ("rowwise_adagrad", "fbgemm"): 2.0,
    ("adam", "sparse_adam"): 3.0,
}
ANCHORS = {"forward": ["aten", "fbgemm"], "rowwise_adagrad": ["fbgemm"], "sgd": ["fbgemm"], "adam": ["sparse_adam"]}
PHASE_TITLES = {
    "forward": "forward",
    "rowwise_adagrad": "forward + backward + row-wise Adagrad",
    "sgd": "forward + backward + SGD",
    "adam": "forward + backward + Adam (lazy, as SparseAdam)",
}
SYSTEM_TITLES = {
    "engine": "engine", "engine_coo": "engine COO path", "aten": "ATen", "fbgemm": "FBGEMM",
    "sparse_adam": "EB+SparseAdam",
}

LR = {"rowwise_adagrad": 0.01, "sgd": 0.01, "adam": 0.001}
EPS = 1e-8


@dataclasses.dataclass(frozen=True, order=True)
class Cell:
    batch: int
    pooling: int
    dist: str
    dim: int

    @property
    def label(self) -> str:
        return f"d{self.dim}/b{self.batch}/p{self.pooling}/{self.dist}"

    @property
    def total_ids(self) -> int:
        return self.batch * self.pooling * len(TABLE_ROWS)


# ---------------------------------------------------------------- inputs


class Inputs:
    """The ids of one (batch, pooling, dist), shared by every dim and system."""

    _perms: dict[int, np.ndarray] = {}

    def __init__(self, batch: int, pooling: int, dist: str, seed: int):
        self.batch, self.pooling, self.dist = batch, pooling, dist
        rng = np.random.default_rng([seed, DISTS.index(dist) if dist in DISTS else 99, batch, pooling])
        count = batch * pooling
        parts, unique = [], 0
        for t, n in enumerate(TABLE_ROWS):
            if dist == "uniform":
                ids = rng.integers(0, n, count, dtype=np.int64)
            else:
                ids = np.searchsorted(_zipf_cdf(n, float(dist.removeprefix("zipf"))), rng.random(count), side="right")
                np.minimum(ids, n - 1, out=ids)
                ids = self._perm(t, n, seed)[ids]
            unique += int(np.count_nonzero(np.bincount(ids, minlength=n)))
            parts.append(torch.from_numpy(ids.astype(np.int32)))
        self.ids32 = torch.cat(parts)  # table-major; int32 to halve the cache
        self.unique = unique
        self.total = self.ids32.numel()

    @classmethod
    def _perm(cls, table: int, n: int, seed: int) -> np.ndarray:
        """A fixed permutation of a table's id space: where the Zipf ranks land."""
        if table not in cls._perms:
            cls._perms[table] = np.random.default_rng([seed, 1000 + table]).permutation(n).astype(np.int32)
        return cls._perms[table]

    def materialize(self) -> dict:
        """int64 ids, TBE offsets (T*B+1), per-table views, bag offsets and the KJT."""
        from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

        tables, per = len(TABLE_ROWS), self.batch * self.pooling
        indices = self.ids32.long()
        offsets = torch.arange(tables * self.batch + 1, dtype=torch.int64) * self.pooling
        kjt = KeyedJaggedTensor(keys=[f"f{t}" for t in range(tables)], values=indices,
                                lengths=torch.full((tables * self.batch,), self.pooling, dtype=torch.int64))
        return {
            "indices": indices,
            "offsets": offsets,
            "table_ids": [indices[t * per:(t + 1) * per] for t in range(tables)],
            "bag_offsets": offsets[:self.batch].clone(),
            "kjt": kjt,
        }


_CDFS: dict[tuple[int, float], np.ndarray] = {}


def _zipf_cdf(n: int, alpha: float) -> np.ndarray:
    """CDF of P(rank k) ~ k^-alpha over k = 1..n (the Zipf law truncated to the table)."""
    key = (n, alpha)
    if key not in _CDFS:
        cdf = np.cumsum(np.arange(1, n + 1, dtype=np.float64) ** -alpha)
        _CDFS[key] = cdf / cdf[-1]
    return _CDFS[key]


class InputCache:
    def __init__(self, seed: int):
        self.seed, self._inputs, self._grads = seed, {}, {}

    def get(self, cell: Cell) -> Inputs:
        key = (cell.batch, cell.pooling, cell.dist)
        if key not in self._inputs:
            self._inputs[key] = Inputs(*key, seed=self.seed)
        return self._inputs[key]

    def grad(self, batch: int, width: int, device: str) -> torch.Tensor:
        """The pooled-output gradient, the same values on every device; one (batch, width) kept at a time."""
        key = (batch, width)
        if key not in self._grads:
            self.drop_grads()
            self._grads[key] = {}
        entry = self._grads[key]
        if device not in entry:
            g = torch.Generator().manual_seed(self.seed + 7)
            entry[device] = (torch.randn(batch, width, generator=g) * 1e-3).to(device)
        return entry[device]

    def drop_grads(self) -> None:
        self._grads.clear()
        gc.collect()

    def keep_only(self, keys: set[tuple[int, int, str]]) -> None:
        """Drops the ids of every (batch, pooling, dist) not in keys."""
        for key in set(self._inputs) - keys:
            del self._inputs[key]


# ---------------------------------------------------------------- systems


def sync() -> None:
    torch.tpu.synchronize()


def build_engine(dim: int, optimizer, max_ids: int, rows: list[int] = TABLE_ROWS):
    from torchrec import EmbeddingBagConfig

    from sparsecore import SparseCoreEmbeddingConfig
    from sparsecore.modules import SparseCoreEmbeddingBagCollection

    # Limits set to the largest batch's total id count: they are checks only (the
    # COO buffers are sized by what a batch carries), so no batch trips them.
    tables = [
        SparseCoreEmbeddingConfig(
            config=EmbeddingBagConfig(name=f"t{t}", num_embeddings=n, embedding_dim=dim, feature_names=[f"f{t}"]),
            max_ids_per_partition=max_ids, max_unique_ids_per_partition=max_ids)
        for t, n in enumerate(rows)
    ]
    engine = SparseCoreEmbeddingBagCollection(tables, optimizer, device="tpu")
    sync()
    return engine


def build_tbe(dim: int, optim_name: str, rows: list[int] = TABLE_ROWS):
    from fbgemm_gpu.split_embedding_configs import EmbOptimType as OptimType
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice,
        EmbeddingLocation,
        SplitTableBatchedEmbeddingBagsCodegen,
    )

    optimizer = {"rowwise_adagrad": OptimType.EXACT_ROWWISE_ADAGRAD, "sgd": OptimType.EXACT_SGD}[optim_name]
    return SplitTableBatchedEmbeddingBagsCodegen(
        embedding_specs=[(n, dim, EmbeddingLocation.HOST, ComputeDevice.CPU) for n in rows],
        optimizer=optimizer, learning_rate=LR[optim_name], eps=EPS)


def engine_optimizer(phase: str):
    from sparsecore import optim

    if phase == "rowwise_adagrad":
        return optim.RowWiseAdagrad(lr=LR[phase], eps=EPS)
    if phase == "sgd":
        return optim.SGD(lr=LR[phase])
    if phase == "adam":
        return optim.Adam(lr=LR[phase], eps=EPS)
    return None


def build_sparse_adam(dim: int, rows: list[int] = TABLE_ROWS):
    bags = [torch.nn.EmbeddingBag(n, dim, mode="sum", sparse=True) for n in rows]
    return bags, [torch.optim.SparseAdam(b.parameters(), lr=LR["adam"], eps=EPS) for b in bags]


def engine_forward(engine, data, mode=torch.inference_mode) -> Callable[[], None]:
    """The engine's forward under ``mode``: an inference lookup, or under torch.no_grad the COO
    path (a training step's forward without autograd: preprocessing, then the buffers' lookup)."""
    def run() -> None:
        with mode():
            engine(data["kjt"]).values()
        sync()
    return run


def engine_train(engine, data, grad) -> Callable[[], None]:
    def run() -> None:
        engine(data["kjt"]).values().backward(grad)
        sync()
    return run


def aten_forward(weights, data) -> Callable[[], None]:
    def run() -> None:
        with torch.inference_mode():
            torch.cat([F.embedding_bag(ids, w, data["bag_offsets"], mode="sum")
                       for ids, w in zip(data["table_ids"], weights)], dim=1)
    return run


def tbe_forward(tbe, data) -> Callable[[], None]:
    # no_grad: the training TBE has no kernel under inference_mode (only its autograd one).
    def run() -> None:
        with torch.no_grad():
            tbe(data["indices"], data["offsets"])
    return run


def tbe_train(tbe, data, grad) -> Callable[[], None]:
    def run() -> None:
        tbe(data["indices"], data["offsets"]).backward(grad)
    return run


def sparse_adam_train(bags, opts, data, grad) -> Callable[[], None]:
    # Table by table (forward, backward, step): all tables' sparse gradients at
    # once would be total ids x dim x 4 B (17 GB for the largest cell).
    dim = bags[0].embedding_dim

    def run() -> None:
        for t, (bag, opt) in enumerate(zip(bags, opts)):
            bag(data["table_ids"][t], data["bag_offsets"]).backward(grad[:, t * dim:(t + 1) * dim])
            opt.step()
            bag.weight.grad = None
    return run


def free() -> None:
    """Returns freed memory to the OS (the caller has dropped its references): the tpu
    allocator's cached blocks and glibc's free heap."""
    gc.collect()
    torch.tpu.empty_cache()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


# ---------------------------------------------------------------- timing


def _ms(fn: Callable[[], None]) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def measure(systems: dict[str, Callable[[], None]], max_rounds: int, budget_s: float,
            warmup: int) -> tuple[dict[str, float], int]:
    """Min ms per system over interleaved rounds, after `warmup` untimed calls each.

    Rounds: max_rounds, fewer (at least 1) when a round would not fit in budget_s. When the
    warm-up says the budget binds but a round fits in it, each system runs once more untimed
    and that call decides: on this machine a first call can be several times slower than the
    next (a new batch of the Adam engine: 139 ms, then 29 and 26), and one cold estimate
    would leave the cell a single round. Past the budget a cell gets one round regardless.
    """
    gc.collect()
    gc.disable()
    try:
        last = {}
        for name, fn in systems.items():
            for _ in range(warmup):
                last[name] = _ms(fn)
        per_round = sum(last.values()) / 1e3
        if per_round * max_rounds > budget_s and per_round <= budget_s:
            per_round = sum(_ms(systems[name]) for name in last) / 1e3
        rounds = max_rounds if per_round * max_rounds <= budget_s else max(1, int(budget_s // max(per_round, 1e-9)))
        times: dict[str, list[float]] = {name: [] for name in systems}
        for _ in range(rounds):
            for name, fn in systems.items():
                times[name].append(_ms(fn))
    finally:
        gc.enable()
    return {name: min(ts) for name, ts in times.items()}, rounds


def copy_bandwidth_gbps(megabytes: int = 512, reps: int = 5) -> float:
    """Large fp32 tensor copy_: (read + write) bytes / time, best of reps."""
    n = megabytes * 2**20 // 4
    src, dst = torch.ones(n), torch.empty(n)
    dst.copy_(src)
    best = min(_ms(lambda: dst.copy_(src)) for _ in range(reps)) / 1e3
    return 2 * n * 4 / best / 1e9


def rss_gb() -> tuple[float, float]:
    """(current, peak) resident set size of this process in GB."""
    with open("/proc/self/statm") as f:
        current = int(f.read().split()[1]) * resource.getpagesize()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return current / 1e9, peak / 1e9


# ---------------------------------------------------------------- correctness


def _where(t: torch.Tensor) -> str:
    return f"{str(t.dtype).removeprefix('torch.')} on {t.device}"


def check_correctness(seed: int = 0) -> dict[str, str]:
    """A small case: the engine equals ATen and FBGEMM forward, and each optimizer's anchor after one step.

    Returns what each side's tables and outputs were observed to be (dtype and device).
    """
    seen = {}
    rows, dim, batch, pooling = [50, 7, 1000, 3], 8, 16, 3
    g = torch.Generator().manual_seed(seed)
    weights = [torch.randn(n, dim, generator=g) for n in rows]
    ids = torch.cat([torch.randint(0, n, (batch * pooling,), generator=g) for n in rows])
    offsets = torch.arange(len(rows) * batch + 1) * pooling
    per = batch * pooling
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    kjt = KeyedJaggedTensor(keys=[f"f{t}" for t in range(len(rows))], values=ids,
                            lengths=torch.full((len(rows) * batch,), pooling))
    grad = torch.randn(batch, len(rows) * dim, generator=g)
    expected = torch.cat([F.embedding_bag(ids[t * per:(t + 1) * per], w, offsets[:batch], mode="sum")
                          for t, w in enumerate(weights)], dim=1)

    def close(name: str, actual: torch.Tensor, wanted: torch.Tensor) -> None:
        if not torch.allclose(actual.cpu().float(), wanted, atol=1e-5, rtol=1e-5):
            diff = (actual.cpu().float() - wanted).abs().max().item()
            raise SystemExit(f"correctness check failed: {name} (max abs diff {diff:.3g})")

    def engine_with(phase: str | None):
        engine = build_engine(dim, engine_optimizer(phase) if phase else None, ids.numel(), rows)
        for t, w in enumerate(weights):
            engine.set_table_weight(f"t{t}", w)
        return engine

    def tbe_with(phase: str):
        tbe = build_tbe(dim, phase, rows)
        with torch.no_grad():
            for view, w in zip(tbe.split_embedding_weights(), weights):
                view.copy_(w)
        return tbe

    engine = engine_with(None)
    with torch.no_grad():  # the COO path: preprocessing, then the lookup of its buffers
        close("engine forward (COO path) vs ATen embedding_bag", engine(kjt).values(), expected)
    with torch.inference_mode():
        out = engine(kjt).values()
        close("engine forward (inference lookup) vs ATen embedding_bag", out, expected)
    seen["engine"] = f"tables {_where(engine.table_weight('t0'))}, pooled output {_where(out)}"
    seen["aten"] = f"tables {_where(weights[0])}, pooled output {_where(expected)}"
    for phase in ("rowwise_adagrad", "sgd"):
        tbe = tbe_with(phase)
        with torch.no_grad():
            out = tbe(ids, offsets)
            close(f"FBGEMM ({phase}) forward vs ATen embedding_bag", out, expected)
        seen["fbgemm"] = f"tables {_where(tbe.split_embedding_weights()[0])}, pooled output {_where(out)}"
        tbe(ids, offsets).backward(grad)
        engine = engine_with(phase)
        engine(kjt).values().backward(grad.to("tpu"))
        sync()
        for t, view in enumerate(tbe.split_embedding_weights()):
            close(f"{phase} step, table t{t}: engine vs FBGEMM", engine.table_weight(f"t{t}"), view.detach())
    bags, opts = build_sparse_adam(dim, rows)
    with torch.no_grad():
        for bag, w in zip(bags, weights):
            bag.weight.copy_(w)
    sparse_adam_train(bags, opts, {"table_ids": [ids[t * per:(t + 1) * per] for t in range(len(rows))],
                                   "bag_offsets": offsets[:batch]}, grad)()
    engine = engine_with("adam")
    engine(kjt).values().backward(grad.to("tpu"))
    sync()
    for t, bag in enumerate(bags):
        close(f"adam step, table t{t}: engine vs EmbeddingBag+SparseAdam", engine.table_weight(f"t{t}"), bag.weight.detach())
    seen["sparse_adam"] = f"tables {_where(bags[0].weight)}, moments {_where(opts[0].state[bags[0].weight]['exp_avg'])}"
    return seen


def git_state() -> dict[str, str | bool]:
    """The commit measured, and whether sparsecore/ differed from it (others edit it concurrently)."""
    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "sparsecore"], cwd=root, capture_output=True,
                               text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return {"head": "unknown", "sparsecore_modified": False}
    return {"head": head, "sparsecore_modified": bool(dirty)}


def describe_sides(seen: dict[str, str]) -> list[str]:
    """Each side's code, precision and device; dtypes and devices as observed by the check when it ran."""
    import fbgemm_gpu

    props = torch.tpu.get_device_properties()
    unseen = "float32 (not observed: --skip-check)"
    return [
        f"engine: sparsecore SparseCoreEmbeddingBagCollection, device tpu ({props.name}, "
        f"{props.sparsecores_per_chip} SparseCores, memory on the host); {seen.get('engine', unseen)}; "
        f"fp32 accumulation and optimizer math; host work inside the timed region (forward: an inference "
        f"lookup under torch.inference_mode, ids validated and limits checked, no COO buffers; training "
        f"phases and the COO path: preprocessing into COO buffers)",
        f"ATen: torch.nn.functional.embedding_bag(mode='sum'), one call per table + torch.cat, device cpu; "
        f"{seen.get('aten', unseen)} (torch {torch.__version__}, {torch.get_num_threads()} threads)",
        f"FBGEMM: SplitTableBatchedEmbeddingBagsCodegen (fbgemm_gpu {fbgemm_gpu.__version__}), device cpu, "
        f"EXACT_ROWWISE_ADAGRAD / EXACT_SGD; {seen.get('fbgemm', unseen)}",
        f"Adam anchor: torch.nn.EmbeddingBag(mode='sum', sparse=True) per table + torch.optim.SparseAdam, "
        f"device cpu; {seen.get('sparse_adam', unseen)}",
    ]


# ---------------------------------------------------------------- the run


def parse_shapes(text: str) -> list[tuple[int, int]]:
    if text == "all":
        return list(SHAPES)
    out = []
    for part in text.split(","):
        b, p = part.lower().split("x")
        out.append((int(b), int(p)))
    return out


def select_cells(args) -> list[Cell]:
    cells = [Cell(b, p, d, dim) for dim in args.dims for (b, p) in args.shapes for d in args.dists]
    if args.cells:
        patterns = args.cells.split(",")
        cells = [c for c in cells if any(fnmatch.fnmatch(c.label, pat) for pat in patterns)]
    return sorted(cells)


def row_for(phase: str, cell: Cell, inputs: Inputs, ms: dict[str, float], rounds: int) -> dict:
    row = {"phase": phase, "cell": cell.label, "dim": cell.dim, "batch": cell.batch, "pooling": cell.pooling,
           "dist": cell.dist, "total_ids": inputs.total, "unique_ids": inputs.unique,
           "unique_ratio": inputs.unique / inputs.total, "rounds": rounds}
    gathered = inputs.total * cell.dim * 4
    for system, value in ms.items():
        row[f"{system}_ms"] = value
        row[f"{system}_mlookups_s"] = inputs.total / value / 1e3
        row[f"{system}_gbps"] = gathered / value / 1e6
    if "engine" in ms:
        for anchor in ANCHORS[phase]:
            if anchor in ms:
                row[f"x_{anchor}"] = ms[anchor] / ms["engine"]
                target = TARGETS.get((phase, anchor))
                if target is not None:
                    row[f"met_{anchor}"] = row[f"x_{anchor}"] >= target
    return row


# Dense state per table element: the table itself plus the optimizer's.
STATE_COPIES = {"main": 1.0, "sgd": 1.0, "adam": 3.0}
BASE_BYTES = 1.5e9  # the process, libraries, the cached ids


def estimated_peak_bytes(group: str, dim: int, sides: int, cells) -> float:
    """Peak RSS of a pass, calibrated on this benchmark (dim 64 and 128, interleaved): the tables,
    then for the largest cell one pooled-output gradient per side and about four output-sized
    and 40 B-per-id temporaries (preprocessing buffers, outputs, sorted ids of the backward)."""
    tables = sides * sum(TABLE_ROWS) * dim * 4 * STATE_COPIES[group]
    out = max(c.batch * dim * len(TABLE_ROWS) * 4 for c in cells)
    ids = max(c.total_ids for c in cells)
    return tables + sides * out + 4 * out + 40 * ids + BASE_BYTES


@dataclasses.dataclass(frozen=True)
class Pass:
    """One build of systems at one dim, run over its cells."""

    group: str  # "main" (forward + row-wise Adagrad), "sgd" or "adam"
    dim: int
    sides: tuple[str, ...]  # ("engine", "anchor"): interleaved; one side: that side alone
    cells: tuple[Cell, ...]

    @property
    def label(self) -> str:
        return f"{self.group} d{self.dim} {'+'.join(self.sides)}"


class Runner:
    def __init__(self, args, cells: list[Cell]):
        self.args, self.cells = args, cells
        self.inputs = InputCache(args.seed)
        self.results: dict[tuple[str, str], dict] = {}
        self.memory: list[dict] = []
        self.bar: tqdm | None = None

    def _measure(self, systems) -> tuple[dict[str, float], int]:
        return measure(systems, self.args.iters, self.args.cell_budget, self.args.warmup)

    def _record(self, phase: str, cell: Cell, ms: dict[str, float], rounds: int) -> None:
        key = (phase, cell.label)
        old = self.results.get(key, {})
        merged = {**{k.removesuffix("_ms"): v for k, v in old.items() if k.endswith("_ms")}, **ms}
        self.results[key] = row_for(phase, cell, self.inputs.get(cell), merged, min(old.get("rounds", rounds), rounds))

    def _note_memory(self, what: str) -> None:
        current, peak = rss_gb()
        self.memory.append({"after": what, "rss_gb": current, "peak_rss_gb": peak})
        tqdm.write(f"  [{what}] rss {current:.1f} GB, peak {peak:.1f} GB", file=sys.stderr)

    def _passes(self, group: str, dim: int, cells: tuple[Cell, ...]) -> list[Pass]:
        """Engine and anchor interleaved when both fit the memory budget, else one after the other."""
        if estimated_peak_bytes(group, dim, 2, cells) <= self.args.mem_budget_gb * 1e9:
            return [Pass(group, dim, ("engine", "anchor"), cells)]
        return [Pass(group, dim, ("engine",), cells), Pass(group, dim, ("anchor",), cells)]

    def plan(self) -> list[Pass]:
        phases, subset = self.args.phases, set(self.args.subset_shapes)
        out = []
        for dim in sorted({c.dim for c in self.cells}):
            cells = tuple(c for c in self.cells if c.dim == dim)
            small = tuple(c for c in cells if (c.batch, c.pooling) in subset)
            if "forward" in phases or "rowwise_adagrad" in phases:
                out += self._passes("main", dim, cells)
            for group in ("sgd", "adam"):
                if group in phases and small:
                    out += self._passes(group, dim, small)
        return out

    def run(self) -> None:
        plan = self.plan()
        for step in plan:
            peak = estimated_peak_bytes(step.group, step.dim, len(step.sides), step.cells) / 1e9
            print(f"pass {step.label}: {len(step.cells)} cells, estimated peak {peak:.1f} GB")
        self.bar = tqdm(total=sum(len(p.cells) for p in plan), unit="cell", dynamic_ncols=True, file=sys.stderr)
        try:
            for i, step in enumerate(plan):
                self._run_pass(step)
                self.inputs.drop_grads()
                self.inputs.keep_only({(c.batch, c.pooling, c.dist) for later in plan[i + 1:] for c in later.cells})
                free()
                self._note_memory(step.label)
        finally:
            self.bar.close()

    def _run_pass(self, step: Pass) -> None:
        dim, group, phases = step.dim, step.group, self.args.phases
        width = dim * len(TABLE_ROWS)
        max_ids = max(c.total_ids for c in step.cells)
        self.bar.set_description(f"build {step.label}")
        engine = tbe = bags = opts = weights = None
        if "engine" in step.sides:
            phase = "rowwise_adagrad" if group == "main" else group
            train = group != "main" or "rowwise_adagrad" in phases
            engine = build_engine(dim, engine_optimizer(phase) if train else None, max_ids)
        if "anchor" in step.sides:
            if group == "adam":
                bags, opts = build_sparse_adam(dim)
            else:
                tbe = build_tbe(dim, "rowwise_adagrad" if group == "main" else group)
                weights = tbe.split_embedding_weights()  # views: ATen reads FBGEMM's tables
        for cell in step.cells:
            self.bar.set_description(f"{group} {cell.label}")
            inputs = self.inputs.get(cell)
            data = inputs.materialize()
            if group == "main" and "forward" in phases:
                systems = {}
                if engine is not None:
                    systems["engine"] = engine_forward(engine, data)
                    systems["engine_coo"] = engine_forward(engine, data, torch.no_grad)
                if tbe is not None:
                    systems["aten"] = aten_forward(weights, data)
                    systems["fbgemm"] = tbe_forward(tbe, data)
                self._record("forward", cell, *self._measure(systems))
            if group != "main" or "rowwise_adagrad" in phases:
                systems = {}
                if engine is not None:
                    systems["engine"] = engine_train(engine, data, self.inputs.grad(cell.batch, width, "tpu"))
                if tbe is not None:
                    systems["fbgemm"] = tbe_train(tbe, data, self.inputs.grad(cell.batch, width, "cpu"))
                if bags is not None:
                    systems["sparse_adam"] = sparse_adam_train(bags, opts, data, self.inputs.grad(cell.batch, width, "cpu"))
                self._record("rowwise_adagrad" if group == "main" else group, cell, *self._measure(systems))
            del data, systems  # the systems' closures hold the cell's inputs too
            free()  # cached blocks sized for this cell would only pile up
            self.bar.set_postfix_str(f"{step.label}: {cell.label} {inputs.unique / inputs.total:.2f} unique", refresh=False)
            self.bar.update(1)


# ---------------------------------------------------------------- reporting


def backward_rows(results: dict[tuple[str, str], dict]) -> list[dict]:
    """Backward (+update) = fwd+bwd+row-wise Adagrad minus the training forward (the engine's COO
    path); Zipf over uniform, against unique ids."""
    rows = []
    for (phase, _), row in sorted(results.items(), key=lambda kv: (kv[1]["dim"], kv[1]["batch"], kv[1]["pooling"], kv[1]["dist"])):
        if phase != "rowwise_adagrad":
            continue
        fwd = results.get(("forward", row["cell"]))
        if fwd is None or "engine_ms" not in row or "engine_ms" not in fwd:
            continue
        out = {k: row[k] for k in ("dim", "batch", "pooling", "dist", "unique_ratio")}
        for system in ("engine", "fbgemm"):
            # The engine's training forward is its COO path (its timed forward is an inference lookup).
            forward = f"{system}_coo_ms" if f"{system}_coo_ms" in fwd else f"{system}_ms"
            if f"{system}_ms" in row and forward in fwd:
                # n/a (NaN) when the noise of the two timings exceeds the backward itself
                bwd = row[f"{system}_ms"] - fwd[forward]
                out[f"{system}_bwd_ms"] = bwd if bwd > 0 else math.nan
        if not math.isnan(out["engine_bwd_ms"]):
            out["engine_bwd_ns_per_id"] = out["engine_bwd_ms"] * 1e6 / row["total_ids"]
            out["engine_bwd_ns_per_unique"] = out["engine_bwd_ms"] * 1e6 / row["unique_ids"]
        rows.append(out | {"unique_ids": row["unique_ids"]})
    base = {(r["dim"], r["batch"], r["pooling"]): r for r in rows if r["dist"] == "uniform"}
    for r in rows:
        b = base.get((r["dim"], r["batch"], r["pooling"]))
        if b is not None and r is not b:
            r["unique_vs_uniform"] = r["unique_ids"] / b["unique_ids"]
            for system in ("engine", "fbgemm"):
                if f"{system}_bwd_ms" in r and b.get(f"{system}_bwd_ms", math.nan) > 0 and r[f"{system}_bwd_ms"] > 0:
                    r[f"{system}_bwd_vs_uniform"] = r[f"{system}_bwd_ms"] / b[f"{system}_bwd_ms"]
    return rows


def phase_columns(phase: str, rows: list[dict]) -> list[tuple[str, str]]:
    systems = ["engine", *ANCHORS[phase]]
    cols = [("dim", "dim"), ("batch", "batch"), ("pooling", "pool"), ("dist", "ids"), ("unique_ratio", "uniq/total")]
    cols += [(f"{s}_ms", f"{SYSTEM_TITLES[s]} ms") for s in systems]
    cols.insert(6, ("engine_coo_ms", "engine COO path ms"))
    cols += [("engine_mlookups_s", "engine Mlookups/s")]
    cols += [(f"{s}_gbps", f"{SYSTEM_TITLES[s]} GB/s") for s in systems]
    for anchor in ANCHORS[phase]:
        target = TARGETS.get((phase, anchor))
        cols.append((f"x_{anchor}", f"x {SYSTEM_TITLES[anchor]}" + (f" (>= {target:.1f})" if target else "")))
        if target:
            cols.append((f"met_{anchor}", f"met {SYSTEM_TITLES[anchor]}"))
    cols.append(("rounds", "rounds"))
    return [(k, title) for k, title in cols if any(k in r for r in rows)]


def render(rows: list[dict], cols: list[tuple[str, str]]) -> str:
    titled = [{title: _fmt(r.get(k, "")) for k, title in cols} for r in rows]
    return report.markdown_table(titled, [title for _, title in cols])


def _fmt(value):
    if isinstance(value, bool):
        return "yes" if value else "NO"
    if isinstance(value, float):
        if math.isnan(value):
            return "n/a"
        return f"{value:.3f}" if abs(value) < 10 else f"{value:.1f}"
    return value


def summaries(results: dict[tuple[str, str], dict]) -> list[str]:
    lines = []
    for (phase, anchor), target in TARGETS.items():
        xs = [r[f"x_{anchor}"] for (p, _), r in results.items() if p == phase and f"x_{anchor}" in r]
        if xs:
            met = sum(x >= target for x in xs)
            lines.append(f"target {PHASE_TITLES[phase]} >= {target:.1f}x {SYSTEM_TITLES[anchor]}: met in {met}/{len(xs)} "
                         f"cells (speedup min {min(xs):.2f}x, median {statistics.median(xs):.2f}x, max {max(xs):.2f}x)")
    return lines


def plot(results: dict[tuple[str, str], dict], path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed in the venv: skipping the plot")
        return None
    panels = [(phase, anchor) for phase in PHASES for anchor in ANCHORS[phase]
              if any(p == phase and f"x_{anchor}" in r for (p, _), r in results.items())]
    if not panels:
        return None
    fig, axes = plt.subplots(len(panels), 1, figsize=(12, 3.2 * len(panels)), squeeze=False)
    for ax, (phase, anchor) in zip(axes[:, 0], panels):
        rows = sorted((r for (p, _), r in results.items() if p == phase and f"x_{anchor}" in r),
                      key=lambda r: (r["dim"], r["batch"], r["pooling"], r["dist"]))
        ax.bar(range(len(rows)), [r[f"x_{anchor}"] for r in rows], color="tab:blue")
        target = TARGETS.get((phase, anchor))
        if target:
            ax.axhline(target, color="tab:red", linestyle="--", label=f"target {target:.1f}x")
            ax.legend(loc="upper right")
        ax.axhline(1.0, color="gray", linewidth=0.8)
        ax.set_xticks(range(len(rows)))
        ax.set_xticklabels([r["cell"] for r in rows], rotation=60, ha="right", fontsize=7)
        ax.set_ylabel("speedup (x)")
        ax.set_title(f"{PHASE_TITLES[phase]}: engine vs {SYSTEM_TITLES[anchor]} (anchor ms / engine ms)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="dim 64, batch 8192, pooling 20, uniform and zipf1.05 (all phases)")
    parser.add_argument("--dims", help=f"comma-separated dims (default {','.join(map(str, DIMS))})")
    parser.add_argument("--shapes", help="comma-separated BATCHxPOOLING, or 'all' (default all five)")
    parser.add_argument("--dists", help=f"comma-separated of {','.join(DISTS)}, any zipfALPHA allowed")
    parser.add_argument("--cells", help="comma-separated glob patterns on cell labels d<dim>/b<batch>/p<pool>/<dist>, "
                                        "e.g. 'd64/b8192/*/zipf*'")
    parser.add_argument("--phases", help=f"comma-separated of {','.join(PHASES)} "
                                         f"(default {','.join(DEFAULT_PHASES)}; --quick: all)")
    parser.add_argument("--subset-shapes", default=",".join(f"{b}x{p}" for b, p in SUBSET_SHAPES),
                        help="shapes on which adam and sgd run, or 'all'")
    parser.add_argument("--iters", type=int, default=3, help="timed rounds per cell at most (min is reported)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed calls per system and cell")
    parser.add_argument("--cell-budget", type=float, default=4.0,
                        help="seconds of timed rounds per cell and phase; bigger cells get fewer rounds (>= 1)")
    parser.add_argument("--mem-budget-gb", type=float, default=17.0,
                        help="engine and anchor run interleaved when the estimated peak of both fits, "
                             "else one after the other")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-check", action="store_true", help="skip the start-up correctness check")
    parser.add_argument("--out", type=Path, default=report.DEFAULT_DIR)
    args = parser.parse_args(argv)

    if args.quick:
        args.dims = args.dims or "64"
        args.shapes = args.shapes or "8192x20"
        args.dists = args.dists or "uniform,zipf1.05"
    args.dims = [int(d) for d in (args.dims or ",".join(map(str, DIMS))).split(",")]
    args.shapes = parse_shapes(args.shapes or "all")
    args.dists = (args.dists or ",".join(DISTS)).split(",")
    args.phases = (args.phases or ",".join(PHASES if args.quick else DEFAULT_PHASES)).split(",")
    args.subset_shapes = parse_shapes(args.subset_shapes)
    if args.quick:
        args.subset_shapes = args.shapes
    bad = [p for p in args.phases if p not in PHASES] + [d for d in args.dists if d != "uniform" and not d.startswith("zipf")]
    if bad:
        parser.error(f"unknown phase or distribution: {bad}")
    cells = select_cells(args)
    if not cells:
        parser.error("no cell selected")

    warnings.filterwarnings("ignore", message=".*is_fx_tracing.*")
    started = time.perf_counter()
    seen = {}
    if not args.skip_check:
        seen = check_correctness(args.seed)
        print("correctness check passed: engine forward == ATen embedding_bag == FBGEMM on the same weights; "
              "one step of row-wise Adagrad and SGD == FBGEMM, of Adam == EmbeddingBag+SparseAdam")
    bandwidth = copy_bandwidth_gbps()
    sides = describe_sides(seen)
    git = git_state()
    sides.insert(0, f"commit {git['head']}" + (" (sparsecore/ modified in the work tree)" if git["sparsecore_modified"] else ""))
    print(f"memory-copy bandwidth of this machine: {bandwidth:.1f} GB/s (512 MiB fp32 copy_, read + write bytes / time)")
    print("\n".join(sides))
    print(f"{len(cells)} cells, phases {','.join(args.phases)}; adam/sgd on shapes "
          f"{','.join(f'{b}x{p}' for b, p in args.subset_shapes)}; up to {args.iters} timed rounds "
          f"({args.cell_budget:.0f} s budget per cell and phase) after {args.warmup} warm-up")

    runner = Runner(args, cells)
    runner.run()
    elapsed = time.perf_counter() - started

    results = runner.results
    sections, payload_tables = [], {}
    head = [f"memory-copy bandwidth: {bandwidth:.1f} GB/s", *sides, ""]
    for phase in PHASES:
        rows = sorted((r for (p, _), r in results.items() if p == phase),
                      key=lambda r: (r["dim"], r["batch"], r["pooling"], r["dist"]))
        if not rows:
            continue
        table = render(rows, phase_columns(phase, rows))
        sections.append(f"## {PHASE_TITLES[phase]}\n\n{table}")
        payload_tables[phase] = rows
    bwd = backward_rows(results)
    if bwd:
        cols = [("dim", "dim"), ("batch", "batch"), ("pooling", "pool"), ("dist", "ids"), ("unique_ratio", "uniq/total"),
                ("engine_bwd_ms", "engine bwd ms"), ("fbgemm_bwd_ms", "FBGEMM bwd ms"),
                ("engine_bwd_ns_per_id", "engine ns/id"), ("engine_bwd_ns_per_unique", "engine ns/unique id"),
                ("unique_vs_uniform", "unique ids vs uniform"), ("engine_bwd_vs_uniform", "engine bwd vs uniform"),
                ("fbgemm_bwd_vs_uniform", "FBGEMM bwd vs uniform")]
        cols = [(k, t) for k, t in cols if any(k in r for r in bwd)]
        sections.append("## backward vs unique ids (row-wise Adagrad; bwd = fwd+bwd+update minus the training forward: the engine's COO path)\n\n"
                        "Target: with Zipf ids the backward cost follows the unique ids, i.e. "
                        "'engine bwd vs uniform' tracks 'unique ids vs uniform'.\n\n" + render(bwd, cols))
    lines = summaries(results)
    markdown = "\n".join(head) + "\n" + "\n\n".join(sections) + "\n\n" + "\n".join(f"- {s}" for s in lines)
    markdown += f"\n\nwall time {elapsed:.0f} s; peak RSS {rss_gb()[1]:.1f} GB"
    print()
    print(markdown)
    payload = {"git": git, "copy_bandwidth_gbps": bandwidth, "sides": sides, "targets": {f"{p}/{a}": t for (p, a), t in TARGETS.items()},
               "config": {"table_rows": TABLE_ROWS, "dims": args.dims, "shapes": args.shapes, "dists": args.dists,
                          "phases": args.phases, "subset_shapes": args.subset_shapes, "iters": args.iters,
                          "warmup": args.warmup, "cell_budget_s": args.cell_budget, "seed": args.seed,
                          "quick": args.quick},
               "tables": payload_tables, "backward_vs_unique": bwd, "summary": lines, "memory": runner.memory,
               "wall_time_s": elapsed}
    json_path, md_path = report.write("embedding", payload, markdown, out_dir=args.out)
    png = plot(results, args.out / "embedding.png")
    print(f"wrote {json_path}, {md_path}" + (f", {png}" if png else ""))
    return payload


if __name__ == "__main__":
    main()
