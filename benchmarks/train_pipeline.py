"""The exact ``sparsecore.TrainPipeline`` against the plain loop on the default DLRM.

``python -m benchmarks.train_pipeline [--steps 40] [--rounds 6]``

The default DLRM is ``models.train``'s job with its defaults, the one ``make
demo`` runs: one process, the synthetic Criteo-like data, its loader and
SparseCore preprocessing, a ``.item()`` of the loss every step. Two
``models.train.Trainer`` are built in the same process, one per loop
(``--pipeline none`` and ``exact``), and their rounds of ``--steps`` training
steps are interleaved (A B B A ...), so both meet the same machine drift; a
round ends in ``torch.tpu.synchronize()``, so what a pipeline left queued
counts. Same thread counts for both. Reported: ms per step of each loop's
best round, the ratio (target: the exact pipeline >= 1.15x the plain loop),
and one more traced round of the pipeline: its wall time against the sum of
its stages' times on the training loop and the SparseCore executor (the
overlap), plotted over its first steps.

``benchmarks.dlrm_distributed`` measures the same ratio for sharded
embeddings at 1 and 2 processes.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from benchmarks import report
from benchmarks.dlrm_distributed import plot_traces
from models.train import TrainConfig, Trainer
from sparsecore.executor import executor_for
from sparsecore.trace import StageTrace

TARGET = 1.15
LOOPS = ("none", "exact")  # TrainConfig.pipeline values: the plain loop, the exact pipeline


class Loop:
    """One Trainer, its batches cycling over epochs."""

    def __init__(self, pipeline: str) -> None:
        self.name = "pipeline" if pipeline == "exact" else "plain"
        self.trainer = Trainer(TrainConfig(pipeline=pipeline, progress=False))
        self.batches = self._batches()
        self.rounds: list[float] = []

    def _batches(self) -> Iterator[Any]:
        for _ in itertools.count():
            yield from self.trainer.train_loader

    def steps(self, n: int) -> float:
        """Seconds of n training steps, queued work included."""
        start = time.perf_counter()
        for _ in range(n):
            self.trainer.train_step(self.batches)
        torch.tpu.synchronize()
        return time.perf_counter() - start

    def close(self) -> None:
        if self.trainer.pipeline is not None:
            self.trainer.pipeline.close()


def traced_round(loop: Loop, steps: int) -> dict[str, Any]:
    """One round of the pipeline with its stages traced: wall time against the sum of the stages."""
    trace = StageTrace()
    loop.trainer.pipeline.trace = trace
    executor_for(loop.trainer.device).trace = trace
    wall = loop.steps(steps)
    loop.trainer.pipeline.trace = None
    executor_for(loop.trainer.device).trace = None
    return trace.summary(timeline=True) | {"round_wall_s": wall, "steps": steps}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=40, help="training steps per timed round")
    p.add_argument("--rounds", type=int, default=6, help="timed rounds per loop, interleaved")
    p.add_argument("--warmup", type=int, default=20, help="warm-up steps per loop")
    p.add_argument("--out", type=Path, default=report.DEFAULT_DIR)
    args = p.parse_args(argv)
    started = time.perf_counter()
    loops = [Loop(pipeline) for pipeline in LOOPS]
    for loop in loops:
        loop.steps(args.warmup)
    gc.collect()
    gc.disable()  # a collection inside a round would land on one loop only
    try:
        for r in range(args.rounds):
            for loop in (loops if r % 2 == 0 else loops[::-1]):
                loop.rounds.append(loop.steps(args.steps))
                print(f"round {r}: {loop.name} {loop.rounds[-1] / args.steps * 1e3:.2f} ms/step", flush=True)
    finally:
        gc.enable()
    plain, pipelined = loops
    trace = traced_round(pipelined, args.steps)
    ratio = min(plain.rounds) / min(pipelined.rounds)
    pairs = [a / b for a, b in zip(plain.rounds, pipelined.rounds)]
    rows = [{"loop": loop.name, "ms_per_step": min(loop.rounds) / args.steps * 1e3,
             "rounds_ms_per_step": [round(t / args.steps * 1e3, 2) for t in loop.rounds],
             "samples_per_s": loop.trainer.cfg.batch_size * args.steps / min(loop.rounds)} for loop in loops]
    rows[1]["x_plain_loop"] = ratio
    for loop in loops:
        loop.close()
    overlap = trace["sum_of_stages_s"] / trace["wall_s"]
    lines = [report.markdown_table(rows, ["loop", "ms_per_step", "samples_per_s", "x_plain_loop",
                                          "rounds_ms_per_step"]), "",
             f"- target exact pipeline >= {TARGET}x the plain loop: {ratio:.2f}x (best round against best round; "
             f"round by round {min(pairs):.2f}-{max(pairs):.2f}x): {'met' if ratio >= TARGET else 'NOT met'}",
             f"- traced pipeline round: stages {overlap:.2f}x the wall time ({trace['sum_of_stages_s'] * 1e3:.0f} ms "
             f"of stages in {trace['wall_s'] * 1e3:.0f} ms)",
             f"- batch {loops[0].trainer.cfg.batch_size}, {args.steps} steps a round, {args.rounds} rounds, "
             f"{torch.get_num_threads()} intra-op threads; wall time {time.perf_counter() - started:.0f} s"]
    table = "\n".join(lines)
    print(table)
    payload = {"rows": rows, "ratio": ratio, "round_ratios": pairs, "target": TARGET, "trace": trace,
               "settings": vars(args) | {"out": str(args.out)}}
    json_path, md_path = report.write("train_pipeline", payload, table, args.out)
    print(f"wrote {json_path}, {md_path}")
    plot_traces([{"trace": trace, "world": 1, "sharding": "default DLRM (unsharded)", "x_plain_loop": ratio}],
                args.out / "train_pipeline.png")
    return payload


if __name__ == "__main__":
    main()
