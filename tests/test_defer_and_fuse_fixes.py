"""DeferAndFuse against Strict where it used to differ: ``.data`` assignments of
pending tensors, a failed op in a graph that also updates real tensors, transfers
between tpu devices, a synchronize on another thread, compiled graphs copying
between real tensors."""

import threading

import pytest
import torch

import torch_tpu
from torch_tpu import defer, deferred_graph

# Autouse: each test starts with a fresh engine (graphs op by op unless it asks for
# compiles) and ends in Strict.
from tests.test_defer_and_fuse import COMPILE, strict_after  # noqa: F401


def in_both_modes(fn, make=lambda: ()):
    """fn(*make()) run in Strict, then under DeferAndFuse, make()'s tensors made in
    Strict (real memory): both results, as cpu tensors."""
    results = []
    for mode in ("strict", "defer_and_fuse"):
        made = make()
        with torch_tpu.eager_mode(mode):
            results.append([t.cpu() for t in fn(*made)])
    return results


def assert_equal_lists(strict, deferred):
    assert len(strict) == len(deferred)
    for s, d in zip(strict, deferred):
        assert torch.equal(d, s), (s, d)


# ---- 1. Tensor.data = a pending tensor ----

@pytest.mark.parametrize("compile_mode", ["off", "sync"])
def test_assigning_a_pending_tensor_to_data_of_a_tensor_the_graph_reads(compile_mode, monkeypatch):
    # .data's setter swaps the storage without an aten op: the graph read the new, empty one.
    monkeypatch.setenv(COMPILE, compile_mode)

    def steps(*params):
        out = []
        for p in params:  # compiled from the second run on
            y = p * 2 + 1  # the pending graph reads p
            z = p.detach() * 3 + 1  # pending
            p.data = z
            out += [y, p.detach(), z]
        return out

    def make():
        return [torch.nn.Parameter(torch.arange(4.0, device="tpu") + k) for k in range(3)]

    assert_equal_lists(*in_both_modes(steps, make))


def test_assigning_to_data_outside_the_graph_records_on():
    def steps():
        a = torch.arange(3.0, device="tpu") + 1  # pending
        b = torch.zeros(3, device="tpu")  # real, not read by the graph
        b.data = a
        return [b * 2, a]

    assert_equal_lists(*in_both_modes(steps))


# ---- 2. a failed op in a graph with in-place updates ----

def test_a_failing_op_spares_pending_tensors_of_a_graph_that_updates_a_real_tensor():
    def steps(w, x):
        h = x * 2
        w.add_(1)  # in place on a real tensor, in the same graph
        with pytest.raises(IndexError):  # Strict raises at the op, DeferAndFuse at .item()
            g = x.index_select(0, torch.tensor([9], device="tpu"))  # out of range
            (h.sum() + g.sum()).item()
        return [h, w, x * 3]

    def make():
        return torch.zeros(4, device="tpu"), torch.arange(8.0, device="tpu").view(4, 2)

    assert_equal_lists(*in_both_modes(steps, make))


def test_pending_tensors_a_failed_compiled_graph_with_in_place_updates_leaves_say_why(monkeypatch):
    # Compiled, the graph may have written its real tensors before the error: it cannot run
    # again for the other values, so reading one names the error instead of "no memory yet".
    monkeypatch.setenv(COMPILE, "sync")
    w, x = torch.zeros(4, device="tpu"), torch.arange(8.0, device="tpu").view(4, 2)
    with torch_tpu.eager_mode("defer_and_fuse"):
        for index in (1, 1, 1, 9):  # compiled from the second run on; 9 is out of range
            h = x * 2
            w.add_(1)
            g = x.index_select(0, torch.tensor([index], device="tpu"))
            if index == 9:
                with pytest.raises(Exception) as error:
                    (h.sum() + g.sum()).item()
            else:
                (h.sum() + g.sum()).item()
        assert defer.stats().compiled_runs > 0
        assert any("stopped a graph" in note for note in getattr(error.value, "__notes__", []))
        with pytest.raises(RuntimeError, match="the DeferAndFuse graph that was to compute it stopped at an error"):
            h.cpu()
        assert (x * 3).cpu()[3].tolist() == [18.0, 21.0]  # and recording goes on


# ---- 3. transfers between tpu devices ----

def test_a_pending_tensor_moved_to_another_tpu_is_on_that_tpu():
    assert torch.tpu.device_count() >= 2  # tests/conftest.py asks for two

    def steps():
        x = torch.arange(4.0, device="tpu") * 2  # pending on tpu:0
        y = x.to("tpu:1")
        assert y.device == torch.device("tpu:1")
        with torch.tpu.device(1):
            z = x.to("tpu")  # the current device: tpu:1
        assert z.device == torch.device("tpu:1")
        back = (y + 1).to("tpu:0")
        assert back.device == torch.device("tpu:0")
        return [y + 1, z, back]

    assert_equal_lists(*in_both_modes(steps))


