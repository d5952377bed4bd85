"""DLRM training throughput: our DLRM on tpu against TorchRec's on CPU.

``python -m benchmarks.dlrm [--batches 2048,16384] [--steps 10] [--skip-auc]``

Same process, same model config and the same batches for every side:
26 Criteo-Kaggle tables capped at 200,000 rows, dim 64, dense arch
512-256-64, over arch 512-256-1, embeddings trained with row-wise Adagrad and
the dense part with Adagrad (lr 0.01 both).

Sides:
  engine     models.dlrm.DLRM on tpu (SparseCore engine, fused optimizer),
             at the tpu default precision (medium: bf16 MXU) and at highest;
             host preprocessing of the KJT inside the timed step.
  torchrec   torchrec.models.dlrm.DLRM under DistributedModelParallel on CPU
             (world size 1, gloo; its planner picks FBGEMM's fused kernel with
             row-wise Adagrad applied in the backward), CPU at "highest".
  plain      the same TorchRec DLRM with plain nn.EmbeddingBag(sparse=True)
             tables trained by torch.optim.SparseAdam, on CPU.

Timing: after warm-up, sides alternate in rounds of --steps steps; the best
round per side is reported as samples/s. Targets: engine >= 1.5x torchrec at
medium and >= 1.1x at highest. The AUC check trains the default planted
DLRM (models.train) at medium and at highest and compares the final
validation AUCs (target: within 0.005). Peak memory: the tpu allocator's peak
for the engine, the process's peak RSS for the run.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import resource
import socket
import time
import warnings

import torch
import torch.distributed as dist
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
from torchrec.models import dlrm as torchrec_dlrm

import sparsecore
from benchmarks import report
from data import schema
from data.samples import Samples
from data.synthetic import SyntheticConfig, SyntheticCriteo
from models.dlrm import DLRM
from models.train import dense_parameters

ROW_CAP = 200_000
DIM = 64
DENSE_ARCH = [512, 256, DIM]
OVER_ARCH = [512, 256, 1]
LR = 0.01
TARGETS = {"medium": 1.5, "highest": 1.1}
AUC_TOLERANCE = 0.005


def batches(batch_size: int, count: int) -> tuple[list[tuple[torch.Tensor, object, torch.Tensor]], tuple[int, ...]]:
    """`count` batches of (dense, KJT, labels) and the table sizes they index."""
    source = SyntheticCriteo(SyntheticConfig(row_cap=ROW_CAP, num_samples=batch_size * count, seed=1))
    out = []
    for i in range(count):
        s: Samples = source.rows(i * batch_size, (i + 1) * batch_size)
        out.append((torch.from_numpy(s.dense), s.kjt(), torch.from_numpy(s.labels)))
    return out, source.table_sizes


def table_configs(sizes) -> list[EmbeddingBagConfig]:
    return [EmbeddingBagConfig(name=f"t_{f}", num_embeddings=n, embedding_dim=DIM, feature_names=[f])
            for f, n in zip(schema.SPARSE_NAMES, sizes)]


class EngineSide:
    def __init__(self, sizes, batch_size: int):
        limit = batch_size * schema.NUM_SPARSE  # the limits only check here
        tables = [sparsecore.SparseCoreEmbeddingConfig(config=c, max_ids_per_partition=limit,
                                                       max_unique_ids_per_partition=limit) for c in table_configs(sizes)]
        ebc = sparsecore.SparseCoreEmbeddingBagCollection(tables, sparsecore.optim.RowWiseAdagrad(lr=LR), device="tpu")
        self.model = DLRM(ebc, schema.NUM_DENSE, DENSE_ARCH, OVER_ARCH).to("tpu")
        self.opt = torch.optim.Adagrad(dense_parameters(self.model), lr=LR)

    def step(self, dense, kjt, labels) -> None:
        logits = self.model(dense.to("tpu"), kjt).squeeze(-1)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, labels.to("tpu"))
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()
        torch.tpu.synchronize()


class TorchRecSide:
    """TorchRec's DLRM under DistributedModelParallel on CPU (world size 1)."""

    def __init__(self, sizes):
        from torchrec.distributed import DistributedModelParallel
        from torchrec.optim import RowWiseAdagrad
        from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
        from torchrec.optim.keyed import KeyedOptimizerWrapper

        ebc = EmbeddingBagCollection(tables=table_configs(sizes), device=torch.device("meta"))
        model = torchrec_dlrm.DLRM(ebc, schema.NUM_DENSE, DENSE_ARCH, OVER_ARCH)
        apply_optimizer_in_backward(RowWiseAdagrad, model.sparse_arch.parameters(), {"lr": LR})
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.model = DistributedModelParallel(model, device=torch.device("cpu"))
        self.opt = KeyedOptimizerWrapper(dict(self.model.named_parameters()), lambda p: torch.optim.Adagrad(p, lr=LR))
        self.kernels = sorted({str(s.compute_kernel) for plan in self.model.plan.plan.values() for s in plan.values()})

    def step(self, dense, kjt, labels) -> None:
        logits = self.model(dense, kjt).squeeze(-1)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, labels)
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()


