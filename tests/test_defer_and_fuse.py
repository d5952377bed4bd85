"""DeferAndFuse (torch_tpu.defer, torch_tpu.deferred_graph) against Strict:
the same code gives Strict's results - training steps of the model zoo,
matmul precision, random ops, in-place updates, autograd - while the ops are
recorded and run later as graphs; every sync point materializes the pending
graph; intermediates nobody holds are never allocated; repeated steps hit
the graph cache."""

import contextlib
import gc
import io
import os
import subprocess
import sys
import time

import pytest
import torch
from torch import nn

import torch_tpu
from torch_tpu import defer, defer_segments, deferred_graph
from torch_tpu.eager import EagerMode
from tests.test_inductor import train_steps, zoo

is_deferred = torch.ops.torch_tpu._is_deferred
COMPILE = "TORCH_TPU_DEFER_COMPILE"


@pytest.fixture(autouse=True)
def strict_after(monkeypatch):
    """Each test starts with fresh stats and an empty graph cache (the cache
    reads the compile setting per graph and keeps it), and ends in Strict.
    Graphs run op by op - Strict's kernels, for exact comparisons - unless the
    test asks for compiles."""
    monkeypatch.setenv(COMPILE, "off")
    monkeypatch.setattr(defer.engine(), "graphs", deferred_graph.GraphCache())
    monkeypatch.setattr(defer.engine(), "segments", defer_segments.Segments(defer.engine().segments.max_ops))
    defer.reset_stats()
    yield
    torch_tpu.set_eager_mode("strict")
    cache = defer.engine().graphs
    cache.wait_for_compiles()  # no compile left running into the next test
    if cache._pool is not None:
        cache._pool.shutdown()
    defer.reset_stats()


def deferring():
    return torch_tpu.eager_mode("defer_and_fuse")


