"""Debug mode's NaN/Inf check (torch_tpu.debug): what counts as a value an op produced.

Views and the outputs of empty* produce no values; in-place ops are checked on what they wrote;
NaN is always reported, Inf only where an op creates it from finite inputs (not a -inf mask
PyTorch places on purpose).
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import torch_tpu


@pytest.fixture(autouse=True)
def strict_after():
    yield
    torch_tpu.set_eager_mode("strict")
    torch_tpu.set_nan_check("raise")


def nan_garbage() -> None:
    """Leaves freed memory of -1 ints (a NaN bit pattern as float32) for the next allocation."""
    garbage = torch.full((4096,), -1, dtype=torch.int32, device="tpu")
    del garbage


def test_filling_an_empty_buffer_slice_by_slice_is_not_a_nan():
    torch_tpu.set_eager_mode("debug")
    nan_garbage()
    buf = torch.empty(4096, device="tpu")
    for i in range(4):
        buf[i * 1024:(i + 1) * 1024] = float(i)  # slice (a view of garbage), then fill_ of it
    assert buf[::1024].tolist() == [0.0, 1.0, 2.0, 3.0]
    nan_garbage()
    buf = torch.empty(4096, device="tpu")
    buf[:2048].copy_(torch.ones(2048, device="tpu"))
    buf.view(2, 2048)[1].zero_()
    assert bool(torch.isfinite(buf).all())


def test_views_and_empty_outputs_are_not_checked():
    torch_tpu.set_eager_mode("debug")
    for make in (lambda: torch.empty(4096, device="tpu"), lambda: torch.empty_like(torch.ones(4096, device="tpu")),
                 lambda: torch.empty_strided((4096,), (1,), device="tpu"),
                 lambda: torch.ones(4, device="tpu").new_empty(4096)):
        nan_garbage()
        buf = make()
        buf[10:20], buf.view(64, 64).t(), buf.reshape(2, -1)[0], buf.unsqueeze(0), buf.split(1024)  # views
        buf[:100].index_put_((torch.arange(5, device="tpu"),), torch.ones(5, device="tpu"))  # writes 5: finite
        buf.masked_fill_(torch.zeros(4096, dtype=torch.bool, device="tpu"), 1.0)  # writes nothing


def test_a_nan_written_in_place_or_computed_from_a_view_is_reported():
    torch_tpu.set_eager_mode("debug")
    nan_garbage()
    buf = torch.empty(4096, device="tpu")
    with pytest.raises(FloatingPointError, match=r"^aten.fill_.Scalar: output 0 holds NaN; called from .*fill_"):
        buf[:8].fill_(float("nan"))  # the written region is the op's result
    x = torch.ones(4, device="tpu")
    with pytest.raises(FloatingPointError, match=r"^aten.div_.Tensor: output 0 holds NaN"):
        x[1:3].sub_(1.0).div_(torch.zeros(2, device="tpu"))
    with pytest.raises(FloatingPointError, match=r"^aten.mul.Tensor: output 0 holds NaN"):
        torch.full((2,), float("inf"), device="tpu")[:1] * 0  # a view's values, used in arithmetic
    with pytest.raises(FloatingPointError, match=r"^aten.div.out: output 0 holds Inf"):
        nan_garbage()
        torch.div(torch.ones(4096, device="tpu"), 0, out=torch.empty(4096, device="tpu"))
    with pytest.raises(FloatingPointError, match=r"^aten._foreach_mul_.Scalar: argument self\[1\] holds Inf"):
        torch._foreach_mul_([torch.ones(3, device="tpu"), torch.full((3,), 3e38, device="tpu")], 10.0)


@pytest.mark.parametrize("expression, op, kind", [
    (lambda z, o: z / z, "aten.div.Tensor", "NaN"),
    (lambda z, o: torch.log(-o), "aten.log.default", "NaN"),
    (lambda z, o: o / z - o / z, "aten.div.Tensor", "Inf"),  # 1/0 is reported first
    (lambda z, o: torch.log(z), "aten.log.default", "Inf"),
    (lambda z, o: torch.exp(o * 1000), "aten.exp.default", "Inf"),
    (lambda z, o: (o * 3e38).sum(), "aten.sum.default", "Inf"),
    (lambda z, o: o.clone().mul_(3e38).mul_(10), "aten.mul_.Tensor", "Inf"),
])
def test_a_nan_or_inf_from_finite_inputs_still_raises_naming_the_op(expression, op, kind):
    z, o = torch.zeros(3, device="tpu"), torch.ones(3, device="tpu")
    torch_tpu.set_eager_mode("debug")
    with pytest.raises(FloatingPointError, match=rf"^{op}: output 0 holds {kind}; called from .*test_debug_nan"):
        expression(z, o)


def test_nan_from_infinite_inputs_still_raises():
    inf = torch.tensor([float("inf")], device="tpu")
    torch_tpu.set_eager_mode("debug")
    with pytest.raises(FloatingPointError, match=r"^aten.sub.Tensor: output 0 holds NaN"):
        inf - inf
    with pytest.raises(FloatingPointError, match=r"^aten.full.default: output 0 holds NaN"):
        torch.full((2,), float("nan"), device="tpu")  # NaN is never deliberate
    torch_tpu.set_nan_check("warn")
    with pytest.warns(RuntimeWarning, match="aten.sub.Tensor: output 0 holds NaN"):
        out = inf - inf
    assert torch.isnan(out.cpu()).all()


def test_deliberate_infinities_pass():
    torch_tpu.set_eager_mode("debug")
    mask = torch.full((3, 3), float("-inf"), device="tpu").triu(1)  # a causal mask
    scores = torch.randn(3, 3, device="tpu") + mask
    assert bool(torch.isfinite(scores.softmax(-1)).all())
    torch.zeros(3, device="tpu").masked_fill_(torch.tensor([True, False, True], device="tpu"), float("inf"))
    torch.where(torch.tensor([True, False], device="tpu"), torch.ones(2, device="tpu"), float("-inf"))
    torch.scalar_tensor(float("-inf"), device="tpu")
    with pytest.raises(FloatingPointError, match="output 0 holds Inf"):
        torch.tensor([float("inf")]).to("tpu")  # data entering the tpu is checked


def attention_cases() -> dict:
    torch.manual_seed(0)
    q = torch.randn(2, 4, 8, 16)
    x = torch.randn(2, 5, 8)
    pad = torch.tensor([[False, False, False, True, True]] * 2)
    mha = nn.MultiheadAttention(8, 2, batch_first=True)
    layer = nn.TransformerEncoderLayer(8, 2, 16, batch_first=True, dropout=0.0)
    return {
        "sdpa causal": lambda d: F.scaled_dot_product_attention(q.to(d), q.to(d), q.to(d), is_causal=True),
        "sdpa bool mask": lambda d: F.scaled_dot_product_attention(
            q.to(d), q.to(d), q.to(d), attn_mask=torch.ones(8, 8, dtype=torch.bool, device=d).tril()),
        "mha key_padding_mask": lambda d: mha.to(d)(x.to(d), x.to(d), x.to(d), key_padding_mask=pad.to(d))[0],
        "encoder layer causal": lambda d: layer.to(d)(
            x.to(d), src_mask=nn.Transformer.generate_square_subsequent_mask(5, device=d), is_causal=True),
    }


@pytest.mark.parametrize("name", list(attention_cases()))
def test_pytorchs_internal_inf_masks_pass_and_results_equal_strict(name):
    case = attention_cases()[name]
    with torch.no_grad():
        strict = case("tpu").cpu()
        with torch_tpu.eager_mode("debug"):
            debug = case("tpu").cpu()
    torch.testing.assert_close(debug, strict, rtol=0, atol=0)
    assert bool(torch.isfinite(debug).all())


def test_internal_inf_masks_pass_in_the_backward_too():
    torch.manual_seed(0)
    q = torch.randn(2, 4, 8, 16, device="tpu", requires_grad=True)
    torch_tpu.set_eager_mode("debug")
    F.scaled_dot_product_attention(q, q, q, is_causal=True).square().sum().backward()
    assert bool(torch.isfinite(q.grad).all())
