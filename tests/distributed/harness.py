"""Runs a function on N local processes joined by a tpu_dist group, with a deadline.

Each rank runs in a fresh (spawned) interpreter on 127.0.0.1, takes
``tpu:<rank>`` (one emulated device per rank, as torchrun's LOCAL_RANK would
give it) and reports what the function returned or the traceback it raised.
Nothing can hang the test run: past the deadline every rank is killed and the
call raises ``TimeoutError``.
"""

from __future__ import annotations

import dataclasses
import datetime
import pickle
import os
import queue
import shutil
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

from torch_tpu.distributed.local_ranks import start_local_ranks


@dataclasses.dataclass
class RankResult:
    rank: int
    value: Any = None
    error: str | None = None
    exitcode: int | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.exitcode == 0


def _entry(rank: int, fn, world_size: int, store: str, group_timeout_s: float, results, args) -> None:
    import torch
    import torch.distributed as dist

    try:
        dist.init_process_group("tpu_dist", init_method=f"file://{store}", rank=rank,
                                world_size=world_size, timeout=datetime.timedelta(seconds=group_timeout_s))
        with warnings.catch_warnings():  # exact fp32, as the rest of the suite (conftest)
            warnings.simplefilter("ignore")
            torch.tpu.set_float32_matmul_precision("highest")
        value = fn(rank, world_size, *args)
        dist.destroy_process_group()
        # Plain pickle: the queue's own would pass tensors as shared memory,
        # which is gone once this process exits.
        results.put((rank, pickle.dumps(value), None))
    except BaseException:  # noqa: BLE001 - reported to the parent
        results.put((rank, None, traceback.format_exc()))


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 120.0,
              group_timeout_s: float = 30.0, env: dict[str, str] | None = None) -> list[RankResult]:
    """Runs ``fn(rank, world_size, *args)`` on every rank; returns each rank's result in rank order."""
    results = mp.get_context("spawn").Queue()
    # A file store: no port to pick (and lose to another process) before rank 0 binds it.
    store = os.path.join(tempfile.mkdtemp(prefix="tpu_dist_store_"), "store")
    procs = start_local_ranks(_entry, world_size, (fn, world_size, store, group_timeout_s, results, args), env)
    deadline = time.monotonic() + timeout_s
    out = {rank: RankResult(rank) for rank in range(world_size)}
    reported = 0
    try:
        while reported < world_size:
            if time.monotonic() > deadline:
                raise TimeoutError(f"ranks did not finish within {timeout_s} s")
            try:
                rank, value, error = results.get(timeout=0.2)
            except queue.Empty:
                if all(not p.is_alive() for p in procs):
                    break  # some rank died without a report
                continue
            out[rank].value, out[rank].error = (pickle.loads(value) if error is None else None), error
            reported += 1
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                raise TimeoutError(f"rank {procs.index(p)} did not exit within {timeout_s} s")
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
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
