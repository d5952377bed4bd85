"""DLRM's dot interaction: the fused tpu op against TorchRec's InteractionArch on CPU.

``python -m benchmarks.interaction [--batches 1024,2048,8192] [--rounds 7]``

The interaction of 26 sparse features and the dense one, dim 64 (the DLRM of
benchmarks.dlrm), forward alone and forward + backward (the input gradients
for a fixed output gradient), same inputs for every side:

  torchrec   torchrec.models.dlrm.InteractionArch on CPU, fp32 (the anchor)
  unfused    models.dlrm.DotInteraction.unfused on tpu: concatenation, Gram
             matrix by batched matmul, one flat gather, concatenation
  fused      models.dlrm.DotInteraction on tpu: torch_tpu.interaction's op,
             one kernel each way

both tpu sides at medium (bf16 MXU operands) and highest precision. Timing:
warm-up, then rounds with the sides interleaved; the best round's mean per
call is reported, with the ratios to TorchRec and to the unfused form.
"""

from __future__ import annotations

import argparse
import contextlib
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from torchrec.models.dlrm import InteractionArch

from benchmarks import report
from models.dlrm import DotInteraction

FEATURES = 26
DIM = 64


def make_inputs(batch: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(batch)
    dense, sparse = torch.randn(batch, DIM, generator=g), torch.randn(batch, FEATURES, DIM, generator=g)
    return dense, sparse, torch.randn(batch, DIM + (FEATURES + 1) * FEATURES // 2, generator=g)


def side(fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], inputs, device: str,
         precision: str | None) -> dict[str, Callable[[], None]]:
    """The side's forward and forward + backward calls, on its device, at its precision."""
    dense, sparse, grad = (t.to(device) for t in inputs)
    dense.requires_grad_()
    sparse.requires_grad_()
    scope = (lambda: torch.tpu.precision(precision)) if precision else contextlib.nullcontext

    def forward() -> None:
        with scope(), torch.no_grad():
            fn(dense, sparse)
        torch.tpu.synchronize()

    def train() -> None:
        with scope():
            torch.autograd.grad(fn(dense, sparse), (dense, sparse), grad)
        torch.tpu.synchronize()

    return {"forward": forward, "forward_backward": train}


def best_ms(calls: dict[str, dict[str, Callable[[], None]]], rounds: int, per_round: int) -> dict[tuple, float]:
    for sides in calls.values():
        for call in sides.values():
            for _ in range(2):
                call()
    best: dict[tuple, float] = {}
    for _ in range(rounds):
        for name, sides in calls.items():
            for phase, call in sides.items():
                start = time.perf_counter()
                for _ in range(per_round):
                    call()
                ms = (time.perf_counter() - start) / per_round * 1e3
                best[name, phase] = min(best.get((name, phase), float("inf")), ms)
    return best


def measure(batch: int, rounds: int) -> list[dict]:
    inputs = make_inputs(batch)
    ours = DotInteraction(FEATURES).to("tpu")
    calls = {"torchrec cpu fp32": side(InteractionArch(FEATURES), inputs, "cpu", None)}
    for precision in ("medium", "highest"):
        calls[f"unfused tpu {precision}"] = side(ours.unfused, inputs, "tpu", precision)
        calls[f"fused tpu {precision}"] = side(ours, inputs, "tpu", precision)
    per_round = max(2, 16384 // batch)
    best = best_ms(calls, rounds, per_round)
    rows = []
    for name in calls:
        row = {"batch": batch, "side": name}
        for phase in ("forward", "forward_backward"):
            row[f"{phase}_ms"] = best[name, phase]
            row[f"{phase}_x_torchrec"] = best["torchrec cpu fp32", phase] / best[name, phase]
            if name.startswith("fused"):
                row[f"{phase}_x_unfused"] = best[name.replace("fused", "unfused"), phase] / best[name, phase]
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.interaction", description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", default="1024,2048,8192", help="comma-separated batch sizes")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--out", type=Path, default=report.DEFAULT_DIR)
    args = p.parse_args(argv)
    warnings.filterwarnings("ignore", message="tpu matmul precision")
    torch.set_float32_matmul_precision("highest")  # the CPU anchor at exact fp32
    rows = [row for batch in map(int, args.batches.split(",")) for row in measure(batch, args.rounds)]
    columns = ["batch", "side", "forward_ms", "forward_x_torchrec", "forward_x_unfused", "forward_backward_ms",
               "forward_backward_x_torchrec", "forward_backward_x_unfused"]
    table = (f"{FEATURES} sparse features + the dense one, dim {DIM}; best of {args.rounds} interleaved rounds; "
             f"{torch.get_num_threads()} threads\n\n" + report.markdown_table(rows, columns))
    print(table)
    json_path, md_path = report.write("interaction", {"rounds": args.rounds, "rows": rows}, table, out_dir=args.out)
    print(f"wrote {json_path}, {md_path}")


if __name__ == "__main__":
    main()
