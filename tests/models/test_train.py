"""models.train: the training loop, checkpoints and resume, metrics, Ctrl-C, the command line.

Small runs (tables at 1e-5 of Criteo Kaggle, batch 512, dim 8) except the
planted-signal acceptance test, which trains the default model for 500 steps.
"""

import dataclasses
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from torchmetrics.functional.classification import binary_auroc

import torch_tpu

from data import schema
from data.synthetic import SyntheticConfig, SyntheticCriteo
from models import checkpoint
from models.evaluation import evaluate
from models.train import LIMITS_FILENAME, RowRange, TrainConfig, Trainer, build_data, build_model, main, parse_args, train
from sparsecore.errors import PartitionLimitError

REPO = Path(__file__).resolve().parents[2]

SMALL = dict(scale=1e-5, num_samples=20_000, val_samples=4096, batch_size=512, embedding_dim=8, dense_arch=(16, 8),
             over_arch=(16, 1), num_workers=0, progress=False, eval_interval=0)
"""15,904 training rows: 31 batches an epoch."""


def small(**overrides) -> TrainConfig:
    return TrainConfig(**{**SMALL, **overrides})


def assert_same_tree(a, b, where="") -> None:
    """Nested dicts / lists / tensors / numbers equal exactly (tensors compared on the host)."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), f"{where}: keys {sorted(map(str, a))} != {sorted(map(str, b))}"
        for k in a:
            assert_same_tree(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_tree(x, y, f"{where}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), where
        torch.testing.assert_close(a.cpu(), b.cpu(), atol=0, rtol=0, msg=where)
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def hand_auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """P(score of a positive > score of a negative) + 0.5 P(tie), over all pairs."""
    pos, neg = scores[labels > 0.5].double(), scores[labels < 0.5].double()
    wins = (pos[:, None] > neg[None, :]).double().sum() + 0.5 * (pos[:, None] == neg[None, :]).double().sum()
    return float(wins / (len(pos) * len(neg)))


# ---------------------------------------------------------------- data and model pieces


def test_row_range_and_the_synthetic_split():
    cfg = small()
    data = build_data(cfg)
    assert len(data.train) == 20_000 - 4096 and len(data.val) == 4096
    source = SyntheticCriteo(SyntheticConfig(scale=1e-5, num_samples=20_000, ids="zipf", seed=0))
    assert data.table_sizes == source.table_sizes and data.pooling == (1,) * schema.NUM_SPARSE
    # The validation split is the last rows of the same stream, the training split the first.
    val, whole = data.val.rows(5, 9), source.rows(20_000 - 4096 + 5, 20_000 - 4096 + 9)
    np.testing.assert_array_equal(val.dense, whole.dense)
    np.testing.assert_array_equal(val.labels, whole.labels)
    for a, b in zip(val.sparse, whole.sparse):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(data.train.rows(0, 3).dense, source.rows(0, 3).dense)
    inner = RowRange(data.val, 100, 200)
    assert len(inner) == 100
    np.testing.assert_array_equal(inner.rows(1, 4).labels, source.rows(20_000 - 4096 + 101, 20_000 - 4096 + 104).labels)
    assert data.teacher_auc == pytest.approx(source.teacher_auc(20_000 - 4096, 20_000))


def test_build_model_is_seeded_and_sized_by_the_data():
    cfg = small(model="dcn")
    data = build_data(cfg)
    a, b = build_model(cfg, data, torch.device("tpu")), build_model(cfg, data, torch.device("tpu"))
    assert_same_tree(a.state_dict(), b.state_dict())
    ebc = a.sparse_arch.embedding_bag_collection
    sizes = {c.name: c.num_embeddings for c in ebc.embedding_bag_configs()}
    assert sizes == {f"t_{n}": rows for n, rows in zip(schema.SPARSE_NAMES, data.table_sizes)}
    other = build_model(dataclasses.replace(cfg, seed=1), data, torch.device("tpu"))
    key = "sparse_arch.embedding_bag_collection.embedding_bags.t_cat_2.weight"
    assert not torch.equal(a.state_dict()[key].cpu(), other.state_dict()[key].cpu())


def test_config_checks():
    with pytest.raises(ValueError, match="embedding dim"):
        small(dense_arch=(16, 4))
    with pytest.raises(ValueError, match="one logit"):
        small(over_arch=(16, 2))
    with pytest.raises(ValueError, match="checkpoint_dir"):
        small(resume=True)
    with pytest.raises(ValueError, match="model"):
        small(model="nope")
    for wrong in (dict(), dict(pipeline="none", device="cpu")):  # compiled: the plain loop, on the tpu
        with pytest.raises(ValueError, match="compile: .*expected pipeline 'none' and device 'tpu'"):
            small(compile=True, **wrong)
    assert parse_args(["--compile"]) == TrainConfig(compile=True, pipeline="none")


# ---------------------------------------------------------------- the loop


def test_tpu_and_cpu_build_the_same_initial_model():
    cfg = small()
    data = build_data(cfg)
    on_tpu = build_model(cfg, data, torch.device("tpu")).state_dict()
    on_cpu = build_model(dataclasses.replace(cfg, device="cpu"), data, torch.device("cpu")).state_dict()
    assert_same_tree(on_tpu, on_cpu)


def test_tpu_and_cpu_runs_give_the_same_losses():
    steps = 20
    tpu = Trainer(small(steps=steps, device="tpu", precision="highest"))
    cpu = Trainer(small(steps=steps, device="cpu", precision="highest"))
    # The same seed built the same initial model on both devices, tables and dense arch alike.
    assert_same_tree(tpu.model.state_dict(), cpu.model.state_dict())
    tpu_summary = tpu.run()
    cpu_summary = cpu.run()
    assert {p.device.type for p in tpu.model.parameters()} == {"tpu"}
    assert {p.device.type for p in cpu.model.parameters()} == {"cpu"}
    assert len(tpu.losses) == len(cpu.losses) == steps
    np.testing.assert_allclose(tpu.losses, cpu.losses, rtol=1e-5, atol=0)
    assert tpu.losses[-1] < tpu.losses[0]  # it trains
    assert tpu_summary["val_auc"] == pytest.approx(cpu_summary["val_auc"], abs=1e-4)
    assert tpu_summary["steps"] == steps and not tpu_summary["interrupted"]
    assert tpu_summary["peak_tpu_memory_bytes"] > 0
    for key, value in tpu.model.state_dict().items():
        torch.testing.assert_close(value.cpu(), cpu.model.state_dict()[key], atol=1e-5, rtol=1e-4, msg=key)


def test_the_pipeline_trains_as_the_plain_loop():
    """The default (sparsecore.TrainPipeline) and --pipeline none: the same run, bit for bit,
    validation in between included (it reads the tables while the pipeline has work queued)."""
    piped = Trainer(small(steps=12, eval_interval=5, eval_batches=2, embedding_optimizer="adam"))
    plain = Trainer(small(steps=12, eval_interval=5, eval_batches=2, embedding_optimizer="adam", pipeline="none"))
    assert piped.pipeline is not None and plain.pipeline is None
    piped_summary, plain_summary = piped.run(), plain.run()
    assert piped.losses == plain.losses
    assert piped_summary["val_auc"] == plain_summary["val_auc"]
    assert_same_tree(piped.model.state_dict(), plain.model.state_dict())
    assert_same_tree(piped.ebc.fused_optimizer.state_dict(), plain.ebc.fused_optimizer.state_dict())


def test_a_compiled_run_trains_as_the_plain_loop():
    """--compile: the step's forward (SparseCore lookups and their fused backward included) as
    one graph and the dense optimizer's step compiled; the same run as eager's, to fp32
    rounding. At "highest": below it, an fp32 ulp that flips a bf16 rounding in one matmul
    is a bf16 ulp in the next, which row-wise Adagrad's first steps (about lr * sign(g))
    carry into the tables at 1e-3."""
    cfg = dict(steps=8, eval_interval=4, eval_batches=2, pipeline="none", precision="highest")
    compiled, plain = Trainer(small(compile=True, **cfg)), Trainer(small(**cfg))
    compiled_summary, plain_summary = compiled.run(), plain.run()
    torch.testing.assert_close(compiled.losses, plain.losses, rtol=1e-5, atol=1e-5)
    assert compiled_summary["val_auc"] == pytest.approx(plain_summary["val_auc"], abs=1e-4)
    for key, value in plain.model.state_dict().items():
        torch.testing.assert_close(compiled.model.state_dict()[key].cpu(), value.cpu(), rtol=1e-4, atol=1e-4, msg=key)


def test_the_pipeline_trains_under_defer_and_fuse_as_under_strict(monkeypatch):
    """The pipeline prefetches the next batch's lookups, so the optimizer's recorded updates
    are still pending when the next forward saves views of the weights for backward; run op by
    op, DeferAndFuse gives Strict's run bit for bit (with Adagrad: DeferAndFuse makes Adam
    capturable, whose bias corrections on the device round otherwise)."""
    monkeypatch.setenv("TORCH_TPU_DEFER_COMPILE", "off")
    strict = Trainer(small(steps=6, dense_optimizer="adagrad"))
    strict.run()
    with torch_tpu.eager_mode("defer_and_fuse"):
        deferred = Trainer(small(steps=6, dense_optimizer="adagrad"))
        deferred.run()
    assert deferred.pipeline is not None
    assert deferred.losses == strict.losses
    assert_same_tree(deferred.model.state_dict(), strict.model.state_dict())


def test_losses_follow_the_loss_of_the_model_on_the_batches():
    # Step 1's loss is the BCE of the freshly built model on the first batch of epoch 0, computed here by hand.
    cfg = small(steps=1, precision="highest")
    trainer = Trainer(cfg)
    trainer.train_loader.set_epoch(0)
    first = next(iter(trainer.train_loader))
    with torch.no_grad():
        p = torch.sigmoid(trainer.model(first.dense.to("tpu"), first.sparse).squeeze(-1).cpu().double())
    y = first.labels.double()
    expected = float(-(y * torch.log(p) + (1 - y) * torch.log1p(-p)).mean())
    trainer.run()
    assert trainer.losses == [pytest.approx(expected, rel=1e-5)]


# ---------------------------------------------------------------- checkpoints and resume


@pytest.mark.parametrize("embedding_optimizer, split, total, resume_workers", [
    ("adam", 15, 30, 0),
    ("rowwise_adagrad", 33, 40, 1),  # resumes in the second epoch (31 batches each), with a loader process
], ids=["adam", "rowwise_adagrad_second_epoch"])
def test_resume_continues_the_exact_run(tmp_path, embedding_optimizer, split, total, resume_workers):
    cfg = small(embedding_optimizer=embedding_optimizer, embedding_lr=0.05, checkpoint_interval=1000)
    a = Trainer(dataclasses.replace(cfg, steps=total, checkpoint_dir=str(tmp_path / "a")))
    a.run()
    b1 = Trainer(dataclasses.replace(cfg, steps=split, checkpoint_dir=str(tmp_path / "b")))
    b1.run()
    assert checkpoint.load(tmp_path / "b" / checkpoint.FILENAME)["step"] == split
    b2 = Trainer(dataclasses.replace(cfg, steps=total, checkpoint_dir=str(tmp_path / "b"), resume=True,
                                     num_workers=resume_workers))
    assert b2.step == split
    b2.run()
    assert b1.losses == a.losses[:split]
    assert len(b2.losses) == total - split
    np.testing.assert_allclose(b2.losses, a.losses[split:], rtol=1e-6, atol=0)

    state_a, state_b = a.model.state_dict(), b2.model.state_dict()
    assert any(k.endswith("embedding_bags.t_cat_0.weight") for k in state_a)
    assert_same_tree(state_a, state_b, "model")
    assert_same_tree(a.ebc.fused_optimizer.state_dict(), b2.ebc.fused_optimizer.state_dict(), "fused_optimizer")
    assert_same_tree(a.dense_opt.state_dict()["state"], b2.dense_opt.state_dict()["state"], "dense_optimizer")
    # Not trivially equal: training moved the tables and filled the optimizer state.
    fresh = build_model(cfg, a.data, torch.device("tpu")).state_dict()
    key = "sparse_arch.embedding_bag_collection.embedding_bags.t_cat_0.weight"
    assert not torch.equal(fresh[key].cpu(), state_a[key].cpu())
    # The last checkpoints of both runs hold the same model.
    ca, cb = (checkpoint.load(tmp_path / d / checkpoint.FILENAME) for d in "ab")
    assert ca["step"] == cb["step"] == total
    assert_same_tree(ca["model"], cb["model"], "checkpoint.model")


def test_resume_restores_the_optimizer_step_counts(tmp_path):
    # Adam's bias correction depends on the step count: a resumed run must not restart it at 0.
    cfg = small(embedding_optimizer="adam", checkpoint_dir=str(tmp_path), steps=4)
    first = Trainer(cfg)
    first.run()
    saved = first.ebc.fused_optimizer.state_dict()
    resumed = Trainer(dataclasses.replace(cfg, resume=True, steps=8))
    assert_same_tree(resumed.ebc.fused_optimizer.state_dict(), saved)
    assert_same_tree(resumed.dense_opt.state_dict()["state"], first.dense_opt.state_dict()["state"])
    steps = [v for k, v in _flatten(saved).items() if k.endswith(".step")]
    assert steps and all(int(torch.as_tensor(s).reshape(-1)[0]) == 4 for s in steps)


def _flatten(tree, prefix=""):
    out = {}
    if isinstance(tree, dict):
        for k, v in tree.items():
            out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
    else:
        out[prefix] = tree
    return out


@pytest.fixture(scope="module")
def saved_checkpoint(tmp_path_factory):
    """A checkpoint of a 3-step run, and its config."""
    directory = tmp_path_factory.mktemp("ckpt")
    cfg = small(steps=3, checkpoint_dir=str(directory))
    Trainer(cfg).run()
    return cfg, directory / checkpoint.FILENAME


def test_truncated_checkpoint_is_refused(saved_checkpoint, tmp_path):
    _, good = saved_checkpoint
    bad = tmp_path / checkpoint.FILENAME
    data = good.read_bytes()
    bad.write_bytes(data[: len(data) // 2])
    with pytest.raises(checkpoint.CheckpointError, match=re.escape(str(bad))) as info:
        checkpoint.load(bad)
    assert "truncated or corrupt" in str(info.value)


def test_garbage_checkpoint_is_refused(tmp_path):
    bad = tmp_path / checkpoint.FILENAME
    bad.write_bytes(os.urandom(4096))
    with pytest.raises(checkpoint.CheckpointError, match=re.escape(str(bad))):
        checkpoint.load(bad)


def test_foreign_checkpoint_is_refused(tmp_path):
    bad = tmp_path / checkpoint.FILENAME
    torch.save({"step": 3, "model": {"w": torch.zeros(2)}}, bad)
    with pytest.raises(checkpoint.CheckpointError, match=re.escape(str(bad))) as info:
        checkpoint.load(bad)
    assert checkpoint.FORMAT in str(info.value)
    torch.save([1, 2, 3], bad)
    with pytest.raises(checkpoint.CheckpointError, match=re.escape(checkpoint.FORMAT)):
        checkpoint.load(bad)


def test_missing_checkpoint_is_refused(tmp_path):
    with pytest.raises(checkpoint.CheckpointError, match="no checkpoint"):
        Trainer(small(checkpoint_dir=str(tmp_path / "empty"), resume=True))


def test_corrupt_checkpoint_stops_a_resume(saved_checkpoint, tmp_path):
    cfg, good = saved_checkpoint
    (tmp_path / checkpoint.FILENAME).write_bytes(good.read_bytes()[:1000])
    with pytest.raises(checkpoint.CheckpointError, match=re.escape(str(tmp_path / checkpoint.FILENAME))):
        Trainer(dataclasses.replace(cfg, checkpoint_dir=str(tmp_path), resume=True))


def test_a_checkpoint_lacking_an_entry_stops_a_resume(saved_checkpoint, tmp_path):
    """A checkpoint of the right format without, say, its dense optimizer's state is refused by
    name before anything is loaded (it raised a KeyError after loading the model)."""
    cfg, good = saved_checkpoint
    payload = torch.load(good, weights_only=True)
    del payload["dense_optimizer"]
    torch.save(payload, tmp_path / checkpoint.FILENAME)
    with pytest.raises(checkpoint.CheckpointError, match="lacks dense_optimizer"):
        Trainer(dataclasses.replace(cfg, checkpoint_dir=str(tmp_path), resume=True))


@pytest.mark.parametrize("change", [
    {"embedding_dim": 16, "dense_arch": (16, 16)},
    {"embedding_lr": 0.1},
    {"model": "dcn"},
], ids=["embedding_dim", "embedding_lr", "model"])
def test_resume_with_other_settings_is_refused(saved_checkpoint, change):
    cfg, path = saved_checkpoint
    with pytest.raises(checkpoint.CheckpointError) as info:
        Trainer(dataclasses.replace(cfg, resume=True, steps=6, **change))
    message = str(info.value)
    assert str(path) in message
    for setting in change:
        assert setting in message
    # Bookkeeping settings may change: this one resumes.
    resumed = Trainer(dataclasses.replace(cfg, resume=True, steps=6, eval_interval=2, checkpoint_interval=7))
    assert resumed.step == 3


@pytest.mark.parametrize("fail", ["os.replace", "os.fsync", "torch.save"])
def test_save_is_atomic(tmp_path, monkeypatch, fail):
    path = tmp_path / checkpoint.FILENAME
    checkpoint.save(path, {"step": 1, "model": {"w": torch.arange(4.0)}})
    before = path.read_bytes()

    def crash(*args, **kwargs):
        raise OSError("simulated crash")

    module, name = fail.split(".")
    monkeypatch.setattr({"os": os, "torch": torch}[module], name, crash)
    with pytest.raises(OSError, match="simulated crash"):
        checkpoint.save(path, {"step": 2, "model": {"w": torch.zeros(4)}})
    monkeypatch.undo()
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == [checkpoint.FILENAME]
    loaded = checkpoint.load(path)
    assert loaded["step"] == 1 and torch.equal(loaded["model"]["w"], torch.arange(4.0))
    # And a save that goes through replaces it.
    checkpoint.save(path, {"step": 2})
    assert checkpoint.load(path)["step"] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == [checkpoint.FILENAME]


def test_save_writes_tpu_tensors_readable_on_the_host(tmp_path):
    path = tmp_path / "sub" / checkpoint.FILENAME  # the directory is created
    weight = torch.randn(3, 4, device="tpu")
    checkpoint.save(path, {"step": 5, "model": {"w": weight}})
    loaded = checkpoint.load(path)
    assert loaded["format"] == checkpoint.FORMAT and loaded["step"] == 5
    assert loaded["model"]["w"].device.type == "cpu"
    assert torch.equal(loaded["model"]["w"], weight.cpu())


def test_sharded_checkpoint_meta_survives_a_crashed_swap(tmp_path):
    """save_sharded moves the old directory aside before renaming the new one in: a crash
    between the two leaves only the old one, which a resume still finds."""
    path = tmp_path / checkpoint.SHARDED_DIRNAME
    with pytest.raises(checkpoint.CheckpointError, match="no sharded checkpoint"):
        checkpoint.sharded_meta(path)
    aside = tmp_path / f".{checkpoint.SHARDED_DIRNAME}.old"
    aside.mkdir()
    (aside / checkpoint.META_FILENAME).write_text(json.dumps({"format": checkpoint.FORMAT, "step": 7}))
    assert checkpoint.sharded_meta(path)["step"] == 7
    path.mkdir()
    (path / checkpoint.META_FILENAME).write_text("{not json")
    with pytest.raises(checkpoint.CheckpointError, match="not readable"):
        checkpoint.sharded_meta(path)


# ---------------------------------------------------------------- observed SparseCore limits


def test_run_saves_observed_limits_that_seed_the_next_run(tmp_path):
    first = Trainer(small(steps=6, eval_batches=2, metrics_file=str(tmp_path / "a" / "metrics.jsonl")))
    summary = first.run()
    path = tmp_path / "a" / LIMITS_FILENAME
    saved = json.loads(path.read_text())
    assert saved["tables"] == summary["observed_limits"] == first.ebc.observed_limits()
    assert set(saved["tables"]) == {f"t_{n}" for n in schema.SPARSE_NAMES}
    assert all(v["max_ids_per_partition"] >= v["max_unique_ids_per_partition"] > 0 for v in saved["tables"].values())
    # Seeded at exactly the observed maxima, the same run fits, and trains the same.
    again = Trainer(small(steps=6, eval_batches=2, limits=str(path), limits_headroom=1.0))
    for t in again.ebc._configs:
        assert t.max_ids_per_partition == saved["tables"][t.name]["max_ids_per_partition"]
    again.run()
    assert again.losses == first.losses
    # Below them, the first batch that needs more says so.
    tight = {"format": saved["format"], "tables": {t: {k: max(1, v // 2) for k, v in seen.items()}
                                                   for t, seen in saved["tables"].items()}}
    (tmp_path / "tight.json").write_text(json.dumps(tight))
    with pytest.raises(PartitionLimitError, match="max_ids_per_partition|max_unique_ids_per_partition"):
        Trainer(small(steps=2, limits=str(tmp_path / "tight.json"), limits_headroom=1.0)).run()
    (tmp_path / "junk.json").write_text("{}")
    with pytest.raises(ValueError, match="not a torch_tpu.sparsecore-limits.v1 file"):
        Trainer(small(steps=2, limits=str(tmp_path / "junk.json")))


# ---------------------------------------------------------------- metrics


def test_metrics_file_and_validation_auc(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    cfg = small(steps=20, eval_interval=10, metrics_file=str(metrics), precision="highest")
    trainer = Trainer(cfg)
    summary = trainer.run()
    entries = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [e["step"] for e in entries] == [10, 20]
    for e in entries:
        assert set(e) == {"step", "train_loss", "samples_per_s", "val_auc", "val_log_loss"}
        assert e["samples_per_s"] > 0 and 0.5 < e["val_auc"] < 1 and 0 < e["val_log_loss"] < 1
    assert entries[0]["train_loss"] == pytest.approx(np.mean(trainer.losses[:10]), rel=1e-9)
    assert entries[1]["train_loss"] == pytest.approx(np.mean(trainer.losses[10:]), rel=1e-9)
    assert summary["val_auc"] == entries[1]["val_auc"]

    # The final entry, recomputed independently from the model's predictions on the validation split.
    scores, labels = [], []
    trainer.model.eval()
    with torch.no_grad(), torch.tpu.precision("highest"):
        for batch in trainer.val_loader:
            scores.append(trainer.model(batch.dense.to("tpu"), batch.sparse).squeeze(-1).cpu())
            labels.append(batch.labels)
    logits, labels = torch.cat(scores), torch.cat(labels)
    assert len(labels) == 4096  # the whole split: 8 batches
    assert entries[1]["val_auc"] == pytest.approx(hand_auc(logits, labels), abs=1e-4)
    assert entries[1]["val_auc"] == pytest.approx(float(binary_auroc(torch.sigmoid(logits), labels.long())), abs=1e-5)
    p = torch.sigmoid(logits.double())
    log_loss = float(-(labels * torch.log(p) + (1 - labels) * torch.log1p(-p)).mean())
    assert entries[1]["val_log_loss"] == pytest.approx(log_loss, rel=1e-5)
    with torch.tpu.precision("highest"):
        again = evaluate(trainer.model, trainer.val_loader, torch.device("tpu"))
    assert again["samples"] == 4096 and again["auc"] == pytest.approx(entries[1]["val_auc"], abs=1e-6)

    # The step-10 entry is what a 10-step run validates to.
    ten = Trainer(dataclasses.replace(cfg, steps=10, metrics_file=str(tmp_path / "ten.jsonl")))
    ten_summary = ten.run()
    assert ten_summary["val_auc"] == pytest.approx(entries[0]["val_auc"], abs=1e-6)
    assert ten_summary["val_log_loss"] == pytest.approx(entries[0]["val_log_loss"], rel=1e-6)


def test_metrics_default_to_the_checkpoint_dir_and_eval_batches_limit(tmp_path):
    cfg = small(steps=2, checkpoint_dir=str(tmp_path), eval_batches=2)
    trainer = Trainer(cfg)
    calls = []
    real = trainer.validate

    def counting():
        result = real()
        calls.append(result)
        return result

    trainer.validate = counting
    trainer.run()
    entries = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [e["step"] for e in entries] == [2]
    assert [c["samples"] for c in calls] == [2 * 512]


def test_evaluate_restores_training_mode_and_refuses_no_batches():
    model = torch.nn.Linear(2, 1)
    model.train()
    with pytest.raises(ValueError, match="no batches"):
        evaluate(model, [], torch.device("cpu"))
    assert model.training


# ---------------------------------------------------------------- Ctrl-C


@pytest.mark.timeout(120)
@pytest.mark.parametrize("workers, to_group", [(0, False), (1, True)], ids=["process", "terminal_with_loader_worker"])
def test_ctrl_c_finishes_the_step_and_writes_a_checkpoint(tmp_path, workers, to_group):
    # to_group: as a terminal's Ctrl-C, SIGINT goes to the whole process group, the loader process included.
    args = ["--scale", "1e-5", "--num-samples", "400000", "--val-samples", "4096", "--batch-size", "512",
            "--embedding-dim", "8", "--dense-arch", "16,8", "--over-arch", "16,1", "--num-workers", str(workers),
            "--no-progress", "--eval-interval", "0", "--checkpoint-dir", str(tmp_path / "ckpt"),
            "--checkpoint-interval", "10"]
    stdout, stderr = tmp_path / "stdout", tmp_path / "stderr"
    with open(stdout, "w") as out, open(stderr, "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "models.train", *args], cwd=REPO, stdout=out, stderr=err,
                                start_new_session=True)
        try:
            deadline = time.monotonic() + 90
            # Trained a bit: the periodic checkpoint (every 10 steps) is there.
            while not (tmp_path / "ckpt" / checkpoint.FILENAME).exists():
                assert proc.poll() is None, f"the run ended early:\n{stderr.read_text()}"
                assert time.monotonic() < deadline, f"no progress:\n{stderr.read_text()}"
                time.sleep(0.1)
            if to_group:
                os.killpg(proc.pid, signal.SIGINT)
            else:
                proc.send_signal(signal.SIGINT)
            code = proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    output, log = stdout.read_text(), stderr.read_text()
    assert code == 0, log
    assert "Traceback" not in log
    assert "interrupt" in log
    match = re.search(r"interrupted at step (\d+); resume with --resume", output)
    assert match, output
    step = int(match.group(1))
    assert 10 <= step < 773  # well before the epoch's end (773 batches)
    assert f"{step} steps" in output
    saved = checkpoint.load(tmp_path / "ckpt" / checkpoint.FILENAME)
    assert saved["step"] == step
    assert not [p for p in (tmp_path / "ckpt").iterdir() if ".tmp" in p.name]
    # The command line resumes it where it stopped.
    cfg = parse_args([*args, "--resume", "--steps", str(step + 2), "--num-workers", "0"])
    resumed = Trainer(cfg)
    assert resumed.step == step
    assert_same_tree({k: v.cpu() for k, v in resumed.model.state_dict().items()}, saved["model"])
    summary = resumed.run()
    assert summary["steps"] == step + 2 and len(resumed.losses) == 2


# ---------------------------------------------------------------- command line


def test_cli_defaults_are_the_config_defaults():
    assert parse_args([]) == TrainConfig()
    cfg = parse_args(["--embedding-dim", "8", "--model", "dcn", "--steps", "7", "--no-progress", "--over-arch", "32,1"])
    assert cfg.dense_arch == (64, 8) and cfg.model == "dcn" and cfg.steps == 7 and not cfg.progress
    assert cfg.over_arch == (32, 1)


@pytest.mark.parametrize("argv", [
    ["--model", "nope"],
    ["--dense-arch", "a,b"],
    ["--embedding-dim", "8", "--dense-arch", "16,4"],
    ["--resume"],
    ["--precision", "low"],
])
def test_cli_argument_errors_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    assert "error:" in capsys.readouterr().err


def test_cli_missing_data_exits_2_with_a_clear_message(capsys):
    assert main(["--data", "/nonexistent", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "error:" in err and "/nonexistent" in err and "not found" in err


@pytest.mark.parametrize("argv, message", [
    (["--data", "synthetic:nope"], "unknown preset"),
    (["--num-samples", "1000", "--val-samples", "1000"], "val_samples"),
])
def test_cli_bad_data_settings_exit_2(argv, message, capsys):
    assert main([*argv, "--no-progress"]) == 2
    assert message in capsys.readouterr().err


def test_cli_resume_without_a_checkpoint_exits_2(tmp_path, capsys):
    argv = [*_small_argv(), "--checkpoint-dir", str(tmp_path), "--resume"]
    assert main(argv) == 2
    assert f"no checkpoint at {tmp_path / checkpoint.FILENAME}" in capsys.readouterr().err


@pytest.mark.timeout(60)
def test_cli_logs_checkpoints_and_resumes(tmp_path):
    argv = [sys.executable, "-m", "models.train", *_small_argv(), "--checkpoint-dir", str(tmp_path)]
    run = subprocess.run([*argv, "--steps", "2", "--num-workers", "1"], cwd=REPO, capture_output=True, text=True,
                         timeout=50)
    assert run.returncode == 0, run.stderr
    assert checkpoint.load(tmp_path / checkpoint.FILENAME)["step"] == 2
    assert f"checkpoint at step 2: {tmp_path / checkpoint.FILENAME}" in run.stderr
    # Nothing but the run's own lines, from this process or its loader worker: no torch.fx notice.
    assert "is_fx_tracing" not in run.stderr, run.stderr


def test_cli_trains_and_reports(tmp_path, capsys):
    assert main([*_small_argv(), "--steps", "3", "--checkpoint-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert re.search(r"final validation AUC 0\.\d{4} \(teacher, the best reachable: 0\.\d{4}\)", out), out
    assert "3 steps" in out and "peak tpu memory" in out and "interrupted" not in out
    assert checkpoint.load(tmp_path / checkpoint.FILENAME)["step"] == 3


def test_loader_workers_default_to_one_on_a_free_core(monkeypatch):
    from models import train as train_module

    assert train_module.loader_workers(3) == 3 and train_module.loader_workers(0) == 0  # asked for: as asked
    monkeypatch.setattr(torch, "get_num_threads", lambda: 4)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.setattr(train_module, "host_cores", lambda: 8)
    assert train_module.loader_workers(None) == 1  # 4 training threads leave 4 of 8 cores free
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert train_module.loader_workers(None) == 0  # 2 ranks x 4 threads fill the 8 cores
    monkeypatch.setattr(train_module, "host_cores", lambda: 9)
    assert train_module.loader_workers(None) == 1


def _small_argv():
    return ["--scale", "1e-5", "--num-samples", "20000", "--val-samples", "4096", "--batch-size", "512",
            "--embedding-dim", "8", "--dense-arch", "16,8", "--over-arch", "16,1", "--num-workers", "0",
            "--no-progress", "--eval-interval", "0"]


# ---------------------------------------------------------------- the planted signal


@pytest.mark.timeout(180)
def test_default_training_recovers_the_planted_signal():
    summary = train(TrainConfig(steps=500, eval_interval=0, num_workers=1, progress=False))
    teacher = summary["teacher_auc"]
    assert 0.75 < teacher < 0.95
    assert summary["steps"] == 500 and not summary["interrupted"]
    assert summary["val_auc"] >= teacher - 0.02, (summary["val_auc"], teacher)
    assert summary["val_auc"] <= teacher + 0.005  # the teacher is the ceiling
    assert summary["train_seconds"] < 60
    assert math.isfinite(summary["val_log_loss"])
