"""DLRM / DLRM-DCNv2 training on the tpu device: ``python -m models.train [flags]``.

The defaults train a small DLRM on planted synthetic data (data.synthetic) on
``tpu`` in about a minute here, and report how close its validation AUC gets
to the teacher's, the best any model can reach on that data. ``--data`` takes
a synthetic preset or a store written by ``python -m data.criteo preprocess``.

Embeddings train on the SparseCore engine with their optimizer fused into
the backward; the dense arch trains with a torch.optim optimizer on the
TensorCore; ``sparsecore.TrainPipeline`` overlaps the two exactly (``--pipeline
none``: the plain loop, same numbers; ``--compile``: the plain loop's step through
``torch.compile(backend="tpu")``, one graph with its lookups). Progress goes to a tqdm bar; validation metrics (AUC, log loss)
and throughput are appended to ``metrics.jsonl``; checkpoints are atomic and
resuming continues the exact run (same batches, same updates); resuming a
checkpoint that already holds the run's last step trains nothing and reports
the final validation of the restored model. Ctrl-C finishes the current step,
writes a checkpoint and exits.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import math
import os
import signal
import sys
import time
from pathlib import Path
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch_tpu
from torchrec import EmbeddingBagConfig
from tqdm import tqdm

import sparsecore
from data import schema
from data.loader import ArraySource, Batch, BatchLoader, Source
from data.synthetic import PRESETS, SyntheticConfig, SyntheticCriteo
from models import checkpoint, distributed
from models.dlrm import DLRM, DLRM_DCN, DLRMTrain
from models.evaluation import evaluate

logger = logging.getLogger(__name__)

EMBEDDING_OPTIMIZERS = {
    "sgd": lambda lr: sparsecore.optim.SGD(lr=lr),
    "adagrad": lambda lr: sparsecore.optim.Adagrad(lr=lr),
    "rowwise_adagrad": lambda lr: sparsecore.optim.RowWiseAdagrad(lr=lr),
    "adam": lambda lr: sparsecore.optim.Adam(lr=lr),
}
DENSE_OPTIMIZERS = {
    "sgd": torch.optim.SGD,
    "adagrad": torch.optim.Adagrad,
    "adam": torch.optim.Adam,
}


def make_dense_optimizer(cfg: "TrainConfig", parameters, device: torch.device) -> torch.optim.Optimizer:
    """The dense optimizer. Under DeferAndFuse, with its step count on the
    device where it can (Adam's capturable), so its updates are the same ops
    every step and the graphs DeferAndFuse records recur (its bias corrections
    would otherwise be new host scalars every step). Elsewhere the default,
    whose numbers a CPU run reproduces exactly."""
    cls = DENSE_OPTIMIZERS[cfg.dense_optimizer]
    deferring = device.type == "tpu" and torch_tpu.get_eager_mode() is torch_tpu.EagerMode.DEFER_AND_FUSE
    extra = {"capturable": True} if deferring and cls is torch.optim.Adam else {}
    return cls(parameters, lr=cfg.dense_lr, **extra)


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig:
    model: str = "dlrm"
    """``dlrm`` (dot interaction) or ``dcn`` (low-rank DCNv2)."""
    data: str = "synthetic:criteo-kaggle"
    """``synthetic:<preset>`` or the path of a preprocessed store."""
    scale: float = 1e-4
    """Synthetic data: factor on the preset's table sizes."""
    num_samples: int = 2_000_000
    """Synthetic data: rows in all; the last ``val_samples`` are the validation split."""
    val_samples: int = 65_536
    multi_hot: bool = False
    ids: str = "zipf"
    batch_size: int = 2048
    embedding_dim: int = 16
    dense_arch: tuple[int, ...] = (64, 16)
    over_arch: tuple[int, ...] = (64, 32, 1)
    dcn_layers: int = 3
    dcn_rank: int = 32
    embedding_optimizer: str = "rowwise_adagrad"
    embedding_lr: float = 0.2
    dense_optimizer: str = "adam"
    dense_lr: float = 0.005
    epochs: int = 1
    steps: int | None = None
    """Stop after this many steps in all (default: the epochs' worth)."""
    eval_interval: int = 250
    """Validate every this many steps (and at the end); 0: only at the end."""
    eval_batches: int | None = None
    """Validation batches per evaluation (default: the whole split)."""
    seed: int = 0
    device: str = "tpu"
    precision: str = "medium"
    """tpu matmul precision: medium (the TPU default, bf16 MXU), high or highest."""
    num_workers: int | None = None
    """Loader processes doing generation and SparseCore preprocessing ahead (0: in this process);
    None: one if this host has a core the training threads leave free, else none (loader_workers)."""
    checkpoint_dir: str | None = None
    checkpoint_interval: int = 500
    resume: bool = False
    metrics_file: str | None = None
    """JSON lines of metrics (default: <checkpoint_dir>/metrics.jsonl when there is a checkpoint dir)."""
    progress: bool = True
    plan: str | None = None
    """Under torchrun: a sharding plan (JSON, sparsecore.distributed.ShardingPlan); default: the default plan."""
    dense_parallel: str = "ddp"
    """Under torchrun: ``ddp`` (replicated dense arch) or ``fsdp2`` (fully_shard over its parts)."""
    limits: str | None = None
    """A ``sparsecore_limits.json`` an earlier run wrote: its observed SparseCore id maxima
    (times ``limits_headroom``) become the tables' partition limits."""
    limits_headroom: float = 1.25
    pipeline: str = "exact"
    """``exact``: sparsecore.TrainPipeline (SparseCore and TensorCore work overlapped, same numbers);
    ``none``: the plain loop (forward, backward, step per batch)."""
    compile: bool = False
    """Train through ``torch.compile(backend="tpu")``: the step's forward with its SparseCore
    lookups and their fused backward as one graph (``fullgraph=True``), and the dense
    optimizer's step. The plain loop on one process, on the tpu (validation stays eager)."""

    def __post_init__(self) -> None:
        self._check_counts()
        # Training needs real storage: cpu, or the tpu (meta and the rest have no data or no backend here).
        bad_device = ValueError(f"device {self.device!r}: expected 'tpu' or 'cpu' (optionally with an index, "
                                f"e.g. 'tpu:0')")
        try:
            device = torch.device(self.device)
        except RuntimeError:
            raise bad_device from None
        if device.type not in ("tpu", "cpu"):
            raise bad_device
        if self.model not in ("dlrm", "dcn"):
            raise ValueError(f"model {self.model!r}: expected 'dlrm' or 'dcn'")
        if self.embedding_optimizer not in EMBEDDING_OPTIMIZERS:
            raise ValueError(f"embedding_optimizer {self.embedding_optimizer!r}: expected one of {sorted(EMBEDDING_OPTIMIZERS)}")
        if self.dense_optimizer not in DENSE_OPTIMIZERS:
            raise ValueError(f"dense_optimizer {self.dense_optimizer!r}: expected one of {sorted(DENSE_OPTIMIZERS)}")
        if self.dense_arch[-1] != self.embedding_dim:
            raise ValueError(f"the dense arch must end at the embedding dim ({self.embedding_dim}), got {self.dense_arch}")
        if self.over_arch[-1] != 1:
            raise ValueError(f"the over arch must end in one logit, got {self.over_arch}")
        if self.resume and not self.checkpoint_dir:
            raise ValueError("resume needs a checkpoint_dir")
        if self.pipeline not in ("exact", "none"):
            raise ValueError(f"pipeline {self.pipeline!r}: expected 'exact' or 'none'")
        if self.dense_parallel not in ("ddp", "fsdp2"):
            raise ValueError(f"dense_parallel {self.dense_parallel!r}: expected 'ddp' or 'fsdp2'")
        if self.compile and (self.pipeline != "none" or device.type != "tpu"):
            raise ValueError(f"compile: the compiled step is the plain loop's on the tpu; expected pipeline 'none' "
                             f"and device 'tpu', got pipeline {self.pipeline!r} and device {self.device!r}")

    def _check_counts(self) -> None:
        """Counts and sizes in range, so a bad flag is refused up front rather than as a traceback
        (a division by zero, TorchRec's assertions) or after a whole run (no validation batches)."""
        at_least = {"batch_size": 1, "embedding_dim": 1, "dcn_layers": 1, "dcn_rank": 1, "num_samples": 1,
                    "val_samples": 1, "epochs": 0, "checkpoint_interval": 1,
                    # 0: validate only at the end (and --steps 0: no training, as asked).
                    "eval_interval": 0, "steps": 0, "eval_batches": 1, "num_workers": 0}
        for name, low in at_least.items():
            value = getattr(self, name)
            if value is not None and value < low:
                raise ValueError(f"{name} {value}: expected an integer >= {low}")
        for name in ("dense_arch", "over_arch"):
            sizes = getattr(self, name)
            if not sizes or min(sizes) < 1:
                raise ValueError(f"{name} {sizes}: expected layer sizes >= 1")
        if not 0 < self.scale < math.inf:
            raise ValueError(f"scale {self.scale}: expected a finite factor > 0")
        if not 0 <= self.seed < 2**32:
            raise ValueError(f"seed {self.seed}: expected an integer in [0, 2**32)")
        if not 1.0 <= self.limits_headroom < math.inf:
            raise ValueError(f"limits_headroom {self.limits_headroom}: expected a finite factor >= 1.0")

    def comparable(self) -> dict[str, Any]:
        """What a checkpoint must agree on to be resumed (not run length or bookkeeping)."""
        fixed = dataclasses.asdict(self)
        for key in ("epochs", "steps", "eval_interval", "eval_batches", "num_workers", "checkpoint_dir",
                    "checkpoint_interval", "resume", "metrics_file", "progress", "plan", "dense_parallel",
                    "pipeline", "compile", "limits", "limits_headroom"):
            fixed.pop(key)
        return fixed


# ---------------------------------------------------------------- data


def host_cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def local_training_threads() -> int:
    """Intra-op threads of all training processes on this host (torchrun's LOCAL_WORLD_SIZE of them)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1")) * torch.get_num_threads()


def loader_workers(requested: int | None) -> int:
    """``requested``, or by default one loader process if the host has a core the training
    threads leave free, else none. On cores the training threads fill, a loader process only
    competes with them (libgomp's threads spin between parallel regions, taking the slices it
    would run in): measured on 2 cores, the default run took 48-63 s with one worker and
    39-44 s with none, and 2 torchrun ranks (1 thread each) 22-27 s against 21-22 s."""
    if requested is not None:
        return requested
    cores, threads = host_cores(), local_training_threads()
    workers = 1 if cores > threads else 0
    logger.info("loader: %d worker process(es) by default (%d cores, %d training threads on them)",
                workers, cores, threads)
    return workers


class RowRange:
    """Rows [start, stop) of another Source."""

    def __init__(self, source: Source, start: int, stop: int):
        self.source, self.start, self.stop = source, start, stop

    def __len__(self) -> int:
        return self.stop - self.start

    def rows(self, start: int, stop: int):
        return self.source.rows(self.start + start, self.start + stop)


@dataclasses.dataclass
class Data:
    train: Source
    val: Source
    table_sizes: tuple[int, ...]
    pooling: tuple[int, ...]
    teacher_auc: float | None = None


def build_data(cfg: TrainConfig) -> Data:
    if cfg.data.startswith("synthetic:"):
        preset = cfg.data.removeprefix("synthetic:")
        if preset not in PRESETS:
            raise ValueError(f"--data {cfg.data!r}: unknown preset; expected synthetic:{{{','.join(sorted(PRESETS))}}}")
        if cfg.val_samples >= cfg.num_samples:
            raise ValueError(f"val_samples {cfg.val_samples} must be fewer than num_samples {cfg.num_samples}")
        source = SyntheticCriteo(SyntheticConfig(preset=preset, scale=cfg.scale, num_samples=cfg.num_samples,
                                                 multi_hot=cfg.multi_hot, ids=cfg.ids, seed=cfg.seed))
        split = cfg.num_samples - cfg.val_samples
        return Data(train=RowRange(source, 0, split), val=RowRange(source, split, cfg.num_samples),
                    table_sizes=source.table_sizes, pooling=source.pooling,
                    teacher_auc=source.teacher_auc(split, cfg.num_samples))
    from data.arrays import open_arrays

    splits = open_arrays(Path(cfg.data))
    train = splits["train"]
    return Data(train=ArraySource(train), val=ArraySource(splits["val"]), table_sizes=tuple(train.table_sizes),
                pooling=(1,) * schema.NUM_SPARSE)


# ---------------------------------------------------------------- model


def build_model(cfg: TrainConfig, data: Data, device: torch.device) -> torch.nn.Module:
    # The SparseCore id limits only check; set them to what a batch can carry at
    # most (all features of the stacked tables count against one partition).
    limit = cfg.batch_size * sum(data.pooling)
    tables = [
        sparsecore.SparseCoreEmbeddingConfig(
            config=EmbeddingBagConfig(name=f"t_{name}", num_embeddings=rows, embedding_dim=cfg.embedding_dim,
                                      feature_names=[name]),
            max_ids_per_partition=limit, max_unique_ids_per_partition=limit)
        for name, rows in zip(schema.SPARSE_NAMES, data.table_sizes)
    ]
    if cfg.limits:
        tables = sparsecore.with_observed_limits(tables, read_limits(Path(cfg.limits)), cfg.limits_headroom)
    torch.manual_seed(cfg.seed)  # the tables' init_fn draws from the device's generator
    ebc = sparsecore.SparseCoreEmbeddingBagCollection(
        tables, EMBEDDING_OPTIMIZERS[cfg.embedding_optimizer](cfg.embedding_lr), device=device)
    # Seeded again: on cpu the table init drew from the same generator as the dense init,
    # and the same seed must build the same model on every device.
    torch.manual_seed(cfg.seed)
    args = (ebc, schema.NUM_DENSE, list(cfg.dense_arch), list(cfg.over_arch))
    model = DLRM(*args) if cfg.model == "dlrm" else DLRM_DCN(*args, dcn_num_layers=cfg.dcn_layers,
                                                              dcn_low_rank_dim=cfg.dcn_rank)
    return model.to(device)


LIMITS_FILENAME = "sparsecore_limits.json"
LIMITS_FORMAT = "torch_tpu.sparsecore-limits.v1"
CHECKPOINT_ENTRIES = ("config", "step", "model", "embedding_optimizer", "dense_optimizer")
"""What a single-process checkpoint holds; a resume refuses one that lacks any."""


def read_limits(path: Path) -> dict[str, dict[str, int]]:
    """The per-table observed maxima of a ``sparsecore_limits.json``."""
    try:
        payload = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise ValueError(f"--limits {path}: not a readable limits file ({error})") from error
    if not isinstance(payload, dict) or payload.get("format") != LIMITS_FORMAT:
        raise ValueError(f"--limits {path}: not a {LIMITS_FORMAT} file (written by models.train as {LIMITS_FILENAME})")
    tables = payload.get("tables")
    if not isinstance(tables, dict) or not all(isinstance(v, dict) for v in tables.values()):
        raise ValueError(f"--limits {path}: expected \"tables\": {{table: {{limit: count}}}}, got {tables!r:.80}")
    try:
        sparsecore.config.check_observed_limits(tables)
    except ValueError as error:
        raise ValueError(f"--limits {path}: {error}") from error
    return tables


def earlier_limits(path: Path) -> dict[str, dict[str, int]]:
    """The maxima an earlier part of a resumed run wrote to ``path`` (none if it wrote none)."""
    if not path.exists():
        return {}
    try:
        return read_limits(path)
    except ValueError as error:
        logger.warning("%s: the earlier part's maxima are not readable (%s); writing this part's only", path, error)
        return {}


def merge_limits(*parts: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    """Per table and limit, the most any part observed."""
    merged: dict[str, dict[str, int]] = {}
    for part in parts:
        for table, seen in part.items():
            into = merged.setdefault(table, {})
            for key, value in seen.items():
                into[key] = max(into.get(key, 0), int(value))
    return merged


def write_limits(path: Path, observed: dict[str, dict[str, int]], cfg: TrainConfig, world_size: int) -> None:
    text = json.dumps({"format": LIMITS_FORMAT, "world_size": world_size, "plan": cfg.plan,
                       "batch_size": cfg.batch_size, "tables": observed}, indent=1)
    checkpoint.write_atomically(path, lambda f: f.write(text.encode()))


def dense_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """Everything but the SparseCore tables (those train in the backward, by the fused optimizer)."""
    return [p for name, p in model.named_parameters() if not name.startswith("sparse_arch.")]


# ---------------------------------------------------------------- the run


class _Interrupt:
    """SIGINT sets a flag the loop checks between steps, so no step is cut in half."""

    def __init__(self) -> None:
        self.requested = False
        self._previous = None

    def __enter__(self) -> _Interrupt:
        owner = os.getpid()

        def handler(signum, frame):  # noqa: ARG001
            if os.getpid() != owner:  # a forked loader worker: the trainer handles it
                return
            if self.requested:  # a second Ctrl-C: stop now
                raise KeyboardInterrupt
            self.requested = True
            logger.warning("interrupt: finishing the step, then saving a checkpoint")

        try:
            self._previous = signal.signal(signal.SIGINT, handler)
        except ValueError:  # not the main thread: leave signals alone
            self._previous = None
        return self

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)


class Trainer:
    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg
        self.rank, self.world_size = distributed.world_from_env()
        self.device = torch.device(cfg.device)
        self.data = build_data(cfg)
        self.model = build_model(cfg, self.data, self.device)
        preprocessor = None  # sharded: ids go to their shards first, each rank's engine preprocesses there
        if self.world_size > 1:
            ebc = self.model.sparse_arch.embedding_bag_collection
            distributed.shard_embeddings(self.model, distributed.load_plan(cfg.plan, ebc, self.world_size))
            if cfg.dense_parallel == "fsdp2":
                self.model = distributed.fully_sharded(self.model)
            else:
                self.model = distributed.data_parallel(self.model)
        else:
            preprocessor = self.model.sparse_arch.embedding_bag_collection.preprocessor()
        # After the wrapping: FSDP2's parameters are its sharded DTensors.
        self.dense_opt = make_dense_optimizer(cfg, dense_parameters(self._unwrapped), self.device)
        self.ebc = self._unwrapped.sparse_arch.embedding_bag_collection
        # The loss: the rank's sum over the global batch size; with DDP summing, every rank
        # trains on the global batch's mean loss (models.distributed).
        self.train_model = DLRMTrain(self.model, loss_divisor=cfg.batch_size)
        self.pipeline = (sparsecore.TrainPipeline(self.train_model, self.dense_opt, self.device)
                         if cfg.pipeline == "exact" else None)
        self._forward, self._dense_step = self._step_functions()
        shards = dict(rank=self.rank, world_size=self.world_size, preprocessor=preprocessor,
                      num_workers=loader_workers(cfg.num_workers))
        self.train_loader = BatchLoader(self.data.train, cfg.batch_size, seed=cfg.seed, shuffle=True, **shards)
        # The whole split, its last partial batch too (the teacher's AUC beside it covers every row).
        self.val_loader = BatchLoader(self.data.val, cfg.batch_size, shuffle=False, drop_last=False, **shards)
        per_epoch = len(self.train_loader)
        self.total_steps = cfg.steps if cfg.steps is not None else cfg.epochs * per_epoch
        self.step = 0
        # Several ranks: a torch.distributed.checkpoint directory, every rank writing its part.
        name = checkpoint.SHARDED_DIRNAME if self.world_size > 1 else checkpoint.FILENAME
        self.checkpoint_path = Path(cfg.checkpoint_dir) / name if cfg.checkpoint_dir else None
        metrics = cfg.metrics_file or (str(Path(cfg.checkpoint_dir) / "metrics.jsonl") if cfg.checkpoint_dir else None)
        self.metrics_path = Path(metrics) if metrics else None
        self.losses: list[float] = []
        if cfg.resume:
            self._restore()

    def _step_functions(self) -> tuple[Callable, Callable[[], Any]]:
        """The plain loop's forward and dense optimizer step: as they are, or compiled."""
        if not self.cfg.compile:
            return self.train_model, self.dense_opt.step
        if self.world_size > 1:
            raise ValueError(f"compile: a compiled step runs on one process, not {self.world_size} (torchrun)")
        return (torch.compile(self.train_model, backend="tpu", fullgraph=True),
                torch.compile(self.dense_opt.step, backend="tpu"))

    @property
    def _unwrapped(self) -> torch.nn.Module:
        return distributed.unwrap(self.model)

    # ---- checkpoints ----

    def _save(self) -> None:
        if self.checkpoint_path is None:
            return
        if self.world_size > 1:
            checkpoint.save_sharded(self.checkpoint_path, distributed.checkpoint_state(self.model, self.dense_opt),
                                    {"config": self.cfg.comparable(), "step": self.step})
            logger.info("checkpoint at step %d: %s", self.step, self.checkpoint_path)
            return
        entries = {
            "config": self.cfg.comparable(),
            "step": self.step,
            "model": self.model.state_dict(),
            "embedding_optimizer": self.ebc.fused_optimizer.state_dict(),
            "dense_optimizer": self.dense_opt.state_dict(),
        }
        assert tuple(entries) == CHECKPOINT_ENTRIES
        checkpoint.save(self.checkpoint_path, entries)
        logger.info("checkpoint at step %d: %s", self.step, self.checkpoint_path)

    def _check_config(self, saved: dict[str, Any]) -> None:
        # Compared as JSON: a sharded checkpoint's config went through it (tuples became lists).
        saved, ours = json.loads(json.dumps(saved)), json.loads(json.dumps(self.cfg.comparable()))
        if saved != ours:
            changed = sorted(k for k in ours if saved.get(k) != ours[k])
            raise checkpoint.CheckpointError(
                f"{self.checkpoint_path} was written by a run with different settings ({', '.join(changed)}); "
                "resume with the same settings or use another --checkpoint-dir")

    def _restore(self) -> None:
        if self.world_size > 1:
            # Any world size and plan: the tables are saved as plan-independent row blocks.
            meta = checkpoint.sharded_meta(self.checkpoint_path)
            self._check_config(meta["config"])
            step = self._resumable_step(meta["step"])  # before loading: a refused checkpoint loads nothing
            state = distributed.checkpoint_state(self.model, self.dense_opt)
            checkpoint.load_sharded(self.checkpoint_path, state)
            distributed.load_checkpoint_state(self.model, self.dense_opt, state)
            self.step = step
            logger.info("resumed from %s at step %d", self.checkpoint_path, self.step)
            return
        payload = checkpoint.load(self.checkpoint_path, CHECKPOINT_ENTRIES)
        self._check_config(payload["config"])
        step = self._resumable_step(payload["step"])  # before loading: a refused checkpoint loads nothing
        self.model.load_state_dict(payload["model"])
        self.ebc.fused_optimizer.load_state_dict(payload["embedding_optimizer"])
        self.dense_opt.load_state_dict(payload["dense_optimizer"])
        self.step = step
        logger.info("resumed from %s at step %d", self.checkpoint_path, self.step)

    def _resumable_step(self, saved: Any) -> int:
        """The checkpoint's step, refused when it is past this run's last step: no step can be
        untrained, so the restored model is not this run's (and its validation would be reported
        as the shorter run's)."""
        step = int(saved)
        if step > self.total_steps:
            raise checkpoint.CheckpointError(
                f"{self.checkpoint_path} holds step {step}, past this run's last step {self.total_steps} "
                f"(--steps / --epochs); resume with --steps {step} or more to continue it, or use another "
                "--checkpoint-dir")
        return step

    # ---- metrics ----

    def _record(self, entry: dict[str, Any]) -> None:
        if self.metrics_path is None or self.rank != 0:
            return
        self.metrics_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.metrics_path, "a") as f:
            f.write(json.dumps(entry) + "\n")

    def validate(self) -> dict[str, float]:
        batches = iter(self.val_loader)
        if self.cfg.eval_batches is not None:
            batches = (b for _, b in zip(range(self.cfg.eval_batches), batches))
        return evaluate(self.model, batches, self.device, gather=distributed.gather)

    # ---- training ----

    def _batches(self):
        """(epoch-ordered) batches from the current step on."""
        per_epoch = len(self.train_loader)
        epoch, start = divmod(self.step, per_epoch)
        while True:
            self.train_loader.set_epoch(epoch, start)
            yield from self.train_loader
            epoch, start = epoch + 1, 0

    def train_step(self, batches: Iterator[Batch]) -> float:
        """One step on the next batch (by the pipeline, or the plain loop); returns the global
        batch's mean loss."""
        if self.pipeline is not None:
            loss, _, _ = self.pipeline.progress(batches)
        else:
            loss, _ = self._forward(next(batches).to(self.device))
            self.dense_opt.zero_grad(set_to_none=True)
            loss.backward()
            self._dense_step()
            torch.tpu.mark_step()  # a step's end (the pipeline marks its own)
        return distributed.global_sum(loss.detach()).item()

    def _validate_and_record(self, train_loss: float | None, samples_per_s: float | None, bar: tqdm) -> dict[str, Any]:
        """Validates the model at the current step; appends the entry to the metrics file and the
        log and returns it. ``train_loss`` and ``samples_per_s`` cover the steps since the last
        validation (None: this process trained none)."""
        metrics = self.validate()
        entry = {"step": self.step, "train_loss": train_loss, "samples_per_s": samples_per_s,
                 "val_auc": metrics["auc"], "val_log_loss": metrics["log_loss"]}
        self._record(entry)
        if self.rank == 0:
            trained = "" if train_loss is None else f"train loss {train_loss:.4f}, "
            bar.write(f"step {self.step}: {trained}val AUC {format_auc(metrics['auc'])}, "
                      f"val log loss {metrics['log_loss']:.4f}")
        return entry

    def _resumed_complete(self, start: int) -> bool:
        """Whether this is a resume whose checkpoint already held the last step (so the loop, which
        validates after its last step, ran none). A fresh ``--steps 0`` run is not one: it asked for
        no training, and gets none and no validation."""
        return self.cfg.resume and start == self.step == self.total_steps

    def run(self) -> dict[str, Any]:
        cfg = self.cfg
        if self.device.type == "tpu":
            torch.tpu.reset_peak_memory_stats(self.device)
        summary: dict[str, Any] = {"teacher_auc": self.data.teacher_auc}
        # Throughput counts training steps only, not validation or checkpoints.
        samples, train_time, window_loss, window_steps = 0, 0.0, 0.0, 0
        bar = tqdm(total=self.total_steps, initial=self.step, unit="step", disable=not cfg.progress or self.rank != 0,
                   dynamic_ncols=True, file=sys.stderr)
        interrupted = False
        try:
            precision = torch.tpu.precision(cfg.precision) if self.device.type == "tpu" else contextlib.nullcontext()
            with precision, _Interrupt() as stop:
                self.model.train()
                batches = self._batches()
                start = self.step
                while self.step < self.total_steps:
                    started = time.perf_counter()
                    loss = self.train_step(batches)
                    train_time += time.perf_counter() - started
                    self.step += 1
                    self.losses.append(loss)
                    samples += cfg.batch_size
                    window_loss, window_steps = window_loss + loss, window_steps + 1
                    bar.update(1)
                    bar.set_postfix(loss=f"{loss:.4f}", samples_per_s=f"{samples / train_time:,.0f}", refresh=False)
                    last = self.step == self.total_steps
                    # Saved before validating: a validation that fails cannot lose the steps trained.
                    if last or (self.checkpoint_path and self.step % cfg.checkpoint_interval == 0):
                        self._save()
                    if (cfg.eval_interval and self.step % cfg.eval_interval == 0) or last:
                        summary.update(self._validate_and_record(window_loss / window_steps, samples / train_time, bar))
                        window_loss, window_steps = 0.0, 0
                    if stop.requested:
                        self._save()
                        interrupted = True
                        break
                if self._resumed_complete(start):
                    # The checkpoint already holds the run's last step: nothing to train, and it is
                    # saved as it is (rewriting it would only cost a write), but the run still ends
                    # with its final validation, of the restored model, as an uninterrupted run does.
                    logger.info("%s already holds all %d steps: validating the restored model, no training",
                                self.checkpoint_path, self.total_steps)
                    summary.update(self._validate_and_record(None, None, bar))
        finally:
            # Also when a step or a validation raises: the pipeline's reader thread must not
            # outlive the run.
            if self.pipeline is not None:
                self.pipeline.close()
            bar.close()
        # The most ids any SparseCore partition carried (all-reduced over the ranks), saved
        # with the run: --limits seeds a later run's partition limits from it.
        summary["observed_limits"] = self.ebc.observed_limits()
        if self.metrics_path is not None and self.rank == 0:
            path = self.metrics_path.parent / LIMITS_FILENAME
            observed = summary["observed_limits"]
            if cfg.resume:
                # This process saw only the steps after the checkpoint: the file keeps the run's maxima.
                observed = merge_limits(earlier_limits(path), observed)
            write_limits(path, observed, cfg, self.world_size)
        summary.update({"steps": self.step, "interrupted": interrupted, "train_seconds": train_time,
                        "samples_per_s": samples / train_time if train_time > 0 else 0.0})
        if self.device.type == "tpu":
            summary["peak_tpu_memory_bytes"] = torch.tpu.max_memory_allocated(self.device)
            if torch_tpu.get_eager_mode() is torch_tpu.EagerMode.DEFER_AND_FUSE and self.step:
                from torch_tpu import defer  # imported only when the mode is on

                s = defer.stats()
                summary["defer_and_fuse"] = {"graphs_per_step": s.graphs / self.step,
                                             "ops_per_graph": s.ops_per_graph(),
                                             "compiled_share": s.compiled_runs / max(s.graphs, 1),
                                             "eager_share": s.eager_share(),
                                             "not_recorded": dict(s.not_recorded)}
        return summary


