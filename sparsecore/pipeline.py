"""``sparsecore.TrainPipeline``: training steps with the SparseCore and TensorCore overlapped, exactly.

The model is TorchRec's pipeline contract: ``model(batch) -> (losses, output)``
(e.g. ``models.dlrm.DLRMTrain``); ``progress(dataloader_iter)`` trains one
batch and returns its ``output``, raising ``StopIteration`` when the iterator
is done. One ``progress`` on batch i runs:

    reader thread        training loop (main thread)   SparseCore executor       input thread (sharded)
    next(iter): i+2      take i+1, prepare(i+1)    ->  preprocess(i+1)     or    input dist of i+1
    (the loader's        forward(i)                    (lookup(i) was queued last step)
    work: generation,    backward(i)               ->  sparse update(i)  (deferred: queued, not waited for)
    parsing, ...)        prefetch(i+1)             ->  lookup(i+1)       (queued after update(i))
                         optimizer.step()              ... meanwhile

so the loader's own work for batch i+2 (reading, generating, its
preprocessing), host preprocessing and the input distribution of batch i+1
overlap batch i's compute, the lookup overlaps the dense forward, and the
sparse update overlaps the rest of the dense backward and the optimizer
step. The iterator is read in order by one thread of its own, two batches
ahead of training (as TorchRec's TrainPipelineSparseDist holds two);
``read_ahead=False`` reads it on the training loop, one batch ahead, for an
iterator that must stay on that thread. The
executor runs its queue in order, so every lookup sees every earlier update:
the numbers are the plain loop's (``forward, backward, step`` per batch),
which the tests check. TorchRec's semi-synchronous pipeline (looking up batch
i+1 before batch i's update) is not exact and is not offered.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import logging
import queue
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from sparsecore.collection import SparseCoreCollection
from sparsecore.distributed.sharded import ShardedSparseCoreCollection
from sparsecore.executor import executor_for
from sparsecore.trace import StageTrace

logger = logging.getLogger(__name__)

SparseModule = SparseCoreCollection | ShardedSparseCoreCollection


def sparse_modules(model: nn.Module) -> list[SparseModule]:
    """The SparseCore collections of a model (a sharded one counts once, not its local engines)."""
    found: list[SparseModule] = []
    skip: list[str] = []
    for name, module in model.named_modules():
        if any(name.startswith(prefix + ".") for prefix in skip):
            continue
        if isinstance(module, (SparseCoreCollection, ShardedSparseCoreCollection)):
            found.append(module)
            skip.append(name)
    return found


def default_sparse_features(batch: Any) -> list[Any]:
    """The batch's ``sparse_features`` (TorchRec's Batch) or ``sparse`` (data.loader.Batch)."""
    for attribute in ("sparse_features", "sparse"):
        if hasattr(batch, attribute):
            return [getattr(batch, attribute)]
    raise TypeError(f"cannot find the sparse features of a {type(batch).__name__}: expected a sparse_features or "
                    "sparse attribute; pass sparse_features=<function of the batch> to TrainPipeline")


@dataclasses.dataclass
class _Staged:
    batch: Any
    features: list[Any]
    prepared: list[concurrent.futures.Future]


_END = object()  # the reader's mark of an exhausted iterator


class _Reader:
    """Reads an iterator on a thread of its own, in order, one item ahead of its
    consumer: what producing a batch costs the host overlaps training. An
    exception the iterator raises comes out of ``next``."""

    POLL_S = 0.1  # how often a reader waiting for its consumer checks for close()
    JOIN_S = 30.0  # close() waits this long for an item being made

    def __init__(self, iterator: Iterator[Any], stage: Callable[[str], Any]) -> None:
        self.iterator = iterator
        self._stage = stage  # (name) -> a context manager timing it on the reader's lane
        self._items: queue.Queue = queue.Queue()
        self._slot = threading.Semaphore(1)  # taken by an item made and not yet consumed
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sparsecore-pipeline-reader", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._closed.is_set():
            if not self._slot.acquire(timeout=self.POLL_S):
                continue
            try:
                with self._stage("read"):
                    item: tuple[Any, BaseException | None] = (next(self.iterator), None)
            except StopIteration:
                item = (_END, None)
            except BaseException as error:  # noqa: BLE001 - handed to the consumer, raised there
                item = (None, error)
            self._items.put(item)
            if item[0] is _END or item[1] is not None:
                return

    def next(self) -> Any:
        item, error = self._items.get()
        if error is not None:
            # The reader has stopped: a later call ends the iteration (as next() on a generator
            # that raised does) rather than waiting for an item that never comes.
            self._items.put((_END, None))
            raise error
        if item is _END:
            self._items.put((item, None))  # exhausted for good: every later call says so too
            raise StopIteration
        self._slot.release()
        return item

    def stop(self) -> None:
        """The reader ends once the item it may be making is made."""
        self._closed.set()

    def close(self) -> None:
        self.stop()
        self._thread.join(self.JOIN_S)
        if self._thread.is_alive():
            logger.warning("the pipeline's batch reader is still inside next() of its iterator after %.0f s; "
                           "left running (a daemon thread)", self.JOIN_S)


class TrainPipeline:
    """Exact SparseCore/TensorCore pipeline (see the module docstring).

    ``model(batch) -> (losses, output)``; ``optimizer`` steps the dense
    parameters (the SparseCore tables train in the backward). ``device``: where
    batches go (``batch.to(device, non_blocking=True)`` when the batch has
    ``to``). ``sparse_features(batch)``: the features of each of the model's
    SparseCore collections, in ``sparse_modules(model)`` order (default: the
    batch's ``sparse_features`` or ``sparse``, for a model with one
    collection). ``read_ahead``: read the batches on a thread of their own
    (see the module docstring). ``trace``: a StageTrace to record the stages in.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, device: torch.device | str, *,
                 sparse_features: Callable[[Any], Sequence[Any]] | None = None, read_ahead: bool = True,
                 trace: StageTrace | None = None) -> None:
        self._model, self._optimizer, self._device = model, optimizer, torch.device(device)
        self.modules = sparse_modules(model)
        if not self.modules:
            raise ValueError("the model has no SparseCore embedding collection; TrainPipeline pipelines their "
                             "lookups and updates (use a plain training loop for other models)")
        if sparse_features is None and len(self.modules) > 1:
            raise ValueError(f"the model has {len(self.modules)} SparseCore collections: pass "
                             "sparse_features=<function of the batch returning their features, in order>")
        self._features_of = sparse_features or default_sparse_features
        for module in self.modules:
            module.set_deferred_updates(True)
        # Whose deferred errors each step raises: the executors of the modules' tpu devices.
        self._executors = [executor_for(d) for d in {m._device for m in self.modules if m._device.type == "tpu"}]
        self.trace = trace
        if self._device.type == "tpu":
            executor_for(self._device).trace = trace
        self._current: _Staged | None = None
        self._iterator: Iterator[Any] | None = None
        self._done = False
        self._read_ahead = read_ahead
        self._reader: _Reader | None = None

    def _stage(self, name: str, lane: str = "main"):
        return self.trace.stage(name, lane) if self.trace is not None else contextlib.nullcontext()

    def _fetch(self, dataloader_iter: Iterator[Any]) -> _Staged | None:
        """The next batch, on its way to the device, its sparse features being prepared."""
        with self._stage("fetch"):
            try:
                batch = self._next(dataloader_iter)
            except StopIteration:
                return None
            if hasattr(batch, "to"):
                batch = batch.to(self._device, non_blocking=True)
            features = list(self._features_of(batch))
            if len(features) != len(self.modules):
                raise ValueError(f"sparse_features gave {len(features)} feature sets for {len(self.modules)} "
                                 "SparseCore collections")
            return _Staged(batch, features, [m.prepare(f) for m, f in zip(self.modules, features)])

    def _next(self, dataloader_iter: Iterator[Any]) -> Any:
        if not self._read_ahead:
            return next(dataloader_iter)
        if self._reader is None or self._reader.iterator is not dataloader_iter:
            self._close_reader()
            owner = weakref.ref(self)  # the reader's thread keeps no pipeline alive (__del__ stops it)

            def stage(name: str) -> Any:
                pipeline = owner()
                return pipeline._stage(name, "reader") if pipeline is not None else contextlib.nullcontext()

            self._reader = _Reader(dataloader_iter, stage)
        return self._reader.next()

    def _close_reader(self) -> None:
        if self._reader is not None:
            self._reader.close()
            self._reader = None

    def __del__(self) -> None:
        reader = getattr(self, "_reader", None)
        if reader is not None:
            reader.stop()

    def _prefetch(self, staged: _Staged) -> None:
        for module, features, prepared in zip(self.modules, staged.features, staged.prepared):
            module.prefetch(features, prepared)

    def progress(self, dataloader_iter: Iterator[Any]) -> Any:
        """Trains the next batch; returns the model's output for it. Once an iterator is
        exhausted, raises StopIteration; a new iterator starts the pipeline afresh."""
        if self._done and dataloader_iter is not self._iterator:
            self._done = False
        self._iterator = dataloader_iter
        if self._current is None:
            staged = None if self._done else self._fetch(dataloader_iter)
            if staged is None:
                self._done = True
                raise StopIteration
            self._prefetch(staged)
            self._current = staged
        current = self._current
        upcoming = self._fetch(dataloader_iter)
        training = self._model.training
        with self._stage("forward"):
            if training:
                self._optimizer.zero_grad(set_to_none=True)
            losses, output = self._model(current.batch)
        if training:
            with self._stage("backward"):
                losses.sum().backward()
        if upcoming is not None:
            self._prefetch(upcoming)  # after the backward: behind its sparse updates
        if training:
            with self._stage("optimizer"):
                self._optimizer.step()
        self._current = upcoming
        self._done = upcoming is None
        for executor in self._executors:
            executor.raise_deferred_error()
        torch.tpu.mark_step()  # a step's end: under DeferAndFuse, where its segments can run dormant
        return output

    def synchronize(self) -> None:
        """Waits for the work in flight: the next batch's preparation (its input distribution,
        whose collectives must finish before the process group goes) and the queued sparse
        updates (reading weights waits for those by itself)."""
        if self._current is not None:
            for prepared in self._current.prepared:
                prepared.result()
        for module in self.modules:
            module.wait_for_updates()

    def close(self) -> None:
        """Finishes the work in flight and stops the modules' own threads (the sharded ones'
        input distribution); the pipeline takes no more batches. Call it before destroying
        the process group."""
        self.synchronize()
        self._close_reader()
        self._current, self._done = None, True
        for module in self.modules:
            module.close()

