"""Pinned host memory for the tpu: tensor.pin_memory() and DataLoader(pin_memory=True).

Pinned batches must report is_pinned(), keep the values of the unpinned
batches, and copy to tpu with non_blocking=True exactly.
"""

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset


class DictDataset(Dataset):
    """Samples as dicts of tensors, to exercise pinning of nested batches."""

    def __init__(self, n):
        gen = torch.Generator().manual_seed(7)
        self.x = torch.randn(n, 3, 4, generator=gen)
        self.y = torch.randint(0, 10, (n,), generator=gen)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i], "y": self.y[i], "pair": (self.x[i].sum(), self.y[i] * 2)}


def make_dataset(n=22):
    gen = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 5, generator=gen), torch.randint(0, 3, (n,), generator=gen))


def test_plain_cpu_tensor_is_not_pinned():
    t = torch.randn(4, 4)
    assert not t.is_pinned()
    assert not t.clone().is_pinned()
    assert not torch.empty(10).is_pinned()


def test_pin_memory_then_is_pinned():
    t = torch.randn(6, 5)
    p = t.pin_memory()
    assert p.is_pinned()
    assert not t.is_pinned()  # pin_memory returns a pinned copy, the source is untouched
    assert p.device.type == "cpu"
    assert p.data_ptr() != t.data_ptr()
    assert torch.equal(p, t)
    assert p.pin_memory().is_pinned()
    # Views of pinned memory are pinned too, as with CUDA.
    assert p[2:].is_pinned() and p.t().is_pinned()
    # Factories with pin_memory=True allocate pinned memory.
    e = torch.empty(3, 3, pin_memory=True)
    assert e.is_pinned()
    z = torch.zeros(4, pin_memory=True)
    assert z.is_pinned() and torch.equal(z, torch.zeros(4))
    for dtype in (torch.int64, torch.bool, torch.bfloat16):
        src = torch.arange(8).to(dtype)
        pinned = src.pin_memory()
        assert pinned.is_pinned() and pinned.dtype == dtype and torch.equal(pinned, src)


def test_pinned_copy_to_tpu_non_blocking():
    t = torch.randn(32, 16)
    p = t.pin_memory()
    d0 = p.to("tpu", non_blocking=True)
    d1 = p.to("tpu:1", non_blocking=True)
    into = torch.empty(32, 16, device="tpu")
    into.copy_(p, non_blocking=True)
    torch.tpu.synchronize()
    assert d0.device == torch.device("tpu:0") and d1.device == torch.device("tpu:1")
    for d in (d0, d1, into):
        assert torch.equal(d.cpu(), t)
    # And back into pinned host memory.
    back = torch.empty(32, 16, pin_memory=True)
    back.copy_(d1 * 2, non_blocking=True)
    torch.tpu.synchronize()
    assert torch.equal(back, t * 2)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_dataloader_pin_memory_yields_pinned_batches(num_workers):
    dataset = make_dataset()
    kwargs = dict(batch_size=4, shuffle=False, num_workers=num_workers)
    reference = list(DataLoader(dataset, **kwargs))
    pinned = list(DataLoader(dataset, pin_memory=True, **kwargs))
    assert len(pinned) == len(reference) == 6  # 22 samples: five full batches and one of 2
    for (x, y), (xr, yr) in zip(pinned, reference):
        assert x.is_pinned() and y.is_pinned()
        assert not xr.is_pinned() and not yr.is_pinned()
        assert torch.equal(x, xr) and torch.equal(y, yr)


def test_dataloader_without_pin_memory_is_not_pinned():
    for x, y in DataLoader(make_dataset(), batch_size=8):
        assert not x.is_pinned() and not y.is_pinned()


def test_dataloader_pinned_batches_to_tpu_non_blocking():
    dataset = make_dataset()
    loader = DataLoader(dataset, batch_size=5, pin_memory=True, drop_last=True)
    weight = torch.randn(5, 3, generator=torch.Generator().manual_seed(1))
    weight_t = weight.to("tpu")
    total_t = torch.zeros(3, device="tpu")
    total_c = torch.zeros(3)
    count = 0
    for x, y in loader:
        assert x.is_pinned()
        xt = x.to("tpu", non_blocking=True)
        yt = y.to("tpu", non_blocking=True)
        assert xt.device.type == "tpu" and yt.device.type == "tpu"
        # Use the batch on device right away; the stream orders the copy before the compute.
        logits_t = xt @ weight_t
        total_t += torch.nn.functional.cross_entropy(logits_t, yt, reduction="none").sum() * torch.ones(3, device="tpu")
        total_c += torch.nn.functional.cross_entropy(x @ weight, y, reduction="none").sum() * torch.ones(3)
        torch.tpu.synchronize()
        assert torch.equal(xt.cpu(), dataset.tensors[0][count * 5 : count * 5 + 5])
        assert torch.equal(yt.cpu(), dataset.tensors[1][count * 5 : count * 5 + 5])
        count += 1
    assert count == 4
    torch.testing.assert_close(total_t.cpu(), total_c, atol=1e-5, rtol=1e-5)


def test_dataloader_pins_nested_batches():
    dataset = DictDataset(10)
    reference = list(DataLoader(dataset, batch_size=3))
    for batch, ref in zip(DataLoader(dataset, batch_size=3, pin_memory=True), reference):
        leaves = [batch["x"], batch["y"], *batch["pair"]]
        ref_leaves = [ref["x"], ref["y"], *ref["pair"]]
        for leaf, ref_leaf in zip(leaves, ref_leaves):
            assert leaf.is_pinned()
            assert torch.equal(leaf, ref_leaf)
        on_tpu = {k: v.to("tpu:1", non_blocking=True) for k, v in batch.items() if torch.is_tensor(v)}
        torch.tpu.synchronize()
        assert torch.equal(on_tpu["x"].cpu(), ref["x"])
        assert on_tpu["y"].device == torch.device("tpu:1")