def test_the_variable_selects_defer_and_fuse_in_a_fresh_process():
    code = ("import torch, torch_tpu\n"
            "from torch_tpu import defer\n"
            "print(torch_tpu.get_eager_mode().value)\n"
            "y = torch.arange(4.0, device='tpu') * 2 + 1\n"
            "print(torch.ops.torch_tpu._is_deferred(y), defer.stats().ops_recorded > 0)\n"
            "print(y.cpu().tolist(), torch.ops.torch_tpu._is_deferred(y))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "TORCH_TPU_DEFER_AND_FUSE": "1"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["defer_and_fuse", "True True", "[1.0, 3.0, 5.0, 7.0] False"], out


# ---- 1. the model zoo ----

@pytest.mark.parametrize("name, compile_mode, steps", [
    ("mlp", "async", 3),  # the default: op by op while compiles run in the background
    ("cnn with batchnorm", "off", 3),
    ("transformer block", "off", 3),
    ("mlp", "sync", 10),  # compiled on the calling thread; the runner then measures both variants
])
def test_model_zoo_training_equals_strict(name, compile_mode, steps, monkeypatch):
    monkeypatch.setenv(COMPILE, compile_mode)
    model, x = zoo()[name]
    strict = train_steps(model, x, steps=steps)
    defer.reset_stats()
    deferred = train_steps(model, x, mode="defer_and_fuse", steps=steps)
    stats = defer.stats()
    assert stats.graphs > 0 and stats.ops_recorded > stats.graphs, stats
    assert stats.compiled_runs + stats.replayed_runs == stats.graphs, stats
    if compile_mode == "sync":
        assert stats.compiled_runs > 0 and stats.replayed_runs > 0, stats
    if compile_mode == "off":
        assert stats.compiled_runs == 0, stats
    assert len(strict) == len(deferred)
    # Op by op runs Strict's kernels in Strict's order: the same bits. Compiled graphs sum in other orders:
    # fp32 rounding apart, no more.
    tol = dict(rtol=0, atol=0) if compile_mode == "off" else dict(rtol=1e-4, atol=1e-5)
    for a, b in zip(strict, deferred):
        torch.testing.assert_close(b, a, **tol)


# ---- 2. sync points ----

def pending_y(x: torch.Tensor) -> torch.Tensor:
    """Inside DeferAndFuse: y = x.sin() * 2 + 1, recorded and not run."""
    graphs = defer.stats().graphs
    y = x.sin() * 2 + 1
    assert is_deferred(y)
    assert defer.stats().graphs == graphs
    return y


def strict_y(x: torch.Tensor) -> torch.Tensor:
    assert torch_tpu.get_eager_mode() is EagerMode.STRICT
    y = x.sin() * 2 + 1
    assert not is_deferred(y)
    return y


def _save(y):
    buffer = io.BytesIO()
    torch.save(y, buffer)
    return buffer


def _load(buffer):
    buffer.seek(0)
    return torch.load(buffer).cpu()


def _print(y):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        print(y)
    return out.getvalue()


def _data_ptr(y):
    assert y.data_ptr() != 0
    assert not is_deferred(y)


def _synchronize(y):
    torch.tpu.synchronize()
    assert not is_deferred(y)


def _mark_step(y):
    torch.tpu.mark_step()
    assert not is_deferred(y)


def _submit(y):
    return torch.tpu.submit(torch.tpu.Stream(), lambda: y.cpu()).result(timeout=60)


SYNC_POINTS = {
    # name: (the read, the reason it materializes or None (not checked), then the value to compare)
    "cpu": (lambda y: y.cpu(), "aten._to_copy.default", None),
    "item": (lambda y: y.sum().item(), "aten._local_scalar_dense.default", None),
    "str": (str, None, None),
    "print": (_print, None, None),
    "nonzero": (lambda y: torch.nonzero(y > 1), "aten.nonzero.default", lambda t: t.cpu()),
    "save and load": (_save, "torch.save", _load),
    "data_ptr": (_data_ptr, "Tensor.data_ptr", None),
    "synchronize": (_synchronize, "torch.tpu.synchronize", None),
    "mark_step": (_mark_step, "torch.tpu.mark_step", None),
    "submit": (_submit, "work submitted to a tpu stream", None),
}


@pytest.mark.parametrize("point", list(SYNC_POINTS))
def test_sync_points_materialize_and_give_stricts_value(point):
    read, reason, then = SYNC_POINTS[point]
    then = then or (lambda value: value)
    torch.manual_seed(0)
    x = torch.randn(5, 4, device="tpu")
    y_strict = strict_y(x)
    expected = then(read(y_strict))
    with deferring():
        y = pending_y(x)
        got = read(y)
        assert not is_deferred(y)
        stats = defer.stats()
        if point == "save and load":
            # Then torch.save's storage.cpu() records an empty tpu tensor and set_s it: a graph of its own.
            assert stats.materialized_by[reason] == 1, stats
        else:
            assert stats.graphs == 1, stats
            if reason is not None:
                assert stats.materialized_by == {reason: 1}, stats
        got = then(got)
        torch.testing.assert_close(y.cpu(), y_strict.cpu(), rtol=0, atol=0)
    if isinstance(expected, torch.Tensor):
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
    else:
        assert got == expected


def test_the_size_limit_materializes(monkeypatch):
    monkeypatch.setattr(defer, "MAX_OPS", 4)
    torch.manual_seed(0)
    x = torch.randn(6, device="tpu")

    def chain(t):
        for i in range(10):
            t = t * 1.5 if i % 2 else t - 0.25
        return t

    expected = chain(x).cpu()
    with deferring():
        y = chain(x)
        stats = defer.stats()
        assert stats.ops_recorded == 10
        assert stats.materialized_by["size limit"] == 2 and stats.graphs == 2, stats
        assert is_deferred(y)  # the last 2 ops are pending
        torch.testing.assert_close(y.cpu(), expected, rtol=0, atol=0)
    assert defer.stats().graphs == 3


def test_repeating_steps_without_sync_points_are_cut_at_their_boundaries(monkeypatch):
    """A loop with no materialization point at all: the repeat detector cuts the
    recording where the step repeats, so every later graph is the same step and
    hits the cache, and the result equals Strict's."""
    monkeypatch.setattr(defer._Repeats, "MIN_PERIOD", 8)
    monkeypatch.setattr(defer._Repeats, "WINDOW", 4)
    torch.manual_seed(0)
    w = torch.randn(8, 8, device="tpu")

    def steps(x, n):
        for _ in range(n):  # 12 ops a step
            h = torch.tanh(x @ w) * 0.5
            x = (h + x).sin() - h.cos() * 0.1
            x = x / (x.abs().amax() + 1.0)
        return x

    x0 = torch.randn(4, 8, device="tpu")
    expected = steps(x0, 12).cpu()
    with deferring():
        y = steps(x0, 12)
        stats = defer.stats()
        assert stats.materialized_by["repeat boundary"] >= 10, stats
        keys = len(defer.engine().graphs.entries)
        y = steps(y, 3)
        assert len(defer.engine().graphs.entries) == keys  # the same step graph again
        got = y.cpu()
    torch.testing.assert_close(got, steps(expected.to("tpu"), 3).cpu(), rtol=0, atol=0)
    assert keys <= 3, keys  # the first (rotated) graph, the period, and at most one more


# ---- 3. dead intermediates ----

MIB = 1 << 20
# With TORCH_TPU_DEFER_COMPILE=sync a graph is compiled by the time it has run
# a few times; its runner then alternates compiled and op by op while it measures.
SYNC_RUNS = 4


def deferred_runs(fn, compile_mode: str) -> list[tuple]:
    """fn() under DeferAndFuse, each run in its own block (SYNC_RUNS of them when compiles are
    synchronous, so that one runs compiled; else one): [(its result, whether it ran compiled)]."""
    results = []
    for _ in range(SYNC_RUNS if compile_mode == "sync" else 1):
        before = defer.stats().compiled_runs
        with deferring():
            out = fn()
        results.append((out, defer.stats().compiled_runs > before))
    return results


def check_runs(results, expected, compile_mode: str, tol: float) -> None:
    """Op-by-op runs give exactly `expected`; compiled ones (sync mode: at least one) within `tol`."""
    if compile_mode == "sync":
        assert any(compiled for _, compiled in results), defer.stats()
    else:
        assert not any(compiled for _, compiled in results), defer.stats()
    for got, compiled in results:
        for g, e in zip(got, expected):
            t = tol if compiled else 0
            torch.testing.assert_close(g, e, rtol=t, atol=t)


def peak_of_chain(x: torch.Tensor) -> tuple:
    """The peak tpu memory above what was allocated before a chain of 20
    elementwise ops of which only the last result is kept; and the result."""
    torch.tpu.synchronize()
    baseline = torch.tpu.memory_allocated()
    torch.tpu.reset_peak_memory_stats()
    y = x
    for _ in range(10):
        y = y * 0.5 + 0.25  # Strict holds y, y * 0.5 and the sum at once
    torch.tpu.synchronize()
    peak = torch.tpu.max_memory_allocated() - baseline
    return peak, y.cpu()


@pytest.mark.parametrize("compile_mode", ["off", "sync"])
def test_dead_intermediates_are_never_allocated(compile_mode, monkeypatch):
    monkeypatch.setenv(COMPILE, compile_mode)
    torch.manual_seed(0)
    x = torch.randn(MIB, device="tpu")  # 4 MiB
    strict_peak, strict = peak_of_chain(x)
    assert strict_peak >= 2 * 4 * MIB
    runs = deferred_runs(lambda: peak_of_chain(x), compile_mode)
    stats = defer.stats()
    assert stats.ops_recorded == 20 * len(runs) and stats.graphs == len(runs), stats
    # Op by op frees each value after its last use; compiled, the chain is one fused kernel.
    peaks = [(peak, compiled) for (peak, _), compiled in runs]
    assert all(peak < strict_peak for peak, _ in peaks), (peaks, strict_peak)
    assert all(peak <= 4 * MIB + 4096 for peak, compiled in peaks if compiled), (peaks, strict_peak)
    check_runs([((y,), compiled) for (_, y), compiled in runs], (strict,), compile_mode, 1e-6)


# ---- 4. matmul precision ----

@pytest.mark.parametrize("compile_mode", ["off", "sync"])
def test_matmul_precision_equals_stricts(compile_mode, monkeypatch):
    monkeypatch.setenv(COMPILE, compile_mode)
    torch.manual_seed(0)
    a, b = torch.randn(32, 128, device="tpu"), torch.randn(128, 16, device="tpu")
    exact = torch.relu(a.cpu() @ b.cpu())

    def f():
        y = torch.relu(a @ b)
        if torch_tpu.get_eager_mode() is EagerMode.DEFER_AND_FUSE:
            assert is_deferred(y)
        return (y.cpu(),)

    with torch.tpu.precision("medium"):
        strict = f()
        runs = deferred_runs(f, compile_mode)
    stats = defer.stats()
    assert stats.graphs == len(runs) and stats.ops_recorded == 2 * len(runs), stats
    check_runs(runs, strict, compile_mode, 1e-6)
    for (got,), _ in runs:
        assert (got - exact).abs().max() > 1e-3  # bf16 operands, visibly


@pytest.mark.parametrize("compile_mode", ["off", "sync"])
def test_matmul_precision_is_the_one_the_op_was_issued_at(compile_mode, monkeypatch):
    """Strict runs a matmul at the precision set when it is issued; a deferred
    one read after the precision block must not run at the new precision."""
    monkeypatch.setenv(COMPILE, compile_mode)
    torch.manual_seed(0)
    a, b = torch.randn(32, 128, device="tpu"), torch.randn(128, 16, device="tpu")
    with torch.tpu.precision("medium"):
        strict = (torch.relu(a @ b).cpu(),)

    def f():
        with torch.tpu.precision("medium"):
            y = torch.relu(a @ b)
        return (y.cpu(),)  # materialized at "highest"

    runs = deferred_runs(f, compile_mode)
    check_runs(runs, strict, compile_mode, 1e-6)


# ---- 5. cache hits ----

def test_repeated_steps_hit_the_graph_cache(monkeypatch):
    monkeypatch.setenv(COMPILE, "sync")
    model, x = zoo()["mlp"]
    entries = defer.engine().graphs.entries
    counts = []
    strict = train_steps(model, x, steps=12)
    deferred = train_steps(model, x, mode="defer_and_fuse", steps=12, after_step=lambda: counts.append(len(entries)))
    stats = defer.stats()
    # The first step differs (SGD creates its momentum buffers); from the second on, every graph is a hit.
    assert counts[0] > 0 and counts[1] == counts[-1], counts
    assert stats.graphs >= 12, stats
    assert stats.compiled_runs + stats.replayed_runs == stats.graphs, stats
    assert stats.compiled_runs > 0, stats
    for a, b in zip(strict, deferred):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)


# ---- 6. in-place ----

def test_in_place_ops_on_a_pending_tensor():
    torch.manual_seed(0)
    a = torch.randn(3, 4, device="tpu")

    def f(a):
        x = a.sin()
        x.add_(1)
        x.mul_(2)
        return x

    expected = f(a).cpu()
    with deferring():
        x = f(a)
        assert is_deferred(x)
        assert not defer.stats().not_recorded, defer.stats()  # the in-place ops were recorded
        got = x.cpu()
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


