"""OpInfo conformance of a representative op subset: tpu against CPU.

Each op's OpInfo samples (float32, bfloat16, int64 where supported on CPU)
must give the CPU results on tpu, and for float32 the same gradients. The
full op_db sweep is ``python -m benchmarks.op_coverage``.
"""

from __future__ import annotations

import pytest
import torch

from benchmarks import opinfo as harness

# ~40 ops across the categories: elementwise, reductions, matmul, shape and
# view, indexing, nn.functional.
OPS = [
    # elementwise binary
    "add", "mul", "div", "sub", "pow", "where", "masked_fill", "clamp",
    # elementwise unary
    "exp", "log", "sin", "abs", "neg", "sigmoid", "tanh", "nn.functional.relu",
    # reductions and scans
    "sum", "mean", "amax", "argmax", "cumsum",
    # matmul
    "matmul", "mm", "bmm", "addmm",
    # shape / view
    "cat", "stack", "reshape", "transpose", "permute",
    # indexing, sorting
    "index_select", "gather", "scatter", "sort", "topk",
    # nn.functional
    "nn.functional.linear", "nn.functional.conv2d", "nn.functional.layer_norm",
    "nn.functional.softmax", "nn.functional.cross_entropy", "nn.functional.embedding",
    "nn.functional.embedding_bag",
]


@pytest.mark.parametrize("op_name", OPS)
def test_opinfo_matches_cpu(op_name: str) -> None:
    # Every sample: the whole file takes about 10 s on 2 cores.
    results = harness.run([op_name])
    assert not results.excluded, f"{op_name} is excluded: {results.excluded}"
    assert results.ops, f"no OpInfo ran for {op_name}"
    problems = [msg for r in results.ops.values() for msg in harness.failures(r)]
    assert not problems, "\n".join(problems)
    forward = sum(r.forward.total for r in results.ops.values())
    assert forward > 0, f"{op_name}: no sample was compared"
    for r in results.ops.values():
        if "float32" in r.dtypes and harness.resolve_ops([r.name])[0].supports_autograd:
            assert r.dtypes["float32"].backward.total > 0, f"{r.name}: no gradient was compared"


def test_harness_detects_a_mismatch() -> None:
    """The comparison is not vacuous: bf16-rounded matmul operands differ from CPU fp32."""
    results = harness.run(["mm"], dtypes=(torch.float32,), backward=False, matmul_precision="medium")
    assert results.ops["mm"].forward.failed > 0


def test_exclusions_are_justified() -> None:
    for name, reason in harness.EXCLUDED.items():
        assert reason and len(reason) > 10, name
    # The subset above must not lose any op to an exclusion.
    for op in harness.resolve_ops(OPS):
        assert harness.exclusion_reason(op) is None, harness.full_name(op)
