"""Eager modes and compiled graphs on tpu against plain CPU, one process.

``python -m benchmarks.eager_modes`` times a training step (forward, backward,
AdamW) of three workloads, all at exact fp32 (tpu "highest", CPU "highest"):

(a) the DLRM dense step at batch 2048: bottom MLP 13-512-256-64, dot
    interaction with 26 embedded features (given, requiring grad), top MLP
    512-256-1, BCE loss;
(b) a small-op-bound step: 4 x [Linear(256), LayerNorm, GELU] at batch 256;
(c) a transformer block: d=512, 8 heads, seq 128, batch 16.

Every variant steps the same AdamW, as the user wrote it (host step count).
Under DeferAndFuse its bias corrections are new scalars every step, so the
step's graph never recurs: DeferAndFuse replays it, then chooses between
recording and running the step eagerly by measurement
(torch_tpu.defer_segments).

Variants: plain CPU eager (the anchor), CPU ``torch.compile`` (Inductor),
tpu Strict, tpu Debug, tpu ``torch.compile(backend="tpu")`` (Inductor on tpu,
the compiler DeferAndFuse shares), tpu DeferAndFuse (after its graphs have
compiled and chosen compiled or op by op). The compiled variants compile the
model and the optimizer step.
Reported: ms/step (the best of interleaved rounds' medians), ratio to CPU
eager and to Strict (also as the median of per-round ratios, ``paired_ratio``),
peak tpu memory over a step. Then each workload's GEMM floor (benchmarks.roofline): its
matmul FLOPs at this host's measured fp32 GEMM speed, and Strict's time over it, the most
any mode could win. Then cold vs warm start of the tpu-compiled step in fresh
processes (empty caches, then the compile cache filled by the first run).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from benchmarks import report, roofline
from torch_tpu.defer_segments import Segments
from torch_tpu.inductor import ChoosingRunner
from torch_tpu.timed_choice import TimedChoice


@dataclass(frozen=True)
class Workload:
    name: str
    build: Callable[[], tuple[nn.Module, tuple[torch.Tensor, ...]]] | None = None
    # A workload whose step is more than a model, its inputs and one optimizer
    # (benchmarks.compile's DLRM step) builds its own step; default: make_step.
    make_step: Callable[[Workload, str], tuple[Callable[[], None], str]] | None = None


class DenseStep(nn.Module):
    """DLRM without its embedding lookup: the dense arch, dot interaction and over arch."""

    def __init__(self, features: int = 26, dim: int = 64) -> None:
        super().__init__()
        from models.dlrm import DotInteraction

        self.bottom = nn.Sequential(nn.Linear(13, 512), nn.ReLU(), nn.Linear(512, 256), nn.ReLU(),
                                    nn.Linear(256, dim), nn.ReLU())
        self.interaction = DotInteraction(features)
        pairs = (features + 1) * features // 2
        self.top = nn.Sequential(nn.Linear(dim + pairs, 512), nn.ReLU(), nn.Linear(512, 256), nn.ReLU(),
                                 nn.Linear(256, 1))

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.top(self.interaction(self.bottom(dense), sparse)).squeeze(1)
        return nn.functional.binary_cross_entropy_with_logits(logits, labels)


class Regression(nn.Module):
    def __init__(self, body: nn.Module) -> None:
        super().__init__()
        self.body = body

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(self.body(x), y)


def dlrm_dense() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    batch = 2048
    return DenseStep(), (torch.randn(batch, 13), torch.randn(batch, 26, 64).requires_grad_(),
                         torch.randint(0, 2, (batch,)).float())


def small_ops() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    layers: list[nn.Module] = []
    for _ in range(4):
        layers += [nn.Linear(256, 256), nn.LayerNorm(256), nn.GELU()]
    return Regression(nn.Sequential(*layers)), (torch.randn(256, 256), torch.randn(256, 256))


def transformer() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    block = nn.TransformerEncoderLayer(d_model=512, nhead=8, dim_feedforward=2048, dropout=0.0, batch_first=True)
    return Regression(block), (torch.randn(16, 128, 512), torch.randn(16, 128, 512))


WORKLOADS = {w.name: w for w in [Workload("dlrm_dense_2048", dlrm_dense), Workload("small_ops_256", small_ops),
                                 Workload("transformer_block", transformer)]}
VARIANTS = ["cpu eager", "cpu compiled", "tpu strict", "tpu debug", "tpu defer_and_fuse", "tpu compiled"]
MODES = {"tpu debug": "debug", "tpu defer_and_fuse": "defer_and_fuse"}


def make_step(workload: Workload, variant: str) -> tuple[Callable[[], None], str]:
    torch.manual_seed(0)
    model, inputs = workload.build()
    device = "tpu" if variant.startswith("tpu") else "cpu"
    model = model.to(device)
    inputs = tuple(t.detach().to(device).requires_grad_(t.requires_grad) for t in inputs)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    forward, update = model, optimizer.step
    if variant.endswith("compiled"):
        backend = "tpu" if device == "tpu" else "inductor"
        forward = torch.compile(model, backend=backend)
        update = torch.compile(optimizer.step, backend=backend)

    def step() -> None:
        loss = forward(*inputs)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        update()

    return step, device


class Variant:
    """One variant's step, warmed up, timed in rounds interleaved with the others'."""

    def __init__(self, workload: Workload, name: str, warmup: int) -> None:
        import torch_tpu

        self.workload, self.name = workload, name
        self.step, self.device = (workload.make_step or make_step)(workload, name)
        self.mode = lambda: torch_tpu.eager_mode(MODES.get(name, "strict"))
        self.times: list[float] = []
        self.peak_mib: float | None = None
        with self.mode():
            for _ in range(warmup):
                self._step()
            if name == "tpu defer_and_fuse":
                # The graphs compiled in the background meanwhile; each then
                # measures compiled against op by op and keeps one.
                from torch_tpu import defer

                defer.engine().graphs.wait_for_compiles()
                for _ in range(ChoosingRunner.CALLS_TO_CHOOSE):
                    self._step()
                # Then each segment (a step) measures itself recorded against run eagerly.
                for _ in range(Segments.MIN_SETTLED_RUNS + TimedChoice.CALLS_TO_CHOOSE):
                    self._step()
                defer.reset_stats()

    def _step(self) -> None:
        self.step()
        if self.device == "tpu":
            torch.tpu.synchronize()

    def time_round(self, steps: int) -> float:
        """The median ms/step of one round (peak tpu memory over a step recorded)."""
        with self.mode():
            if self.device == "tpu":
                base = torch.tpu.memory_allocated()
                torch.tpu.reset_peak_memory_stats()
            times = []
            for _ in range(steps):
                start = time.perf_counter()
                self._step()
                times.append((time.perf_counter() - start) * 1e3)
            if self.device == "tpu":
                self.peak_mib = (torch.tpu.max_memory_allocated() - base) / 2**20
        self.times.append(statistics.median(times))
        return self.times[-1]

    def row(self, steps: int) -> dict:
        row = {"workload": self.workload.name, "variant": self.name, "ms_per_step": min(self.times),
               "rounds_ms": [round(t, 2) for t in self.times], "peak_tpu_mib_over_resident": self.peak_mib}
        if self.name == "tpu defer_and_fuse":
            from torch_tpu import defer

            s = defer.stats()
            timed = steps * len(self.times)
            row.update(graphs_per_step=s.graphs / timed, ops_per_graph=s.ops_per_graph(),
                       compiled_share=s.compiled_runs / max(s.graphs, 1),
                       eager_share=s.eager_share(),
                       not_recorded=dict(s.not_recorded))
        return row


COLD_WARM = r"""
import json, time, torch
from benchmarks.eager_modes import WORKLOADS, exact_fp32, make_step
exact_fp32()
step, _ = make_step(WORKLOADS["small_ops_256"], "tpu compiled")
start = time.perf_counter()
step(); torch.tpu.synchronize()
print(json.dumps({"first_step_s": time.perf_counter() - start, "cache": torch.tpu.compile_cache_stats()}))
"""


def cold_and_warm_start() -> list[dict]:
    """First-step time of the compiled small-op step in fresh processes: caches empty, then warm."""
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, TORCH_TPU_LOCAL_CACHE_DIR=os.path.join(tmp, "tpu"),
                   TORCHINDUCTOR_CACHE_DIR=os.path.join(tmp, "inductor"), PYTHONWARNINGS="ignore")
        env.pop("TORCH_TPU_CACHE_DIR", None)
        for start in ("cold", "warm"):
            out = subprocess.run([sys.executable, "-c", COLD_WARM], env=env, capture_output=True, text=True,
                                 timeout=600, check=True).stdout
            result = json.loads(out.strip().splitlines()[-1])
            cache = result["cache"]
            rows.append({"start": start, "first_step_s": result["first_step_s"],
                         "graphs_compiled": cache["local"]["misses"], "local_hits": cache["local"]["hits"]})
    return rows


def paired_ratio(anchor_rounds: list[float], rounds: list[float]) -> float:
    """The median over rounds of anchor ms / this ms, each pair from the same round.

    The best round of each side is the figure of record; this is its check on a host
    whose speed drifts (a shared VM: a round can be 1.5x slower than the one before it
    for every variant alike). A pair shares the host's state of the moment, so drift
    cancels; what noise remains pulls the ratio towards 1, so it errs low."""
    return statistics.median(a / b for a, b in zip(anchor_rounds, rounds, strict=True))


def measure(workload: Workload, variants: list[str], steps: int, rounds: int, warmup: int) -> list[dict]:
    """One row per variant (rounds interleaved), with its ratios to CPU eager, to Strict and
    to CPU Inductor when those were measured too."""
    timed = [Variant(workload, v, warmup) for v in variants]
    for _ in range(rounds):
        for v in timed:
            v.time_round(steps)
    results = {v.name: v.row(steps) for v in timed}
    rounds_ms = {v.name: v.times for v in timed}  # unrounded, for the paired ratio
    del timed  # the next workload's models need the memory
    for name, r in results.items():
        print(json.dumps(r), flush=True)
        if "cpu eager" in results:
            r["cpu_eager_over_this"] = results["cpu eager"]["ms_per_step"] / r["ms_per_step"]
        if "tpu strict" in results:
            r["speedup_vs_strict"] = results["tpu strict"]["ms_per_step"] / r["ms_per_step"]
            r["speedup_vs_strict_paired"] = paired_ratio(rounds_ms["tpu strict"], rounds_ms[name])
        if "cpu compiled" in results:  # the other way round: <= 1.1 is benchmarks.compile's target
            r["over_cpu_inductor"] = r["ms_per_step"] / results["cpu compiled"]["ms_per_step"]
    return list(results.values())


def find(rows: list[dict], workload: str, variant: str) -> dict | None:
    """The row of ``variant`` on ``workload``, if measured."""
    return next((r for r in rows if r["workload"] == workload and r["variant"] == variant), None)


def gemm_floors(workloads: list[Workload], rows: list[dict]) -> list[dict]:
    """Per workload, the time its matmul FLOPs take at this host's GEMM peak, beside Strict's
    ms/step from ``rows`` (benchmarks.roofline): no mode can beat Strict by more than that
    ratio. FLOPs are counted on a CPU step of the same model, once."""
    peak = roofline.gemm_peak_gflops()
    floors = []
    for w in workloads:
        step, _ = (w.make_step or make_step)(w, "cpu eager")
        strict = find(rows, w.name, "tpu strict")
        floors.append(roofline.floor_row(w.name, roofline.step_flops(step), peak,
                                         None if strict is None else strict["ms_per_step"]))
    return floors


def gemm_floor_section(floors: list[dict]) -> str:
    """The GEMM floors as a headed markdown table."""
    columns = ["workload", "gflop_per_step", "gemm_peak_gflops", "gemm_floor_ms", "strict_ms", "max_speedup_vs_strict"]
    return ("GEMM floor (matmul FLOPs at this host's fp32 GEMM peak; no mode beats Strict by more):\n\n"
            + report.markdown_table(floors, columns))


def timing_arguments(description: str, workloads: list[str], variants: list[str]) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--workloads", default=",".join(workloads))
    p.add_argument("--variants", default=",".join(variants))
    p.add_argument("--steps", type=int, default=10, help="timed steps per round")
    p.add_argument("--rounds", type=int, default=3, help="rounds, variants interleaved; the best round counts")
    p.add_argument("--warmup", type=int, default=10)
    return p


def exact_fp32() -> None:
    """Every variant at exact fp32: CPU and tpu matmuls at "highest"."""
    warnings.filterwarnings("ignore", message="tpu matmul precision")
    torch.set_float32_matmul_precision("highest")
    torch.tpu.set_float32_matmul_precision("highest")


def main(argv: list[str] | None = None) -> None:
    p = timing_arguments(__doc__.split("\n\n")[0], list(WORKLOADS), VARIANTS)
    p.add_argument("--skip-cold-start", action="store_true")
    args = p.parse_args(argv)
    exact_fp32()

    rows = []
    workloads = [WORKLOADS[name] for name in args.workloads.split(",")]
    for w in workloads:
        rows += measure(w, args.variants.split(","), args.steps, args.rounds, args.warmup)
    floors = gemm_floors(workloads, rows)
    columns = ["workload", "variant", "ms_per_step", "rounds_ms", "cpu_eager_over_this", "speedup_vs_strict",
               "speedup_vs_strict_paired", "peak_tpu_mib_over_resident", "graphs_per_step", "ops_per_graph",
               "compiled_share", "eager_share"]
    table = report.markdown_table(rows, columns)
    table += "\n\n" + gemm_floor_section(floors)
    starts = [] if args.skip_cold_start else cold_and_warm_start()
    if starts:
        table += "\n\nCold vs warm start (compiled small-op step, fresh processes):\n\n"
        table += report.markdown_table(starts, ["start", "first_step_s", "graphs_compiled", "local_hits"])
    print(table)
    report.write("eager_modes", {"steps": args.steps, "rows": rows, "gemm_floors": floors, "starts": starts}, table)


if __name__ == "__main__":
    main()