class PlainSide:
    """The same TorchRec DLRM with nn.EmbeddingBag(sparse=True) tables and SparseAdam."""

    def __init__(self, sizes):
        ebc = EmbeddingBagCollection(tables=table_configs(sizes))
        for name, bag in ebc.embedding_bags.items():
            ebc.embedding_bags[name] = torch.nn.EmbeddingBag(bag.num_embeddings, DIM, mode="sum", sparse=True,
                                                              include_last_offset=True)
        self.model = torchrec_dlrm.DLRM(ebc, schema.NUM_DENSE, DENSE_ARCH, OVER_ARCH)
        self.opts = [torch.optim.SparseAdam(list(ebc.parameters()), lr=LR),
                     torch.optim.Adagrad(dense_parameters(self.model), lr=LR)]

    def step(self, dense, kjt, labels) -> None:
        logits = self.model(dense, kjt).squeeze(-1)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, labels)
        for o in self.opts:
            o.zero_grad()
        loss.backward()
        for o in self.opts:
            o.step()


@contextlib.contextmanager
def process_group():
    """A one-rank gloo group on 127.0.0.1 for DistributedModelParallel."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def measure(sides: dict, data, steps: int, rounds: int, warmup: int) -> dict[str, float]:
    """Best samples/s per side over interleaved rounds of `steps` steps."""
    batch_size = len(data[0][2])
    for side in sides.values():
        for i in range(warmup):
            side(*data[i % len(data)])
    best = {name: 0.0 for name in sides}
    for r in range(rounds):
        for name, side in sides.items():
            start = time.perf_counter()
            for i in range(steps):
                side(*data[(r * steps + i) % len(data)])
            best[name] = max(best[name], steps * batch_size / (time.perf_counter() - start))
    return best


def precision_step(engine: EngineSide, precision: str):
    def run(dense, kjt, labels) -> None:
        with torch.tpu.precision(precision):
            engine.step(dense, kjt, labels)
    return run


def peak_rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def throughput(batch_size: int, steps: int, rounds: int, warmup: int) -> dict:
    data, sizes = batches(batch_size, max(steps, 4))
    engine = EngineSide(sizes, batch_size)
    torchrec_side = TorchRecSide(sizes)
    plain = PlainSide(sizes)
    torch.tpu.reset_peak_memory_stats()
    sides = {
        "engine_medium": precision_step(engine, "medium"),
        "engine_highest": precision_step(engine, "highest"),
        "torchrec": torchrec_side.step,
        "plain": plain.step,
    }
    rates = measure(sides, data, steps, rounds, warmup)
    row = {"batch": batch_size, **{f"{k}_samples_per_s": v for k, v in rates.items()}}
    for precision in TARGETS:
        ratio = rates[f"engine_{precision}"] / rates["torchrec"]
        row[f"x_torchrec_{precision}"] = ratio
        row[f"met_{precision}"] = "yes" if ratio >= TARGETS[precision] else "NO"
    row["x_plain_medium"] = rates["engine_medium"] / rates["plain"]
    row["engine_peak_tpu_gb"] = torch.tpu.max_memory_allocated() / 2**30
    row["process_peak_rss_gb"] = peak_rss_gb()
    row["torchrec_kernels"] = ",".join(torchrec_side.kernels)
    return row


def auc_check() -> dict:
    """The default planted DLRM trained at medium and at highest: final validation AUCs."""
    from models.train import TrainConfig, train

    out = {}
    for precision in ("medium", "highest"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            summary = train(TrainConfig(precision=precision, progress=False, eval_interval=0))
        out[precision] = {"val_auc": summary["val_auc"], "teacher_auc": summary["teacher_auc"],
                          "samples_per_s": summary["samples_per_s"]}
    out["auc_difference"] = abs(out["medium"]["val_auc"] - out["highest"]["val_auc"])
    out["met"] = out["auc_difference"] <= AUC_TOLERANCE
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.dlrm", description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", default="2048,16384", help="comma-separated batch sizes")
    p.add_argument("--steps", type=int, default=8, help="steps per timed round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--skip-auc", action="store_true", help="skip the medium-vs-highest AUC training runs")
    args = p.parse_args(argv)
    torch.set_float32_matmul_precision("highest")  # the CPU sides: exact fp32
    rows = []
    with process_group():
        for batch in (int(b) for b in args.batches.split(",")):
            steps = args.steps if batch <= 4096 else max(2, args.steps // 4)
            rows.append(throughput(batch, steps, args.rounds, args.warmup))
            r = rows[-1]
            print(f"batch {batch}: engine {r['engine_medium_samples_per_s']:,.0f} samples/s (medium), "
                  f"{r['engine_highest_samples_per_s']:,.0f} (highest); TorchRec DMP {r['torchrec_samples_per_s']:,.0f}; "
                  f"plain EmbeddingBag+SparseAdam {r['plain_samples_per_s']:,.0f}; "
                  f"x TorchRec {r['x_torchrec_medium']:.2f} (target {TARGETS['medium']}) / "
                  f"{r['x_torchrec_highest']:.2f} (target {TARGETS['highest']})", flush=True)
    auc = None if args.skip_auc else auc_check()
    if auc:
        print(f"planted AUC: medium {auc['medium']['val_auc']:.4f}, highest {auc['highest']['val_auc']:.4f} "
              f"(teacher {auc['medium']['teacher_auc']:.4f}); difference {auc['auc_difference']:.4f} "
              f"(target <= {AUC_TOLERANCE}: {'met' if auc['met'] else 'NOT met'})")
    columns = ["batch", "engine_medium_samples_per_s", "engine_highest_samples_per_s", "torchrec_samples_per_s",
               "plain_samples_per_s", "x_torchrec_medium", "met_medium", "x_torchrec_highest", "met_highest",
               "x_plain_medium", "engine_peak_tpu_gb", "process_peak_rss_gb"]
    header = (f"precision: engine tpu medium (bf16 MXU, fp32 accumulation) and highest (fp32); TorchRec and plain "
              f"sides CPU fp32 (torch matmul precision {torch.get_float32_matmul_precision()!r}); TorchRec kernels: "
              f"{rows[0]['torchrec_kernels']}\n\n")
    table = header + report.markdown_table(rows, columns)
    if auc:
        table += (f"\n\nplanted-data AUC (models.train defaults): medium {auc['medium']['val_auc']:.4f}, highest "
                  f"{auc['highest']['val_auc']:.4f}, difference {auc['auc_difference']:.4f} (target <= {AUC_TOLERANCE})")
    json_path, md_path = report.write("dlrm", {"rows": rows, "auc_check": auc, "targets": TARGETS}, table)
    print(f"wrote {json_path}, {md_path}")


if __name__ == "__main__":
    main()
