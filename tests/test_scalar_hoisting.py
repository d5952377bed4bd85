"""torch_tpu.scalar_hoisting: 0-d math that large kernels read is stacked into
one vector computed once per call; results do not change."""

import copy

import torch
from torch import nn
from torch.fx.experimental.proxy_tensor import make_fx

import torch_tpu  # noqa: F401
from torch_tpu import inductor
from torch_tpu.scalar_hoisting import MIN_READER_ELEMENTS, hoist_scalar_math


def bias_corrected(x: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    # AdamW's shape of scalar math: two bias corrections of a step count.
    return x * torch.sqrt(1 - 0.999 ** step) / (1 - 0.9 ** step)


def stacks(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if n.target is torch.ops.aten.stack.default]


def test_costly_scalar_math_read_by_a_large_kernel_is_stacked_and_gives_the_same_values():
    x, step = torch.randn(MIN_READER_ELEMENTS), torch.tensor(7.0)
    gm = make_fx(bias_corrected, tracing_mode="fake")(x, step)
    before = copy.deepcopy(gm)
    assert hoist_scalar_math(gm) == 2  # sqrt(1 - 0.999 ** step) and 1 - 0.9 ** step
    # Each is stacked before its first reader (the mul reads the first before the second is computed).
    assert sum(len(s.args[0]) for s in stacks(gm)) == 2
    readers = [n for n in gm.graph.nodes if n.target in (torch.ops.aten.mul.Tensor, torch.ops.aten.div.Tensor)]
    assert [a.target for r in readers for a in r.all_input_nodes if a.meta["val"].dim() == 0] == [
        torch.ops.aten.select.int] * 2
    for s in (1.0, 7.0, 1000.0):
        assert torch.equal(gm(x, torch.tensor(s)), before(x, torch.tensor(s)))
    assert torch.equal(gm(x, step), bias_corrected(x, step))


def test_cheap_scalar_math_and_small_readers_are_left_alone():
    step = torch.tensor(3.0)
    cheap = make_fx(lambda x, s: x * (s + 1), tracing_mode="fake")(torch.randn(MIN_READER_ELEMENTS), step)
    small = make_fx(bias_corrected, tracing_mode="fake")(torch.randn(MIN_READER_ELEMENTS // 2), step)
    for gm in (cheap, small):
        assert hoist_scalar_math(gm) == 0
        assert not stacks(gm)


def test_compiled_adamw_step_hoists_its_bias_corrections_and_equals_torch_optim(monkeypatch):
    hoisted = []

    def counting(gm):
        hoisted.append(hoist_scalar_math(gm))
        return hoisted[-1]

    monkeypatch.setattr(inductor, "hoist_scalar_math", counting)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.LayerNorm(64), nn.Linear(64, 64))
    x = torch.randn(32, 64)
    reference = copy.deepcopy(model)
    reference_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, foreach=False)
    tpu = copy.deepcopy(model).to("tpu")
    opt = torch.optim.AdamW(tpu.parameters(), lr=1e-2)
    step = torch.compile(opt.step, backend="tpu")
    for _ in range(3):
        for m, o, update, inp in ((reference, reference_opt, reference_opt.step, x),
                                  (tpu, opt, step, x.to("tpu"))):
            o.zero_grad()
            m(inp).square().mean().backward()
            update()
    # Two bias corrections per parameter: its foreach ops run over all six parameters, weights included.
    assert max(hoisted) == 2 * 6
    for a, b in zip(reference.state_dict().values(), tpu.state_dict().values()):
        torch.testing.assert_close(b.cpu(), a, rtol=1e-5, atol=1e-6)
    for a, b in zip(reference_opt.state_dict()["state"].values(), opt.state_dict()["state"].values()):
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(b[key].cpu(), a[key], rtol=1e-5, atol=1e-7)
