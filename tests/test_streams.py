"""Streams are ordered queues; events order work across them."""

import os
import threading
import time

import pytest
import torch

import torch_tpu.threads


def test_default_and_current_stream():
    s = torch.tpu.current_stream()
    assert s == torch.tpu.default_stream()
    assert s.device == torch.device("tpu:0")
    assert s.query()


def test_submitted_work_runs_in_order_and_synchronize_waits():
    s = torch.tpu.Stream()
    order = []
    gate = threading.Event()
    first = torch.tpu.submit(s, lambda: (gate.wait(5), order.append(1)))
    second = torch.tpu.submit(s, order.append, 2)
    assert not s.query()  # blocked behind the gate
    gate.set()
    torch.tpu.synchronize()
    assert order == [1, 2]
    assert s.query() and first.done() and second.done()


def test_errors_reach_the_future():
    s = torch.tpu.Stream()
    future = torch.tpu.submit(s, lambda: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        future.result(timeout=5)
    assert torch.tpu.submit(s, lambda: 7).result(timeout=5) == 7


def test_submitted_work_keeps_the_callers_grad_mode():
    s = torch.tpu.Stream()
    with torch.no_grad():
        assert torch.tpu.submit(s, torch.is_grad_enabled).result(timeout=10) is False
    assert torch.tpu.submit(s, torch.is_grad_enabled).result(timeout=10) is True


def live_threads() -> int:
    return len(os.listdir("/proc/self/task"))


@pytest.mark.parametrize("where", ["stream", "threads.worker"])
def test_worker_threads_start_no_openmp_team(where):
    """A parallel region from a worker thread would give libgomp a second pool (one more
    thread); ATen ops there run on one thread instead, with the same results."""
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        if where == "stream":
            s = torch.tpu.Stream()
            submit = lambda fn: torch.tpu.submit(s, fn)  # noqa: E731
        else:
            submit = torch_tpu.threads.worker("test-worker").submit
        x, w = torch.randn(1 << 20), torch.randn(256, 256)
        expected = (x * 2 + 1, w @ w)  # the main thread's OpenMP pool exists from here on
        submit(lambda: None).result(timeout=10)  # the worker exists too
        before = live_threads()
        threads, (y, ww) = submit(lambda: (torch.get_num_threads(), (x * 2 + 1, w @ w))).result(timeout=30)
        assert live_threads() == before
        assert threads == 1
        assert torch.equal(y, expected[0]) and torch.allclose(ww, expected[1])
    finally:
        torch.set_num_threads(previous)


def test_event_orders_one_stream_after_another():
    producer, consumer = torch.tpu.Stream(), torch.tpu.Stream()
    log = []
    torch.tpu.submit(producer, lambda: (time.sleep(0.2), log.append("produced")))
    event = torch.tpu.Event()
    event.record(producer)
    assert not event.query()
    consumer.wait_event(event)
    torch.tpu.submit(consumer, log.append, "consumed")
    consumer.synchronize()
    assert log == ["produced", "consumed"]
    assert event.query()


def test_an_event_dropped_while_a_stream_waits_on_it_still_orders_the_stream():
    # wait_stream records a temporary event, queues a wait on it and drops it
    # at once: the queued wait must keep the event alive (it was freed under it).
    producer, consumer = torch.tpu.Stream(), torch.tpu.Stream()
    log = []
    for i in range(50):
        torch.tpu.submit(producer, lambda i=i: (time.sleep(0.002), log.append(("produced", i))))
        consumer.wait_stream(producer)
        torch.tpu.Event().record(producer)  # recorded, then dropped with its record still queued
        torch.tpu.submit(consumer, lambda i=i: log.append(("consumed", i)))
    consumer.synchronize()
    for i in range(50):
        assert log.index(("produced", i)) < log.index(("consumed", i))


def test_event_timing():
    s = torch.tpu.Stream()
    start, end = torch.tpu.Event(enable_timing=True), torch.tpu.Event(enable_timing=True)
    start.record(s)
    torch.tpu.submit(s, time.sleep, 0.05)
    end.record(s)
    end.synchronize()
    assert 40 <= start.elapsed_time(end) < 2000


def test_ops_under_a_stream_run_after_its_queued_work():
    s = torch.tpu.Stream()
    x = torch.zeros(4, device="tpu")
    torch.tpu.submit(s, lambda: (time.sleep(0.1), x.fill_(3.0)))
    with torch.tpu.stream(s):
        assert torch.tpu.current_stream() == s
        y = x + 1
    assert torch.tpu.current_stream() == torch.tpu.default_stream()
    torch.testing.assert_close(y.cpu(), torch.full((4,), 4.0))


def test_generic_torch_stream_and_event_apis():
    s = torch.Stream(device="tpu")
    e = torch.Event(device="tpu")
    e.record(s)
    e.synchronize()
    assert e.query()
    torch.accelerator.synchronize()
    assert torch.accelerator.current_stream().device.type == "tpu"


def test_streams_per_device():
    s1 = torch.tpu.Stream("tpu:1")
    assert s1.device == torch.device("tpu:1")
    done = torch.tpu.submit(s1, lambda: "ok")
    torch.tpu.synchronize(1)
    assert done.result(timeout=1) == "ok"


READS = {
    "cpu": lambda x: x.cpu(),
    "item": lambda x: torch.full((2, 2), x[0, 0].item()),
    "matmul": lambda x: (x @ torch.eye(2, device="tpu")).cpu(),
    "to_float64": lambda x: x.to(torch.float64).float().cpu(),
    "copy_": lambda x: torch.empty(2, 2, device="tpu").copy_(x).cpu(),
    "clone": lambda x: x.clone().cpu(),
}


@pytest.mark.parametrize("read", sorted(READS))
def test_every_kernel_under_a_stream_runs_after_its_queued_work(read):
    # Not only the boxed fallback's ops: copies, .item() and the kernels of our own too.
    s = torch.tpu.Stream()
    x = torch.zeros(2, 2, device="tpu")
    with torch.tpu.stream(s):
        torch.tpu.submit(s, lambda: (time.sleep(0.1), x.fill_(5.0)))
        got = READS[read](x)
    torch.testing.assert_close(got, torch.full((2, 2), 5.0))


def test_a_stream_context_on_another_device_restores_the_device_and_its_stream():
    assert torch.tpu.device_count() >= 2
    torch.tpu.set_device(0)
    s1 = torch.tpu.Stream("tpu:1")
    with torch.tpu.stream(s1):
        assert torch.tpu.current_device() == 1 and torch.tpu.current_stream(1) == s1
    assert torch.tpu.current_device() == 0  # as torch.cuda.StreamContext
    assert torch.tpu.current_stream(1) == torch.tpu.default_stream(1)
    assert torch.tpu.current_stream(0) == torch.tpu.default_stream(0)
