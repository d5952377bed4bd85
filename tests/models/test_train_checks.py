"""models.train: out-of-range settings refused up front, nothing lost to a failing validation,
validation AUC (ties, saturated logits, one class) over the whole split, observed limits kept
across a resume.

Small runs, as tests/models/test_train.py (tables at 1e-5 of Criteo Kaggle, batch 512, dim 8).
"""

import dataclasses
import json

import numpy as np
import pytest
import torch

from data.loader import Batch, BatchLoader
from models import checkpoint
from models.evaluation import evaluate
from models.train import LIMITS_FILENAME, RowRange, TrainConfig, Trainer, build_data, main

SMALL = dict(scale=1e-5, num_samples=20_000, val_samples=4096, batch_size=512, embedding_dim=8, dense_arch=(16, 8),
             over_arch=(16, 1), num_workers=0, progress=False, eval_interval=0)


def small(**overrides) -> TrainConfig:
    return TrainConfig(**{**SMALL, **overrides})


def small_argv() -> list[str]:
    return ["--scale", "1e-5", "--num-samples", "20000", "--val-samples", "4096", "--batch-size", "512",
            "--embedding-dim", "8", "--dense-arch", "16,8", "--over-arch", "16,1", "--num-workers", "0",
            "--no-progress", "--eval-interval", "0"]


def mann_whitney(logits: list[float], labels: list[float]) -> float:
    """By hand, in float64: P(positive's logit > negative's) + 0.5 P(tie), over all pairs."""
    pairs = [(p, n) for p, yp in zip(logits, labels) if yp == 1 for n, yn in zip(logits, labels) if yn == 0]
    return sum(1.0 if p > n else 0.5 if p == n else 0.0 for p, n in pairs) / len(pairs)


class FixedLogits(torch.nn.Module):
    """Returns the logits of the rows whose indices its dense input carries."""

    def __init__(self, logits: list[float]) -> None:
        super().__init__()
        self.logits = torch.tensor(logits, dtype=torch.float32)

    def forward(self, dense: torch.Tensor, sparse) -> torch.Tensor:  # noqa: ARG002
        return self.logits[dense[:, 0].long()].unsqueeze(-1)


def evaluate_fixed(logits: list[float], labels: list[float], batch_size: int = 3) -> dict:
    rows = torch.arange(len(labels)).float()[:, None]
    y = torch.tensor(labels, dtype=torch.float32)
    batches = [Batch(dense=rows[i:i + batch_size], sparse=None, labels=y[i:i + batch_size])
               for i in range(0, len(labels), batch_size)]
    return evaluate(FixedLogits(logits), batches, torch.device("cpu"))


# ---------------------------------------------------------------- settings refused up front


@pytest.mark.parametrize("setting, value", [
    ("checkpoint_interval", 0), ("checkpoint_interval", -5), ("eval_interval", -1), ("eval_batches", 0),
    ("eval_batches", -2), ("dcn_rank", 0), ("dcn_layers", 0), ("batch_size", 0), ("steps", -1), ("epochs", -1),
    ("num_workers", -1),
])
def test_config_refuses_out_of_range_counts(setting, value):
    with pytest.raises(ValueError, match=rf"{setting} {value}: expected an integer >= \d"):
        small(**{setting: value})


@pytest.mark.parametrize("setting, value, message", [
    ("scale", float("inf"), "scale inf: expected a finite factor > 0"),
    ("scale", float("nan"), "scale nan: expected a finite factor > 0"),
    ("seed", -1, r"seed -1: expected an integer in \[0, 2\*\*32\)"),
    ("seed", 2**64, "seed 18446744073709551616: expected an integer in"),
    ("limits_headroom", float("nan"), "limits_headroom nan: expected a finite factor >= 1.0"),
    ("limits_headroom", 0.5, "limits_headroom 0.5: expected a finite factor >= 1.0"),
])
def test_config_refuses_unusable_factors_and_seeds(setting, value, message):
    """Refused by name up front: an infinite scale or a seed numpy cannot take failed deep in
    the data's construction (OverflowError tracebacks), a NaN headroom in a cast."""
    with pytest.raises(ValueError, match=message):
        small(**{setting: value})


def test_config_keeps_zero_where_it_means_off():
    assert small(eval_interval=0).eval_interval == 0  # validate only at the end
    assert small(steps=0, eval_batches=None).steps == 0


