"""MXU precision on tpu: medium = bf16 operands, fp32 accumulation; high = 3-pass; highest = fp32."""

import os
import subprocess
import sys
import warnings

import pytest
import torch

import torch_tpu.precision


def bf16(t):
    return t.to(torch.bfloat16).float()


def rel_err(result, exact):
    return ((result - exact).norm() / exact.norm()).item()


@pytest.fixture
def operands():
    g = torch.Generator().manual_seed(0)
    return torch.randn(64, 96, generator=g), torch.randn(96, 48, generator=g)


def on_tpu(fn, *tensors):
    return fn(*(t.to("tpu") for t in tensors)).cpu()


def test_default_is_medium_and_cpu_setting_is_separate():
    torch.tpu.set_float32_matmul_precision("medium")
    assert torch.tpu.get_float32_matmul_precision() == "medium"
    assert torch.get_float32_matmul_precision() == "highest"


@pytest.mark.parametrize(
    "name, fn",
    [
        ("mm", lambda a, b: a @ b),
        ("linear", lambda a, b: torch.nn.functional.linear(a, b.t())),
        ("einsum", lambda a, b: torch.einsum("ik,kj->ij", a, b)),
        ("bmm", lambda a, b: torch.bmm(a.expand(3, -1, -1), b.expand(3, -1, -1))),
        ("addmm", lambda a, b: torch.addmm(torch.ones(a.shape[0], b.shape[1], device=a.device), a, b, beta=0.5, alpha=2)),
        ("mv", lambda a, b: a @ b[:, 0].contiguous()),
        ("mm_strided", lambda a, b: a[:, ::2] @ b[::2, :]),
        ("mm_transposed", lambda a, b: (b.t() @ a.t()).t()),
        ("addmm_", lambda a, b: torch.zeros(a.shape[0], b.shape[1], device=a.device).addmm_(a, b)),
        ("baddbmm_", lambda a, b: torch.zeros(3, a.shape[0], b.shape[1], device=a.device)
         .baddbmm_(a.expand(3, -1, -1), b.expand(3, -1, -1))),
        ("addmv_", lambda a, b: torch.zeros(a.shape[0], device=a.device).addmv_(a, b[:, 0].contiguous())),
        ("addbmm", lambda a, b: torch.addbmm(torch.zeros(a.shape[0], b.shape[1], device=a.device),
                                             a.expand(3, -1, -1), b.expand(3, -1, -1))),
        ("addmm_row_bias", lambda a, b: torch.addmm(torch.arange(b.shape[1], device=a.device) * 0.1, a, b)),
    ],
)
def test_medium_equals_the_bf16_rounded_reference(operands, name, fn):
    a, b = operands
    with torch.tpu.precision("medium"):
        result = on_tpu(fn, a, b)
    reference = fn(bf16(a), bf16(b))
    # Equal up to accumulation order; far from exact fp32.
    torch.testing.assert_close(result, reference, atol=1e-4, rtol=1e-5)
    assert rel_err(fn(a, b), reference) > 1e-4


@pytest.mark.parametrize(
    "m, k, n",
    # The last two: one row block split into panel ranges among the threads (15 and 19 panels).
    [(1, 1, 1), (9, 3, 17), (8, 64, 32), (65, 131, 33), (130, 2048, 70), (3, 7, 600), (64, 2048, 456), (33, 1024, 600)],
)
def test_medium_gemm_edges(m, k, n):
    # Row blocks, column panels and odd k of the bf16 kernel: every remainder against the reference.
    g = torch.Generator().manual_seed(m * 1000 + n)
    a, b, c = torch.randn(m, k, generator=g), torch.randn(k, n, generator=g), torch.randn(m, n, generator=g)
    with torch.tpu.precision("medium"):
        got = torch.addmm(c.to("tpu"), a.to("tpu"), b.to("tpu"), beta=0.5, alpha=-2).cpu()
        got_t = (b.to("tpu").t() @ a.to("tpu").t()).t().cpu()
    expected = torch.addmm(c, bf16(a), bf16(b), beta=0.5, alpha=-2)
    torch.testing.assert_close(got, expected, atol=1e-4 * max(1, k ** 0.5), rtol=1e-5)
    torch.testing.assert_close(got_t, bf16(a) @ bf16(b), atol=1e-4 * max(1, k ** 0.5), rtol=1e-5)
    a3, b3 = torch.randn(3, m, k, generator=g), torch.randn(3, n, k, generator=g).transpose(1, 2)  # b3 strided
    with torch.tpu.precision("medium"):
        got_b = torch.bmm(a3.to("tpu"), b3.to("tpu")).cpu()
    torch.testing.assert_close(got_b, torch.bmm(bf16(a3), bf16(b3)), atol=1e-4 * max(1, k ** 0.5), rtol=1e-5)


