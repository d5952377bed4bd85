"""torch.tpu's precision and RNG functions called inside a torch.compile'd function
behave as in eager on every call: they run as Python at a graph break (traced, the
precision setter was dropped from the graph after the first call, and the RNG
functions failed in Dynamo); under fullgraph=True the error names the function."""

import re

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