@pytest.mark.parametrize("read_view_first", [False, True])
def test_in_place_updates_of_a_real_tensor_reach_it_and_its_views(read_view_first):
    torch.manual_seed(0)
    p0, q0 = torch.randn(3, 4), torch.randn(3, 4)
    expected = p0 * 0.5 + q0
    p, q = p0.to("tpu"), q0.to("tpu")
    v = p[0]  # a view created before the update
    with deferring():
        out = p.mul_(0.5).add_(q)
        assert out is p
        assert not is_deferred(p)  # real memory, with a pending write
        if read_view_first:
            torch.testing.assert_close(v.cpu(), expected[0], rtol=0, atol=0)  # reading materializes
        defer.materialize()
        assert defer.stats().graphs == 1, defer.stats()
        torch.testing.assert_close(p.cpu(), expected, rtol=0, atol=0)
        torch.testing.assert_close(v.cpu(), expected[0], rtol=0, atol=0)
    torch.testing.assert_close(p.cpu(), expected, rtol=0, atol=0)
    torch.testing.assert_close(v.cpu(), expected[0], rtol=0, atol=0)


def test_a_view_created_in_the_mode_sees_the_update():
    torch.manual_seed(0)
    p0, q0 = torch.randn(3, 4), torch.randn(3, 4)
    expected = p0 * 0.5 + q0
    p, q = p0.to("tpu"), q0.to("tpu")
    with deferring():
        v = p[1]
        p.mul_(0.5).add_(q)
        defer.materialize()
        torch.testing.assert_close(v.cpu(), expected[1], rtol=0, atol=0)
        w = p[2]
        p.add_(1)
        s = w.sum()
        torch.testing.assert_close(s.cpu(), (expected[2] + 1).sum(), rtol=0, atol=0)
    torch.testing.assert_close(p.cpu(), expected + 1, rtol=0, atol=0)


def test_in_place_through_a_view_of_a_pending_tensor():
    torch.manual_seed(0)
    x = torch.randn(3, 4, device="tpu")

    def f(x):
        h = x * 2
        h[0].fill_(7)
        return h, h.sum()

    h_strict, s_strict = f(x)
    with deferring():
        h, s = f(x)
        got_h, got_s = h.cpu(), s.cpu()
    torch.testing.assert_close(got_h, h_strict.cpu(), rtol=0, atol=0)
    torch.testing.assert_close(got_s, s_strict.cpu(), rtol=0, atol=0)


# ---- 7. random ops ----

def random_sequence(mode: str) -> list[torch.Tensor]:
    x = torch.ones(4, 8, device="tpu")
    with torch_tpu.eager_mode(mode):
        torch.tpu.manual_seed(0)
        h = x * 3
        a = torch.rand(4, 8, device="tpu")
        d = nn.functional.dropout(h, 0.5, training=True)
        b = torch.randn(3, device="tpu") + a.sum()
        e = nn.functional.dropout(h + b.sum(), 0.3, training=True)
        out = [a.cpu(), d.cpu(), b.cpu(), e.cpu()]
    return out


def test_random_ops_draw_stricts_sequence():
    strict = random_sequence("strict")
    deferred = random_sequence("defer_and_fuse")
    assert (strict[1] == 0).any() and (strict[1] != 0).any()  # dropout dropped some, kept some
    assert defer.stats().sync_points["aten.native_dropout.default"], defer.stats()  # the random ops ran at once
    for s, d in zip(strict, deferred):
        torch.testing.assert_close(d, s, rtol=0, atol=0)


# ---- 8. leaving the mode ----

def test_leaving_the_mode_materializes():
    torch.manual_seed(0)
    x = torch.randn(4, 5, device="tpu")

    def f(x):
        a = x + 1
        b = a.relu()
        c = b[1:]  # a view of a pending tensor
        d = torch.cat([a, b]).exp()
        return a, b, c, d

    expected = [t.cpu() for t in f(x)]
    with deferring():
        got = f(x)
        assert all(is_deferred(t) for t in got)
        assert defer.stats().graphs == 0
    assert torch_tpu.get_eager_mode() is EagerMode.STRICT
    assert not any(is_deferred(t) for t in got)
    assert defer.stats().materialized_by == {"leaving DeferAndFuse": 1}, defer.stats()
    for t, want in zip(got, expected):
        torch.testing.assert_close(t.cpu(), want, rtol=0, atol=0)
    # Strict again: ops run at once.
    assert not is_deferred(x * 2)
    assert defer.stats().ops_recorded == 5


# ---- 9. autograd ----

@pytest.mark.parametrize("compile_mode", ["off", "sync"])
def test_autograd_through_deferred_ops_equals_strict(compile_mode, monkeypatch):
    monkeypatch.setenv(COMPILE, compile_mode)
    torch.manual_seed(0)
    x0, w0 = torch.randn(6, 5), torch.randn(5, 3)

    def f():
        x = x0.to("tpu")
        w = w0.to("tpu").requires_grad_()
        h = (x @ w).tanh() * 3
        loss = (h.square() + h.sin()).mean()
        if torch_tpu.get_eager_mode() is EagerMode.DEFER_AND_FUSE:
            assert is_deferred(loss)
        loss.backward()
        assert w.grad is not None
        return loss.detach().cpu(), w.grad.cpu()

    strict = f()
    runs = deferred_runs(f, compile_mode)
    assert defer.stats().ops_recorded > 5 * len(runs), defer.stats()
    check_runs(runs, strict, compile_mode, 1e-5)


def test_a_dlrm_step_with_sparsecore_embeddings_equals_strict():
    """The SparseCore engine's kernels are materialization points; the dense
    arch, interaction and loss are recorded around them."""
    from tests.test_eager_modes import dlrm_step

    strict = dlrm_step("strict")
    defer.reset_stats()
    deferred = dlrm_step("defer_and_fuse")
    stats = defer.stats()
    assert stats.ops_recorded > stats.graphs > 0, stats
    assert not stats.not_recorded, stats  # no op fell back
    for a, b in zip(strict, deferred):
        torch.testing.assert_close(b, a, rtol=0, atol=0)


@pytest.mark.parametrize("compile_mode", ["off", "sync"])
def test_a_view_saved_before_its_tensors_update_runs_keeps_its_version(compile_mode, monkeypatch):
    """An optimizer's update is recorded (the version bumped once, as in Strict), then a
    layer's forward saves weight.t() for backward, then the graph runs the update: that
    run must not bump the version again, or the backward refuses the saved view. (A
    pipeline's forward runs so: its lookups were prefetched, nothing materializes first.)"""
    monkeypatch.setenv(COMPILE, compile_mode)
    torch.manual_seed(0)
    w0, x0 = torch.randn(16, 64), torch.randn(8, 64)

    def step():
        w, x = w0.to("tpu").requires_grad_(), x0.to("tpu").requires_grad_()
        with torch.no_grad():
            w.mul_(0.5)
        z = nn.functional.linear(x, w).relu().sum()
        torch.tpu.synchronize()  # runs the update, after the view was saved
        z.backward()
        return w.grad.cpu(), x.grad.cpu(), torch.tensor(float(w._version))

    strict = step()
    runs = deferred_runs(step, compile_mode)
    check_runs(runs, strict, compile_mode, 1e-5)


