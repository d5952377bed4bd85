"""DLRM's dot interaction as one tpu op (torch_tpu/csrc/TpuDotInteraction.cpp): forward and
backward against float64 references at highest and medium precision (the MXU's bf16 operands),
on DLRM's shape, every edge of the kernel's 3x4 dot blocks, strided inputs and the shapes
past the fused kernel's limits (which take the unfused form); the fused path is the one a
DotInteraction on tpu runs, and it traces under torch.compile."""

import logging

import pytest
import torch

from models.dlrm import DotInteraction
from tests.test_small_bmm import mxu_operand
from torch_tpu.graph_ops import register_graph_op
from torch_tpu.interaction import dot_interaction


def reference(dense: torch.Tensor, sparse: torch.Tensor, precision: str) -> torch.Tensor:
    """[dense, <x_i, x_j> for i < j] in float64, from the operands the MXU multiplies."""
    x = torch.cat((dense.unsqueeze(1), sparse), dim=1)
    if precision == "medium":
        x = mxu_operand(x)
    x = x.double()
    rows, cols = torch.triu_indices(x.size(1), x.size(1), offset=1)
    return torch.cat((dense.double(), torch.bmm(x, x.transpose(1, 2))[:, rows, cols]), dim=1)


def reference_grads(grad: torch.Tensor, dense: torch.Tensor, sparse: torch.Tensor,
                    precision: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The backward by hand: (g + g^T) x with g the Gram matrix's gradient (its upper
    triangle), each operand as the MXU sees it; the dense gradient adds the pass-through."""
    batch, dim = dense.shape
    n = sparse.size(1) + 1
    rows, cols = torch.triu_indices(n, n, offset=1)
    g = torch.zeros(batch, n, n, dtype=torch.float64)
    g[:, rows, cols] = grad[:, dim:].double()
    s, x = g + g.transpose(1, 2), torch.cat((dense.unsqueeze(1), sparse), dim=1)
    if precision == "medium":
        s, x = mxu_operand(s.float()).double(), mxu_operand(x)
    dx = torch.bmm(s, x.double())
    return grad[:, :dim].double() + dx[:, 0], dx[:, 1:]


def inputs(batch: int, features: int, dim: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    dense, sparse = torch.randn(batch, dim, generator=g), torch.randn(batch, features, dim, generator=g)
    grad = torch.randn(batch, dim + (features + 1) * features // 2, generator=g)
    return dense, sparse, grad


def on_tpu(dense, sparse, grad, precision: str):
    d, s = (t.to("tpu").requires_grad_() for t in (dense, sparse))
    with torch.tpu.precision(precision):
        out = dot_interaction(d, s)
        out.backward(grad.to("tpu"))
    return out.detach().cpu(), d.grad.cpu(), s.grad.cpu()


# Dot blocks are 3 rows x 4 columns of the triangle; the shapes reach blocks of every size
# (rows 1..3 at the triangle's last rows, columns 1..4 at its right edge) and dims that are
# and are not multiples of 8 (packed rows are zero-padded to 8).
SHAPES = [  # batch, features (F: F + 1 vectors), dim
    (64, 26, 64),  # DLRM
    (5, 1, 8),  # one pair
    (3, 2, 1),
    (4, 5, 13),
    (3, 7, 24),
    (2, 11, 100),
    (2, 63, 32),  # 64 vectors: the fused kernel's most
    (2, 4, 512),  # its widest
]


@pytest.mark.parametrize("precision", ["highest", "medium"])
@pytest.mark.parametrize("batch,features,dim", SHAPES)
def test_forward_and_backward_match_float64(batch, features, dim, precision):
    dense, sparse, grad = inputs(batch, features, dim)
    out, d_dense, d_sparse = on_tpu(dense, sparse, grad, precision)
    want_dense, want_sparse = reference_grads(grad, dense, sparse, precision)
    # fp32 sums of up to `dim` products of magnitude ~1 (dots) and of n x dim (gradients).
    torch.testing.assert_close(out.double(), reference(dense, sparse, precision), atol=2e-5 * dim, rtol=1e-5)
    torch.testing.assert_close(d_dense.double(), want_dense, atol=2e-5 * dim, rtol=1e-5)
    torch.testing.assert_close(d_sparse.double(), want_sparse, atol=2e-5 * dim, rtol=1e-5)
    # The dense part passes through unrounded, at every precision.
    assert torch.equal(out[:, :dim], dense)


@pytest.mark.parametrize("batch,features,dim,dtype,precision", [
    (3, 64, 8, torch.float32, "highest"),  # 65 vectors: past the fused kernel
    (2, 3, 513, torch.float32, "highest"),  # wider than it takes
    (4, 5, 16, torch.float32, "high"),  # three bf16 passes: the unfused form on mxu bmm
    (4, 5, 16, torch.float64, "highest"),
])
def test_unfused_form_past_the_kernel(batch, features, dim, dtype, precision):
    dense, sparse, grad = (t.to(dtype) for t in inputs(batch, features, dim, seed=1))
    out, d_dense, d_sparse = on_tpu(dense, sparse, grad, precision)
    want_dense, want_sparse = reference_grads(grad, dense, sparse, "highest")
    tol = dict(atol=1e-4 * dim, rtol=1e-4)  # high: bf16x3 is about fp32 but not exactly
    torch.testing.assert_close(out.double(), reference(dense, sparse, "highest"), **tol)
    torch.testing.assert_close(d_dense.double(), want_dense, **tol)
    torch.testing.assert_close(d_sparse.double(), want_sparse, **tol)


def test_gradcheck_float64():
    dense, sparse, _ = inputs(3, 4, 5, seed=2)
    d, s = (t.double().to("tpu").requires_grad_() for t in (dense, sparse))
    assert torch.autograd.gradcheck(dot_interaction, (d, s))


def test_strided_inputs():
    # sparse a transposed view, dense a column slice, the output's gradient a slice.
    dense, sparse, grad = inputs(16, 26, 64, seed=3)
    wide = torch.randn(16, 128)
    wide[:, 32:96] = dense
    d = wide.to("tpu")[:, 32:96].requires_grad_()
    s = sparse.transpose(1, 2).contiguous().to("tpu").transpose(1, 2).requires_grad_()
    g = torch.cat((grad, torch.zeros(16, 7)), dim=1).to("tpu")[:, :grad.size(1)]
    assert not d.is_contiguous() and not s.is_contiguous() and not g.is_contiguous()
    out = dot_interaction(d, s)
    out.backward(g)
    want_dense, want_sparse = reference_grads(grad, dense, sparse, "highest")
    torch.testing.assert_close(out.detach().cpu().double(), reference(dense, sparse, "highest"), atol=2e-3, rtol=1e-5)
    torch.testing.assert_close(d.grad.cpu().double(), want_dense, atol=2e-3, rtol=1e-5)
    torch.testing.assert_close(s.grad.cpu().double(), want_sparse, atol=2e-3, rtol=1e-5)


def test_empty_batch():
    dense, sparse, grad = inputs(0, 26, 64)
    out, d_dense, d_sparse = on_tpu(dense, sparse, grad, "medium")
    assert out.shape == (0, 64 + 351) and d_dense.shape == (0, 64) and d_sparse.shape == (0, 26, 64)


def test_bad_inputs_are_named():
    with pytest.raises(RuntimeError, match=r"dense \[4, 8\] and sparse \[4, 3, 9\] disagree on B or D"):
        dot_interaction(torch.zeros(4, 8, device="tpu"), torch.zeros(4, 3, 9, device="tpu"))
    with pytest.raises(RuntimeError, match=r"expected dense \(B, D\) and sparse \(B, F, D\)"):
        dot_interaction(torch.zeros(4, 8, device="tpu"), torch.zeros(4, 8, device="tpu"))
    with pytest.raises(ValueError, match="takes tpu tensors"):
        dot_interaction(torch.zeros(4, 8), torch.zeros(4, 3, 8))
    with pytest.raises(RuntimeError, match=r"grad \[4, 9\] is not the output's shape \(4, 11\)"):
        torch.ops.torch_tpu.dot_interaction_backward(torch.zeros(4, 9, device="tpu"), torch.zeros(4, 8, device="tpu"),
                                                     torch.zeros(4, 2, 8, device="tpu"))


def bmm_calls(fn) -> int:
    with torch.profiler.profile() as prof:
        fn()
    return sum(e.count for e in prof.key_averages() if e.key == "aten::bmm")


@pytest.mark.parametrize("precision", ["highest", "medium"])
def test_dlrm_interaction_on_tpu_runs_the_fused_kernel(precision):
    # No batched matmul, forward or backward: the fused kernels did the work. (The unfused
    # form, which high precision takes, is the measurable contrast: two batched matmuls of
    # three bf16 passes each.)
    dense, sparse, grad = inputs(32, 26, 64, seed=4)
    module = DotInteraction(26).to("tpu")
    d, s = (t.to("tpu").requires_grad_() for t in (dense, sparse))

    def step():
        with torch.tpu.precision(precision):
            module(d, s).backward(grad.to("tpu"))

    assert bmm_calls(step) == 0
    with torch.tpu.precision("high"):
        assert bmm_calls(lambda: dot_interaction(d, s).backward(grad.to("tpu"))) == 6


def test_compiled_matches_eager():
    dense, sparse, grad = inputs(16, 26, 64, seed=5)
    module = DotInteraction(26).to("tpu")
    compiled = torch.compile(module, backend="tpu", fullgraph=True)
    results = []
    for fn in (module, compiled):
        d, s = (t.to("tpu").requires_grad_() for t in (dense, sparse))
        out = fn(d, s)
        out.backward(grad.to("tpu"))
        results.append((out.detach().cpu(), d.grad.cpu(), s.grad.cpu()))
    for eager, traced in zip(*results):
        assert torch.equal(eager, traced)


def test_compiled_graphs_hold_the_interaction(caplog):
    # A graph op (torch_tpu.graph_ops): the compiled forward and backward are one graph
    # each that calls the kernel, not compiled segments around it.
    dense, sparse, grad = inputs(16, 26, 64, seed=6)
    bottom = torch.nn.Linear(64, 64).to("tpu")

    def f(d, s):
        return torch.relu(dot_interaction(torch.relu(bottom(d)), s))

    results = []
    with caplog.at_level(logging.INFO, logger="torch_tpu.inductor"):
        for fn in (f, torch.compile(f, backend="tpu", fullgraph=True)):
            d, s = (t.to("tpu").requires_grad_() for t in (dense, sparse))
            out = fn(d, s)
            out.backward(grad.to("tpu"))
            results.append((out.detach().cpu(), d.grad.cpu(), s.grad.cpu()))
    assert not [r.message for r in caplog.records if "compiled around" in r.message]
    for eager, compiled in zip(*results):
        torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)  # Inductor's fused relu, linear


def test_graph_ops_need_host_and_meta_kernels():
    with pytest.raises(ValueError, match="needs a CPU kernel"):
        register_graph_op(torch.ops.torch_tpu._deferred_empty.default)
    with pytest.raises(TypeError, match="takes an op overload"):
        register_graph_op(torch.ops.torch_tpu.dot_interaction)


def test_compiled_batch_sizes_stay_symbolic_under_fullgraph():
    # The meta kernel keeps B a SymInt: Dynamo traces one dynamic graph, the backend bounds its
    # shape specializations (a warning), and fullgraph=True never hits Dynamo's recompile limit.
    import torch._dynamo

    torch._dynamo.reset()
    step = torch.compile(lambda d, s: dot_interaction(d, s).sum(), backend="tpu", fullgraph=True)
    g = torch.Generator().manual_seed(0)
    with pytest.warns(RuntimeWarning, match="shape specializations of one graph"):
        for batch in range(2, 14):
            dense = torch.randn(batch, 4, generator=g).to("tpu").requires_grad_()
            sparse = torch.randn(batch, 3, 4, generator=g).to("tpu")
            out = step(dense, sparse)
            out.backward()
            expected = dot_interaction(dense.detach(), sparse).sum()
            torch.testing.assert_close(out.detach().cpu(), expected.cpu(), rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="disagree on B"):
        torch.ops.torch_tpu.dot_interaction(torch.randn(3, 4, device="meta"), torch.randn(2, 3, 4, device="meta"))
