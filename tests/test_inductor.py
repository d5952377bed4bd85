"""Inductor on tpu (torch_tpu.inductor) and torch.compile(backend="tpu"):
compiled results equal Strict's (forward, gradients, optimizer step), matmul
precision included; buffers and outputs live in tpu memory; outputs that
alias inputs share their storage - whether a graph runs directly on the tpu
tensors or on host views of them (torch_tpu.direct_run); graphs that cannot
keep tpu semantics run op by op; the runner keeps whichever of compiled / op
by op measures faster."""

import copy
import time

import pytest
import torch
import torch.fx
from torch import nn

import torch_tpu

from torch_tpu import direct_run, inductor


def zoo() -> dict:
    torch.manual_seed(0)
    cnn = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 6 * 6, 4))
    block = nn.TransformerEncoderLayer(d_model=32, nhead=4, dim_feedforward=64, dropout=0.0, batch_first=True)
    dense = nn.Sequential(nn.Linear(13, 64), nn.ReLU(), nn.Linear(64, 16), nn.ReLU())
    return {"mlp": (nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.GELU(), nn.Linear(32, 4)),
                    torch.randn(8, 16)),
            "cnn with batchnorm": (cnn, torch.randn(4, 3, 8, 8)),
            "transformer block": (block, torch.randn(2, 10, 32)),
            "dlrm dense arch": (dense, torch.randn(64, 13))}


def train_steps(model: nn.Module, x: torch.Tensor, *, compiled: bool = False, mode: str = "strict", steps: int = 2,
                after_step=None) -> list[torch.Tensor]:
    """Forward, .square().mean().backward() and an SGD momentum step, `steps` times (the model compiled with the
    tpu backend or not, under eager `mode`): each step's output, then the last gradients and the final state_dict.
    (Not Adam: gradients that are zero in exact arithmetic - a key bias under softmax - are rounding noise, which
    Adam scales to lr-sized steps of random sign.)"""
    model = copy.deepcopy(model).to("tpu")
    fn = torch.compile(model, backend="tpu") if compiled else model
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=0.01)
    outs = []
    with torch_tpu.eager_mode(mode):
        for _ in range(steps):
            opt.zero_grad()
            out = fn(x.to("tpu"))
            out.square().mean().backward()
            opt.step()
            outs.append(out.detach().cpu())
            if after_step is not None:
                after_step()
    return outs + [p.grad.cpu() for p in model.parameters()] + [t.detach().cpu() for t in model.state_dict().values()]


@pytest.mark.parametrize("name", ["mlp", "cnn with batchnorm", "transformer block", "dlrm dense arch"])
def test_compiled_training_equals_strict(name):
    model, x = zoo()[name]
    strict = train_steps(model, x, compiled=False)
    compiled = train_steps(model, x, compiled=True)
    assert len(strict) == len(compiled)
    for a, b in zip(strict, compiled):
        # Fused reductions sum in another order: fp32 rounding apart, no more.
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)


def test_compiled_matmuls_keep_the_tpu_precision():
    torch.manual_seed(0)
    a, b = torch.randn(64, 256), torch.randn(256, 32)
    fn = torch.compile(lambda x, y: torch.relu(x @ y) + 1, backend="tpu")
    exact = torch.relu(a @ b) + 1
    rounded = torch.relu(a.bfloat16().float() @ b.bfloat16().float()) + 1
    with torch.tpu.precision("medium"):
        medium_strict = (torch.relu(a.to("tpu") @ b.to("tpu")) + 1).cpu()
        medium = fn(a.to("tpu"), b.to("tpu")).cpu()
    torch.testing.assert_close(medium, medium_strict, rtol=0, atol=0)
    torch.testing.assert_close(medium, rounded, rtol=1e-5, atol=1e-5)
    assert (medium - exact).abs().max() > 1e-3  # bf16 operands, visibly
    # The precision is read when the graph runs, not when it was compiled.
    with torch.tpu.precision("highest"):
        torch.testing.assert_close(fn(a.to("tpu"), b.to("tpu")).cpu(), exact, rtol=1e-5, atol=1e-5)