@pytest.mark.parametrize("device", ["bogus", "meta", "cuda"])
def test_config_refuses_devices_it_cannot_train_on(device):
    with pytest.raises(ValueError, match=f"device '{device}': expected 'tpu' or 'cpu'"):
        small(device=device)


@pytest.mark.parametrize("argv, message", [
    (["--checkpoint-interval", "0"], "checkpoint_interval 0: expected an integer >= 1"),
    (["--eval-interval", "-3"], "eval_interval -3: expected an integer >= 0"),
    (["--eval-batches", "0"], "eval_batches 0: expected an integer >= 1"),
    (["--model", "dcn", "--dcn-rank", "0"], "dcn_rank 0: expected an integer >= 1"),
    (["--device", "bogus"], "device 'bogus': expected 'tpu' or 'cpu'"),
    (["--device", "meta"], "device 'meta': expected 'tpu' or 'cpu'"),
], ids=["checkpoint_interval", "eval_interval", "eval_batches", "dcn_rank", "device_bogus", "device_meta"])
def test_cli_out_of_range_flags_exit_2_with_a_clear_message(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        main([*small_argv(), "--steps", "1", *argv])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "error:" in err and message in err and "Traceback" not in err


# ---------------------------------------------------------------- nothing lost


def test_a_failing_final_validation_keeps_the_final_checkpoint(tmp_path):
    trainer = Trainer(small(steps=3, checkpoint_dir=str(tmp_path), checkpoint_interval=1000))

    def failing() -> dict:
        raise ValueError("validation failed")

    trainer.validate = failing
    with pytest.raises(ValueError, match="validation failed"):
        trainer.run()
    assert checkpoint.load(tmp_path / checkpoint.FILENAME)["step"] == 3


# ---------------------------------------------------------------- validation AUC


def test_auc_of_saturated_logits_with_ties_is_the_mann_whitney_statistic():
    # float32 sigmoid makes every logit above ~17 exactly 1.0; the model still ranks them.
    logits = [17.0, 18.0, 20.0, 25.0, 30.0, 40.0, 20.0, 25.0, -3.0, 0.5, 0.5]
    labels = [0, 0, 1, 0, 1, 1, 0, 1, 0, 1, 0]
    auc = evaluate_fixed(logits, labels)["auc"]
    assert auc == pytest.approx(mann_whitney(logits, labels), abs=1e-12)
    assert bool((torch.sigmoid(torch.tensor(logits[:8])) == 1.0).all())  # what float32 probabilities would tie
    rng = np.random.default_rng(0)
    z = rng.normal(0, 3, 400).round(1)  # rounded: many ties
    y = (rng.random(400) < 1 / (1 + np.exp(-z))).astype(float)
    assert evaluate_fixed(z.tolist(), y.tolist(), 64)["auc"] == pytest.approx(mann_whitney(z.tolist(), y.tolist()),
                                                                              abs=1e-12)


@pytest.mark.parametrize("label", [0.0, 1.0])
def test_auc_of_one_class_is_undefined(label):
    metrics = evaluate_fixed([0.1, 0.2, 0.3, 0.4], [label] * 4)
    assert metrics["auc"] is None and metrics["samples"] == 4 and metrics["log_loss"] > 0


def test_one_class_validation_is_reported_undefined_in_valid_json(tmp_path, capsys):
    argv = ["--num-samples", "2048", "--val-samples", "512", "--batch-size", "4", "--num-workers", "0", "--no-progress",
            "--eval-batches", "1", "--steps", "2", "--embedding-dim", "8", "--dense-arch", "16,8", "--over-arch", "16,1",
            "--checkpoint-dir", str(tmp_path)]
    cfg = TrainConfig(num_samples=2048, val_samples=512)
    first = build_data(cfg).val.rows(0, 4).labels
    assert len(set(first.tolist())) == 1  # the one batch validated holds one class
    assert main(argv) == 0
    assert "final validation AUC undefined: the validation labels are all one class" in capsys.readouterr().out
    entries = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [e["val_auc"] for e in entries] == [None]
    assert checkpoint.load(tmp_path / checkpoint.FILENAME)["step"] == 2


def test_validation_covers_the_whole_split_with_a_partial_last_batch():
    trainer = Trainer(small(val_samples=4096 + 100, steps=1))
    assert len(trainer.data.val) == 4196
    assert trainer.validate()["samples"] == 4196
    assert len(trainer.train_loader) == (20_000 - 4196) // 512  # training batches stay whole


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_loader_without_drop_last_gives_the_ranks_equal_slices_of_the_split(world_size):
    # The last partial batch keeps the largest multiple of the world size: equal slices, so the
    # ranks' results gather (1003 rows: 235 in the last batch; at 2 and 4 ranks 234 and 232).
    val = RowRange(build_data(small()).val, 0, 1000 + 3)
    per_rank = [list(BatchLoader(val, 256, shuffle=False, rank=r, world_size=world_size, drop_last=False))
                for r in range(world_size)]
    assert all(len(batches) == 4 for batches in per_rank)
    kept = 768 + 235 - 235 % world_size
    got = np.concatenate([b.labels.numpy() for i in range(4) for batches in per_rank for b in [batches[i]]])
    np.testing.assert_array_equal(got, val.rows(0, kept).labels)
    assert [len(per_rank[r][3]) for r in range(world_size)] == [235 // world_size] * world_size


def test_a_last_batch_smaller_than_the_world_is_dropped():
    val = RowRange(build_data(small()).val, 0, 512 + 1)
    loaders = [BatchLoader(val, 256, shuffle=False, rank=r, world_size=2, drop_last=False) for r in range(2)]
    assert [len(loader) for loader in loaders] == [2, 2]  # no rank gets an empty slice
    assert len(BatchLoader(val, 256, shuffle=False, drop_last=False)) == 3


# ---------------------------------------------------------------- observed limits across a resume


def test_resume_keeps_the_runs_observed_limits(tmp_path):
    cfg = small(checkpoint_interval=1000, eval_batches=1)
    Trainer(dataclasses.replace(cfg, steps=8, checkpoint_dir=str(tmp_path / "a"))).run()
    Trainer(dataclasses.replace(cfg, steps=5, checkpoint_dir=str(tmp_path / "b"))).run()
    path = tmp_path / "b" / LIMITS_FILENAME
    first = json.loads(path.read_text())["tables"]
    # Resumed with no steps left: the file still holds the first part's maxima (not zeros).
    Trainer(dataclasses.replace(cfg, steps=5, checkpoint_dir=str(tmp_path / "b"), resume=True)).run()
    assert json.loads(path.read_text())["tables"] == first
    # Resumed to the end: the maxima over the whole run, as the uninterrupted run's.
    Trainer(dataclasses.replace(cfg, steps=8, checkpoint_dir=str(tmp_path / "b"), resume=True)).run()
    assert json.loads(path.read_text())["tables"] == json.loads((tmp_path / "a" / LIMITS_FILENAME).read_text())["tables"]


def test_a_limits_file_without_its_tables_is_named(tmp_path):
    from models.train import LIMITS_FORMAT, read_limits

    path = tmp_path / "limits.json"
    path.write_text(json.dumps({"format": LIMITS_FORMAT, "world_size": 1}))
    with pytest.raises(ValueError, match=r'--limits .*limits.json: expected "tables"'):
        read_limits(path)


@pytest.mark.parametrize("seen, message", [
    ({"max_ids_per_partition": 4}, "has max_unique_ids_per_partition None; expected a count >= 0"),
    ({"max_ids_per_partition": "x", "max_unique_ids_per_partition": 2}, "has max_ids_per_partition 'x'"),
    ({"max_ids_per_partition": -3, "max_unique_ids_per_partition": 2}, "has max_ids_per_partition -3"),
])
def test_a_limits_files_bad_counts_are_named(tmp_path, seen, message):
    from models.train import LIMITS_FORMAT, read_limits

    path = tmp_path / "limits.json"
    path.write_text(json.dumps({"format": LIMITS_FORMAT, "tables": {"t_cat_0": seen}}))
    with pytest.raises(ValueError, match=rf"--limits .*limits.json: table 't_cat_0' {message}"):
        read_limits(path)


def test_tables_past_the_devices_memory_end_with_its_message_not_a_traceback(capsys):
    assert main([*small_argv(), "--steps", "1", "--scale", "100000"]) == 2
    err = capsys.readouterr().err
    assert "error: tpu:0 out of memory" in err and "--scale" in err and "Traceback" not in err
