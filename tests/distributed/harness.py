"""Runs a function on N local processes joined by a tpu_dist group, with a deadline.

Each rank runs in a spawned interpreter on 127.0.0.1, takes ``tpu:<rank>`` (one
emulated device per rank, as torchrun's LOCAL_RANK would give it) and reports
what the function returned or the traceback it raised. Nothing can hang the test
run: past the deadline every rank is killed and the call raises ``TimeoutError``.

Starting ranks is most of a short test's time (each imports torch, torchrec and
sparsecore), so calls with the default group settings share a pool of ranks per
world size, kept for the session. A task starts from the state a fresh rank has
(random generators, peak memory, thread count, matmul precision) and ends with a
barrier, so a task that leaves the group unusable fails instead of the next one;
a pool any of whose ranks failed is discarded. Calls that set ``env`` or their own
group timeout (the failure tests break their group on purpose) get fresh ranks.
"""

from __future__ import annotations

import atexit
import dataclasses
import datetime
import gc
import os
import pickle
import queue
import shutil
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from torch_tpu.distributed.local_ranks import start_local_ranks

DEFAULT_GROUP_TIMEOUT_S = 30.0


@dataclasses.dataclass
class RankResult:
    rank: int
    value: Any = None
    error: str | None = None
    exitcode: int | None = None  # None: the rank is a pooled one, still alive
    reported: bool = False

    @property
    def ok(self) -> bool:
        return self.reported and self.error is None and self.exitcode in (0, None)


def _join_group(rank: int, world_size: int, store: str, group_timeout_s: float) -> None:
    dist.init_process_group("tpu_dist", init_method=f"file://{store}", rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(seconds=group_timeout_s))
    _exact_fp32()


def _exact_fp32() -> None:
    """As the rest of the suite (conftest); the warning that highest costs more on a TPU is known."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.tpu.set_float32_matmul_precision("highest")


def _report(results, rank: int, run: Callable[[], Any]) -> bool:
    try:
        value = run()
        # Plain pickle: the queue's own would pass tensors as shared memory,
        # which is gone once this process exits.
        results.put((rank, pickle.dumps(value), None))
        return True
    except BaseException:  # noqa: BLE001 - reported to the parent
        results.put((rank, None, traceback.format_exc()))
        return False


def _entry(rank: int, fn, world_size: int, store: str, group_timeout_s: float, results, args) -> None:
    """A fresh rank: joins, runs one function, leaves."""
    def run():
        _join_group(rank, world_size, store, group_timeout_s)
        value = fn(rank, world_size, *args)
        dist.destroy_process_group()
        return value

    _report(results, rank, run)


def _pooled_entry(rank: int, world_size: int, store: str, task_queues, results) -> None:
    """A pooled rank: joins once, then runs tasks until told to stop or its parent is gone."""
    tasks = task_queues[rank]
    parent = os.getppid()
    if not _report(results, rank, lambda: _join_group(rank, world_size, store, DEFAULT_GROUP_TIMEOUT_S)):
        return
    fresh_rng = (torch.get_rng_state(), torch.tpu.get_rng_state_all())
    threads = torch.get_num_threads()
    while os.getppid() == parent:
        try:
            task = tasks.get(timeout=1.0)
        except queue.Empty:
            continue
        if task is None:
            break
        fn, args = task
        torch.set_rng_state(fresh_rng[0])
        torch.tpu.set_rng_state_all(fresh_rng[1])
        torch.set_num_threads(threads)
        _exact_fp32()
        torch.tpu.reset_peak_memory_stats()

        def run():
            value = fn(rank, world_size, *args)
            dist.barrier()  # the group still works for the next task
            return value

        ok = _report(results, rank, run)
        del fn, args, task
        gc.collect()
        if not ok:
            break
    dist.destroy_process_group()


def _collect(procs: list, results, world_size: int, timeout_s: float) -> dict[int, RankResult]:
    """Each rank's report, until all reported or died; raises TimeoutError past the deadline."""
    deadline = time.monotonic() + timeout_s
    out = {rank: RankResult(rank) for rank in range(world_size)}
    settled = False  # every rank reported or died, so what is still in the pipe is all there is
    while not all(r.reported for r in out.values()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"ranks did not finish within {timeout_s} s")
        try:
            rank, value, error = results.get(timeout=0.2)
        except queue.Empty:
            if settled:
                break
            # A rank flushes its report before it exits: one more wait after this reads it.
            settled = all(r.reported or not procs[r.rank].is_alive() for r in out.values())
            continue
        out[rank].value, out[rank].error = (pickle.loads(value) if error is None else None), error
        out[rank].reported = True
    return out