def record_splits(patch=setattr) -> list:
    """Every graph inductor.compile_around splits from now on (None where it compiles nothing);
    ``patch`` installs the spy (``monkeypatch.setattr`` in a test, plain setattr in a subprocess)."""
    splits = []
    compile_around = inductor.compile_around
    patch(inductor, "compile_around", lambda gm, choose=True: splits.append(compile_around(gm, choose)) or splits[-1])
    return splits


def has_compiled_segment(split) -> bool:
    return split is not None and any(isinstance(m, inductor._Compiled) for m in split.children())


def trace(fn, *args) -> torch.fx.GraphModule:
    from torch.fx.experimental.proxy_tensor import make_fx

    return make_fx(fn, tracing_mode="fake")(*args)


@pytest.fixture(params=["direct", "host views"])
def direct(request, monkeypatch) -> bool:
    """Whether graphs compiled in the test run directly on tpu tensors (else on host views)."""
    if request.param == "host views":
        monkeypatch.setattr(direct_run, "prepare", lambda compiled: False)
    return request.param == "direct"


def single(outputs):
    """A one-output graph's output: a compile fresh from Inductor returns it bare, one loaded from the cache
    as a 1-sequence."""
    return outputs[0] if isinstance(outputs, (list, tuple)) else outputs


def test_buffers_and_outputs_live_in_tpu_memory(direct):
    x = torch.randn(256, 256, device="tpu")

    def f(x):
        return (x.sin() @ x.cos()).tanh().sum(0)

    runner = inductor.compile_graph(trace(f, x), [x], choose=False)
    assert runner.direct is direct
    torch.tpu.synchronize()
    before = torch.tpu.memory_allocated()
    torch.tpu.reset_peak_memory_stats()
    out = single(runner(x))
    assert out.device.type == "tpu"
    torch.testing.assert_close(out.cpu(), f(x.cpu()), rtol=1e-4, atol=1e-3)
    assert torch.tpu.memory_allocated() - before == out.untyped_storage().nbytes()
    # The 256x256 intermediates were tpu allocations too.
    assert torch.tpu.max_memory_allocated() - before >= 256 * 256 * 4


def test_outputs_that_alias_inputs_share_their_storage(direct):
    x = torch.randn(8, 6, device="tpu")
    runner = inductor.compile_graph(trace(lambda x: (x[2:], x * 2), x), [x], choose=False)
    assert runner.direct is direct
    view, doubled = runner(x)
    assert view.device.type == "tpu" and doubled.device.type == "tpu"
    assert view.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
    x.add_(1)
    torch.testing.assert_close(view.cpu(), x.cpu()[2:])


def mlp_layer(x, w, b, gamma, beta):
    return nn.functional.gelu(nn.functional.layer_norm(x @ w + b, (w.shape[1],), gamma, beta)).sum(0)


@pytest.mark.parametrize("precision", ["highest", "medium"])
def test_direct_and_host_view_runs_agree_bit_for_bit(precision, monkeypatch):
    torch.manual_seed(0)
    args = [torch.randn(64, 32), torch.randn(32, 48), torch.randn(48), torch.randn(48), torch.randn(48)]
    args = [a.to("tpu") for a in args]
    gm = trace(mlp_layer, *args)
    direct_runner = inductor.compile_graph(gm, args, choose=False)
    monkeypatch.setattr(direct_run, "prepare", lambda compiled: False)
    view_runner = inductor.compile_graph(gm, args, choose=False)
    assert direct_runner.direct and not view_runner.direct
    with torch.tpu.precision(precision):
        direct_out, view_out = single(direct_runner(*args)), single(view_runner(*args))
        strict = mlp_layer(*args)
    assert direct_out.device.type == "tpu"
    torch.testing.assert_close(direct_out.cpu(), view_out.cpu(), rtol=0, atol=0)
    torch.testing.assert_close(direct_out.cpu(), strict.cpu(), rtol=1e-5, atol=1e-4)