@pytest.mark.parametrize("compile_mode", ["off", "sync"])
def test_the_fused_dlrm_interaction_is_recorded_not_a_sync_point(compile_mode, monkeypatch):
    """A graph op (torch_tpu.graph_ops) is recorded like an ATen op: a forward and
    backward through DLRM's fused interaction is one graph."""
    from models.dlrm import DotInteraction

    monkeypatch.setenv(COMPILE, compile_mode)
    torch.manual_seed(0)
    bottom, interaction = nn.Linear(13, 16).to("tpu"), DotInteraction(4)
    dense, sparse = torch.randn(8, 13, device="tpu"), torch.randn(8, 4, 16, device="tpu")

    def step():
        bottom.zero_grad(set_to_none=True)
        s = sparse.clone().requires_grad_()
        out = interaction(torch.relu(bottom(dense)), s)
        out.square().sum().backward()
        return out.detach(), s.grad, bottom.weight.grad

    strict = tuple(t.cpu() for t in step())

    def deferred():
        results = step()
        defer.materialize()
        return tuple(t.cpu() for t in results)

    runs = deferred_runs(deferred, compile_mode)
    stats = defer.stats()
    # One graph a run (the .cpu() copies after it are sync points on real memory).
    assert stats.graphs == len(runs) and not stats.not_recorded, stats
    assert not [op for op in stats.sync_points if "interaction" in op], stats
    check_runs(runs, strict, compile_mode, 1e-5)


@pytest.mark.parametrize("compile_mode", ["off", "sync"])
def test_in_place_updates_of_real_tensors_take_no_second_copy(compile_mode, monkeypatch):
    """An optimizer-like update of a real tensor runs in place when its graph
    runs (op by op or compiled): no new value beside the old, no copy back."""
    monkeypatch.setenv(COMPILE, compile_mode)
    torch.manual_seed(0)
    p, g = torch.randn(1 << 20, device="tpu"), torch.randn(1 << 20, device="tpu")  # 4 MiB each
    expected = p.cpu()
    for _ in range(6):
        expected = expected * 0.9 + 0.1 * g.cpu()
    with deferring():
        for _ in range(5):
            p.mul_(0.9).add_(g, alpha=0.1)
            torch.tpu.synchronize()
        base = torch.tpu.memory_allocated()
        torch.tpu.reset_peak_memory_stats()
        p.mul_(0.9).add_(g, alpha=0.1)
        torch.tpu.synchronize()
        extra = torch.tpu.max_memory_allocated() - base
    assert extra < 4 * MIB, extra
    torch.testing.assert_close(p.cpu(), expected, rtol=1e-5, atol=1e-6)
    if compile_mode == "sync":
        assert defer.stats().compiled_runs > 0, defer.stats()


# ---- 9b. torch.compile under the mode ----

@pytest.mark.parametrize("name", ["mlp", "cnn with batchnorm"])
def test_a_model_compiled_with_the_tpu_backend_trains_under_the_mode(name):
    """Dynamo compiles with the mode off; the compiled forward and backward run as
    sync points on real memory (the optimizer's recorded writes materialized before
    them), and the numbers are compiled Strict's. BatchNorm's running statistics are
    an input mutation, written back around the compiled graph."""
    model, x = zoo()[name]
    torch._dynamo.reset()
    strict = train_steps(model, x, compiled=True, steps=3)
    torch._dynamo.reset()
    defer.reset_stats()
    deferred = train_steps(model, x, compiled=True, mode="defer_and_fuse", steps=3)
    stats = defer.stats()
    assert stats.materialized_by["torch.compile graph"] >= 2, stats  # the optimizer's pending writes, each step
    assert stats.ops_recorded > 0, stats
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1  # compiled, not skipped for the mode
    # Each compiled graph measures itself compiled against op by op at its first calls, in either
    # mode: fp32 rounding apart, no more.
    for a, b in zip(strict, deferred):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)


def test_a_function_first_called_under_the_mode_is_compiled_for_strict_too():
    """Dynamo skips for good a function it refused to compile: called first under
    the mode, it must compile, or it would run uncompiled from then on."""
    torch._dynamo.reset()
    calls = []

    def backend(gm, example_inputs):
        calls.append(gm)
        return gm

    fn = torch.compile(lambda x: torch.relu(x) * 2 + 1, backend=backend)
    x = torch.randn(4, 4, device="tpu")
    with deferring():
        assert torch.equal(fn(x).cpu(), torch.relu(x.cpu()) * 2 + 1)
    assert len(calls) == 1
    assert torch.equal(fn(x).cpu(), torch.relu(x.cpu()) * 2 + 1)
    assert len(calls) == 1  # the same compile, from Dynamo's cache


def test_ops_run_eagerly_inside_a_compiled_function_are_recorded_as_usual():
    """At a graph break (``.item()`` here) the function's own ops run eagerly
    while Dynamo watches new frames; the mode's frames are kept from it - before,
    Dynamo traced them as user code and failed on a pending tensor."""
    torch._dynamo.reset()

    def f(x):
        y = torch.sin(x) * 2
        n = y.sum().item()  # a graph break: run eagerly
        return y + n

    fn = torch.compile(f, backend="tpu")
    x0 = torch.randn(5, 3)
    expected = f(x0.to("tpu")).cpu()
    frames = torch._dynamo.utils.counters["frames"]
    traced = frames["total"]
    with deferring():
        x = x0.to("tpu") * 1.0  # pending: the compiled graph before the break gets it materialized
        result = fn(x).cpu()
    assert frames["total"] - traced == 2  # f and its resumption after the break, none of the mode's
    assert defer.stats().ops_recorded > 0
    torch.testing.assert_close(result, expected, rtol=1e-6, atol=1e-6)


# ---- 10. segments: recorded or run eagerly ----

def slowed(method, seconds: float):
    """``method`` with a sleep before each call: one way of running made clearly the slower."""
    def run(*args, **kwargs):
        time.sleep(seconds)
        return method(*args, **kwargs)
    return run


def test_segments_that_run_slower_recorded_run_eagerly_with_stricts_results(monkeypatch):
    monkeypatch.setattr(defer_segments.Segments, "MIN_SETTLED_RUNS", 2)
    monkeypatch.setattr(defer._Engine, "_record", slowed(defer._Engine._record, 0.0005))
    model, x = zoo()["mlp"]
    strict = train_steps(model, x, steps=20)
    deferred = train_steps(model, x, mode="defer_and_fuse", steps=20)
    stats = defer.stats()
    # Settled after a few steps, then 4 runs of each way while choosing, then eager: the rest.
    assert stats.eager_segments >= 8 and stats.ops_run_eagerly > 20 * stats.eager_segments, stats
    chosen = [s.choice.chosen for s in defer.engine().segments.known.values() if s.choice is not None]
    assert chosen == [defer_segments.EAGER], chosen
    for a, b in zip(strict, deferred):
        torch.testing.assert_close(b, a, rtol=0, atol=0)  # Strict's kernels either way


def test_segments_that_run_faster_recorded_stay_recorded(monkeypatch):
    monkeypatch.setattr(defer_segments.Segments, "MIN_SETTLED_RUNS", 2)
    monkeypatch.setattr(defer._Engine, "run_eagerly", slowed(defer._Engine.run_eagerly, 0.0005))
    model, x = zoo()["mlp"]
    strict = train_steps(model, x, steps=25)
    counts = []
    deferred = train_steps(model, x, mode="defer_and_fuse", steps=25,
                           after_step=lambda: counts.append((defer.stats().graphs, defer.stats().eager_segments)))
    # The choice measured each way, chose recorded, and never runs eagerly again (a clear choice).
    assert 1 <= counts[-1][1] <= defer_segments.TimedChoice.CALLS_TO_CHOOSE // 2, counts
    assert counts[-1][1] == counts[-6][1] and counts[-1][0] == counts[-6][0] + 5, counts
    for a, b in zip(strict, deferred):
        torch.testing.assert_close(b, a, rtol=0, atol=0)


