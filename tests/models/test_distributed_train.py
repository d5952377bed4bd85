"""``torchrun -m models.train`` with sharded embeddings (and the exact pipeline, its default) trains as one
process on the same global batch by the plain loop."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from data import schema
from sparsecore.distributed import ShardingPlan, TableSharding
from torch_tpu.distributed.local_ranks import free_port

ROOT = Path(__file__).resolve().parents[2]
ARGS = ["--steps", "4", "--eval-interval", "2", "--eval-batches", "2", "--num-samples", "20000",
        "--val-samples", "4096", "--batch-size", "512", "--precision", "highest", "--num-workers", "0",
        "--no-progress"]
TABLES = [f"t_{name}" for name in schema.SPARSE_NAMES]


def plan(kind: str) -> ShardingPlan:
    def one(i: int) -> TableSharding:
        if kind == "table_wise":
            return TableSharding(sharding_type="table_wise", ranks=(i % 2,))
        if kind == "column_wise":
            return TableSharding(sharding_type="column_wise", ranks=(0, 1), column_widths=(8, 8))
        if kind == "table_row_wise":
            return TableSharding(sharding_type="table_row_wise", ranks=(i % 2,))
        if kind == "data_parallel":  # half the tables replicated, half row-wise
            return TableSharding(sharding_type="data_parallel" if i % 2 else "row_wise", ranks=(0, 1))
        return TableSharding(sharding_type="row_wise", ranks=(0, 1))

    hosts = ((0,), (1,)) if kind == "table_row_wise" else None
    return ShardingPlan(world_size=2, hosts=hosts, tables={t: one(i) for i, t in enumerate(TABLES)})


def run(args: list[str], metrics: Path, ranks: int) -> list[dict]:
    env = {**os.environ, "TORCH_TPU_NUM_DEVICES": str(ranks), "GLOO_SOCKET_IFNAME": "lo", "PYTHONPATH": str(ROOT)}
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--master-addr",
                "127.0.0.1", "--master-port", str(free_port())] if ranks > 1 else [sys.executable]
    out = subprocess.run([*launcher, "-m", "models.train", *ARGS, *args, "--metrics-file", str(metrics)],
                         env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return [json.loads(line) for line in metrics.read_text().splitlines()]


@pytest.fixture(scope="module")
def single_process(tmp_path_factory) -> list[dict]:
    return run(["--pipeline", "none"], tmp_path_factory.mktemp("single") / "metrics.jsonl", 1)  # the plain loop


@pytest.fixture(scope="module")
def row_wise_run(tmp_path_factory) -> tuple[Path, list[dict]]:
    """Two ranks under the row-wise plan: the run directory (with the limits it saved) and its metrics."""
    directory = tmp_path_factory.mktemp("row_wise")
    plan("row_wise").save(directory / "plan.json")
    return directory, run(["--plan", str(directory / "plan.json")], directory / "metrics.jsonl", 2)


# column_wise, table_row_wise and data_parallel run under `make test-all` (the module-level
# tests of tests/distributed/test_sharded_embeddings.py cover them in CI).
@pytest.mark.parametrize("kind", ["default", "table_wise", "row_wise", "fsdp2"] + [
    pytest.param(k, marks=pytest.mark.slow) for k in ("column_wise", "table_row_wise", "data_parallel")])
def test_two_ranks_train_as_one_process(kind, tmp_path, single_process, request):
    args = ["--dense-parallel", "fsdp2"] if kind == "fsdp2" else []  # fsdp2: the default plan
    if kind == "row_wise":
        sharded = request.getfixturevalue("row_wise_run")[1]
    else:
        if kind not in ("default", "fsdp2"):
            plan(kind).save(tmp_path / "plan.json")
            args += ["--plan", str(tmp_path / "plan.json")]
        sharded = run(args, tmp_path / "metrics.jsonl", 2)
    expected = single_process
    assert [m["step"] for m in sharded] == [m["step"] for m in expected] == [2, 4]
    for got, want in zip(sharded, expected):
        for key in ("train_loss", "val_auc", "val_log_loss"):
            assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-6), (kind, got["step"], key)


def test_observed_limits_are_the_maxima_over_ranks_and_seed_the_next_run(tmp_path, row_wise_run):
    """Saved once (rank 0) with the maxima over both ranks: seeded at exactly those, the same
    sharded run fits on every rank (a rank-local maximum could be too small on the other one)."""
    directory, first = row_wise_run
    saved = json.loads((directory / "sparsecore_limits.json").read_text())
    assert saved["world_size"] == 2 and set(saved["tables"]) == set(TABLES)
    assert all(v["max_ids_per_partition"] > 0 for v in saved["tables"].values())
    again = run(["--plan", str(directory / "plan.json"), "--limits", str(directory / "sparsecore_limits.json"),
                 "--limits-headroom", "1.0"], tmp_path / "again" / "metrics.jsonl", 2)
    assert [m["train_loss"] for m in again] == [m["train_loss"] for m in first]


# CI keeps FSDP2's training (test_two_ranks_train_as_one_process[fsdp2]) and DDP's resume; FSDP2's resume
# (18 s: two torchrun launches) runs in make test-all.
@pytest.mark.parametrize("dense", ["ddp", pytest.param("fsdp2", marks=pytest.mark.slow)])
def test_sharded_run_checkpoints_and_resumes_exactly(dense, tmp_path, single_process):
    """Stopped after step 2 (a torch.distributed.checkpoint directory) and resumed under another plan:
    step 4 is the uninterrupted single-process run's."""
    plan("row_wise").save(tmp_path / "first.json")
    plan("table_wise").save(tmp_path / "second.json")
    common = ["--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-interval", "2", "--dense-parallel", dense]
    run([*common, "--plan", str(tmp_path / "first.json"), "--steps", "2"], tmp_path / "a.jsonl", 2)
    assert (tmp_path / "ckpt" / "checkpoint.dcp" / "meta.json").is_file()
    assert not list((tmp_path / "ckpt").glob(".checkpoint.dcp.*"))  # nothing left of the swap
    resumed = run([*common, "--plan", str(tmp_path / "second.json"), "--resume"], tmp_path / "b.jsonl", 2)
    assert [m["step"] for m in resumed] == [4]
    for key in ("train_loss", "val_auc", "val_log_loss"):
        assert resumed[0][key] == pytest.approx(single_process[1][key], rel=1e-5, abs=1e-6), key