def test_a_graph_with_a_cpu_output_runs_on_host_views():
    x = torch.randn(16, device="tpu")
    runner = inductor.compile_graph(trace(lambda x: ((x * 2).sum().cpu(), x.exp()), x), [x], choose=False)
    assert not runner.direct
    total, exp = runner(x)
    assert total.device.type == "cpu" and exp.device.type == "tpu"
    torch.testing.assert_close(total, (x.cpu() * 2).sum())
    torch.testing.assert_close(exp.cpu(), x.cpu().exp())


def test_inputs_are_checked_against_the_layouts_the_graph_was_compiled_for(direct):
    # One builtin call checks them all; the wrapper asserts none itself.
    x, y = torch.randn(4, 8, device="tpu"), torch.randn(8, device="tpu")
    runner = inductor.compile_graph(trace(lambda x, y: ((x * y).exp(),), x, y), [x, y], choose=False)
    assert runner.direct == direct
    assert runner._layouts == ((0, (4, 8), (8, 1)), (1, (8,), (1,)))
    source = direct_run._wrapper_globals(runner.compiled)["__file__"]
    with open(source) as f:
        assert "assert_size_stride(" not in f.read()  # (the name is imported all the same)
    torch.testing.assert_close(single(runner(x, y)).cpu(), (x.cpu() * y.cpu()).exp())
    column_major = x.cpu().t().contiguous().t().to("tpu")  # same values and sizes, strides (1, 4)
    with pytest.raises(AssertionError, match=r"compiled graph input 0: compiled for size \(4, 8\) and stride "
                                             r"\(8, 1\), got size \[4, 8\] and stride \[1, 4\]"):
        runner(column_major, y)
    with pytest.raises(AssertionError, match=r"compiled graph input 1: .* got size \[9\]"):
        runner(x, torch.randn(9, device="tpu"))
    single_row = torch.randn(1, 8, device="tpu")[:, :]  # a size-1 dim's stride is free, as Inductor's assert has it
    one = inductor.compile_graph(trace(lambda x: (x + 1,), single_row), [single_row], choose=False)
    wide = torch.randn(2, 16, device="tpu")[:1, :8]  # strides (16, 1) against the compiled (8, 1)
    torch.testing.assert_close(single(one(wide)).cpu(), wide.cpu() + 1)


def test_symbolic_inputs_leave_the_size_checks_to_inductor():
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

    assert inductor.input_layouts([torch.randn(4, 8), 3]) == ((0, (4, 8), (8, 1)),)
    mode = FakeTensorMode(shape_env=ShapeEnv(), static_shapes=False)
    dynamic = mode.from_tensor(torch.randn(4, 8), symbolic_context=StatelessSymbolicContext(
        dynamic_sizes=[DimDynamic.DYNAMIC, DimDynamic.STATIC]))
    assert inductor.input_layouts([torch.randn(2), dynamic]) is None


def test_the_direct_allocator_follows_the_thread():
    """Inside enter_direct the wrapper's allocations are tpu memory on that thread only; elsewhere cpu."""
    import threading

    empty_strided = direct_run._builtins()["empty_strided"]
    enter, leave = direct_run.switches()
    assert empty_strided((2, 3), (3, 1), torch.float32).device.type == "cpu"
    previous = enter(0)
    try:
        t = empty_strided((2, 3), (3, 1), torch.bfloat16)
        assert (t.device.type, t.dtype, t.shape, t.stride()) == ("tpu", torch.bfloat16, (2, 3), (3, 1))
        elsewhere = []
        other = threading.Thread(target=lambda: elsewhere.append(empty_strided((4,), (1,), torch.float32).device.type))
        other.start()
        other.join()
        assert elsewhere == ["cpu"]
    finally:
        leave(previous)
    assert empty_strided((2,), (1,), torch.float32).device.type == "cpu"
    with pytest.raises(TypeError, match="torch.dtype"):
        empty_strided((2,), (1,), "float32")


def test_compiled_code_run_outside_a_direct_run_allocates_cpu_memory():
    """Inductor loads one module per generated source, so a CPU compile of the same graph may
    share the wrapper module a tpu graph re-pointed: called on CPU tensors outside a direct run,
    its buffers and outputs are CPU memory."""
    x = torch.randn(32, device="tpu")
    runner = inductor.compile_graph(trace(lambda x: (x.sin() + 1).cos() * x, x), [x], choose=False)
    assert runner.direct
    assert direct_run._wrapper_globals(runner.compiled)["empty_strided_cpu"] is direct_run._builtins()["empty_strided"]
    out = single(runner.compiled(x.cpu()))
    assert out.device.type == "cpu"
    torch.testing.assert_close(out, (x.cpu().sin() + 1).cos() * x.cpu())


