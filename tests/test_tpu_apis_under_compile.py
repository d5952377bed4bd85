"""torch.tpu's functions of process state (precision, RNG, current device, memory
statistics, streams) called inside a torch.compile'd function behave as in eager on every
call: they run as Python at a graph break (traced, the precision setter was dropped from
the graph after the first call, and the others failed in Dynamo); under fullgraph=True the
error names the function. Queries of constants (device count, properties) are traced."""

import re
import time

import pytest
import torch
import torch._dynamo

BACKENDS = ["aot_eager", "tpu"]


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture
def operands():
    g = torch.Generator().manual_seed(0)
    return torch.randn(64, 256, generator=g).to("tpu"), torch.randn(256, 32, generator=g).to("tpu")


def in_block(a, b):
    y0 = a @ b
    with torch.tpu.precision("highest"):
        y = (a @ b).relu()
    return y + 1, y0 * 2


def set_and_restore(a, b):
    torch.tpu.set_float32_matmul_precision("highest")
    y = a @ b
    torch.tpu.set_float32_matmul_precision("medium")
    return y, (a @ b) * 2


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fn", [in_block, set_and_restore])
def test_precision_set_inside_applies_on_every_call(operands, backend, fn):
    with torch.tpu.precision("medium"):
        expected = fn(*operands)
        compiled = torch.compile(fn, backend=backend)
        for _ in range(4):
            for got, want in zip(compiled(*operands), expected):
                torch.testing.assert_close(got, want, atol=0, rtol=0)
            assert torch.tpu.get_float32_matmul_precision() == "medium"
    # The inner matmul ran exact, the outer one at bf16: the check above can tell them apart.
    assert (expected[0] - 1 - (expected[1] / 2).relu()).abs().max() > 1e-2


def test_code_called_inside_the_block_is_still_compiled(operands):
    # Dynamo runs the frame holding the `with` uncompiled; the helper it calls compiles.
    def helper(a, b):
        return (a @ b).relu() + 1

    def fn(a, b):
        with torch.tpu.precision("highest"):
            return helper(a, b)

    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    with torch.tpu.precision("medium"):
        expected = fn(*operands)
        compiled = torch.compile(fn, backend=backend)
        for _ in range(3):
            torch.testing.assert_close(compiled(*operands), expected, atol=0, rtol=0)
    assert len(graphs) == 1


@pytest.mark.parametrize("api, fn", [
    ("torch.tpu.precision", lambda a, b: in_block(a, b)[0]),
    ("torch.tpu.set_float32_matmul_precision", lambda a, b: set_and_restore(a, b)[0]),
    ("torch.tpu.get_float32_matmul_precision",
     lambda a, b: a @ b if torch.tpu.get_float32_matmul_precision() == "medium" else a),
    ("torch.tpu.manual_seed", lambda a, b: (torch.tpu.manual_seed(0), a @ b)[1]),
    ("torch.tpu.get_rng_state", lambda a, b: (torch.tpu.get_rng_state(), a @ b)[1]),
])
def test_fullgraph_error_names_the_api(operands, api, fn):
    # The reason the function carries, not just the user's source line quoted in any error.
    with pytest.raises(torch._dynamo.exc.Unsupported, match=rf"reason: {re.escape(api)} reads or sets the tpu"):
        torch.compile(fn, backend="aot_eager", fullgraph=True)(*operands)


def seeded_dropout(x, seed):
    torch.tpu.manual_seed(seed)
    return torch.nn.functional.dropout(x, 0.5) * 1 + torch.rand(x.shape, device=x.device)


def restored_state(x):
    state = torch.tpu.get_rng_state()
    a = torch.nn.functional.dropout(x, 0.5)
    torch.tpu.set_rng_state(state)
    return a, torch.nn.functional.dropout(x, 0.5)


def all_devices(x):
    torch.tpu.manual_seed_all(5)
    states = torch.tpu.get_rng_state_all()
    y = torch.rand(x.shape, device=x.device)
    torch.tpu.set_rng_state_all(states)
    return y, torch.rand(x.shape, device=x.device) + torch.tpu.initial_seed()


def test_manual_seed_inside_equals_eager():
    # aot_eager draws with the eager kernels, so every call equals eager.
    x = torch.ones(1000, device="tpu")
    compiled = torch.compile(seeded_dropout, backend="aot_eager")
    for seed in (7, 7, 8):
        torch.testing.assert_close(compiled(x, seed), seeded_dropout(x, seed), atol=0, rtol=0)