def _kill(procs: list) -> None:
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join()


class _Pool:
    """Ranks of one world size that stay joined between tasks."""

    def __init__(self, world_size: int, timeout_s: float) -> None:
        ctx = mp.get_context("spawn")
        self.world_size = world_size
        self.results = ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(world_size)]
        self.store_dir = tempfile.mkdtemp(prefix="tpu_dist_store_")
        store = os.path.join(self.store_dir, "store")
        self.procs = start_local_ranks(_pooled_entry, world_size, (world_size, store, self.tasks, self.results))
        try:
            joined = list(_collect(self.procs, self.results, world_size, timeout_s).values())
            assert_all_ok(joined)
        except BaseException:
            self.close()
            raise

    def run(self, fn, args: tuple, timeout_s: float) -> list[RankResult]:
        for q in self.tasks:
            q.put((fn, args))
        out = _collect(self.procs, self.results, self.world_size, timeout_s)
        for rank, p in enumerate(self.procs):
            out[rank].exitcode = None if p.is_alive() else p.exitcode
        return [out[r] for r in range(self.world_size)]

    def close(self) -> None:
        for q in self.tasks:
            q.put(None)
        deadline = time.monotonic() + 10
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
        _kill(self.procs)
        shutil.rmtree(self.store_dir, ignore_errors=True)


_pools: dict[int, _Pool] = {}


@atexit.register
def _close_pools() -> None:
    while _pools:
        _pools.popitem()[1].close()


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 120.0,
              group_timeout_s: float = DEFAULT_GROUP_TIMEOUT_S,
              env: dict[str, str] | None = None) -> list[RankResult]:
    """Runs ``fn(rank, world_size, *args)`` on every rank; returns each rank's result in rank order."""
    if env or group_timeout_s != DEFAULT_GROUP_TIMEOUT_S:
        return _run_fresh(fn, world_size, args, timeout_s, group_timeout_s, env)
    pool = _pools.pop(world_size, None) or _Pool(world_size, timeout_s)
    try:
        out = pool.run(fn, args, timeout_s)
    except BaseException:
        pool.close()
        raise
    if all(r.ok for r in out):
        _pools[world_size] = pool
    else:
        pool.close()
    return out


def _run_fresh(fn, world_size: int, args: tuple, timeout_s: float, group_timeout_s: float,
               env: dict[str, str] | None) -> list[RankResult]:
    results = mp.get_context("spawn").Queue()
    # A file store: no port to pick (and lose to another process) before rank 0 binds it.
    store = os.path.join(tempfile.mkdtemp(prefix="tpu_dist_store_"), "store")
    procs = start_local_ranks(_entry, world_size, (fn, world_size, store, group_timeout_s, results, args), env)
    deadline = time.monotonic() + timeout_s
    try:
        out = _collect(procs, results, world_size, timeout_s)
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                raise TimeoutError(f"rank {procs.index(p)} did not exit within {timeout_s} s")
    finally:
        _kill(procs)
        shutil.rmtree(os.path.dirname(store), ignore_errors=True)
    for rank, p in enumerate(procs):
        out[rank].exitcode = p.exitcode
    return [out[r] for r in range(world_size)]


def assert_all_ok(results: list[RankResult]) -> list[Any]:
    """The ranks' values; fails with every failing rank's traceback."""
    failures = [f"rank {r.rank} (exit {r.exitcode}):\n{r.error or 'died without a report'}"
                for r in results if not r.ok]
    assert not failures, "\n".join(failures)
    return [r.value for r in results]