def test_a_direct_graph_on_another_device_allocates_there():
    x = torch.randn(64, 64, device="tpu:1")
    runner = inductor.compile_graph(trace(lambda x: (x @ x).relu() + 1, x), [x], choose=False)
    assert runner.direct
    torch.tpu.synchronize(1)
    before = [torch.tpu.memory_allocated(d) for d in (0, 1)]
    out = single(runner(x))
    after = [torch.tpu.memory_allocated(d) for d in (0, 1)]
    assert out.device == torch.device("tpu:1") and torch.tpu.current_device() == 0
    assert after[0] == before[0] and after[1] - before[1] == out.untyped_storage().nbytes()
    torch.testing.assert_close(out.cpu(), ((x @ x).relu() + 1).cpu(), rtol=0, atol=0)  # Strict's numbers


def test_a_direct_graph_runs_after_the_streams_queued_work():
    x = torch.zeros(64, device="tpu")
    runner = inductor.compile_graph(trace(lambda x: x.sin() + 1, x), [x], choose=False)
    assert runner.direct
    s = torch.tpu.Stream()
    torch.tpu.submit(s, lambda: (time.sleep(0.1), x.fill_(3.0)))
    with torch.tpu.stream(s):
        y = single(runner(x))
    torch.testing.assert_close(y.cpu(), torch.full((64,), 3.0).sin() + 1)


def targets(gm: torch.fx.GraphModule) -> list:
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("precision", ["highest", "high", "medium"])
def test_a_linear_read_by_a_kernel_equals_strict_bit_for_bit(dtype, precision):
    """The bias stays inside the matmul (mxu_addmm), read by a kernel or not. Added to the finished
    product instead, a bf16/fp16 product would be rounded before the add, and at fp32 the sum taken in
    another order: the MXU kernels start their accumulators from the bias (K = 1024: several blocks)."""
    torch.manual_seed(0)
    x, w = torch.randn(64, 1024, device="tpu", dtype=dtype), torch.randn(256, 1024, device="tpu", dtype=dtype)
    b = (torch.randn(256) * 30).to("tpu", dtype)

    def linear_relu(x, w, b):
        return torch.relu(torch.addmm(b, x, w.t())) * 2

    gm = trace(linear_relu, x, w, b)
    assert torch.ops.torch_tpu.mxu_addmm.default in targets(inductor.host_graph(gm))
    with torch.tpu.precision(precision):
        runner = inductor.compile_graph(gm, [x, w, b], choose=False)
        got, strict = single(runner(x, w, b)), linear_relu(x, w, b)
    torch.testing.assert_close(got.cpu(), strict.cpu(), rtol=0, atol=0)


def test_a_matmul_without_an_mxu_op_runs_op_by_op():
    a, v = torch.randn(16, 8, device="tpu"), torch.randn(8, device="tpu")
    gm = trace(lambda a, v: torch.mv(a, v).exp(), a, v)
    assert any(n.target == torch.ops.aten.mv.default for n in gm.graph.nodes)
    with pytest.raises(inductor.NotCompilable, match="aten.mv"):
        inductor.host_graph(gm)
    with torch.tpu.precision("medium"):
        runner = inductor.compile_graph(gm, [a, v])
        assert runner is gm  # op by op: the tpu's mv at medium precision
        torch.testing.assert_close(runner(a, v).cpu(), torch.mv(a, v).exp().cpu(), rtol=0, atol=0)


@pytest.mark.parametrize("faster", ["compiled", "replay"])
def test_the_runner_keeps_the_faster_variant(faster):
    calls = {"compiled": 0, "replay": 0}

    def variant(name):
        def run(x):
            calls[name] += 1
            time.sleep(0.0 if name == faster else 0.01)
            return x + 1
        return run

    runner = inductor.ChoosingRunner(variant("compiled"), variant("replay"))
    x = torch.zeros(2, device="tpu")
    for _ in range(runner.CALLS_TO_CHOOSE):
        torch.testing.assert_close(runner(x).cpu(), torch.ones(2))
    assert runner.runs_compiled == (faster == "compiled")
    before = dict(calls)
    runner(x)
    assert calls[faster] == before[faster] + 1