def test_manual_seed_inside_equals_seeding_outside_with_the_tpu_backend():
    # Compiled kernels draw another stream than eager's (torch_tpu.inductor), so the
    # reference is the same compiled code seeded before the call.
    x = torch.ones(1000, device="tpu")
    compiled = torch.compile(seeded_dropout, backend="tpu")
    unseeded = torch.compile(lambda x: torch.nn.functional.dropout(x, 0.5) * 1 + torch.rand(x.shape, device=x.device),
                             backend="tpu")
    first = compiled(x, 7)
    torch.testing.assert_close(compiled(x, 7), first, atol=0, rtol=0)
    assert not torch.equal(compiled(x, 8), first)
    torch.tpu.manual_seed(7)
    torch.testing.assert_close(unseeded(x), first, atol=0, rtol=0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fn", [restored_state, all_devices])
def test_rng_state_functions_inside(backend, fn):
    x = torch.ones(1000, device="tpu")
    torch.tpu.manual_seed(3)
    expected = fn(x)
    compiled = torch.compile(fn, backend=backend)
    torch.tpu.manual_seed(3)
    for _ in range(2):
        first, second = compiled(x)
        torch.testing.assert_close(second, first + (fn is all_devices) * 5, atol=0, rtol=0)
    if backend == "aot_eager":
        torch.tpu.manual_seed(3)
        for got, want in zip(compiled(x), expected):
            torch.testing.assert_close(got, want, atol=0, rtol=0)


@pytest.mark.parametrize("call", [
    lambda: torch.tpu.seed(),
    lambda: torch.tpu.seed_all(),
    lambda: torch.tpu.initial_seed(),
    lambda: torch.tpu.default_generator().initial_seed(),
    lambda: torch.tpu.get_float32_matmul_precision(),
])
def test_other_calls_run_inside(call):
    x = torch.ones(8, device="tpu")
    compiled = torch.compile(lambda x: (call(), x * 2)[1], backend="aot_eager")
    torch.testing.assert_close(compiled(x), x * 2)


def slow_add_one(x):
    time.sleep(0.1)  # long enough that a graph not waiting for the stream reads x first
    x.add_(1)


@pytest.mark.parametrize("block", ["with s", "with torch.tpu.stream(s)"])
def test_a_stream_block_runs_after_the_stream_s_work_as_in_eager(block):
    """``with s:`` on a stream made outside: Dynamo annotates the block's ops with the stream,
    which Inductor compiled into ``with stream1:`` blocks naming a variable it never defined."""
    s = torch.tpu.Stream()

    def with_stream(x):
        with s:
            y = x * 2 + 1
        return y.sum(), y

    def with_context(x):
        with torch.tpu.stream(s):
            y = x * 2 + 1
        return y.sum(), y

    fn = with_stream if block == "with s" else with_context
    compiled = torch.compile(fn, backend="tpu")
    for _ in range(2):
        results = []
        for run in (fn, compiled):
            x = torch.zeros(64, device="tpu")
            torch.tpu.submit(s, slow_add_one, x)
            results.append(run(x))
        for got, want in zip(results[1], results[0]):
            torch.testing.assert_close(got, want, atol=0, rtol=0)
    assert results[0][0].item() == 64 * 3  # the block read x after the stream's add


NO_ARGUMENT_STATE_APIS = ["memory_allocated", "max_memory_allocated", "memory_reserved", "max_memory_reserved",
                          "memory_stats", "reset_peak_memory_stats", "reset_accumulated_memory_stats", "mem_get_info",
                          "empty_cache", "compile_cache_stats", "current_stream", "default_stream"]


@pytest.mark.parametrize("api, call", [
    ("torch.tpu.set_device", lambda x: torch.tpu.set_device(0)),
    ("torch.tpu.device", lambda x: torch.tpu.device(0).__enter__()),
    ("torch.tpu.device", lambda x: torch.tpu.device_of(x).__enter__()),
    *[(f"torch.tpu.{name}", lambda x, name=name: getattr(torch.tpu, name)()) for name in NO_ARGUMENT_STATE_APIS],
    ("torch.tpu.set_stream", lambda x: torch.tpu.set_stream(None)),
    ("torch.tpu.Stream", lambda x: torch.tpu.Stream()),
    ("torch.tpu.submit", lambda x: torch.tpu.submit(None, print)),
    ("torch.tpu.stream", lambda x: torch.tpu.stream(None).__enter__()),
])
def test_fullgraph_error_names_the_state_api(api, call):
    x = torch.ones(4, device="tpu")
    with pytest.raises(torch._dynamo.exc.Unsupported, match=rf"reason: {re.escape(api)} reads or sets the tpu"):
        torch.compile(lambda x: (call(x), x * 2)[1], backend="aot_eager", fullgraph=True)(x)


def test_memory_statistics_inside_are_read_at_every_call():
    compiled = torch.compile(lambda x: (torch.tpu.memory_allocated(), x * 2), backend="aot_eager")
    x = torch.ones(4, device="tpu")
    before = compiled(x)[0]  # read before the graph allocates, as after the call
    assert before == torch.tpu.memory_allocated()
    held = torch.empty(1 << 20, device="tpu")  # 4 MiB
    assert compiled(x)[0] == before + held.untyped_storage().nbytes()


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_device_set_inside_is_the_device_eager_uses(backend):
    def fn(x):
        with torch.tpu.device(1):
            y = torch.ones(2, device="tpu") + 1
        torch.tpu.set_device(1)
        z = torch.zeros(2, device="tpu")
        torch.tpu.set_device(0)
        return x.sum() + 1, y, z

    x = torch.ones(2, device="tpu")
    compiled = torch.compile(fn, backend=backend)
    for _ in range(2):
        for got, want in zip(compiled(x), fn(x)):
            assert got.device == want.device
            torch.testing.assert_close(got, want, atol=0, rtol=0)
        assert torch.tpu.current_device() == 0


def test_device_properties_are_traced_as_constants():
    def fn(x):
        properties = torch.tpu.get_device_properties()
        return x * properties.multi_processor_count + properties.total_memory + torch.tpu.device_count()

    x = torch.ones(4, device="tpu")
    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(x), fn(x), atol=0, rtol=0)