def test_an_eager_segment_that_departs_from_its_ops_is_recorded_from_there(monkeypatch):
    monkeypatch.setattr(defer_segments.Segments, "MIN_SETTLED_RUNS", 2)
    monkeypatch.setattr(defer_segments.TimedChoice, "next", lambda self: (defer_segments.EAGER, False))

    strict = sgd_steps("strict", extra_at=7, sync="cpu")
    seen = []
    deferred = sgd_steps("defer_and_fuse", extra_at=7, sync="cpu", after=lambda i: seen.append(
        (defer.stats().ops_recorded, defer.stats().eager_segments)))
    # Steps before the odd one ran eagerly (nothing recorded); the odd step records from where it departs.
    assert seen[6][1] >= 2 and seen[6][0] == seen[5][0], seen
    assert seen[7][0] > seen[6][0] and seen[7][1] == seen[6][1], seen
    for a, b in zip(strict, deferred):
        torch.testing.assert_close(b, a, rtol=0, atol=0)


def sgd_steps(mode: str, n: int = 10, extra_at: int = -1, probe=None, after=None,
              sync: str = "synchronize", lr=lambda i: 0.1, masked: bool = False) -> list[torch.Tensor]:
    """SGD steps of a small model, each ending in a sync point (one segment a step): the
    loss copied to the CPU (``sync="cpu"``), torch.tpu.synchronize(), (``"mark_step"``)
    torch.tpu.mark_step() or ``sync()`` when it is a function. ``extra_at``: a step with ops the others do not have, from its
    third op; ``probe(i)`` runs mid-step, after the forward, ``after(i)`` after the sync
    point; ``lr(i)``: step i's learning rate; ``masked``: the loss also sums a boolean
    mask's elements, whose data-dependent shape cuts the step in two inside an op (as a
    SparseCore kernel or a collective cuts a DLRM step)."""
    torch.manual_seed(0)
    w = torch.randn(8, 8, device="tpu", requires_grad=True)
    x = torch.randn(4, 8, device="tpu")
    losses = []
    with torch_tpu.eager_mode(mode):
        for i in range(n):
            h = torch.tanh(x @ w)
            if i == extra_at:
                h = h * 2.0 + 1.0
            if probe is not None:
                probe(i)
            loss = h.square().mean()
            if masked:
                loss = loss + 0.1 * h[h > 0].sum()
            loss.backward()
            with torch.no_grad():
                w -= lr(i) * w.grad
                w.grad = None
            if sync == "cpu":
                losses.append(loss.detach().cpu())
            else:
                losses.append(loss.detach())
                if callable(sync):
                    sync()
                else:
                    (torch.tpu.mark_step if sync == "mark_step" else torch.tpu.synchronize)()
            if after is not None:
                after(i)
    return [t.cpu() for t in losses] + [w.detach().cpu()]


def test_a_segment_whose_graph_is_new_every_step_still_gets_its_choice(monkeypatch):
    """A scalar that changes every step - a scheduled lr here, a plain AdamW's bias corrections
    in practice - makes the step's graph new every time: never compiled, replayed op by op.
    Its segment still gets the recorded-or-eager choice rather than recording forever."""
    monkeypatch.setattr(defer_segments.Segments, "MIN_SETTLED_RUNS", 2)
    monkeypatch.setattr(defer._Engine, "_record", slowed(defer._Engine._record, 0.0005))

    def scheduled(i):
        return 0.1 / (i + 1)

    strict = sgd_steps("strict", n=20, lr=scheduled)
    deferred = sgd_steps("defer_and_fuse", n=20, lr=scheduled)
    stats = defer.stats()
    assert stats.compiled_runs == 0 and stats.eager_segments >= 8, stats
    chosen = [s.choice.chosen for s in defer.engine().segments.known.values() if s.choice is not None]
    assert chosen == [defer_segments.EAGER], chosen
    for a, b in zip(strict, deferred):
        torch.testing.assert_close(b, a, rtol=0, atol=0)


def mode_stack() -> list:
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    return _get_current_dispatch_mode_stack()


def test_eager_segments_ending_at_synchronize_run_without_the_mode(monkeypatch):
    monkeypatch.setattr(defer_segments.Segments, "MIN_SETTLED_RUNS", 2)
    monkeypatch.setattr(defer_segments.TimedChoice, "next", lambda self: (defer_segments.EAGER, False))
    strict = sgd_steps("strict", extra_at=7)
    seen = []
    deferred = sgd_steps("defer_and_fuse", extra_at=7, probe=lambda i: seen.append(
        (i, any(isinstance(m, defer.DeferAndFuse) for m in mode_stack()), defer.stats().ops_recorded)))
    recording = [i for i, on, _ in seen if on]
    # Recorded until settled (2 runs) and the one after (its successor learnt), then dormant:
    # the mode is off the thread for every later step, the odd one included, and nothing is recorded.
    assert recording == list(range(len(recording))) and 2 <= len(recording) <= 4, seen
    assert seen[-1][2] == seen[len(recording)][2], seen
    assert defer.stats().eager_segments >= 10 - len(recording) - 1, defer.stats()
    for a, b in zip(strict, deferred):
        torch.testing.assert_close(b, a, rtol=0, atol=0)
    assert not any(isinstance(m, defer.DeferAndFuse) for m in mode_stack())  # left with the context


def test_a_dormant_segment_chosen_recorded_again_brings_the_mode_back(monkeypatch):
    monkeypatch.setattr(defer_segments.Segments, "MIN_SETTLED_RUNS", 2)
    choices = iter([defer_segments.EAGER] * 3 + [defer_segments.RECORDED] * 100)
    monkeypatch.setattr(defer_segments.TimedChoice, "next", lambda self: (next(choices), False))
    strict = sgd_steps("strict", n=12)
    seen = []
    deferred = sgd_steps("defer_and_fuse", n=12, probe=lambda i: seen.append(
        any(isinstance(m, defer.DeferAndFuse) for m in mode_stack())))
    assert False in seen and seen[-4:] == [True] * 4, seen
    first_off = seen.index(False)
    assert seen[first_off:first_off + 3] == [False] * 3 and seen[first_off + 3] is True, seen
    for a, b in zip(strict, deferred):
        torch.testing.assert_close(b, a, rtol=0, atol=0)


def test_a_mode_entered_during_a_dormant_segment_keeps_its_place(monkeypatch):
    from torch.utils._python_dispatch import TorchDispatchMode

    class Counting(TorchDispatchMode):
        calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Counting.calls += 1
            return func(*args, **(kwargs or {}))

    monkeypatch.setattr(defer_segments.Segments, "MIN_SETTLED_RUNS", 2)
    monkeypatch.setattr(defer_segments.TimedChoice, "next", lambda self: (defer_segments.EAGER, False))
    counting = Counting()
    stacks = []

    def probe(i):
        if i == 6:
            counting.__enter__()  # entered mid-step while DeferAndFuse is away
        if i == 9:
            counting.__exit__(None, None, None)
        stacks.append([type(m).__name__ for m in mode_stack()])

    strict = sgd_steps("strict", n=12)
    deferred = sgd_steps("defer_and_fuse", n=12, probe=probe)
    # DeferAndFuse never comes back above the other mode, which exits as it entered.
    assert stacks[6] == stacks[7] == stacks[8] == ["Counting"], stacks
    assert Counting.calls > 0 and "DeferAndFuse" not in stacks[9], stacks
    for a, b in zip(strict, deferred):
        torch.testing.assert_close(b, a, rtol=0, atol=0)


def test_leaving_and_reentering_defer_and_fuse_while_dormant(monkeypatch):
    monkeypatch.setattr(defer_segments.Segments, "MIN_SETTLED_RUNS", 2)
    monkeypatch.setattr(defer_segments.TimedChoice, "next", lambda self: (defer_segments.EAGER, False))
    sgd_steps("defer_and_fuse", n=8)
    assert mode_stack() == []
    with torch_tpu.eager_mode("defer_and_fuse"):
        assert any(isinstance(m, defer.DeferAndFuse) for m in mode_stack())
        y = torch.arange(4.0, device="tpu") * 3
        assert is_deferred(y)  # recording again
        assert y.cpu().tolist() == [0.0, 3.0, 6.0, 9.0]
    assert mode_stack() == []


