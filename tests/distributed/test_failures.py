"""A rank that dies, a collective that never completes and shapes that disagree: clear errors, never a hang."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from tests.distributed.harness import run_ranks

GROUP_TIMEOUT_S = 5.0


def survivor_sees(action) -> str:
    """Runs the collective; returns the error it raised, with how long it took."""
    started = time.monotonic()
    try:
        action()
    except RuntimeError as e:
        return f"{time.monotonic() - started:.1f}s {e}"
    return "completed"


def one_rank_dies(rank: int, world: int) -> str:
    dist.barrier()
    if rank == world - 1:
        os._exit(7)
    return survivor_sees(lambda: dist.all_reduce(torch.ones(1024, device="tpu")))


def one_rank_never_joins(rank: int, world: int) -> str:
    if rank == world - 1:
        time.sleep(GROUP_TIMEOUT_S + 2)
        return "slept"
    return survivor_sees(lambda: dist.all_reduce(torch.ones(1024, device="tpu")))


def shapes_disagree(rank: int, world: int) -> str:
    return survivor_sees(lambda: dist.all_reduce(torch.ones(4 + rank, device="tpu")))


def seconds(report: str) -> float:
    return float(report.split("s ", 1)[0])


# Both transports: shared memory (ranks on one host, the default here) and gloo alone.
TRANSPORTS = {"shared_memory": {}, "gloo": {"TORCH_TPU_DIST_TRANSPORT": "gloo"}}
DEATH_WORDS = {"shared_memory": ["rank(s) 2 exited (their process is gone)"], "gloo": ["closed", "reset"]}


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_dead_rank_fails_the_survivors_collective(transport):
    results = run_ranks(one_rank_dies, 3, group_timeout_s=GROUP_TIMEOUT_S, timeout_s=60, env=TRANSPORTS[transport])
    assert results[2].exitcode == 7
    for r in results[:2]:
        assert r.ok, r.error
        assert any(word in r.value for word in DEATH_WORDS[transport]), r.value
        assert seconds(r.value) <= GROUP_TIMEOUT_S + 2, r.value


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_collective_that_never_completes_times_out_with_the_group_timeout(transport):
    results = run_ranks(one_rank_never_joins, 2, group_timeout_s=GROUP_TIMEOUT_S, timeout_s=60,
                        env=TRANSPORTS[transport])
    assert results[0].ok, results[0].error
    assert "timed out" in results[0].value.lower(), results[0].value
    if transport == "shared_memory":
        assert "waiting for rank(s) 1" in results[0].value, results[0].value
    assert GROUP_TIMEOUT_S - 0.5 <= seconds(results[0].value) <= GROUP_TIMEOUT_S + 5, results[0].value


def test_shapes_that_disagree_are_named_with_the_debug_check():
    results = run_ranks(shapes_disagree, 2, group_timeout_s=GROUP_TIMEOUT_S, timeout_s=60,
                        env={"TORCH_DISTRIBUTED_DEBUG": "DETAIL"})
    for r in results:
        assert r.ok, r.error
        assert "Detected mismatch between collectives" in r.value, r.value
        assert "TensorShape=[4]" in r.value and "TensorShape=[5]" in r.value, r.value


def test_shapes_that_disagree_are_named_on_every_rank_over_shared_memory():
    results = run_ranks(shapes_disagree, 2, group_timeout_s=GROUP_TIMEOUT_S, timeout_s=60)
    for r in results:
        assert r.ok, r.error
        assert "the ranks' calls disagree" in r.value, r.value
        assert "rank 0: all_reduce SUM of Float[4]" in r.value and "rank 1: all_reduce SUM of Float[5]" in r.value
        assert seconds(r.value) < GROUP_TIMEOUT_S - 1, r.value  # at once, not at the timeout


def test_shapes_that_disagree_never_hang_on_gloo_alone():
    # Gloo aborts the rank that receives more than it expected (its message
    # names a collective mismatch); the other gets an error at once.
    results = run_ranks(shapes_disagree, 2, group_timeout_s=GROUP_TIMEOUT_S, timeout_s=60,
                        env=TRANSPORTS["gloo"])
    assert all(not r.ok or r.value != "completed" for r in results)
    survivors = [r for r in results if r.ok]
    for r in survivors:
        assert seconds(r.value) <= GROUP_TIMEOUT_S + 2, r.value