@pytest.mark.parametrize("deterministic", [False, True])
def test_deterministic_algorithms_keep_a_graph_compiled(deterministic):
    """While the choice is measured, calls alternate between the variants, whose results
    may differ by rounding; under torch.use_deterministic_algorithms every call runs the
    compiled one, so the results never depend on timings."""
    ran = []

    def variant(name):
        def run(x):
            ran.append(name)
            return x + 1
        return run

    runner = inductor.ChoosingRunner(variant("compiled"), variant("replay"))
    x = torch.zeros(2, device="tpu")
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(deterministic)
    try:
        for _ in range(runner.CALLS_TO_CHOOSE + 2):
            torch.testing.assert_close(runner(x).cpu(), torch.ones(2))
    finally:
        torch.use_deterministic_algorithms(before)
    assert set(ran) == ({"compiled"} if deterministic else {"compiled", "replay"})


def test_a_close_choice_is_checked_again_and_a_noisy_start_corrected():
    # The compiled variant's first calls are slowed (a burst of other work, say): op by op is
    # chosen, but the two were within CLOSE, so a later check times compiled at its real speed.
    calls = {"compiled": 0, "replay": 0}

    def compiled(x):
        calls["compiled"] += 1
        time.sleep(0.03 if calls["compiled"] <= 4 else 0.0)
        return x + 1

    def replay(x):
        calls["replay"] += 1
        time.sleep(0.02)
        return x + 1

    runner = inductor.ChoosingRunner(compiled, replay)
    runner.RECHECK_EVERY = 3
    x = torch.zeros(2, device="tpu")
    for _ in range(runner.CALLS_TO_CHOOSE):
        runner(x)
    assert runner.runs_compiled is False
    for _ in range(runner.RECHECK_EVERY + 1):  # the check's two timed calls end the first RECHECK_EVERY
        torch.testing.assert_close(runner(x).cpu(), torch.ones(2))
    assert runner.runs_compiled is True
    before = dict(calls)
    runner(x)
    assert calls == {**before, "compiled": before["compiled"] + 1}


def test_a_clear_choice_is_not_checked_again():
    calls = {"compiled": 0, "replay": 0}

    def variant(name, seconds):
        def run(x):
            calls[name] += 1
            time.sleep(seconds)
            return x + 1
        return run

    runner = inductor.ChoosingRunner(variant("compiled", 0.0), variant("replay", 0.02))
    runner.RECHECK_EVERY = 2
    x = torch.zeros(2, device="tpu")
    for _ in range(runner.CALLS_TO_CHOOSE):
        runner(x)
    before = dict(calls)
    for _ in range(10):
        runner(x)
    assert calls == {**before, "compiled": before["compiled"] + 10}


def test_a_check_whose_last_run_never_reports_is_made_again_later():
    """A caller may drop a timed run (a DeferAndFuse segment or chain whose run departs
    from its ops): the check that run would have ended is made again later, not never."""
    from torch_tpu.timed_choice import TimedChoice

    choice = TimedChoice("test", ("a", "b"))
    choice.RECHECK_EVERY = 4
    while choice.chosen is None:
        variant, timed = choice.next()
        choice.report(variant, 1.0 if variant == 0 else 1.5)  # within CLOSE: to be checked again
    check = [choice.next() for _ in range(3)]
    assert check == [(0, False), (0, False), (1, True)], check
    choice.report(1, 1.5)  # the check's first run reports
    assert choice.next() == (0, True)  # its last run never does
    later = [choice.next() for _ in range(8)]
    assert (1, True) in later, later


def test_the_tpu_backend_is_found_by_name():
    from torch._dynamo import list_backends

    assert "tpu" in list_backends(exclude_tags=())