# ---- 4. synchronize on another thread ----

def test_a_version_bump_landing_while_another_thread_runs_the_graph_is_kept(monkeypatch):
    # The recording thread bumps an in-place op's version after recording it, outside the
    # graph's lock: a synchronize on another thread may run the graph in between. Restoring
    # the versions read before the run undid that bump (autograd then saw a saved tensor
    # "modified by an inplace operation").
    w = torch.zeros(4, device="tpu")
    real_replay = deferred_graph.replay

    def replay_as_the_bump_lands(*args, **kwargs):
        out = real_replay(*args, **kwargs)
        torch._C._autograd._unsafe_set_version_counter((w,), (w._version + 1,))
        return out

    monkeypatch.setattr(deferred_graph, "replay", replay_as_the_bump_lands)
    with torch_tpu.eager_mode("defer_and_fuse"):
        w.add_(1)
        version = w._version
        syncer = threading.Thread(target=torch.tpu.synchronize)
        syncer.start()
        syncer.join()
        assert defer.stats().graphs == 1
        assert w._version == version + 1  # the bump that landed; none of the graph's own
        assert w.cpu().tolist() == [1.0] * 4


def test_compiled_graphs_run_by_another_thread_equal_strict_and_keep_versions(monkeypatch):
    # Run on another thread, the graph's written inputs are aliases with counters of their own.
    monkeypatch.setenv(COMPILE, "sync")

    def steps(w, x):
        out = []
        for _ in range(4):  # compiled from the second run on
            w.mul_(0.5)
            w.add_(x * 2)
            version = w._version
            syncer = threading.Thread(target=torch.tpu.synchronize)
            syncer.start()
            syncer.join()
            assert w._version == version
            out.append(w.cpu())
        return out

    def make():
        return torch.ones(4, device="tpu"), torch.arange(4.0, device="tpu")

    assert_equal_lists(*in_both_modes(steps, make))
    assert defer.stats().compiled_runs > 0


def test_training_with_synchronize_on_another_thread_equals_strict():
    def train():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2)).to("tpu")
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        x = torch.randn(3, 4).to("tpu")
        stop = threading.Event()

        def syncer():
            while not stop.is_set():
                torch.tpu.synchronize()

        thread = threading.Thread(target=syncer)
        thread.start()
        try:
            for _ in range(10):
                model(x).square().mean().backward()
                opt.step()
                opt.zero_grad()
        finally:
            stop.set()
            thread.join()
        return list(model.parameters())

    assert_equal_lists(*in_both_modes(train))


# ---- 5. compiled graphs copying an input they then update ----

@pytest.mark.parametrize("copy", ["plain", "clone"])
def test_a_copy_of_a_tensor_the_graph_then_updates_equals_strict_when_compiles_are_on(copy, monkeypatch):
    # Upstream Inductor drops the copy of an input as a no-op and writes the destination from
    # the source's buffer after the source's update (its runs alternate with op by op ones).
    monkeypatch.setenv(COMPILE, "sync")

    def steps(a, b):
        out = []
        for _ in range(4):  # compiled from the second run on
            c = b * 1  # b is read first: it comes before a in the graph's inputs
            a.copy_(b if copy == "plain" else b.clone())
            b.add_(1)
            torch.tpu.synchronize()
            out += [c.cpu(), a.cpu(), b.cpu()]  # read on the host: no op joins the next graph
        return out

    def make():
        return torch.zeros(2, 3, device="tpu"), torch.arange(6.0, device="tpu").view(2, 3)

    assert_equal_lists(*in_both_modes(steps, make))


def test_graphs_copying_an_input_they_then_update_are_told_apart():
    def graph_of(code):
        a, b = torch.zeros(3, device="tpu"), torch.arange(3.0, device="tpu")
        seen = []
        real_run = deferred_graph.GraphCache.run

        def spy(self, graph, outputs, errors=None):
            seen.append(deferred_graph.copies_an_updated_source(graph))
            return real_run(self, graph, outputs, errors)

        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(deferred_graph.GraphCache, "run", spy)
            with torch_tpu.eager_mode("defer_and_fuse"):
                code(a, b)
                torch.tpu.synchronize()
        return seen

    assert graph_of(lambda a, b: (b * 1, a.copy_(b * 2), b.mul_(2))) == [True]
    assert graph_of(lambda a, b: (a.copy_(b), a.mul_(2))) == [False]  # the source is not updated
    assert graph_of(lambda a, b: (b.mul_(2), a.copy_(b))) == [False]  # updated before the copy