def mxu_operand(t):
    """What the MXU multiplies: the bf16 rounding, with subnormals flushed to zero."""
    r = bf16(t)
    return torch.where(r.abs() < torch.finfo(torch.float32).tiny, torch.zeros_like(r), r)


def test_medium_rounds_each_operand_value_as_the_mxu_does():
    # Times the identity, a medium matmul returns its operand as the MXU sees it, exactly:
    # bf16 with ties to even, large values kept, subnormals flushed; transposed and sliced operands.
    g = torch.Generator().manual_seed(1)
    x = torch.randn(300, 37, generator=g) * 1e3
    x[0, :4] = torch.tensor([3.38e38, 1e-40, -2.5e-39, 1.00390625])  # the last is a tie: rounds to even (1.0)
    identity = torch.eye(300, device="tpu")
    with torch.tpu.precision("medium"):
        transposed = (x.to("tpu").t() @ identity).t().cpu()
        sliced = (identity[::2, ::2] @ x.to("tpu")[::2]).cpu()
        with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
            identity @ x.to("tpu")[::2]
    assert torch.equal(transposed, mxu_operand(x))
    assert torch.equal(sliced, mxu_operand(x[::2]))
    assert transposed[0, 3] == 1.0 and transposed[0, 0] == bf16(x)[0, 0] and transposed[0, 1] == 0
    with torch.tpu.precision("medium"):  # the rounding path (bmm) flushes alike
        batched = torch.bmm(x.to("tpu").t().unsqueeze(0), identity.unsqueeze(0)).squeeze(0).t().cpu()
    assert torch.equal(batched, mxu_operand(x))


def test_medium_contiguous_operands_in_whole_panels_round_as_the_mxu_does():
    # Contiguous operands whose result has whole 64-column panels take the AMX tile
    # path (TpuBf16Gemm.cpp): the same rounding, flushing and fp32 accumulation.
    g = torch.Generator().manual_seed(2)
    x = torch.randn(256, 64, generator=g) * 1e3
    x[0, :4] = torch.tensor([3.38e38, 1e-40, -2.5e-39, 1.00390625])
    with torch.tpu.precision("medium"):
        through_identity = (torch.eye(256, device="tpu") @ x.to("tpu")).cpu()
    assert torch.equal(through_identity, mxu_operand(x))
    # Rows that fill no whole tile (70), a bias with beta, and a long inner dimension.
    a, b = torch.randn(70, 1024, generator=g), torch.randn(1024, 192, generator=g)
    bias = torch.randn(192, generator=g)
    with torch.tpu.precision("medium"):
        got_mm = (a.to("tpu") @ b.to("tpu")).cpu()
        got_addmm = torch.addmm(bias.to("tpu"), a.to("tpu"), b.to("tpu"), beta=0.5).cpu()
    want = mxu_operand(a).double() @ mxu_operand(b).double()
    torch.testing.assert_close(got_mm.double(), want, atol=1e-4 * 1024 ** 0.5, rtol=1e-5)
    torch.testing.assert_close(got_addmm.double(), want + 0.5 * bias.double(), atol=1e-4 * 1024 ** 0.5, rtol=1e-5)
    assert (got_mm - a @ b).abs().max() > 1e-2  # the check tells bf16 operands from fp32 ones


def test_medium_transposed_operands_in_whole_panels_round_as_the_mxu_does():
    # A Linear's transposed weight (forward) and transposed activations (weight gradient)
    # take the tile path too, converted and transposed by the tpu's own kernels.
    g = torch.Generator().manual_seed(3)
    y = torch.randn(64, 203, generator=g) * 1e3  # 203: rows that fill no 8x8 block
    y[:4, 0] = torch.tensor([3.38e38, 1e-40, -2.5e-39, 1.00390625])
    w = torch.randn(64, 256, generator=g) * 1e3
    w[0, :4] = y[:4, 0]
    with torch.tpu.precision("medium"):
        lhs_transposed = (y.to("tpu").t() @ torch.eye(64, device="tpu")).cpu()
        rhs_transposed = (torch.eye(256, device="tpu") @ w.to("tpu").t()).cpu()
    assert torch.equal(lhs_transposed, mxu_operand(y.t()))
    assert torch.equal(rhs_transposed, mxu_operand(w.t()))
    # Both transposed, an inner dimension that is no multiple of 8, a bias with beta.
    activations, weight = torch.randn(134, 70, generator=g), torch.randn(192, 134, generator=g)
    bias = torch.randn(192, generator=g)
    with torch.tpu.precision("medium"):
        got = torch.addmm(bias.to("tpu"), activations.to("tpu").t(), weight.to("tpu").t(), beta=2.0).cpu()
    want = mxu_operand(activations.t()).double() @ mxu_operand(weight.t()).double() + 2.0 * bias.double()
    torch.testing.assert_close(got.double(), want, atol=1e-4 * 134 ** 0.5, rtol=1e-5)


