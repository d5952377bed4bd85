"""torch.compile(backend="tpu") where the tpu's kernels and the traced graph disagreed
(eval-mode batch norm statistics, channels_last convolutions), and graphs spanning two
tpu devices: compiled results equal Strict's (the same code run eagerly on tpu) or the
CPU kernels'. The suite runs with two tpu devices (conftest) at exact fp32."""

import copy
import itertools

import pytest
import torch
import torch.fx
from torch import nn

import torch_tpu  # noqa: F401 - the tpu device
from torch_tpu import inductor


def trace(fn, *args) -> torch.fx.GraphModule:
    from torch.fx.experimental.proxy_tensor import make_fx

    return make_fx(fn, tracing_mode="fake")(*args)


def single(outputs):
    """A one-output graph's output: a compile fresh from Inductor returns it bare, one loaded from the cache
    as a 1-sequence."""
    return outputs[0] if isinstance(outputs, (list, tuple)) else outputs


def with_running_stats(model: nn.Module) -> nn.Module:
    """Batch norms with running statistics other than the initial 0 and 1."""
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                m.running_mean.uniform_(-1, 1)
                m.running_var.uniform_(0.5, 2)
    return model


def strict_and_compiled(model: nn.Module):
    strict = copy.deepcopy(model).to("tpu")
    mine = copy.deepcopy(model).to("tpu")
    return strict, mine, torch.compile(mine, backend="tpu")


# --- eval-mode batch norm under grad ---------------------------------------------------------


@pytest.mark.parametrize("make,dtype", [
    (lambda: nn.Sequential(nn.Linear(8, 4), nn.BatchNorm1d(4)), torch.float32),
    (lambda: nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU()), torch.float32),
    (lambda: nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU()), torch.bfloat16),
], ids=["linear-bn1d", "conv-bn2d-relu", "conv-bn2d-relu bf16"])
def test_an_eval_batch_norm_trains_compiled_as_strict(make, dtype):
    """The runner alternates compiled and op by op forwards: four steps meet each with each backward."""
    torch.manual_seed(0)
    model = with_running_stats(make()).eval().to(dtype)
    strict, mine, compiled = strict_and_compiled(model)
    shape = (5, 8) if isinstance(model[0], nn.Linear) else (2, 3, 8, 8)
    tolerance = 1e-5 if dtype == torch.float32 else 1.6e-2  # bf16: two of its ulps
    for _ in range(4):
        x = torch.randn(shape, dtype=dtype)
        expected, got = strict(x.to("tpu")), compiled(x.to("tpu"))
        expected.float().square().sum().backward()
        got.float().square().sum().backward()
        torch.testing.assert_close(got.detach().cpu(), expected.detach().cpu(), rtol=tolerance, atol=tolerance)
    for p, q in zip(mine.parameters(), strict.parameters()):
        torch.testing.assert_close(p.grad.cpu(), q.grad.cpu(), rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_eval_batch_norm_backward_takes_the_forward_s_empty_statistics(dtype):
    """Traced on tpu the saved statistics are (C,); the forward's CPU kernel (the tpu's) makes them empty."""
    torch.manual_seed(0)
    g, x = (torch.randn(5, 4, 3, device="tpu", dtype=dtype) for _ in range(2))
    w, mean = (torch.randn(4, device="tpu", dtype=dtype) for _ in range(2))
    var = (torch.rand(4) + 0.5).to("tpu", dtype)
    statistics = torch.ops.aten._native_batch_norm_legit_no_training(x, w, None, mean, var, 0.1, 1e-5)[1:]
    assert [tuple(s.shape) for s in statistics] == [(0,), (0,)]

    def backward(g, x, w, mean, var, save_mean, save_invstd):
        return torch.ops.aten.native_batch_norm_backward(g, x, w, mean, var, save_mean, save_invstd, False, 1e-5,
                                                         [True, True, True])

    traced = [torch.empty(4, device="tpu", dtype=torch.float32)] * 2  # what tracing says the forward makes
    runner = inductor.compile_graph(trace(backward, g, x, w, mean, var, *traced), [g, x, w, mean, var, *traced])
    strict = backward(g, x, w, mean, var, *statistics)
    variants = set()
    for _ in range(2):  # compiled, then op by op
        got = runner(g, x, w, mean, var, *statistics)
        variants.add(runner.last_ran_compiled)
        for e, c in zip(strict, got):  # (compiled: Inductor's decomposition, fp32 rounding apart)
            torch.testing.assert_close(c.cpu(), e.cpu(), rtol=1e-5, atol=1e-5)
    assert variants == {True, False}


def test_an_eval_batch_norm_inference_graph_compiles_unchanged(monkeypatch):
    """Without grad nothing reads the statistics: the graph is compiled as traced, nothing added."""
    torch._dynamo.reset()  # an earlier test's graph of the same structure would be reused, uncompiled here
    torch.manual_seed(0)
    model = with_running_stats(nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU())).eval().to("tpu")
    x = torch.randn(2, 3, 8, 8, device="tpu")
    graphs = []
    compile_graph = inductor.compile_graph

    def spy(gm, example_inputs, **kwargs):
        before = gm.code
        runner = compile_graph(gm, example_inputs, **kwargs)
        graphs.append((gm, gm.code == before, runner))
        return runner

    monkeypatch.setattr(inductor, "compile_graph", spy)
    with torch.no_grad():
        got = torch.compile(model, backend="tpu")(x)
        expected = model(x)
    ((gm, unchanged, runner),) = graphs
    assert any(n.target is torch.ops.aten._native_batch_norm_legit_no_training.default for n in gm.graph.nodes)
    assert unchanged and isinstance(runner, inductor.ChoosingRunner)  # compiled, not op by op
    torch.testing.assert_close(got.cpu(), expected.cpu(), rtol=1e-5, atol=1e-5)