def test_a_dormant_segment_ends_at_the_synchronize_its_recorded_runs_ended_at(monkeypatch):
    """A step synchronizing twice after its forward (the second time with nothing
    pending) and once at its end: the backward's segment began two synchronizes
    before its end, and runs dormant until the second."""
    monkeypatch.setattr(defer_segments.Segments, "MIN_SETTLED_RUNS", 2)
    monkeypatch.setattr(defer_segments.TimedChoice, "next", lambda self: (defer_segments.EAGER, False))

    def twice(i):
        torch.tpu.synchronize()
        torch.tpu.synchronize()

    def twice_then_look(i):
        twice(i)
        dormant.append(defer.engine().segments.dormant)

    dormant = []
    strict = sgd_steps("strict", probe=twice)
    deferred = sgd_steps("defer_and_fuse", probe=twice_then_look)
    assert dormant[-1] is not None and torch.ops.aten.tanh_backward.default in dormant[-1].ops, dormant[-1]
    assert dormant[-1] is dormant[-2]
    for a, b in zip(strict, deferred):
        torch.testing.assert_close(b, a, rtol=0, atol=0)


def mode_on() -> bool:
    return any(isinstance(m, defer.DeferAndFuse) for m in mode_stack())


def segments_chosen_eager(monkeypatch) -> None:
    """Every segment settles after 2 recorded runs and is chosen eager, untimed, from
    then on (``peek`` too: a chain's segments are never due for a timed run)."""
    monkeypatch.setattr(defer_segments.Segments, "MIN_SETTLED_RUNS", 2)
    monkeypatch.setattr(defer_segments.TimedChoice, "next", lambda self: (defer_segments.EAGER, False))
    monkeypatch.setattr(defer_segments.TimedChoice, "peek", lambda self: (defer_segments.EAGER, False))


@pytest.mark.parametrize("sync", ["synchronize", "mark_step"])
def test_a_step_cut_inside_an_op_runs_dormant_as_a_chain(sync, monkeypatch):
    """Neither of the step's segments can run dormant alone (one begins, the other
    ends, inside the mask's op); together, from boundary to boundary, they do."""
    segments_chosen_eager(monkeypatch)
    strict = sgd_steps("strict", n=12, sync=sync, masked=True)
    seen = []
    deferred = sgd_steps("defer_and_fuse", n=12, sync=sync, masked=True,
                         probe=lambda i: seen.append((mode_on(), defer.stats().ops_recorded)))
    chains = defer.engine().segments.chains
    assert [len(chain) for chain in chains] == [2], chains  # the mask's op cuts the step in two
    # Recorded until both segments settled and their order learnt, then away for every later step.
    first_off = [on for on, _ in seen].index(False)
    assert first_off <= 4 and not any(on for on, _ in seen[first_off:]), seen
    assert seen[-1][1] == seen[first_off][1], seen  # nothing recorded since
    assert defer.stats().eager_segments >= 2 * (len(seen) - first_off - 1), defer.stats()
    for a, b in zip(strict, deferred):
        torch.testing.assert_close(b, a, rtol=0, atol=0)
    assert not mode_on()


def test_a_synchronize_after_each_mark_step_neither_ends_a_chain_nor_keeps_it_from_forming(monkeypatch):
    """A caller timing the pipeline's steps synchronizes after each progress(), which
    ends in mark_step: host boundaries are counted by kind, so the chain ending at
    mark_step forms (its first segment saw a synchronize, not a mark_step) and the
    synchronize does not end it before its ops have run."""
    segments_chosen_eager(monkeypatch)

    def mark_then_synchronize():
        torch.tpu.mark_step()
        torch.tpu.synchronize()

    strict = sgd_steps("strict", n=16, sync=mark_then_synchronize, masked=True)
    seen = []
    deferred = sgd_steps("defer_and_fuse", n=16, sync=mark_then_synchronize, masked=True,
                         probe=lambda i: seen.append((mode_on(), defer.stats().eager_segments)))
    assert not any(on for on, _ in seen[-6:]), seen
    (chain,) = defer.engine().segments.chains
    # Each step ends its chain once: no segment counted that never ran.
    assert seen[-1][1] - seen[-2][1] == len(chain), seen
    for a, b in zip(strict, deferred):
        torch.testing.assert_close(b, a, rtol=0, atol=0)


def test_a_chains_timing_is_not_cut_short_by_another_kind_of_boundary(monkeypatch):
    """A synchronize right after the mark_step that began a dormant chain (a round's
    end in a benchmark loop) used to end the chain with none of its ops run, and
    report that empty run's microseconds as the dormant variant's time."""
    class SegmentsEager(defer_segments.TimedChoice):  # segments always eager; chains choose for real
        def next(self):
            return (defer_segments.EAGER, False) if "chain" not in self.name else super().next()

        def peek(self):
            return (defer_segments.EAGER, False) if "chain" not in self.name else super().peek()

    monkeypatch.setattr(defer_segments.Segments, "MIN_SETTLED_RUNS", 2)
    monkeypatch.setattr(defer_segments, "TimedChoice", SegmentsEager)
    steps = []

    def boundary():
        torch.tpu.mark_step()
        steps.append(None)
        if len(steps) % 3 == 0:
            torch.tpu.synchronize()  # nothing pending, nothing run since the mark_step

    def slow_when_dormant(i):
        if not mode_on():
            time.sleep(0.005)  # dormant made the slower variant

    sgd_steps("defer_and_fuse", n=40, sync=boundary, masked=True, probe=slow_when_dormant)
    (choice,) = defer.engine().segments.chains.values()
    assert min(choice.times[defer_segments.DORMANT]) > 0.005, choice.times
    assert choice.chosen == defer_segments.AS_PLANNED, choice.times


def test_a_chain_runs_dormant_when_that_measures_faster(monkeypatch):
    """The chain's own choice times it from synchronize to synchronize, dormant
    against as its segments chose - here with the mode made slow, so dormant wins."""
    monkeypatch.setattr(defer_segments.Segments, "MIN_SETTLED_RUNS", 2)
    monkeypatch.setattr(defer._Engine, "run_eagerly", slowed(defer._Engine.run_eagerly, 0.0005))
    monkeypatch.setattr(defer._Engine, "_record", slowed(defer._Engine._record, 0.0005))
    strict = sgd_steps("strict", n=40, masked=True)
    seen = []
    deferred = sgd_steps("defer_and_fuse", n=40, masked=True, probe=lambda i: seen.append(mode_on()))
    (choice,) = defer.engine().segments.chains.values()
    assert choice.chosen == defer_segments.DORMANT, choice.times
    assert not any(seen[-5:]), seen
    for a, b in zip(strict, deferred):
        torch.testing.assert_close(b, a, rtol=0, atol=0)


def test_an_eager_segment_ends_at_its_synchronize_when_autograds_copies_do_not_come(monkeypatch):
    """Recorded, a backward ending a segment copies gradients whose meta strides
    differ from their parameters' (new_empty_strided, copy_); run eagerly it does
    not, and the synchronize ends the segment there rather than the next op
    departing from it."""
    monkeypatch.setattr(defer_segments.Segments, "MIN_SETTLED_RUNS", 2)
    monkeypatch.setattr(defer_segments.TimedChoice, "next", lambda self: (defer_segments.EAGER, True))  # mode stays
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4)).to("tpu")
    x = torch.randn(8, 16, device="tpu")
    counts = []
    with torch_tpu.eager_mode("defer_and_fuse"):
        for _ in range(10):
            model.zero_grad(set_to_none=True)
            model(x).square().mean().backward()
            torch.tpu.synchronize()
            counts.append((defer.stats().ops_recorded, defer.stats().eager_segments))
    tail = defer.engine().segments.known
    assert any(s.ops[-1] is torch.ops.aten.copy_.default for s in tail.values()), "no autograd copy at a segment's end"
    # Once eager, every step is one eager segment and nothing more is recorded.
    assert counts[-1][0] == counts[-4][0] and counts[-1][1] == counts[-4][1] + 3, counts