def test_medium_bmm_in_whole_panels_rounds_as_the_mxu_does():
    # Attention's shapes: batches of row-major or transposed matrices on the tile path.
    g = torch.Generator().manual_seed(4)
    x = torch.randn(3, 70, 64, generator=g) * 1e3
    x[1, 0, :4] = torch.tensor([3.38e38, 1e-40, -2.5e-39, 1.00390625])
    eye = torch.eye(70).expand(3, 70, 70).contiguous()
    with torch.tpu.precision("medium"):
        rows = torch.bmm(eye.to("tpu"), x.to("tpu")).cpu()
        columns = torch.bmm(x.to("tpu").transpose(1, 2).contiguous().transpose(1, 2),
                            torch.eye(64).expand(3, 64, 64).contiguous().to("tpu")).cpu()
    assert torch.equal(rows, mxu_operand(x)) and torch.equal(columns, mxu_operand(x))
    q, k = torch.randn(5, 40, 34, generator=g), torch.randn(5, 128, 34, generator=g)
    v = torch.randn(5, 40, 128, generator=g)
    with torch.tpu.precision("medium"):
        scores = torch.bmm(q.to("tpu"), k.to("tpu").transpose(1, 2)).cpu()
        values = torch.bmm(q.to("tpu").transpose(1, 2), v.to("tpu")).cpu()
    torch.testing.assert_close(scores.double(), mxu_operand(q).double() @ mxu_operand(k).double().transpose(1, 2),
                               atol=1e-4 * 34 ** 0.5, rtol=1e-5)
    torch.testing.assert_close(values.double(), mxu_operand(q).double().transpose(1, 2) @ mxu_operand(v).double(),
                               atol=1e-4 * 40 ** 0.5, rtol=1e-5)


@pytest.mark.parametrize("m, k, n", [(70, 65, 100), (33, 13, 512), (40, 415, 130), (2, 1, 1), (1, 256, 7)])
@pytest.mark.parametrize("layout", ["rows", "a transposed", "b transposed"])
def test_medium_odd_inner_dimensions_and_partial_panels(m, k, n, layout):
    # An odd inner dimension (a zero pair member) and a last panel of fewer than 64
    # columns (computed aside, copied in): DLRM's 415-wide and 13-wide layers.
    g = torch.Generator().manual_seed(m * 1000 + k + n)
    a, b, bias = torch.randn(m, k, generator=g), torch.randn(k, n, generator=g), torch.randn(n, generator=g)
    at, bt = a.to("tpu"), b.to("tpu")
    if layout == "a transposed":
        at = a.t().contiguous().to("tpu").t()
    if layout == "b transposed":
        bt = b.t().contiguous().to("tpu").t()
    with torch.tpu.precision("medium"):
        got_mm = (at @ bt).cpu()
        got_addmm = torch.addmm(bias.to("tpu"), at, bt, beta=0.5).cpu()
    want = mxu_operand(a).double() @ mxu_operand(b).double()
    tolerance = dict(atol=1e-4 * max(1, k ** 0.5), rtol=1e-5)
    torch.testing.assert_close(got_mm.double(), want, **tolerance)
    torch.testing.assert_close(got_addmm.double(), want + 0.5 * bias.double(), **tolerance)


def test_medium_partial_panel_and_odd_k_round_as_the_mxu_does():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(65, 100, generator=g) * 1e3  # 65 rows: an odd inner dimension below
    x[0, :4] = torch.tensor([3.38e38, 1e-40, -2.5e-39, 1.00390625])
    with torch.tpu.precision("medium"):
        through_identity = (torch.eye(65, device="tpu") @ x.to("tpu")).cpu()
        transposed = (x.to("tpu").t() @ torch.eye(65, device="tpu")).cpu()
    assert torch.equal(through_identity, mxu_operand(x))
    assert torch.equal(transposed, mxu_operand(x.t()))


