"""tpu random number generation: reproducible, separate from the CPU's."""

import pytest
import torch


def draws():
    x = torch.ones(1000, device="tpu")
    return (
        torch.nn.functional.dropout(x, p=0.5, training=True).cpu(),
        torch.randperm(50, device="tpu").cpu(),
        torch.multinomial(torch.ones(20, device="tpu"), 10).cpu(),
        torch.rand(5, device="tpu").cpu(),
        torch.randn(5, device="tpu").cpu(),
    )


def test_manual_seed_makes_random_ops_reproducible():
    torch.tpu.manual_seed(1234)
    first = draws()
    torch.tpu.manual_seed(1234)
    second = draws()
    for a, b in zip(first, second):
        torch.testing.assert_close(a, b)


def test_independent_of_the_cpu_generator():
    torch.manual_seed(1)  # seeds every device too, so the tpu seed comes after
    torch.tpu.manual_seed(7)
    first = draws()
    torch.manual_seed(2)
    torch.tpu.manual_seed(7)
    torch.rand(100)  # consume CPU randomness
    second = draws()
    for a, b in zip(first, second):
        torch.testing.assert_close(a, b)


def test_different_seeds_differ_and_dropout_is_a_real_mask():
    torch.tpu.manual_seed(1)
    a = draws()
    torch.tpu.manual_seed(2)
    b = draws()
    assert not torch.equal(a[0], b[0])
    kept = (a[0] != 0).float().mean().item()
    assert 0.4 < kept < 0.6
    assert set(a[0].unique().tolist()) <= {0.0, 2.0}
    assert sorted(a[1].tolist()) == list(range(50))


def test_torch_manual_seed_seeds_tpu_too():
    torch.manual_seed(99)
    a = torch.rand(4, device="tpu").cpu()
    torch.manual_seed(99)
    b = torch.rand(4, device="tpu").cpu()
    torch.testing.assert_close(a, b)
    assert torch.tpu.initial_seed() == 99


def test_rng_state_round_trip():
    torch.tpu.manual_seed(5)
    state = torch.tpu.get_rng_state()
    a = torch.rand(8, device="tpu").cpu()
    torch.tpu.set_rng_state(state)
    b = torch.rand(8, device="tpu").cpu()
    torch.testing.assert_close(a, b)
    states = torch.tpu.get_rng_state_all()
    assert len(states) == torch.tpu.device_count()
    c = torch.rand(8, device="tpu").cpu()
    torch.tpu.set_rng_state_all(states)
    torch.testing.assert_close(torch.rand(8, device="tpu").cpu(), c)


def test_explicit_tpu_generator():
    g = torch.Generator(device="tpu")
    assert g.device.type == "tpu"
    g.manual_seed(3)
    a = torch.rand(6, device="tpu", generator=g).cpu()
    g.manual_seed(3)
    b = torch.rand(6, device="tpu", generator=g).cpu()
    torch.testing.assert_close(a, b)
    # A tpu generator draws the same stream as a CPU generator with its seed.
    torch.testing.assert_close(a, torch.rand(6, generator=torch.Generator().manual_seed(3)))


def test_devices_have_their_own_generators():
    torch.tpu.manual_seed_all(11)
    a0 = torch.rand(4, device="tpu:0").cpu()
    a1 = torch.rand(4, device="tpu:1").cpu()
    torch.testing.assert_close(a0, a1)  # same seed, separate streams
    torch.tpu.manual_seed_all(11)
    torch.rand(4, device="tpu:0")
    torch.testing.assert_close(torch.rand(4, device="tpu:1").cpu(), a1)


def test_seed_changes_initial_seed():
    torch.tpu.seed()
    s = torch.tpu.initial_seed()
    torch.tpu.manual_seed(s)
    assert torch.tpu.initial_seed() == s
    with pytest.raises(RuntimeError):
        torch.tpu.set_rng_state(torch.zeros(3, dtype=torch.uint8))


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_activation_checkpointing_recomputes_the_same_dropout_mask(use_reentrant):
    # torch.utils.checkpoint stashes the device's RNG state only for an initialized device
    # module (torch.tpu._initialized): else the recomputed forward draws another mask and the
    # gradients silently differ from the plain forward's.
    from torch.utils.checkpoint import checkpoint

    def block(a):
        return torch.nn.functional.dropout(a * a, 0.5, training=True) ** 2

    grads = []
    for checkpointed in (False, True):
        torch.manual_seed(0)
        x = torch.linspace(0.5, 2.0, 64, device="tpu").view(4, 16).requires_grad_()
        out = checkpoint(block, x, use_reentrant=use_reentrant) if checkpointed else block(x)
        out.sum().backward()
        grads.append(x.grad.cpu())
    assert (grads[0] == 0).any() and (grads[0] != 0).any()  # dropout dropped some, kept some
    assert torch.equal(grads[1], grads[0])


def test_a_cpu_generator_is_refused_by_tpu_random_ops():
    # As CUDA: "Expected a 'cuda' device type for generator".
    with pytest.raises(RuntimeError, match="Expected a 'tpu' device type for generator but found 'cpu'"):
        torch.randn(3, device="tpu", generator=torch.Generator().manual_seed(0))
    with pytest.raises(RuntimeError, match="Expected a 'tpu' device type for generator"):
        torch.empty(3, device="tpu").normal_(generator=torch.Generator())
    g = torch.Generator("tpu").manual_seed(0)
    assert torch.randn(3, device="tpu", generator=g).device.type == "tpu"


def test_generator_offsets_are_named_as_the_tpu_s():
    g = torch.Generator("tpu")
    for call in (g.get_offset, lambda: g.set_offset(4)):
        with pytest.raises(RuntimeError, match="tpu generators draw from an mt19937 stream"):
            call()


def test_native_dropout_edges_are_cpus():
    """p = 1 scales the kept values by 0, so an inf or NaN input gives NaN (not 0), and an
    empty input comes back as itself with a mask of its dtype: ATen's CPU kernel, both."""
    x = torch.tensor([float("inf"), float("nan"), 1.0, -2.0])
    want_out, want_mask = torch.native_dropout(x, 1.0, True)
    out, mask = torch.native_dropout(x.to("tpu"), 1.0, True)
    torch.testing.assert_close(out.cpu(), want_out, equal_nan=True)
    assert mask.dtype == want_mask.dtype and not mask.cpu().any()
    empty = torch.empty(0, 3)
    cpu_out, cpu_mask = torch.native_dropout(empty, 0.5, True)
    tpu_empty = empty.to("tpu")
    out, mask = torch.native_dropout(tpu_empty, 0.5, True)
    assert (cpu_out is empty) and (out is tpu_empty)
    assert mask.dtype == cpu_mask.dtype and mask.shape == cpu_mask.shape and mask.device == tpu_empty.device