def test_shape_specializations_are_bounded(monkeypatch):
    """New batch sizes after the first make Dynamo hand over a symbolic graph:
    one static compile per size, up to the bound, then uncompiled with one
    warning - and the results stay right throughout."""
    from torch_tpu import compile_backend

    monkeypatch.setattr(compile_backend, "MAX_SPECIALIZATIONS", 3)
    torch._dynamo.reset()
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 2)).to("tpu")
    compiled = torch.compile(model, backend="tpu")
    specializations = []
    original = compile_backend.ShapeSpecializations.__call__

    def spy(self, *args):
        specializations.append(self)
        return original(self, *args)

    monkeypatch.setattr(compile_backend.ShapeSpecializations, "__call__", spy)
    with pytest.warns(RuntimeWarning, match="3 shape specializations of one graph"), torch.no_grad():
        for batch in range(2, 10):
            x = torch.randn(batch, 8, device="tpu")
            torch.testing.assert_close(compiled(x).cpu(), model(x).cpu(), rtol=1e-5, atol=1e-6)
    assert specializations and max(len(s.compiled) for s in specializations) == 3


@pytest.mark.parametrize("dynamic", [None, True])
def test_new_sizes_of_a_function_of_tensor_methods_compile_per_shape(dynamic):
    """Dynamo's graph calls tensor methods (``x.norm``) as call_method nodes: their symbolic
    sizes reach compiled code as much as a function's do (they were taken for ops run as
    they are, and the compile failed on symbolic sizes)."""
    torch._dynamo.reset()

    def normalize(x):
        return x.div(x.norm(dim=1, keepdim=True)).softmax(-1)

    compiled = torch.compile(normalize, backend="tpu", dynamic=dynamic)
    for batch in (2, 3, 5):
        x = torch.randn(batch, 8)
        torch.testing.assert_close(compiled(x.to("tpu")).cpu(), normalize(x))


def test_compiled_dropout_repeats_its_mask_under_a_seed():
    # A graph drawing random numbers is not alternated between compiled and op by op
    # (two random streams) while the runner times them.
    model = nn.Sequential(nn.Linear(16, 16), nn.Dropout(0.5)).to("tpu")
    compiled = torch.compile(model, backend="tpu")
    x = torch.ones(4, 16, device="tpu")
    masks = []
    for _ in range(10):
        torch.tpu.manual_seed(0)
        masks.append((compiled(x) == 0).cpu())
    assert all(torch.equal(masks[0], m) for m in masks)
    assert 0 < int(masks[0].sum()) < masks[0].numel()


def test_graphs_with_value_dependent_sizes_run_op_by_op():
    import torch._dynamo

    y = torch.tensor([1.0, -2.0, 3.0], device="tpu")
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True, capture_scalar_outputs=True):
        masked = torch.compile(lambda x: (x[x > 0] * 2).sum(), backend="tpu", fullgraph=True)
        counted = torch.compile(lambda x: torch.ones(int((x > 0).sum().item()), device="tpu").sum(), backend="tpu")
        assert masked(y).item() == 8.0
        assert counted(y).item() == 2.0


@pytest.mark.parametrize("mode, weighted", [("sum", False), ("mean", False), ("sum", True), ("max", False)])
def test_compiled_embedding_bag_trains_as_eager(mode, weighted):
    # The CPU kernel's offset2bag / bag_size are shaped unlike the tpu graph's: those ops run op by op.
    torch.manual_seed(0)
    bag = nn.EmbeddingBag(50, 8, mode=mode).to("tpu")
    compiled_bag = copy.deepcopy(bag)
    ids, offsets = torch.randint(0, 50, (12,)).to("tpu"), torch.tensor([0, 3, 6, 9]).to("tpu")
    weights = torch.rand(12).to("tpu") if weighted else None
    results = []
    for module, fn in ((bag, bag), (compiled_bag, torch.compile(compiled_bag, backend="tpu"))):
        out = fn(ids, offsets, per_sample_weights=weights)
        out.square().sum().backward()
        results.append((out.detach().cpu(), module.weight.grad.cpu()))
    for eager, compiled in zip(*results):
        torch.testing.assert_close(compiled, eager, rtol=1e-6, atol=1e-6)
