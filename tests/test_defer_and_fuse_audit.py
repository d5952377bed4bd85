"""DeferAndFuse against Strict where an audit of its transfers, ``.data`` property and
threads found them to differ: ops naming the tpu without an index, whose graph runs
under another current device than the one they were recorded under."""

import pytest
import torch

import torch_tpu

# Autouse: each test starts with a fresh engine (graphs op by op unless it asks for
# compiles) and ends in Strict.
from tests.test_defer_and_fuse import COMPILE, strict_after  # noqa: F401


def in_both_modes(fn):
    """fn() run in Strict, then under DeferAndFuse: its tensors as (cpu value, device)."""
    results = []
    for mode in ("strict", "defer_and_fuse"):
        with torch_tpu.eager_mode(mode):
            results.append([(t.cpu(), t.device) for t in fn()])
    return results


def assert_same(strict, deferred):
    assert len(strict) == len(deferred)
    for (s, s_device), (d, d_device) in zip(strict, deferred):
        assert d_device == s_device, (s_device, d_device)
        assert torch.equal(d, s), (s, d)


@pytest.mark.parametrize("compile_mode", ["off", "sync"])
def test_ops_naming_the_current_tpu_keep_the_device_they_were_recorded_on(compile_mode, monkeypatch):
    # torch.zeros(device="tpu") and x.to("tpu") were recorded as such: the graph, run under
    # another current device, put their values there ("fill_deferred: ... does not fit").
    assert torch.tpu.device_count() >= 2  # tests/conftest.py asks for two
    monkeypatch.setenv(COMPILE, compile_mode)

    def steps():
        out = []
        for _ in range(3):  # compiled from the second run on
            with torch.tpu.device(1):
                inside = torch.zeros(2, device="tpu") + 1  # pending on tpu:1
            outside = torch.full((2,), 3.0, device="tpu") * 2  # pending on tpu:0
            x = torch.arange(3.0, device="tpu") * 2
            moved = x.to("tpu") + 1  # tpu:0 to the current device, tpu:0
            like = torch.zeros_like(x, device="tpu") + x
            with torch.tpu.device(1):
                # Read in the block: the graph runs with tpu:1 current.
                out += [(v.cpu(), v.device) for v in (outside, moved, like)]
            out.append((inside.cpu(), inside.device))  # run with tpu:0 current
        return [torch.cat([v for v, _ in out])] + [torch.empty(0, device=d) for _, d in out]

    assert_same(*in_both_modes(steps))


class _Tracked(torch.Tensor):
    """A subclass recording the torch functions it sees (one that logs its use, say)."""

    seen: list = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        cls.seen.append(getattr(func, "__name__", str(func)))
        return super().__torch_function__(func, types, args, kwargs or {})


@pytest.mark.parametrize("device", ["cpu", "tpu"])
def test_a_subclass_sees_only_the_data_assignment(device):
    # The .data setter's checks (get_device, the storage) went through the subclass's
    # __torch_function__: one that refuses what it does not know refused the assignment.
    def steps():
        t = torch.ones(3, device=device).as_subclass(_Tracked)
        pending = torch.arange(3.0, device=device) * 2
        _Tracked.seen = []
        t.data = pending
        seen = list(_Tracked.seen)
        return [torch.tensor([len(seen), seen.count("__set__")]), t.as_subclass(torch.Tensor)]

    assert_same(*in_both_modes(steps))
