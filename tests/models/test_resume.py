"""models.train --resume from a checkpoint that already holds the run's last step: the run trains
nothing and leaves the checkpoint as it is, but ends with the final validation of the restored
model, as the run that wrote it did; a checkpoint past the run's last step is refused.

Small runs, as tests/models/test_train.py (tables at 1e-5 of Criteo Kaggle, batch 512, dim 8).
"""

import dataclasses
import json
import re
from pathlib import Path

import pytest

from models import checkpoint
from models.train import TrainConfig, Trainer, main

SMALL = dict(scale=1e-5, num_samples=20_000, val_samples=4096, batch_size=512, embedding_dim=8, dense_arch=(16, 8),
             over_arch=(16, 1), num_workers=0, progress=False, eval_interval=0)
"""15,904 training rows: 31 batches an epoch."""

FINAL = re.compile(r"final validation AUC (\S+) .*, log loss (\S+)")


def small(**overrides) -> TrainConfig:
    return TrainConfig(**{**SMALL, **overrides})


def small_argv(directory: Path) -> list[str]:
    return ["--scale", "1e-5", "--num-samples", "20000", "--val-samples", "4096", "--batch-size", "512",
            "--embedding-dim", "8", "--dense-arch", "16,8", "--over-arch", "16,1", "--num-workers", "0",
            "--no-progress", "--eval-interval", "0", "--checkpoint-dir", str(directory)]


def metrics(directory: Path) -> list[dict]:
    return [json.loads(line) for line in (directory / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("length", [dict(steps=5), dict(steps=None, epochs=1)], ids=["steps", "epoch"])
@pytest.mark.parametrize("pipeline", ["exact", "none"])
def test_resuming_a_finished_run_reports_its_final_validation(tmp_path, length, pipeline):
    cfg = small(checkpoint_dir=str(tmp_path), checkpoint_interval=1000, pipeline=pipeline, **length)
    first = Trainer(cfg)
    reference = first.run()  # the run that wrote the checkpoint, validated in memory after its last step
    saved = tmp_path / checkpoint.FILENAME
    written, stamp = saved.read_bytes(), saved.stat().st_mtime_ns
    total = first.total_steps

    again = Trainer(dataclasses.replace(cfg, resume=True))  # the same command, run again
    assert again.step == total
    summary = again.run()

    assert again.losses == [] and summary["steps"] == total and not summary["interrupted"]
    # The restored model on the same split validates as the model that was saved.
    assert summary["val_auc"] == reference["val_auc"]
    assert summary["val_log_loss"] == reference["val_log_loss"]
    # The final entry is written as a normal run's (with no training figures: none trained here)...
    last = metrics(tmp_path)[-1]
    assert last == {"step": total, "train_loss": None, "samples_per_s": None, "val_auc": reference["val_auc"],
                    "val_log_loss": reference["val_log_loss"]}
    # ...and the checkpoint, which already held this state, is not rewritten.
    assert saved.read_bytes() == written and saved.stat().st_mtime_ns == stamp


def test_the_cli_prints_the_final_validation_when_resuming_a_finished_run(tmp_path, capsys):
    argv = [*small_argv(tmp_path), "--steps", "4"]
    assert main(argv) == 0
    reference = FINAL.search(capsys.readouterr().out)
    assert reference, "the first run printed no final validation"
    assert main([*argv, "--resume"]) == 0
    out = capsys.readouterr().out
    resumed = FINAL.search(out)
    assert resumed, f"the resumed run printed no final validation:\n{out}"
    assert resumed.groups() == reference.groups()
    assert "4 steps" in out
    assert [e["step"] for e in metrics(tmp_path)] == [4, 4]


def test_a_resume_with_steps_left_still_validates_once_at_its_end(tmp_path):
    cfg = small(checkpoint_dir=str(tmp_path), checkpoint_interval=1000)
    Trainer(dataclasses.replace(cfg, steps=3)).run()
    resumed = Trainer(dataclasses.replace(cfg, steps=5, resume=True))
    summary = resumed.run()
    assert len(resumed.losses) == 2 and summary["steps"] == 5
    assert [e["step"] for e in metrics(tmp_path)] == [3, 5]
    assert metrics(tmp_path)[-1]["train_loss"] is not None


def test_a_fresh_run_of_no_steps_neither_trains_nor_validates(tmp_path):
    summary = Trainer(small(steps=0, checkpoint_dir=str(tmp_path))).run()
    assert summary["steps"] == 0 and "val_auc" not in summary
    assert not (tmp_path / checkpoint.FILENAME).exists() and not (tmp_path / "metrics.jsonl").exists()


def test_a_checkpoint_past_the_runs_last_step_is_refused(tmp_path, capsys):
    cfg = small(checkpoint_dir=str(tmp_path), steps=5)
    Trainer(cfg).run()
    saved = tmp_path / checkpoint.FILENAME
    written = saved.read_bytes()
    with pytest.raises(checkpoint.CheckpointError) as info:
        Trainer(dataclasses.replace(cfg, steps=3, resume=True))
    message = str(info.value)
    assert str(saved) in message and "step 5" in message and "last step 3" in message and "--steps 5" in message
    # From the command line: exit 2 with the message, nothing trained or written.
    assert main([*small_argv(tmp_path), "--steps", "3", "--resume"]) == 2
    err = capsys.readouterr().err
    assert "error:" in err and "holds step 5, past this run's last step 3" in err
    assert saved.read_bytes() == written
    assert [e["step"] for e in metrics(tmp_path)] == [5]