def test_an_eager_segment_ends_at_a_stream_submission_when_autograds_copies_do_not_come(monkeypatch):
    """The same, for a segment ended by a call outside ops - work submitted to a tpu
    stream, as the SparseCore pipeline's prefetch does after the backward: with
    nothing pending, the submission ends the eager segment whose recorded runs it
    ended. Before, the next op departed from it: never ending eagerly, it was
    recorded again every step and its choice never came."""
    monkeypatch.setattr(defer_segments.Segments, "MIN_SETTLED_RUNS", 2)
    monkeypatch.setattr(defer_segments.TimedChoice, "next", lambda self: (defer_segments.EAGER, True))  # mode stays
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4)).to("tpu")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(8, 16, device="tpu")
    stream = torch.tpu.Stream()
    counts = []
    with torch_tpu.eager_mode("defer_and_fuse"):
        for _ in range(10):
            model.zero_grad(set_to_none=True)
            model(x).square().mean().backward()
            torch.tpu.submit(stream, lambda: None).result(timeout=60)
            opt.step()
            torch.tpu.synchronize()
            counts.append((defer.stats().ops_recorded, defer.stats().eager_segments))
    ended_by_submission = [s for s in defer.engine().segments.known.values()
                           if s.end_reason == "work submitted to a tpu stream"]
    assert any(s.ops[-1] is torch.ops.aten.copy_.default for s in ended_by_submission), ended_by_submission
    # Once eager, every step is two eager segments and nothing more is recorded.
    assert counts[-1][0] == counts[-4][0] and counts[-1][1] == counts[-4][1] + 6, counts


def test_leaving_the_mode_mid_segment_leaves_nothing_running_or_timed(monkeypatch):
    """A segment running eagerly with the mode on when DeferAndFuse is left ends
    there, untimed: a timing across the gap would count the time spent outside."""
    monkeypatch.setattr(defer_segments.Segments, "MIN_SETTLED_RUNS", 2)
    monkeypatch.setattr(defer_segments.TimedChoice, "next", lambda self: (defer_segments.EAGER, True))  # mode stays
    segments = defer.engine().segments
    torch.manual_seed(0)
    w = torch.randn(8, 8, device="tpu", requires_grad=True)
    x = torch.randn(4, 8, device="tpu")
    with torch_tpu.eager_mode("defer_and_fuse"):
        for _ in range(6):
            torch.tanh(x @ w).square().mean().backward()
            w.grad = None
            torch.tpu.synchronize()
        torch.tanh(x @ w)
        assert segments.eager is not None and segments.pos > 0 and segments._timed is not None
    assert segments.eager is None and segments._timed is None and segments._start is None


# ---- cases an audit found giving other results than Strict ----


def strict_and_deferred(fn):
    """fn() in Strict and under DeferAndFuse, its results brought to the cpu."""
    strict = fn()
    with deferring():
        deferred = fn()
        deferred = [t.cpu() for t in deferred]
    return [t.cpu() for t in strict], deferred


def test_equal_scalars_of_other_types_are_other_graphs():
    # 2 == 2.0 == True in Python, -0.0 == 0.0; the results' dtypes and values differ.
    def fn():
        x = torch.arange(3, device="tpu")
        f = torch.ones(3, device="tpu")
        return [x * 2, x * 2.0, x * True, f * 0.0, f * -0.0, x.float().pow(2), x.float().pow(2.0)]

    strict, deferred = strict_and_deferred(fn)
    for s, d in zip(strict, deferred):
        assert s.dtype == d.dtype and torch.equal(s, d)
        assert torch.equal(torch.signbit(s), torch.signbit(d))


def test_cpu_scalar_tensors_are_read_at_their_use():
    def fn():
        ones = torch.ones(3, device="tpu")
        outs = [ones.mul(torch.tensor(v)) for v in (2.0, 3.0, 4.0)]  # temporaries: their addresses recur
        s = torch.tensor(1.0)
        before = ones + s
        s += 1
        return outs + [before, ones + s]

    strict, deferred = strict_and_deferred(fn)
    assert [t.tolist() for t in deferred] == [t.tolist() for t in strict]
    assert [t[0].item() for t in deferred] == [2.0, 3.0, 4.0, 2.0, 3.0]


def test_in_place_view_ops_change_the_geometry_at_once():
    with deferring():
        z = torch.ones(2, 3, device="tpu") * 2
        z.unsqueeze_(0)
        assert z.shape == (1, 2, 3)
        z.squeeze_(0)
        z.t_()
        assert z.shape == (3, 2)
        assert torch.equal(z.cpu(), torch.full((3, 2), 2.0))


def test_in_place_ops_whose_result_does_not_fit_raise_as_in_strict():
    for make in (lambda: torch.arange(4, device="tpu"), lambda: torch.arange(4, device="tpu") + 0):
        with deferring():
            r = make()  # a real tensor, then a pending one
            with pytest.raises(RuntimeError, match="result type Float can't be cast to the desired output type Long"):
                r.add_(1.5)
            with pytest.raises(RuntimeError, match=r"doesn't match the broadcast shape \[3, 4\]"):
                r.add_(torch.ones(3, 4, device="tpu", dtype=torch.long))
            assert r.cpu().tolist() == [0, 1, 2, 3]


def test_a_failing_op_spares_the_pending_tensors_that_do_not_depend_on_it():
    with deferring():
        x = torch.arange(8.0, device="tpu").view(4, 2)
        h = x * 2
        g = x.index_select(0, torch.tensor([9], device="tpu"))  # out of range: raises when the graph runs
        with pytest.raises(IndexError):
            (h.sum() + g.sum()).item()
        assert h.cpu().tolist() == (torch.arange(8.0).view(4, 2) * 2).tolist()
        assert (x * 3).cpu()[3].tolist() == [18.0, 21.0]  # and recording goes on


def test_an_in_place_matmul_into_a_real_tensor_keeps_mxu_precision_when_compiles_are_on(monkeypatch):
    monkeypatch.setenv(COMPILE, "sync")
    g = torch.Generator().manual_seed(0)
    a, v, c0 = (torch.randn(*s, generator=g).to("tpu") for s in ((64, 64), (64,), (64,)))

    def steps():
        c = c0.clone()
        for _ in range(8):  # past the run that compiles the graph
            c.addmv_(a, v)
            c.mul_(0.5)
            torch.tpu.synchronize()
        return c.cpu()

    with torch.tpu.precision("medium"):
        strict = steps()
        with deferring():
            deferred = steps()
    assert torch.equal(deferred, strict)


def test_a_compiled_graph_reading_a_view_of_a_tensor_it_writes_in_place_keeps_strict_s_order(monkeypatch):
    monkeypatch.setenv(COMPILE, "sync")
    w = torch.zeros(3, 4, device="tpu")
    seen = []
    with deferring():
        for _ in range(6):  # compiled from the second run on
            z = w.t() * 2.0  # reads w through a view, then w is written in place
            w.add_(1.0)
            seen.append((z + 0.0)[0, 0].item())
    assert seen == [0.0, 2.0, 4.0, 6.0, 8.0, 10.0]