def test_a_plan_from_the_planner_trains_as_one_process(tmp_path, single_process):
    """sparsecore-plan's output drives torchrun -m models.train --plan."""
    from data.synthetic import SyntheticConfig, SyntheticCriteo
    from sparsecore.planner import TableSpec, parse_topology, plan_tables

    sizes = SyntheticCriteo(SyntheticConfig(num_samples=20000, scale=1e-4)).table_sizes  # the data ARGS train on
    tables = [TableSpec(name=f"t_{f}", num_embeddings=n, embedding_dim=16) for f, n in zip(schema.SPARSE_NAMES, sizes)]
    result = plan_tables(tables, parse_topology("v5p:2"), batch_size=512)
    result.plan.save(tmp_path / "plan.json")
    sharded = run(["--plan", str(tmp_path / "plan.json")], tmp_path / "metrics.jsonl", 2)
    for got, want in zip(sharded, single_process):
        for key in ("train_loss", "val_auc", "val_log_loss"):
            assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-6), key


def test_two_ranks_validate_a_split_that_does_not_divide_into_their_batches(tmp_path):
    # 4099 validation rows at batch 512: a last batch of 3 rows, of which the ranks take one
    # each (equal slices gather across ranks); an uneven split crashed the gather.
    metrics = tmp_path / "metrics.jsonl"
    env = {**os.environ, "TORCH_TPU_NUM_DEVICES": "2", "GLOO_SOCKET_IFNAME": "lo", "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr",
                          "127.0.0.1", "--master-port", str(free_port()), "-m", "models.train", "--steps", "1",
                          "--num-samples", "20000", "--val-samples", "4099", "--batch-size", "512", "--num-workers",
                          "0", "--no-progress", "--metrics-file", str(metrics)],
                         env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert 0.0 < json.loads(metrics.read_text().splitlines()[-1])["val_auc"] < 1.0