# --- channels_last convolutions ----------------------------------------------------------------

CL = {4: torch.channels_last, 5: torch.channels_last_3d}


def conv_case(dims: int, input_last: bool, weight_last: bool, transposed: bool, groups: int, dtype: torch.dtype):
    """(input, weight, the convolution's arguments after the bias) for a `dims`-d convolution."""
    spatial = {1: (9,), 2: (9, 9), 3: (5, 6, 7)}[dims]
    x = torch.randn(2, 8, *spatial, dtype=dtype)
    w = torch.randn(8, 8 // groups, *([3] * dims), dtype=dtype)
    if dims == 1:  # channels_last has no 3d format: permuted memory instead
        x = x.transpose(1, 2).contiguous().transpose(1, 2) if input_last else x
        w = w.transpose(1, 2).contiguous().transpose(1, 2) if weight_last else w
    else:
        x = x.contiguous(memory_format=CL[x.dim()]) if input_last else x
        w = w.contiguous(memory_format=CL[w.dim()]) if weight_last else w
    args = ([1] * dims, [1] * dims, [1] * dims, transposed, [0] * dims, groups)
    return x, w, args


CONV_CASES = [c for c in itertools.product([1, 2, 3], [False, True], [False, True], [False, True], [1, 4],
                                           [torch.float32, torch.float64])
              if not (c[0] == 3 and c[4] == 4)]


def significant_strides(t: torch.Tensor) -> tuple:
    return tuple(s if n > 1 else None for n, s in zip(t.shape, t.stride()))


@pytest.mark.parametrize("dims,input_last,weight_last,transposed,groups,dtype", CONV_CASES)
def test_the_mxu_convolution_meta_lays_out_its_outputs_as_the_cpu_kernel(dims, input_last, weight_last,
                                                                         transposed, groups, dtype):
    """Inductor indexes an extern kernel's output by its Meta strides."""
    x, w, args = conv_case(dims, input_last, weight_last, transposed, groups, dtype)
    b = torch.randn(8, dtype=dtype)
    real = torch.ops.torch_tpu.mxu_convolution(x, w, b, *args)
    meta = torch.ops.torch_tpu.mxu_convolution(x.to("meta"), w.to("meta"), b.to("meta"), *args)
    assert meta.shape == real.shape and significant_strides(meta) == significant_strides(real)
    grad = torch.randn_like(real)
    backward_args = (grad, x, w, [8], *args, [True, True, True])
    real_grads = torch.ops.torch_tpu.mxu_convolution_backward(*backward_args)
    meta_grads = torch.ops.torch_tpu.mxu_convolution_backward(*[a.to("meta") if isinstance(a, torch.Tensor) else a
                                                                for a in backward_args])
    for r, m in zip(real_grads, meta_grads):
        assert m.shape == r.shape and significant_strides(m) == significant_strides(r)


def test_a_compiled_channels_last_convolution_graph_equals_strict():
    torch.manual_seed(0)
    x = torch.randn(2, 3, 8, 8, device="tpu").contiguous(memory_format=torch.channels_last)
    w1, w2 = torch.randn(4, 3, 3, 3, device="tpu"), torch.randn(2, 4, 1, 1, device="tpu")

    def f(x, w1, w2):
        return torch.relu(torch.conv2d(x, w1, padding=1) * 2 + 1).sum(1, keepdim=True) * torch.conv2d(
            torch.conv2d(x, w1, padding=1), w2)

    gm = trace(f, x, w1, w2)
    runner = inductor.compile_graph(gm, [x, w1, w2], choose=False)
    expected, got = f(x, w1, w2), single(runner(x, w1, w2))
    traced = gm.graph.output_node().args[0]
    traced = traced[0] if isinstance(traced, (list, tuple)) else traced
    assert got.stride() == traced.meta["val"].stride()  # what the next graph was compiled for
    torch.testing.assert_close(got.cpu(), expected.cpu(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("model_last,input_last", [(True, True), (True, False), (False, True)])
def test_compiled_channels_last_cnn_inference_equals_strict(model_last, input_last):
    torch.manual_seed(0)
    net = with_running_stats(nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                                           nn.Conv2d(8, 4, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten())).eval()
    net = net.to("tpu")
    if model_last:
        net = net.to(memory_format=torch.channels_last)
    x = torch.randn(2, 3, 16, 16, device="tpu")
    if input_last:
        x = x.contiguous(memory_format=torch.channels_last)
    with torch.no_grad():
        expected, got = net(x), torch.compile(net, backend="tpu")(x)
    torch.testing.assert_close(got.cpu(), expected.cpu(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("make", [
    lambda: nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU()),
    lambda: nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 2, 1)),
    # (no bias before a training batch norm: its gradient is 0 in exact arithmetic, rounding noise here)
    lambda: nn.Sequential(nn.Conv2d(3, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4)),
], ids=["conv-relu", "conv-relu-conv", "conv-bn"])
def test_compiled_channels_last_training_equals_strict(make):
    """Four steps: the runners alternate compiled and op by op forwards and backwards. The loss
    weighs the outputs by a fixed random probe (a batch-normalized output's sum of squares
    does not depend on the convolution: its gradient would be rounding noise)."""
    torch.manual_seed(0)
    strict, mine, compiled = strict_and_compiled(make())
    probe = None
    for _ in range(4):
        x = torch.randn(2, 3, 8, 8).to("tpu").contiguous(memory_format=torch.channels_last)
        expected, got = strict(x), compiled(x)
        probe = torch.randn(expected.shape, device="tpu") if probe is None else probe
        (expected * probe).sum().backward()
        (got * probe).sum().backward()
        torch.testing.assert_close(got.detach().cpu(), expected.detach().cpu(), rtol=1e-5, atol=1e-5)
    for p, q in zip(mine.parameters(), strict.parameters()):
        torch.testing.assert_close(p.grad.cpu(), q.grad.cpu(), rtol=1e-5, atol=1e-5)


def channels_last_slice(*shape, device="cpu"):
    """A channels_last tensor's slice along the width: channels_last strides, not dense."""
    x = torch.randn(*shape[:-1], 2 * shape[-1], device=device).contiguous(memory_format=torch.channels_last)
    return x[..., ::2]


@pytest.mark.parametrize("precision", ["medium", "high", "highest"])
@pytest.mark.parametrize("sliced", ["input", "weight"])
def test_the_mxu_convolution_of_a_channels_last_slice_lays_out_as_its_meta(precision, sliced):
    """Medium and high precision round the operands through a copy, which made a slice contiguous."""
    torch.manual_seed(0)
    x = channels_last_slice(2, 3, 6, 6) if sliced == "input" else torch.randn(2, 3, 6, 6)
    w = channels_last_slice(4, 3, 3, 3) if sliced == "weight" else torch.randn(4, 3, 3, 3)
    args = ([1, 1], [1, 1], [1, 1], False, [0, 0], 1)
    with torch.tpu.precision(precision):
        real = torch.ops.torch_tpu.mxu_convolution(x, w, None, *args)
        grads = torch.ops.torch_tpu.mxu_convolution_backward(torch.randn_like(real), x, w, [4], *args,
                                                              [True, True, False])
    meta = torch.ops.torch_tpu.mxu_convolution(x.to("meta"), w.to("meta"), None, *args)
    meta_grads = torch.ops.torch_tpu.mxu_convolution_backward(meta, x.to("meta"), w.to("meta"), [4], *args,
                                                               [True, True, False])
    assert real.is_contiguous(memory_format=torch.channels_last)  # as ATen's CPU convolution lays it out
    assert significant_strides(real) == significant_strides(meta)
    for r, m in zip(grads[:2], meta_grads[:2]):
        assert significant_strides(r) == significant_strides(m)


@pytest.mark.parametrize("precision", ["medium", "high", "highest"])
def test_an_eager_convolution_of_a_channels_last_slice_lays_out_as_on_cpu(precision):
    torch.manual_seed(0)
    x, w = channels_last_slice(2, 3, 6, 6), torch.randn(4, 3, 3, 3)
    expected = torch.conv2d(x, w, padding=1)
    with torch.tpu.precision(precision):
        got = torch.conv2d(x.to("tpu"), w.to("tpu"), padding=1)
    assert got.stride() == expected.stride()
    tolerance = 1e-5 if precision == "highest" else 5e-2  # bf16 operands below highest
    torch.testing.assert_close(got.cpu(), expected, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("precision", ["medium", "high"])
def test_a_compiled_convolution_of_a_channels_last_slice_equals_strict(precision):
    """A graph run on the tpu tensors themselves calls the tpu kernel, which made the slice
    contiguous, while the compiled code read its output as channels_last."""
    torch.manual_seed(0)
    x, w = channels_last_slice(2, 3, 6, 6, device="tpu"), torch.randn(4, 3, 3, 3, device="tpu")

    def f(x, w):
        return torch.conv2d(x, w, padding=1).relu() * 2

    with torch.tpu.precision(precision):
        runner = inductor.compile_graph(trace(f, x, w), [x, w], choose=False)
        expected, got = f(x, w), single(runner(x, w))
    torch.testing.assert_close(got.cpu(), expected.cpu(), rtol=1e-5, atol=1e-5)


def test_compiles_are_tagged_with_the_host_compile_revision(monkeypatch):
    """Inductor's cache key does not cover the MXU ops' Meta kernels: entries compiled before a
    change to them must not be handed back, by Inductor's cache tiers nor by ours."""
    seen = []
    compile_ = torch._inductor.standalone_compile

    def spy(*args, **kwargs):
        seen.append(torch.compiler.config.cache_key_tag)
        return compile_(*args, **kwargs)

    monkeypatch.setattr(torch._inductor, "standalone_compile", spy)
    monkeypatch.setattr(inductor, "HOST_COMPILE_REVISION", "test-" + str(id(seen)))  # a miss everywhere
    x = torch.randn(4, device="tpu")
    inductor.compile_graph(trace(lambda x: x.sin() * 3, x), [x], choose=False)
    assert seen == [f"torch_tpu-host-rtest-{id(seen)}"]


# --- two tpu devices -----------------------------------------------------------------------------


class TwoStage(nn.Module):
    """A model split across tpu:0 and tpu:1."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 2)

    def place(self):
        self.a.to("tpu:0")
        self.b.to("tpu:1")
        return self

    def forward(self, x):
        return self.b(torch.relu(self.a(x)).to("tpu:1"))


def test_a_model_split_across_two_devices_trains_compiled_as_strict():
    torch.manual_seed(0)
    model = TwoStage()
    strict, mine = copy.deepcopy(model).place(), copy.deepcopy(model).place()
    compiled = torch.compile(mine, backend="tpu")
    for _ in range(4):
        x = torch.randn(4, 8, device="tpu:0")
        expected, got = strict(x), compiled(x)
        assert got.device == expected.device == torch.device("tpu:1")
        expected.square().sum().backward()
        got.square().sum().backward()
        torch.testing.assert_close(got.detach().cpu(), expected.detach().cpu(), rtol=1e-5, atol=1e-5)
    for p, q in zip(mine.parameters(), strict.parameters()):
        assert p.grad.device == q.grad.device == p.device
        torch.testing.assert_close(p.grad.cpu(), q.grad.cpu(), rtol=1e-5, atol=1e-5)


CROSS_DEVICE = {
    "factory on tpu:1 beside a tpu:0 input": (lambda x: (x * 2, torch.ones(3, device="tpu:1") * 3), "tpu:0"),
    "factory on tpu:1, a cpu input": (lambda s: torch.arange(4, device="tpu:1") * s, "cpu"),
    "copy from tpu:0 to tpu:1": (lambda x: (x.exp().to("tpu:1") * 2, x.sum()), "tpu:0"),
    "inputs on tpu:0 and tpu:1": (lambda a, b: (a * 2 + 1, (b * 3).exp()), ("tpu:0", "tpu:1")),
    "all on tpu:1": (lambda x: ((x * 2 + 1).exp(), torch.ones(2, device="tpu:1") + 1), "tpu:1"),
}


@pytest.mark.parametrize("case", list(CROSS_DEVICE))
def test_compiled_results_land_on_strict_s_devices(case):
    fn, devices = CROSS_DEVICE[case]
    torch.manual_seed(0)
    args = [torch.randn(4, 4, device=d) if d != "cpu" else torch.tensor(2.0)
            for d in (devices if isinstance(devices, tuple) else (devices,))]
    expected, got = fn(*args), torch.compile(fn, backend="tpu")(*args)
    expected = expected if isinstance(expected, tuple) else (expected,)
    got = got if isinstance(got, tuple) else (got,)
    for e, g in zip(expected, got):
        assert g.device == e.device
        torch.testing.assert_close(g.cpu(), e.cpu(), rtol=1e-6, atol=1e-6)


def test_a_graph_runs_on_the_one_device_its_tensors_are_on():
    x0, x1 = torch.randn(4, device="tpu:0"), torch.randn(4, device="tpu:1")
    on_1 = trace(lambda x: x * 2 + torch.ones(4, device="tpu:1"), x1)
    assert inductor.graph_device(on_1, [x1]) == 1
    with pytest.raises(inductor.NotCompilable, match=r"tpu devices \[0, 1\]"):
        inductor.graph_device(on_1, [x1], device=0)  # the caller would run it on tpu:0
    mixed = trace(lambda a, b: (a * 2, b * 3), x0, x1)
    with pytest.raises(inductor.NotCompilable, match=r"tpu devices \[0, 1\]"):
        inductor.graph_device(mixed, [x0, x1])
    runner = inductor.compile_graph(trace(lambda: torch.ones(3, device="tpu:1") * 3), [], choose=False)
    out = single(runner())
    assert out.device == torch.device("tpu:1")
    torch.testing.assert_close(out.cpu(), torch.full((3,), 3.0))


@pytest.mark.parametrize("literal", [
    lambda x: torch.tensor([1.0, 2.0, 3.0], device=x.device),
    lambda x: torch.as_tensor([0.5, -1.0, 2.0], device=x.device),
    lambda x: torch.tensor(2.0, device=x.device),
], ids=["tensor", "as_tensor", "scalar"])
def test_a_tensor_literal_made_on_the_tpu_compiles(literal):
    """A constant built on the tpu inside the function: the CPU compile traced it as a tpu
    tensor among CPU examples and failed (FakeTensorDeviceMismatchError) where eager works."""
    def f(x):
        return x * 3 + literal(x)

    x = torch.randn(3, device="tpu")
    with torch.tpu.precision("highest"):
        got = torch.compile(f, backend="tpu")(x)
        torch.testing.assert_close(got.cpu(), f(x).cpu())
    assert got.device == x.device


def test_cpu_outputs_keep_their_aliasing_and_strides(monkeypatch):
    """CPU outputs of a compiled tpu graph that are views of one another (a slice, a transpose,
    an expand) come back as the same views of one copy, as eager's: they were cloned one by
    one (independent copies, an expand materialized)."""
    def f(x):
        y = (x * 2).cpu()
        return y, y[1:], y.t(), y[:, ::2], y.expand(2, 4, 3)

    x = torch.randn(4, 3, device="tpu")
    torch.use_deterministic_algorithms(True)  # the compiled variant on every call
    try:
        outs = torch.compile(f, backend="tpu")(x)
    finally:
        torch.use_deterministic_algorithms(False)
    want = f(x)
    assert [o.stride() for o in outs] == [w.stride() for w in want]
    assert all(o.untyped_storage().data_ptr() == outs[0].untyped_storage().data_ptr() for o in outs)
    for o, w in zip(outs, want):
        torch.testing.assert_close(o, w)
    outs[0][1, 0] = 100.0
    assert outs[1][0, 0] == 100.0 and outs[2][0, 1] == 100.0 and outs[4][1, 1, 0] == 100.0