def format_auc(auc: float | None) -> str:
    """An AUC for the log; None (a validation set of one class) has none."""
    return "undefined: the validation labels are all one class" if auc is None else f"{auc:.4f}"


def train(cfg: TrainConfig) -> dict[str, Any]:
    """Runs the configured training; returns the summary (final metrics, throughput, memory)."""
    return Trainer(cfg).run()


# ---------------------------------------------------------------- command line


def _sizes(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated layer sizes like 64,16, got {text!r}") from None


def parse_args(argv: list[str] | None = None) -> TrainConfig:
    defaults = TrainConfig()
    p = argparse.ArgumentParser(prog="python -m models.train", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=["dlrm", "dcn"], default=defaults.model)
    p.add_argument("--data", default=defaults.data,
                   help=f"synthetic:{{{','.join(sorted(PRESETS))}}} or a preprocessed store (python -m data.criteo preprocess)")
    p.add_argument("--scale", type=float, default=defaults.scale, help="synthetic: factor on the table sizes")
    p.add_argument("--num-samples", type=int, default=defaults.num_samples, help="synthetic: rows in all")
    p.add_argument("--val-samples", type=int, default=defaults.val_samples, help="synthetic: validation rows")
    p.add_argument("--multi-hot", action="store_true", help="synthetic: MLPerf multi-hot sizes")
    p.add_argument("--ids", choices=["uniform", "zipf"], default=defaults.ids, help="synthetic: id distribution")
    p.add_argument("--batch-size", type=int, default=defaults.batch_size)
    p.add_argument("--embedding-dim", type=int, default=defaults.embedding_dim)
    p.add_argument("--dense-arch", type=_sizes, default=None, help="bottom MLP, e.g. 512,256,64 (ends at the embedding dim)")
    p.add_argument("--over-arch", type=_sizes, default=defaults.over_arch, help="top MLP, e.g. 512,256,1")
    p.add_argument("--dcn-layers", type=int, default=defaults.dcn_layers)
    p.add_argument("--dcn-rank", type=int, default=defaults.dcn_rank)
    p.add_argument("--embedding-optimizer", choices=sorted(EMBEDDING_OPTIMIZERS), default=defaults.embedding_optimizer)
    p.add_argument("--embedding-lr", type=float, default=defaults.embedding_lr)
    p.add_argument("--dense-optimizer", choices=sorted(DENSE_OPTIMIZERS), default=defaults.dense_optimizer)
    p.add_argument("--dense-lr", type=float, default=defaults.dense_lr)
    p.add_argument("--epochs", type=int, default=defaults.epochs)
    p.add_argument("--steps", type=int, default=None, help="stop after this many steps in all")
    p.add_argument("--eval-interval", type=int, default=defaults.eval_interval)
    p.add_argument("--eval-batches", type=int, default=None)
    p.add_argument("--seed", type=int, default=defaults.seed)
    p.add_argument("--device", default=defaults.device)
    p.add_argument("--precision", choices=["medium", "high", "highest"], default=defaults.precision)
    p.add_argument("--num-workers", type=int, default=defaults.num_workers)
    p.add_argument("--checkpoint-dir", default=None)
    p.add_argument("--checkpoint-interval", type=int, default=defaults.checkpoint_interval)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--metrics-file", default=None)
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--plan", default=None, help="under torchrun: a sharding plan JSON (default: the default plan)")
    p.add_argument("--dense-parallel", choices=["ddp", "fsdp2"], default=defaults.dense_parallel,
                   help="under torchrun: DDP or FSDP2 over the dense arch")
    p.add_argument("--limits", default=None,
                   help=f"an earlier run's {LIMITS_FILENAME}: its observed id maxima set the partition limits")
    p.add_argument("--limits-headroom", type=float, default=defaults.limits_headroom,
                   help="factor on the observed maxima (--limits)")
    p.add_argument("--pipeline", choices=["exact", "none"], default=None,
                   help="exact: sparsecore.TrainPipeline (overlapped, same numbers); none: the plain loop "
                        "(default: exact, or none with --compile)")
    p.add_argument("--compile", action="store_true",
                   help="train through torch.compile(backend='tpu'): the step as one graph (plain loop, one process)")
    a = p.parse_args(argv)
    dense_arch = a.dense_arch or (*defaults.dense_arch[:-1], a.embedding_dim)
    try:
        return TrainConfig(
            model=a.model, data=a.data, scale=a.scale, num_samples=a.num_samples, val_samples=a.val_samples,
            multi_hot=a.multi_hot, ids=a.ids, batch_size=a.batch_size, embedding_dim=a.embedding_dim,
            dense_arch=dense_arch, over_arch=a.over_arch, dcn_layers=a.dcn_layers, dcn_rank=a.dcn_rank,
            embedding_optimizer=a.embedding_optimizer, embedding_lr=a.embedding_lr,
            dense_optimizer=a.dense_optimizer, dense_lr=a.dense_lr, epochs=a.epochs, steps=a.steps,
            eval_interval=a.eval_interval, eval_batches=a.eval_batches, seed=a.seed, device=a.device,
            precision=a.precision, num_workers=a.num_workers, checkpoint_dir=a.checkpoint_dir,
            checkpoint_interval=a.checkpoint_interval, resume=a.resume, metrics_file=a.metrics_file,
            progress=not a.no_progress, plan=a.plan, dense_parallel=a.dense_parallel,
            pipeline=a.pipeline or ("none" if a.compile else defaults.pipeline), compile=a.compile,
            limits=a.limits, limits_headroom=a.limits_headroom)
    except ValueError as error:
        p.error(str(error))


def main(argv: list[str] | None = None) -> int:
    # force: importing torchrec (fbgemm_gpu) already configured the root logger at WARNING.
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", force=True)
    # torch.fx's one-time notice about is_fx_tracing, which TorchRec's KJT code triggers once in
    # this process and once in each loader worker (they inherit this level): it is addressed to
    # TorchRec's authors, not to whoever runs the training.
    logging.getLogger("torch.fx._symbolic_trace").setLevel(logging.ERROR)
    cfg = parse_args(argv)
    try:
        summary = train(cfg)
    except (checkpoint.CheckpointError, FileNotFoundError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except torch.OutOfMemoryError as error:  # its message names the device, the request and what is free
        print(f"error: {' '.join(str(error).split())} (smaller tables: --scale, --embedding-dim; or more devices)",
              file=sys.stderr)
        return 2
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    if int(os.environ.get("RANK", "0")) != 0:
        return 0
    teacher = summary.get("teacher_auc")
    if "val_auc" in summary:
        print(f"final validation AUC {format_auc(summary['val_auc'])}"
              + (f" (teacher, the best reachable: {teacher:.4f})" if teacher is not None else "")
              + f", log loss {summary['val_log_loss']:.4f}")
    print(f"{summary['steps']} steps, {summary['samples_per_s']:,.0f} samples/s ({summary['train_seconds']:.1f} s in training steps)")
    if "peak_tpu_memory_bytes" in summary:
        print(f"peak tpu memory {summary['peak_tpu_memory_bytes'] / 2**20:.1f} MiB")
    if "defer_and_fuse" in summary:
        d = summary["defer_and_fuse"]
        print(f"DeferAndFuse: {d['graphs_per_step']:.1f} graphs per step, {d['ops_per_graph']:.0f} ops per graph, "
              f"{d['compiled_share']:.0%} of graph runs compiled, {d['eager_share']:.0%} of segments run eagerly "
              f"(measured faster); ops that fell back (not recorded): {d['not_recorded'] or 'none'}")
    if summary["interrupted"]:
        print(f"interrupted at step {summary['steps']}; resume with --resume")
    return 0


if __name__ == "__main__":
    sys.exit(main())
