"""Batched matmuls of small matrices on tpu (torch_tpu/csrc/TpuSmallBmm.cpp), at medium and highest
precision, against float64 references: DLRM's Gram shapes, every edge of the register blocks,
strided and broadcast operands, and the shapes just past "small" that take the general path."""

import pytest
import torch


def mxu_operand(t: torch.Tensor) -> torch.Tensor:
    """What the MXU multiplies at medium precision: fp32 subnormals flushed, then bf16 (ties to even)."""
    flushed = torch.where(t.abs() < torch.finfo(torch.float32).tiny, torch.zeros_like(t), t)
    return flushed.to(torch.bfloat16).float()


def reference(a: torch.Tensor, b: torch.Tensor, precision: str) -> torch.Tensor:
    if precision == "medium":
        a, b = mxu_operand(a), mxu_operand(b)
    return torch.bmm(a.double(), b.double()).float()


def tpu_bmm(a: torch.Tensor, b: torch.Tensor, precision: str) -> torch.Tensor:
    with torch.tpu.precision(precision):
        return torch.bmm(a.to("tpu"), b.to("tpu")).cpu()


# Register blocks are up to 4 rows x 3 vectors of 8 columns; the shapes below reach every
# block<rows, vectors> the kernel has (rows = m mod 4 at the edge, vectors = what is left of n).
SHAPES = [  # batch, m, k, n
    (1024, 27, 64, 27),  # DLRM's Gram matrix (26 features + the dense one, dim 64): blocks 4x3, 3x3, 4x1, 3x1
    (1024, 27, 27, 64),  # its backward, (g + g^T) @ x: 4x3, 3x3, 4x2, 3x2
    (1, 1, 1, 1),  # 1x1
    (3, 5, 3, 9),  # 4x2, 1x2: a partial vector
    (2, 9, 4, 24),  # 4x3, 1x3: exactly one block wide
    (3, 6, 5, 40),  # 4x3, 2x3, 4x2, 2x2
    (2, 6, 4, 30),  # 2x3, 2x1 with 6 of 8 columns stored
    (2, 2, 7, 17),  # 2x3 with one column of the last vector stored
    (4, 8, 1, 24),  # depth 1
    (2, 64, 512, 128),  # the largest "small" shape
    (2, 65, 16, 8),  # past it: the general path
    (2, 4, 513, 8),
]

SMALL = [shape for shape in SHAPES if shape[1] <= 64 and shape[2] <= 512 and shape[3] <= 128]


@pytest.mark.parametrize("precision", ["highest", "medium"])
@pytest.mark.parametrize("batch, m, k, n", SHAPES)
def test_bmm_matches_the_float64_reference(precision, batch, m, k, n):
    g = torch.Generator().manual_seed(batch * 7919 + m * 101 + k * 11 + n)
    a, b = torch.randn(batch, m, k, generator=g), torch.randn(batch, k, n, generator=g)
    got = tpu_bmm(a, b, precision)
    # fp32 accumulation of k products against an exact sum.
    torch.testing.assert_close(got, reference(a, b, precision), atol=2e-6 * k ** 0.5, rtol=1e-5)


@pytest.mark.parametrize("round_operands", [False, True])
@pytest.mark.parametrize("batch, m, k, n", SMALL)
def test_the_kernel_alone_matches_the_float64_reference(round_operands, batch, m, k, n):
    g = torch.Generator().manual_seed(batch + m + k + n)
    a, b = torch.randn(batch, m, k, generator=g), torch.randn(batch, k, n, generator=g)
    got = torch.ops.torch_tpu._small_bmm(a, b, round_operands)
    expected = reference(a, b, "medium" if round_operands else "highest")
    torch.testing.assert_close(got, expected, atol=2e-6 * k ** 0.5, rtol=1e-5)