def test_conv_medium_and_its_backward(operands):
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(2, 3, 8, 8, generator=g), torch.randn(4, 3, 3, 3, generator=g)
    grad_out = torch.randn(2, 4, 6, 6, generator=g)
    with torch.tpu.precision("medium"):
        xt, wt = x.to("tpu").requires_grad_(), w.to("tpu").requires_grad_()
        yt = torch.nn.functional.conv2d(xt, wt)
        yt.backward(grad_out.to("tpu"))
    xr, wr = bf16(x).requires_grad_(), bf16(w).requires_grad_()
    yr = torch.nn.functional.conv2d(xr, wr)
    yr.backward(bf16(grad_out))
    torch.testing.assert_close(yt.detach().cpu(), yr.detach(), atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(xt.grad.cpu(), xr.grad, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(wt.grad.cpu(), wr.grad, atol=1e-4, rtol=1e-5)


def test_errors_shrink_from_medium_to_high_to_highest(operands):
    a, b = operands
    exact = (a.double() @ b.double()).float()
    errors = {}
    for mode in ("medium", "high", "highest"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with torch.tpu.precision(mode):
                errors[mode] = rel_err(on_tpu(torch.mm, a, b), exact)
    assert 1e-4 < errors["medium"] < 1e-2  # bf16 has an 8-bit mantissa
    assert errors["high"] < errors["medium"] / 100
    assert errors["highest"] <= 1e-6
    assert errors["highest"] <= errors["high"]


@pytest.mark.parametrize("layout", ["rows", "a transposed", "b transposed"])
def test_high_is_three_bf16_passes(layout):
    # hi(a) hi(b) + hi(a) lo(b) + lo(a) hi(b), hi = bf16(x), lo = bf16(x - hi): on AMX
    # each pass runs on the tiles, elsewhere as an fp32 GEMM of the rounded operands.
    g = torch.Generator().manual_seed(6)
    a, b, bias = torch.randn(70, 131, generator=g), torch.randn(131, 100, generator=g), torch.randn(100, generator=g)
    at = a.t().contiguous().to("tpu").t() if layout == "a transposed" else a.to("tpu")
    bt = b.t().contiguous().to("tpu").t() if layout == "b transposed" else b.to("tpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.tpu.precision("high"):
            got = torch.addmm(bias.to("tpu"), at, bt, beta=0.25).cpu()
    a_hi, b_hi = mxu_operand(a).double(), mxu_operand(b).double()
    a_lo, b_lo = mxu_operand(a - mxu_operand(a)).double(), mxu_operand(b - mxu_operand(b)).double()
    want = a_hi @ b_hi + a_hi @ b_lo + a_lo @ b_hi + 0.25 * bias.double()
    torch.testing.assert_close(got.double(), want, atol=1e-5 * 131 ** 0.5, rtol=1e-6)
    exact = a.double() @ b.double() + 0.25 * bias.double()
    assert (got.double() - exact).abs().max() < 1e-2 * (mxu_operand(a).double() @ mxu_operand(b).double()
                                                          + 0.25 * bias.double() - exact).abs().max()


def test_only_fp32_is_rounded():
    a = torch.randn(8, 8, dtype=torch.float64)
    with torch.tpu.precision("medium"):
        torch.testing.assert_close(on_tpu(torch.mm, a, a), a @ a)


def test_high_and_highest_warn_once(monkeypatch):
    monkeypatch.setattr(torch_tpu.precision, "_warned", set())
    with pytest.warns(UserWarning, match="costs about 3x"):
        with torch.tpu.precision("high"):
            pass
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.tpu.precision("high"):
            pass


def test_invalid_precision_is_named():
    with pytest.raises(ValueError, match="must be one of"):
        torch.tpu.set_float32_matmul_precision("low")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kernel", ["0", "1"])
def test_medium_on_each_gemm_engine_gives_the_same_results(kernel):
    # In a fresh process, each engine the machine would not pick by default:
    # "0" oneDNN's bf16 mode over rounded operands (or, without AVX512,
    # rounding + fp32 GEMMs); "1" the AVX512-BF16 kernel, even on AMX CPUs
    # (without AVX512-BF16, the same as "0").
    code = (
        "import torch, torch_tpu\n"
        "g = torch.Generator().manual_seed(3)\n"
        "a, b = torch.randn(70, 131, generator=g), torch.randn(131, 33, generator=g)\n"
        "a3, b3 = torch.randn(4, 9, 17, generator=g), torch.randn(4, 17, 5, generator=g)\n"
        "r = lambda t: t.bfloat16().float()\n"
        "with torch.tpu.precision('medium'):\n"
        "    got = (a.to('tpu') @ b.to('tpu').t().contiguous().t()).cpu()\n"
        "    got3 = torch.bmm(a3.to('tpu'), b3.to('tpu')).cpu()\n"
        "torch.testing.assert_close(got, r(a) @ r(b), atol=2e-3, rtol=1e-5)\n"
        "torch.testing.assert_close(got3, torch.bmm(r(a3), r(b3)), atol=1e-4, rtol=1e-5)\n"
        "assert (a @ b - r(a) @ r(b)).abs().max() > 1e-2  # the check can tell the two apart\n"
        "print('ok')\n"
    )
    env = {**os.environ, "TORCH_TPU_BF16_KERNEL": kernel}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=100)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-2000:]



def _at(precision, fn, *tensors):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.tpu.precision(precision):
            return on_tpu(fn, *tensors)


@pytest.mark.parametrize("precision", ["medium", "high", "highest"])
def test_infinite_operands_give_ieee_infinities_at_every_precision(precision):
    """An inf operand makes an inf where IEEE fp32 (CPU) does and NaN only where it does too
    (inf - inf): high's split (lo = inf - inf) and its correction passes (inf x 0) must not
    turn the infs into NaN. mm, bmm, addmm and a convolution, against CPU."""
    a = torch.tensor([[float("inf"), 1.0, 0.5], [2.0, 3.0, -1.0], [float("-inf"), 1.0, 1.0]])
    b = torch.tensor([[1.0, 2.0], [1.0, 1.0], [float("inf"), 0.25]])
    bias = torch.tensor([0.5, -1.0])
    signal, kernel = torch.tensor([[[float("inf"), 1.0, 2.0, 3.0]]]), torch.tensor([[[1.0, 0.5]]])
    cases = [(torch.mm, (a, b)), (torch.bmm, (a[None], b[None])), (torch.addmm, (bias, a, b)),
             (torch.nn.functional.conv1d, (signal, kernel))]
    for fn, args in cases:
        want = fn(*args)
        assert not want.isnan().all()  # the case has infs to keep
        torch.testing.assert_close(_at(precision, fn, *args), want, equal_nan=True, rtol=0, atol=0.05)


@pytest.mark.parametrize("precision", ["medium", "high", "highest"])
def test_a_product_scaled_by_zero_is_not_formed(precision):
    """alpha = 0: the product of operands holding inf and NaN is not formed (0 * inf would be
    NaN), as CPU's BLAS and ATen kernels do: addmm, baddbmm, addmv and addbmm give beta * self."""
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(40, 48, generator=g), torch.randn(48, 36, generator=g)
    a[3, 5], b[7, 2] = float("inf"), float("nan")
    cases = [(torch.addmm, torch.randn(40, 36, generator=g), a, b),
             (torch.baddbmm, torch.randn(2, 40, 36, generator=g), a.expand(2, -1, -1), b.expand(2, -1, -1)),
             (torch.addmv, torch.randn(40, generator=g), a, b[:, 2]),
             (torch.addbmm, torch.randn(40, 36, generator=g), a.expand(2, -1, -1), b.expand(2, -1, -1))]
    for fn, bias, m1, m2 in cases:
        op = lambda s, x, y: fn(s, x, y, beta=0.5, alpha=0)  # noqa: E731
        want = op(bias, m1, m2)
        assert want.isfinite().all()
        torch.testing.assert_close(_at(precision, op, bias, m1, m2), want, rtol=0, atol=0)


@pytest.mark.parametrize("precision", ["medium", "high", "highest"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float16, torch.bfloat16])
def test_a_bias_of_another_dtype_is_refused_as_on_cpu(precision, dtype):
    a, b, bias = torch.randn(8, 16), torch.randn(16, 4), torch.randn(4, dtype=dtype)
    with pytest.raises(RuntimeError) as on_cpu:
        torch.addmm(bias, a, b)
    with pytest.raises(RuntimeError, match="must have the same dtype") as on_device:
        _at(precision, torch.addmm, bias, a, b)
    assert str(on_device.value).splitlines()[0] == str(on_cpu.value).splitlines()[0]