def test_a_compiled_graph_returning_one_buffer_for_two_outputs_fills_both(monkeypatch):
    monkeypatch.setenv(COMPILE, "sync")
    x = torch.arange(4.0, device="tpu")
    for _ in range(3):
        with deferring():
            a = x * 2
            b, c = a.clone(), a.clone()
        assert b.tolist() == c.tolist() == [0.0, 2.0, 4.0, 6.0]
        b.add_(1)
        assert c.tolist() == [0.0, 2.0, 4.0, 6.0]  # two buffers, not one


def test_an_error_raised_on_leaving_the_mode_leaves_it_all_the_same():
    x = torch.arange(6.0, device="tpu")
    with pytest.raises(IndexError):
        with deferring():
            bad = x.index_select(0, torch.tensor([7], device="tpu")) + 1  # raises when the graph runs: on leaving
    assert torch_tpu.get_eager_mode() is EagerMode.STRICT and not defer.on_this_thread()
    assert not is_deferred(x * 2) and is_deferred(bad)  # bad's value never came: its op failed
    with deferring():
        y = x * 3
    assert y.tolist() == [0.0, 3.0, 6.0, 9.0, 12.0, 15.0]


def test_a_queued_compile_keeps_no_tensor_of_the_step_alive(monkeypatch):
    # The compile reads the inputs' geometry only: a step's tensors must be freed when the step
    # lets them go, not when a background compile gets to its graph. The compile here stays
    # queued (an executor that holds what is submitted) while the step's tensors go.
    import concurrent.futures
    import weakref

    class Queue:
        def __init__(self):
            self.held = []

        def submit(self, fn, *args):
            self.held.append((fn, args))  # what a compile still queued would keep
            done = concurrent.futures.Future()
            done.set_result(None)  # (never run: the graph stays op by op)
            return done

    monkeypatch.setenv(COMPILE, "async")
    queue = Queue()
    monkeypatch.setattr(defer.engine().graphs, "_executor", lambda: queue)
    refs = []
    for _ in range(deferred_graph.COMPILE_AT_RUN):
        x = torch.randn(1024, device="tpu")
        with deferring():
            y = (x * 2 + 1).relu()
        assert torch.equal(y.cpu(), (x.cpu() * 2 + 1).relu())
        refs.append(weakref.ref(x))
        del x, y
    assert len(queue.held) == 1  # the compile, queued
    gc.collect()
    assert all(r() is None for r in refs)


# ---- reads through another alias of written memory; views that change the dtype ----

def _write_slice_read_base(x):
    y = x * 2  # x: a graph input
    x[2:5].add_(100)  # written through a view of it
    return [y, x * 1, x]


def _read_view_write_base_read_view(x):
    v = x[2:5]  # a real view (of real memory: taken at once)
    y = v * 2  # v: a graph input
    x.add_(1)
    return [y, v * 1, v + 0, x]


def _write_base_read_an_older_view(x, v):
    y = x * 2 + v.sum()  # x and v: graph inputs
    x.mul_(3)  # read, so written functionally: the new value is copied in after the graph
    return [y, v * 1, x[1:3] * 1, (v + x[2:5]) * 1, x]


def _two_writes_through_two_aliases(x):
    v = x[4:]
    y = v * 1
    x.add_(1)
    w = v * 1
    v.mul_(2)  # a second tensor writing the same memory: the graph runs first
    return [y, w, v * 1, x * 1, x]


@pytest.mark.parametrize("case", [_write_slice_read_base, _read_view_write_base_read_view,
                                  "older view", _two_writes_through_two_aliases])
@pytest.mark.parametrize("compile_mode", ["off", "sync"])
def test_a_read_sees_an_earlier_write_through_another_alias(case, compile_mode, monkeypatch):
    # A real tensor (or a real view of it) read by the pending graph, then the same memory
    # written through another tensor: later reads of it saw the graph input's old value.
    monkeypatch.setenv(COMPILE, compile_mode)
    older_view = case == "older view"  # a view taken in Strict, before the mode

    def run(mode):
        outs = []
        for _ in range(4 if compile_mode == "sync" else 1):  # the graph compiled from the second run on
            x = torch.arange(10.0, device="tpu")  # real memory, made in Strict
            v = x[2:5]
            with torch_tpu.eager_mode(mode):
                got = _write_base_read_an_older_view(x, v) if older_view else case(x)
                outs.append([t.cpu() for t in got])
        return outs

    strict, deferred = run("strict"), run("defer_and_fuse")
    for s_run, d_run in zip(strict, deferred):
        for s, d in zip(s_run, d_run):
            assert torch.equal(d, s), (s, d)


def test_a_module_keeping_a_view_of_its_weight_trains_as_in_strict():
    # The view is read by each forward; the optimizer writes the weight in the same graph.
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.randn(4, 8) * 0.3)
            self.head = None

        def forward(self, x):
            if self.head is None:
                self.head = self.weight[:, :4]  # a view of the parameter, kept
            return (x @ self.head).tanh() @ self.weight

    def train(mode):
        torch.manual_seed(0)
        m = M().to("tpu")
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        x, y = torch.randn(16, 4, device="tpu"), torch.randn(16, 8, device="tpu")
        losses = []
        with torch_tpu.eager_mode(mode):
            for _ in range(6):  # no sync point inside the loop
                opt.zero_grad()
                loss = ((m(x) - y) ** 2).mean()
                loss.backward()
                opt.step()
                losses.append(loss.detach())
            return torch.stack(losses).cpu(), m.weight.detach().cpu()

    strict_losses, strict_w = train("strict")
    losses, w = train("defer_and_fuse")
    assert torch.equal(losses, strict_losses), (strict_losses, losses)
    assert torch.equal(w, strict_w)


def _dtype_views(d_pending):
    def fn():
        x = torch.arange(1.0, 5.0, device="tpu")
        if not d_pending:
            torch.tpu.synchronize()  # real memory
        outs = [x.view(torch.int32), x.view(torch.uint8), x.view(torch.int32) >> 1, x.view(torch.float32)]
        b = x * 1
        b.view(torch.int32).bitwise_xor_(-2147483648)  # the sign bit flipped through a bitcast view
        outs.append(b * 1)
        w = x * 1
        bits = w.view(torch.int32)
        w.add_(1)  # the base updated after the bitcast view was taken
        outs += [bits + 0, w]
        z = torch.complex(x, x + 10) * 1
        r = torch.view_as_real(z)
        outs += [r, z.real, z.imag * 1, z.conj() * 1, torch.view_as_real(z.conj().resolve_conj())]
        z.mul_(2)
        outs += [r * 1, z]
        outs.append(torch.view_as_complex(torch.arange(8.0, device="tpu").reshape(4, 2) * 1))
        real = torch.arange(4.0, device="tpu")
        torch.tpu.synchronize()
        real.add_(1)  # real memory with a pending write, then a bitcast of it
        outs.append(real.view(torch.int32) + 0)
        return outs
    return fn


@pytest.mark.parametrize("pending", [False, True])
def test_views_that_change_the_dtype_equal_stricts(pending):
    strict, deferred = strict_and_deferred(_dtype_views(pending))
    assert len(strict) == len(deferred)
    for i, (s, d) in enumerate(zip(strict, deferred)):
        assert (d.dtype, d.shape) == (s.dtype, s.shape), (i, s, d)
        assert torch.equal(d.resolve_conj(), s.resolve_conj()), (i, s, d)


def test_a_view_changing_the_dtype_of_a_pending_tensor_is_a_sync_point():
    with deferring():
        x = torch.arange(4.0, device="tpu") * 1
        assert is_deferred(x)
        v = x.view(torch.int32)
        assert v.dtype == torch.int32 and not is_deferred(x)  # the graph ran; the view is of real memory
    assert defer.stats().sync_points["aten.view.dtype"] == 1, defer.stats()
    assert v.tolist() == torch.arange(4.0).view(torch.int32).tolist()
