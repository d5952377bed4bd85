"""torch.compile(backend="tpu") on bf16 and fp16 models with normalization layers:
the compiled forward hands its backward the statistics the backward was compiled
for (torch_tpu.host_norms), so gradients equal eager's to the dtype's rounding."""

import copy

import pytest
import torch
from torch import nn

import torch_tpu  # noqa: F401 - the tpu device
from torch_tpu import host_norms, inductor


def grads(model: nn.Module, x: torch.Tensor, *, compiled: bool, autocast: torch.dtype | None) -> list[torch.Tensor]:
    model = copy.deepcopy(model).to("tpu")
    fn = torch.compile(model, backend="tpu") if compiled else model
    x = x.to("tpu").requires_grad_()
    with torch.autocast("tpu", dtype=autocast, enabled=autocast is not None):
        out = fn(x)
    out.float().square().mean().backward()
    return [out.detach().float().cpu(), x.grad.float().cpu()] + [p.grad.float().cpu() for p in model.parameters()]


CASES = {
    "bf16 linear + layernorm": (lambda: nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32)).bfloat16(),
                                lambda: torch.randn(8, 16, dtype=torch.bfloat16), None),
    "fp16 layernorm without affine": (lambda: nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32, elementwise_affine=False)).half(),
                                      lambda: torch.randn(8, 16, dtype=torch.float16), None),
    "conv + batchnorm under bf16 autocast": (lambda: nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8)),
                                             lambda: torch.randn(4, 3, 8, 8), torch.bfloat16),
}


@pytest.mark.parametrize("case", list(CASES))
def test_compiled_gradients_equal_eager_with_reduced_precision_norms(case):
    make_model, make_input, autocast = CASES[case]
    torch.manual_seed(0)
    model, x = make_model(), make_input()
    eager = grads(model, x, compiled=False, autocast=autocast)
    compiled = grads(model, x, compiled=True, autocast=autocast)
    for e, c in zip(eager, compiled):
        assert torch.isfinite(c).all()
        # Eager keeps the statistics in the input's dtype, the compiled graph at fp32: a bf16 rounding apart.
        torch.testing.assert_close(c, e, rtol=3e-2, atol=3e-2)


def test_the_host_graph_keeps_the_tpu_graph_s_fp32_statistics():
    from torch.fx.experimental.proxy_tensor import make_fx

    x = torch.randn(8, 32, dtype=torch.bfloat16, device="tpu")
    w, b = torch.ones(32, dtype=torch.bfloat16, device="tpu"), torch.zeros(32, dtype=torch.bfloat16, device="tpu")
    gm = make_fx(lambda x, w, b: torch.ops.aten.native_layer_norm(x, [32], w, b, 1e-5), tracing_mode="fake")(x, w, b)
    wanted = [n.meta["val"].dtype for n in gm.graph.nodes if n.op == "call_function" and n.target.__name__ == "getitem"]
    assert wanted == [torch.bfloat16, torch.float32, torch.float32]  # the tpu's rules
    host = inductor.host_graph(gm)
    assert sum(n.target in host_norms.NORMS for n in host.graph.nodes) == 1
    runner = inductor.compile_graph(gm, [x, w, b], choose=False)
    out, mean, rstd = runner(x, w, b)
    assert [out.dtype, mean.dtype, rstd.dtype] == wanted
    reference = x.float().cpu()
    torch.testing.assert_close(mean.cpu().flatten(), reference.mean(1), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out.float().cpu(), torch.nn.functional.layer_norm(reference, [32]), rtol=1e-2, atol=1e-2)