@pytest.mark.parametrize("precision", ["highest", "medium"])
def test_tpu_bmm_of_small_matrices_runs_no_cpu_bmm(precision):
    # Its results can match MKL's bit for bit (both sum k in order at these sizes), so the path
    # shows in the profile instead: the kernel only allocates its output, where the general
    # path runs ATen's CPU bmm on the host views (its resolve_conj calls). The general path is
    # profiled at highest: at medium, a CPU with AVX512-BF16 or AMX takes every shape to its bf16
    # GEMM (oneDNN's, on AMX, allocates its rounded operands).
    x = torch.randn(256, 27, 64, device="tpu")
    with torch.tpu.precision(precision), torch.profiler.profile() as small:
        torch.bmm(x, x.transpose(1, 2))
    big = torch.randn(2, 65, 16, device="tpu")
    with torch.tpu.precision("highest"), torch.profiler.profile() as general:
        torch.bmm(big, big.transpose(1, 2))
    allocation_only = {"aten::transpose", "aten::as_strided", "aten::bmm", "aten::empty", "aten::empty_like",
                       "aten::empty_strided"}
    assert {e.name for e in small.events()} <= allocation_only
    assert sum(e.name == "aten::bmm" for e in small.events()) == 1
    assert not {e.name for e in general.events()} <= allocation_only
    with pytest.raises(RuntimeError, match="does not take a"):
        torch.ops.torch_tpu._small_bmm(big.cpu(), big.cpu().transpose(1, 2), False)


@pytest.mark.parametrize("precision", ["highest", "medium"])
def test_gram_of_strided_and_broadcast_operands(precision):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(64, 27, 80, generator=g)
    with torch.tpu.precision(precision):
        xt = x.to("tpu")[:, :, 8:72]  # rows 80 apart on the device: not contiguous
        x = x[:, :, 8:72]
        gram = torch.bmm(xt, xt.transpose(1, 2)).cpu()  # b reads x down its columns
        shared = torch.bmm(xt, xt[0].t().expand(64, -1, -1)).cpu()  # b with batch stride 0
        columns = torch.bmm(xt.transpose(1, 2)[:, ::2], xt[:, :, :13]).cpu()  # a strided both ways
    torch.testing.assert_close(gram, reference(x, x.transpose(1, 2), precision), atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(shared, reference(x, x[0].t().expand(64, -1, -1), precision), atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(columns, reference(x.transpose(1, 2)[:, ::2], x[:, :, :13], precision),
                               atol=1e-5, rtol=1e-5)
    assert torch.equal(gram, gram.transpose(1, 2))  # each entry is one dot product, in k order


def test_medium_rounds_each_operand_as_the_mxu_does():
    # Times an identity, medium returns its operand exactly as the MXU sees it: ties to even,
    # large values kept, subnormals flushed; through a, through b, and through a transposed b.
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 27, 64, generator=g) * 1e3
    x[0, 0, :4] = torch.tensor([3.38e38, 1e-40, -2.5e-39, 1.00390625])  # the last is a tie: rounds to 1.0
    eye64, eye27 = torch.eye(64).expand(2, -1, -1), torch.eye(27).expand(2, -1, -1)
    expected = mxu_operand(x)
    for got in (tpu_bmm(x, eye64, "medium"), tpu_bmm(eye27, x, "medium"),
                tpu_bmm(eye64, x.transpose(1, 2), "medium").transpose(1, 2)):
        assert torch.equal(got, expected)
    assert tpu_bmm(x, eye64, "medium")[0, 0, 3] == 1.0


@pytest.mark.parametrize("precision", ["highest", "medium"])
def test_non_finite_operands_give_what_the_reference_gives(precision):
    g = torch.Generator().manual_seed(2)
    a, b = torch.randn(4, 27, 64, generator=g), torch.randn(4, 64, 27, generator=g)
    a[1, 3, 5], a[2, 0, 0], b[3, 7, 2] = float("inf"), float("nan"), float("-inf")
    got = tpu_bmm(a, b, precision)
    torch.testing.assert_close(got, reference(a, b, precision), atol=1e-5, rtol=1e-5, equal_nan=True)
    assert got[2, 0].isnan().all() and got[1, 3].isinf().all()


def test_dot_interaction_trains_as_on_cpu():
    # The Gram matrix and its backward (DLRM's interaction) on tpu against CPU fp32.
    from models.dlrm import DotInteraction

    g = torch.Generator().manual_seed(5)
    dense, sparse = torch.randn(256, 64, generator=g), torch.randn(256, 26, 64, generator=g)
    grads = []
    for device in ("cpu", "tpu"):
        d, s = (t.detach().to(device).requires_grad_() for t in (dense, sparse))
        with torch.tpu.precision("highest"):
            out = DotInteraction(26).to(device)(d, s)
            out.square().sum().backward()
        grads.append((out.detach().cpu(), d.grad.cpu(), s.grad.cpu()))
    for cpu, tpu in zip(*grads):
        torch.testing.assert_close(tpu, cpu, atol=1e-4, rtol=1e-5)
