"""Eager aten ops on the tpu device, each checked against the same computation on CPU.

Covers factories, host<->device and device<->device copies, views and writes
through them, in-place and out= ops, resize_, indexing, reductions, dtypes,
0-dim and empty tensors, and ops whose output shape depends on the data.
"""

import pytest
import torch
from torch.testing import assert_close

TPU = torch.device("tpu:0")
TPU1 = torch.device("tpu:1")


def same(tpu_result, cpu_result, **kw):
    """A tpu result equals the CPU result (same dtype and shape, close values)."""
    assert tpu_result.device.type == "tpu"
    assert_close(tpu_result.cpu(), cpu_result, **kw)


def cpu_and_tpu(*shape, dtype=torch.float32, seed=0, device=TPU):
    gen = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        c = torch.randn(*shape, generator=gen).to(dtype)
    elif dtype == torch.bool:
        c = torch.randint(0, 2, shape, generator=gen).bool()
    else:
        c = torch.randint(-50, 50, shape, generator=gen).to(dtype)
    return c, c.to(device)


# --------------------------------------------------------------------------- factories


@pytest.mark.parametrize("device", ["tpu", "tpu:0", "tpu:1"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int64, torch.int32, torch.bfloat16, torch.bool])
def test_zeros_ones_full(device, dtype):
    fill = True if dtype == torch.bool else 3
    for fn, args in [(torch.zeros, ((2, 3),)), (torch.ones, ((2, 3),)), (torch.full, ((2, 3), fill))]:
        t = fn(*args, dtype=dtype, device=device)
        expected_index = 1 if device == "tpu:1" else 0
        assert t.device == torch.device("tpu", expected_index)
        assert t.dtype == dtype
        assert_close(t.cpu(), fn(*args, dtype=dtype))


def test_factory_default_dtypes():
    assert torch.zeros(2, device="tpu").dtype == torch.zeros(2).dtype
    assert torch.full((2,), 7, device="tpu").dtype == torch.full((2,), 7).dtype
    assert torch.full((2,), 7.5, device="tpu").dtype == torch.full((2,), 7.5).dtype
    assert torch.arange(5, device="tpu").dtype == torch.int64


def test_arange_linspace_eye_logspace():
    same(torch.arange(10, device="tpu"), torch.arange(10))
    same(torch.arange(1.0, 4.0, 0.25, device="tpu"), torch.arange(1.0, 4.0, 0.25))
    same(torch.arange(-3, 11, 3, dtype=torch.int32, device="tpu:1"), torch.arange(-3, 11, 3, dtype=torch.int32))
    same(torch.linspace(-1, 1, 7, device="tpu"), torch.linspace(-1, 1, 7))
    same(torch.linspace(0, 10, 5, dtype=torch.float64, device="tpu"), torch.linspace(0, 10, 5, dtype=torch.float64))
    same(torch.logspace(0, 2, 5, device="tpu"), torch.logspace(0, 2, 5))
    same(torch.eye(4, device="tpu"), torch.eye(4))
    same(torch.eye(3, 5, dtype=torch.int64, device="tpu:1"), torch.eye(3, 5, dtype=torch.int64))
    assert torch.eye(3, device="tpu:1").device == TPU1


def test_empty_and_like_factories():
    e = torch.empty(3, 4, device="tpu:1", dtype=torch.float16)
    assert e.shape == (3, 4) and e.dtype == torch.float16 and e.device == TPU1
    es = torch.empty_strided((2, 3), (1, 2), device="tpu")
    assert es.stride() == (1, 2) and es.device == TPU

    c, t = cpu_and_tpu(2, 5)
    same(torch.zeros_like(t), torch.zeros_like(c))
    same(torch.ones_like(t, dtype=torch.int32), torch.ones_like(c, dtype=torch.int32))
    same(torch.full_like(t, -2.5), torch.full_like(c, -2.5))
    el = torch.empty_like(t)
    assert el.shape == t.shape and el.device == TPU
    assert t.new_zeros(3).device == TPU
    same(t.new_ones((2, 2)), c.new_ones((2, 2)))
    same(t.new_full((3,), 4.0), c.new_full((3,), 4.0))
    same(t.new_tensor([1.0, 2.0]), c.new_tensor([1.0, 2.0]))


def test_tensor_constructor_on_device():
    data = [[1, 2, 3], [4, 5, 6]]
    same(torch.tensor(data, device="tpu"), torch.tensor(data))
    same(torch.tensor(data, dtype=torch.float64, device="tpu:1"), torch.tensor(data, dtype=torch.float64))
    assert torch.tensor(data, device="tpu:1").device == TPU1
    same(torch.as_tensor([1.5, 2.5], device="tpu"), torch.as_tensor([1.5, 2.5]))


# --------------------------------------------------------------------------- copies between devices


def test_to_and_cpu_round_trip():
    c, _ = cpu_and_tpu(3, 4)
    t = c.to("tpu")
    assert t.device == TPU
    assert t.data_ptr() != c.data_ptr()
    back = t.cpu()
    assert back.device.type == "cpu"
    assert torch.equal(back, c)
    # Mutating the tpu copy does not touch the CPU source.
    t.add_(1)
    assert torch.equal(c, back)
    assert_close(t.cpu(), c + 1)


def test_to_tpu1_and_cross_device_copies():
    c, _ = cpu_and_tpu(4, 3, seed=1)
    t1 = c.to("tpu:1")
    assert t1.device == TPU1
    assert torch.equal(t1.cpu(), c)

    t0 = t1.to("tpu:0")
    assert t0.device == TPU
    assert torch.equal(t0.cpu(), c)
    t1.mul_(2)  # distinct memory
    assert torch.equal(t0.cpu(), c)
    assert_close(t1.cpu(), c * 2)

    back = t0.to(TPU1)
    assert back.device == TPU1 and torch.equal(back.cpu(), c)

    dst = torch.empty(4, 3, device="tpu:1")
    dst.copy_(t0)
    assert dst.device == TPU1 and torch.equal(dst.cpu(), c)


def test_to_with_dtype_and_device():
    c, t = cpu_and_tpu(3, 3, seed=2)
    same(t.to(torch.float64), c.to(torch.float64))
    same(t.to("tpu:1", torch.int32), c.to(torch.int32))
    assert t.to("tpu:1", torch.int32).device == TPU1
    assert_close(t.to("cpu", torch.bfloat16), c.to(torch.bfloat16))
    assert t.to("tpu:0") is t  # no-op conversion returns self
    assert t.to(TPU, copy=True) is not t


def test_copy_both_ways_with_dtype_and_broadcast():
    c, t = cpu_and_tpu(2, 3, seed=3)
    # cpu -> tpu with dtype conversion
    dst = torch.zeros(2, 3, dtype=torch.float64, device="tpu")
    r = dst.copy_(c)
    assert r is dst
    same(dst, c.to(torch.float64))
    # tpu -> cpu with dtype conversion
    host = torch.zeros(2, 3, dtype=torch.int32)
    host.copy_(t)
    assert torch.equal(host, c.to(torch.int32))
    # broadcast a row from cpu into tpu, and from tpu into cpu
    row_c = torch.tensor([1.0, 2.0, 3.0])
    dst = torch.empty(4, 3, device="tpu")
    dst.copy_(row_c)
    same(dst, row_c.expand(4, 3).contiguous())
    host = torch.empty(2, 3)
    host.copy_(t[0])
    assert torch.equal(host, c[0].expand(2, 3))
    # tpu -> tpu broadcast with dtype change
    dst = torch.empty(3, 2, 3, dtype=torch.float16, device="tpu")
    dst.copy_(t)
    same(dst, c.to(torch.float16).expand(3, 2, 3).contiguous())


def test_copy_into_noncontiguous_destination():
    c, t = cpu_and_tpu(3, 4, seed=4)
    dst_c = torch.zeros(4, 3)
    dst_t = torch.zeros(4, 3, device="tpu")
    dst_c.t().copy_(c)
    dst_t.t().copy_(t)
    same(dst_t, dst_c)
    # cpu source into a strided tpu view
    base_c = torch.zeros(4, 6)
    base_t = torch.zeros(4, 6, device="tpu")
    base_c[:, ::2].copy_(c.t())
    base_t[:, ::2].copy_(c.t())
    same(base_t, base_c)


def test_non_blocking_copies():
    c, _ = cpu_and_tpu(64, 8, seed=5)
    pinned = c.pin_memory()
    t = pinned.to("tpu", non_blocking=True)
    t1 = t.to("tpu:1", non_blocking=True)
    back = torch.empty(64, 8).pin_memory()
    back.copy_(t1, non_blocking=True)
    torch.tpu.synchronize()
    assert torch.equal(t.cpu(), c)
    assert torch.equal(t1.cpu(), c)
    assert torch.equal(back, c)
    host = t.to("cpu", non_blocking=True)
    torch.tpu.synchronize()
    assert torch.equal(host, c)


# --------------------------------------------------------------------------- views


def test_views_match_cpu():
    c, t = cpu_and_tpu(2, 3, 4, seed=6)
    pairs = [
        (lambda x: x.view(6, 4)),
        (lambda x: x.view(-1)),
        (lambda x: x.reshape(4, 6)),
        (lambda x: x.transpose(0, 2)),
        (lambda x: x.permute(2, 0, 1)),
        (lambda x: x.narrow(2, 1, 2)),
        (lambda x: x[:, 1:, ::2]),
        (lambda x: x[1, :, -1]),
        (lambda x: x[..., None, 0]),
        (lambda x: x[:, :1].expand(2, 5, 4)),
        (lambda x: x.unsqueeze(1)),
        (lambda x: x.unsqueeze(-1).squeeze(-1)),
        (lambda x: x.as_strided((3, 2), (4, 1), 2)),
        (lambda x: x[0].t()),
        (lambda x: x.unfold(2, 2, 1)),
        (lambda x: x.diagonal(dim1=1, dim2=2)),
        (lambda x: x.movedim(0, -1)),
        (lambda x: x.unbind(1)[2]),
        (lambda x: x.chunk(2, dim=2)[1]),
    ]
    for i, fn in enumerate(pairs):
        vc, vt = fn(c), fn(t)
        assert vt.device == TPU, i
        assert vt.shape == vc.shape and vt.stride() == vc.stride(), i
        assert vt.storage_offset() == vc.storage_offset(), i
        assert vt.untyped_storage().data_ptr() == t.untyped_storage().data_ptr(), i
        assert torch.equal(vt.cpu(), vc), i


def test_writes_through_views_visible_in_base():
    c, t = cpu_and_tpu(4, 6, seed=7)
    for x in (c, t):
        x.view(2, 12)[1, 3] = 100.0
        x.t()[2, 1] = -7.0
        x.narrow(1, 4, 2).fill_(5.0)
        x[::2, 0].mul_(10)
        x.unsqueeze(0)[0, 3].zero_()
        x.as_strided((2,), (7,), 1).add_(1000)
        x.reshape(24)[0] = 42.0  # contiguous -> reshape is a view
        x.permute(1, 0)[0].add_(0.5)
    same(t, c)


def test_contiguous_of_views():
    c, t = cpu_and_tpu(3, 5, seed=8)
    vc = c.t()[1:, ::2].contiguous()
    vt = t.t()[1:, ::2].contiguous()
    assert vt.is_contiguous()
    same(vt, vc)
    # reshape of a non-contiguous tensor copies and keeps values
    same(t.t().reshape(15), c.t().reshape(15))
    same(t.expand(2, 3, 5).reshape(6, 5), c.expand(2, 3, 5).reshape(6, 5))


# --------------------------------------------------------------------------- in-place ops


def test_inplace_ops_return_self_and_match():
    c, t = cpu_and_tpu(4, 5, seed=9)
    for x in (c, t):
        assert x.add_(1) is x
        assert x.mul_(torch.full((5,), 0.5, device=x.device)) is x
        assert x.sub_(0.25, alpha=2) is x
        assert x.div_(3) is x
        assert x.clamp_(-0.4, 0.6) is x
        assert x.pow_(2) is x
        assert x.neg_() is x
        assert x.addcmul_(x, x, value=0.5) is x
        assert x.exp_() is x
    same(t, c)


def test_inplace_on_tpu1_stays_on_tpu1():
    c, t = cpu_and_tpu(3, 3, seed=10, device=TPU1)
    r = t.add_(torch.ones(3, 3, device="tpu:1"))
    assert r is t and t.device == TPU1
    same(t, c + 1)


def test_index_put_masked_fill_scatter():
    c, t = cpu_and_tpu(5, 4, seed=11)
    idx_rows = torch.tensor([0, 2, 4])
    idx_cols = torch.tensor([1, 3, 0])
    vals = torch.tensor([10.0, 20.0, 30.0])
    mask_c = c > 0
    src = torch.arange(8.0).reshape(2, 4)
    index = torch.tensor([[0, 1, 2, 3], [4, 3, 2, 1]])

    results = []
    for x, dev in ((c, "cpu"), (t, "tpu")):
        r = x.index_put_((idx_rows.to(dev), idx_cols.to(dev)), vals.to(dev))
        assert r is x
        r = x.index_put_((idx_rows.to(dev),), torch.tensor(1.0, device=dev), accumulate=True)
        assert r is x
        assert x.masked_fill_(mask_c.to(dev), -1.0) is x
        assert x.scatter_(0, index.to(dev), src.to(dev)) is x
        assert x.scatter_add_(1, index.to(dev) % 4, src.to(dev)) is x
        assert x.index_fill_(1, torch.tensor([2], device=dev), 9.0) is x
        assert x.index_add_(0, torch.tensor([1, 1], device=dev), torch.ones(2, 4, device=dev)) is x
        results.append(x)
    same(results[1], results[0])


def test_setitem_forms():
    c, t = cpu_and_tpu(4, 5, seed=12)
    for x in (c, t):
        dev = x.device
        x[1] = 3.0
        x[:, 2] = torch.arange(4.0, device=dev)
        x[x < -1] = 0.0
        x[torch.tensor([0, 3], device=dev), 4] = torch.tensor([7.0, 8.0], device=dev)
        x[2:, 1:3] += 1
    same(t, c)
    # setting from a CPU tensor / scalar value into a tpu tensor
    t[0] = torch.full((5,), 2.0)
    c[0] = 2.0
    same(t, c)


# --------------------------------------------------------------------------- out= variants


def test_add_out():
    a_c, a_t = cpu_and_tpu(3, 4, seed=13)
    b_c, b_t = cpu_and_tpu(3, 4, seed=14)
    out = torch.empty(3, 4, device="tpu")
    ptr = out.data_ptr()
    r = torch.add(a_t, b_t, alpha=2, out=out)
    assert r is out
    assert out.data_ptr() == ptr  # right-size out is written in place
    same(out, torch.add(a_c, b_c, alpha=2))


def test_add_out_resizes_wrong_size_out():
    a_c, a_t = cpu_and_tpu(3, 4, seed=15)
    out = torch.empty(0, device="tpu")
    r = torch.add(a_t, 1, out=out)
    assert r is out and out.shape == (3, 4) and out.device == TPU
    same(out, a_c + 1)
    # On tpu:1 the grown buffer must stay on tpu:1.
    out1 = torch.empty(0, device="tpu:1")
    torch.mul(a_t.to("tpu:1"), 3, out=out1)
    assert out1.device == TPU1 and out1.untyped_storage().device == TPU1
    same(out1, a_c * 3)
    mm_out = torch.empty(0, device="tpu:1")
    torch.mm(a_t.to("tpu:1"), a_t.t().to("tpu:1"), out=mm_out)
    assert mm_out.untyped_storage().device == TPU1
    same(mm_out, a_c @ a_c.t())


def test_mm_out_with_wrong_size_out_is_resized():
    a_c, a_t = cpu_and_tpu(3, 5, seed=16)
    b_c, b_t = cpu_and_tpu(5, 2, seed=17)
    out = torch.empty(7, device="tpu")
    r = torch.mm(a_t, b_t, out=out)
    assert r is out
    assert out.shape == (3, 2) and out.device == TPU
    same(out, torch.mm(a_c, b_c))
    # Correct size: written in place.
    out2 = torch.empty(3, 2, device="tpu")
    ptr = out2.data_ptr()
    torch.mm(a_t, b_t, out=out2)
    assert out2.data_ptr() == ptr
    same(out2, torch.mm(a_c, b_c))


def test_matmul_out_into_noncontiguous_views():
    # A right-size out= that is a strided view must be filled through its strides.
    a_c, a_t = cpu_and_tpu(3, 5, seed=47)
    b_c, b_t = cpu_and_tpu(5, 2, seed=48)
    bb_c, bb_t = cpu_and_tpu(2, 3, 5, seed=49)
    bc_c, bc_t = cpu_and_tpu(2, 5, 2, seed=50)
    results = []
    for dev, a, b, b1, b2 in (("cpu", a_c, b_c, bb_c, bc_c), ("tpu", a_t, b_t, bb_t, bc_t)):
        base = torch.zeros(2, 3, device=dev)
        torch.mm(a, b, out=base.t())
        corner = torch.zeros(4, 4, device=dev)
        torch.mm(a, b, out=corner[:3, :2])
        bias = torch.ones(2, device=dev)
        addmm_base = torch.zeros(2, 3, device=dev)
        torch.addmm(bias, a, b, beta=0.5, out=addmm_base.t())
        bmm_base = torch.zeros(2, 2, 3, device=dev)
        torch.bmm(b1, b2, out=bmm_base.transpose(1, 2))
        results.append((base, corner, addmm_base, bmm_base))
    for t, c in zip(results[1], results[0]):
        same(t, c)


def test_matmul_out_with_wrong_dtype_raises_like_cpu():
    a_c, a_t = cpu_and_tpu(3, 4, seed=51)
    for a, dev in ((a_c, "cpu"), (a_t, "tpu")):
        with pytest.raises(RuntimeError, match="dtype"):
            torch.mm(a, a.t(), out=torch.empty(3, 3, dtype=torch.float64, device=dev))
        with pytest.raises(RuntimeError, match="dtype"):
            torch.bmm(a[None], a.t()[None], out=torch.empty(1, 3, 3, dtype=torch.float64, device=dev))


def test_cat_out():
    a_c, a_t = cpu_and_tpu(2, 3, seed=18)
    b_c, b_t = cpu_and_tpu(4, 3, seed=19)
    out = torch.empty(1, device="tpu")
    r = torch.cat([a_t, b_t], dim=0, out=out)
    assert r is out and out.device == TPU
    same(out, torch.cat([a_c, b_c], dim=0))
    out = torch.empty(6, 3, device="tpu")
    torch.cat([a_t, b_t], out=out)
    same(out, torch.cat([a_c, b_c]))


def test_other_out_variants():
    a_c, a_t = cpu_and_tpu(4, 6, seed=20)
    out_v = torch.empty(0, device="tpu")
    out_i = torch.empty(0, dtype=torch.int64, device="tpu")
    vals, idx = torch.max(a_t, dim=1, out=(out_v, out_i))
    assert vals is out_v and idx is out_i
    ev, ei = torch.max(a_c, dim=1)
    same(out_v, ev)
    same(out_i, ei)
    out = torch.empty(2, 2, device="tpu")
    torch.sum(a_t, dim=0, out=out)
    same(out, a_c.sum(0))
    out = torch.empty(0, device="tpu")
    torch.matmul(a_t, a_t.t(), out=out)
    same(out, a_c @ a_c.t())


# --------------------------------------------------------------------------- resize_


def test_resize_grow_keeps_prefix():
    c = torch.arange(6.0)
    t = c.to("tpu")
    r = t.resize_(4, 5)
    assert r is t and t.shape == (4, 5) and t.device == TPU
    assert torch.equal(t.flatten()[:6].cpu(), c)
    t.fill_(1.5)
    same(t, torch.full((4, 5), 1.5))


def test_resize_same_size_keeps_strides():
    # Like CPU: resize_ to the current sizes is a no-op, strides are untouched.
    for make in (lambda d: torch.zeros(4, 3, device=d).t(), lambda d: torch.zeros(4, 4, device=d)[:3, :2]):
        c, t = make("cpu"), make("tpu")
        c.resize_(c.shape)
        t.resize_(t.shape)
        assert t.stride() == c.stride()
        assert t.storage_offset() == c.storage_offset()


def test_resize_shrink_and_on_tpu1():
    c = torch.arange(12, dtype=torch.int32)
    t = c.to("tpu:1")
    t.resize_(2, 3)
    assert t.device == TPU1
    same(t, c[:6].view(2, 3))
    t.resize_(10)
    assert t.device == TPU1
    assert torch.equal(t[:6].cpu(), c[:6])


def test_resize_as_and_untyped_storage_resize():
    c, t = cpu_and_tpu(2, 2, seed=21)
    t2 = t.clone()
    t2.resize_as_(torch.empty(3, 3))
    assert t2.shape == (3, 3)
    assert torch.equal(t2.flatten()[:4].cpu(), c.flatten())
    s = t.untyped_storage()
    s.resize_(64)
    assert s.nbytes() == 64
    assert torch.equal(t.cpu(), c)


# --------------------------------------------------------------------------- indexing, sorting, scans, reductions


def test_indexing_and_gather():
    c, t = cpu_and_tpu(5, 6, seed=22)
    rows = torch.tensor([4, 0, 2, 2])
    mask = c[:, 0] > 0
    same(t[rows.to("tpu")], c[rows])
    same(t[rows], c[rows])  # CPU index into a tpu tensor
    same(t[mask.to("tpu")], c[mask])
    same(t[[1, 3], [0, 5]], c[[1, 3], [0, 5]])
    same(t[:, rows.to("tpu")], c[:, rows])
    gidx = torch.randint(0, 6, (5, 3), generator=torch.Generator().manual_seed(0))
    same(torch.gather(t, 1, gidx.to("tpu")), torch.gather(c, 1, gidx))
    same(torch.index_select(t, 0, rows.to("tpu")), torch.index_select(c, 0, rows))
    same(torch.index_select(t, 1, rows.to("tpu")), torch.index_select(c, 1, rows))
    same(torch.take(t, torch.tensor([0, 7, 29], device="tpu")), torch.take(c, torch.tensor([0, 7, 29])))
    same(torch.masked_select(t, t > 0.5), torch.masked_select(c, c > 0.5))


def test_sort_topk_argsort():
    c, t = cpu_and_tpu(4, 7, seed=23)
    for kwargs in ({}, {"dim": 0}, {"descending": True}, {"dim": 0, "descending": True, "stable": True}):
        vt, it = torch.sort(t, **kwargs)
        vc, ic = torch.sort(c, **kwargs)
        same(vt, vc)
        same(it, ic)
    for k, dim, largest in ((3, 1, True), (2, 0, False), (1, -1, True)):
        vt, it = torch.topk(t, k, dim=dim, largest=largest)
        vc, ic = torch.topk(c, k, dim=dim, largest=largest)
        same(vt, vc)
        same(it, ic)
    same(torch.argsort(t, dim=1), torch.argsort(c, dim=1))
    ic, it_ = cpu_and_tpu(10, dtype=torch.int64, seed=24)
    same(torch.sort(it_, stable=True)[1], torch.sort(ic, stable=True)[1])
    vt, it = torch.kthvalue(t, 3, dim=1)
    vc, ic = torch.kthvalue(c, 3, dim=1)
    same(vt, vc)
    same(it, ic)


def test_scans():
    c, t = cpu_and_tpu(3, 5, seed=25)
    same(torch.cumsum(t, dim=1), torch.cumsum(c, dim=1))
    same(torch.cumsum(t, dim=0), torch.cumsum(c, dim=0))
    same(torch.cumprod(t, dim=1), torch.cumprod(c, dim=1))
    vt, it = torch.cummax(t, dim=1)
    vc, ic = torch.cummax(c, dim=1)
    same(vt, vc)
    same(it, ic)
    ic, it_ = cpu_and_tpu(3, 5, dtype=torch.int32, seed=26)
    r = torch.cumsum(it_, 1)
    assert r.dtype == torch.cumsum(ic, 1).dtype
    same(r, torch.cumsum(ic, 1))


def test_reductions_with_dims():
    c, t = cpu_and_tpu(3, 4, 5, seed=27)
    same(t.sum(), c.sum())
    same(t.sum(dim=1), c.sum(dim=1))
    same(t.sum(dim=(0, 2), keepdim=True), c.sum(dim=(0, 2), keepdim=True))
    same(t.mean(dim=-1), c.mean(dim=-1))
    same(t.prod(dim=2), c.prod(dim=2))
    same(t.std(dim=1), c.std(dim=1))
    same(t.var(dim=(0, 1), unbiased=False), c.var(dim=(0, 1), unbiased=False))
    same(t.amax(dim=(1, 2)), c.amax(dim=(1, 2)))
    same(t.amin(dim=0), c.amin(dim=0))
    same(t.norm(dim=1), c.norm(dim=1))
    same(torch.logsumexp(t, dim=2), torch.logsumexp(c, dim=2))
    for fn in (torch.max, torch.min):
        vt, it = fn(t, dim=1)
        vc, ic = fn(c, dim=1)
        same(vt, vc)
        same(it, ic)
    same(t.argmax(), c.argmax())
    same(t.argmin(dim=2, keepdim=True), c.argmin(dim=2, keepdim=True))
    same(t.median(dim=1).values, c.median(dim=1).values)
    same((t > 0).any(dim=0), (c > 0).any(dim=0))
    same((t > 0).all(dim=2), (c > 0).all(dim=2))
    same(t.sum(dim=1, dtype=torch.float64), c.sum(dim=1, dtype=torch.float64))
    same(torch.count_nonzero(t > 0, dim=1), torch.count_nonzero(c > 0, dim=1))


def test_elementwise_and_broadcasting_binary_ops():
    a_c, a_t = cpu_and_tpu(3, 1, 4, seed=28)
    b_c, b_t = cpu_and_tpu(5, 1, seed=29)
    for fn in (torch.add, torch.mul, torch.sub, torch.maximum, torch.atan2):
        same(fn(a_t, b_t), fn(a_c, b_c))
    same(a_t / (b_t.abs() + 1), a_c / (b_c.abs() + 1))
    same(torch.pow(a_t.abs(), b_t), torch.pow(a_c.abs(), b_c))
    same(a_t * 2.5 - 1, a_c * 2.5 - 1)
    for fn in (torch.sin, torch.exp, torch.tanh, torch.sigmoid, torch.abs, torch.floor, torch.sign, torch.erf):
        same(fn(a_t), fn(a_c))
    same(torch.sqrt(a_t.abs()), torch.sqrt(a_c.abs()))
    same(torch.lerp(a_t, a_t * 2, 0.3), torch.lerp(a_c, a_c * 2, 0.3))


def test_mixed_device_scalar_tensor():
    # A 0-dim CPU tensor is allowed as an operand of a tpu op (like on CUDA).
    c, t = cpu_and_tpu(3, seed=30)
    s = torch.tensor(2.5)
    r = t * s
    assert r.device == TPU
    same(r, c * s)
    same(s + t, s + c)
    same(t.clone().add_(s), c + s)


_MIXED_DEVICE_OPS = {
    "add_tpu0_tpu1": lambda: torch.ones(3, device="tpu:0") + torch.ones(3, device="tpu:1"),
    "add_cpu_tpu0": lambda: torch.ones(3) + torch.ones(3, device="tpu:0"),
    "add_inplace_tpu1_tpu0": lambda: torch.ones(3, device="tpu:1").add_(torch.ones(3, device="tpu:0")),
    "add_out_on_tpu1": lambda: torch.add(torch.ones(3, device="tpu:0"), 1, out=torch.empty(3, device="tpu:1")),
    "add_out_on_cpu": lambda: torch.add(torch.ones(3, device="tpu:0"), 1, out=torch.empty(3)),
    "mm_tpu0_tpu1": lambda: torch.mm(torch.ones(2, 3, device="tpu:0"), torch.ones(3, 2, device="tpu:1")),
    "mm_cpu_tpu0": lambda: torch.mm(torch.ones(2, 3), torch.ones(3, 2, device="tpu:0")),
    "cat_tpu0_tpu1": lambda: torch.cat([torch.ones(2, device="tpu:0"), torch.ones(2, device="tpu:1")]),
    "where_tpu0_tpu1": lambda: torch.where(
        torch.ones(2, device="tpu:0") > 0, torch.ones(2, device="tpu:1"), torch.zeros(2, device="tpu:0")
    ),
}


@pytest.mark.parametrize("name", sorted(_MIXED_DEVICE_OPS))
def test_mixed_device_ops_raise(name):
    # PyTorch's device contract (as on CUDA): non-scalar operands and out= tensors
    # on different devices are an error, never a silent cross-device computation.
    with pytest.raises(RuntimeError, match="device"):
        _MIXED_DEVICE_OPS[name]()


# --------------------------------------------------------------------------- dtypes


@pytest.mark.parametrize("dtype", [torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64])
def test_integer_dtypes(dtype):
    gen = torch.Generator().manual_seed(31)
    lo = 0 if dtype == torch.uint8 else -20
    c = torch.randint(lo, 20, (4, 5), generator=gen, dtype=dtype)
    t = c.to("tpu")
    assert t.dtype == dtype
    same(t + 3, c + 3)
    same(t * t, c * c)
    same(t // 3, c // 3)
    same(t % 7, c % 7)
    same(t & 6, c & 6)
    same(t.sum(dim=1), c.sum(dim=1))
    assert t.sum().dtype == c.sum().dtype
    same(t.max(dim=0).values, c.max(dim=0).values)
    same(t / 2, c / 2)  # true division promotes to float
    same(t.to(torch.float32), c.to(torch.float32))
    same(t.bitwise_not(), c.bitwise_not())


def test_bool_dtype():
    a_c, a_t = cpu_and_tpu(4, 4, dtype=torch.bool, seed=32)
    b_c, b_t = cpu_and_tpu(4, 4, dtype=torch.bool, seed=33)
    assert a_t.dtype == torch.bool
    same(a_t & b_t, a_c & b_c)
    same(a_t | b_t, a_c | b_c)
    same(a_t ^ b_t, a_c ^ b_c)
    same(~a_t, ~a_c)
    same(a_t.sum(), a_c.sum())
    same(a_t.any(dim=1), a_c.any(dim=1))
    same(a_t.all(), a_c.all())
    same(a_t.to(torch.float32), a_c.to(torch.float32))
    same(torch.logical_and(a_t, b_t), torch.logical_and(a_c, b_c))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_floats(dtype):
    a_c, a_t = cpu_and_tpu(4, 6, dtype=dtype, seed=34)
    b_c, b_t = cpu_and_tpu(6, 3, dtype=dtype, seed=35)
    assert a_t.dtype == dtype
    same(a_t + a_t, a_c + a_c)
    same(a_t * 0.5, a_c * 0.5)
    same(torch.exp(a_t), torch.exp(a_c))
    same(a_t.sum(dim=1), a_c.sum(dim=1))
    same(a_t.to(torch.float32), a_c.to(torch.float32))
    same(torch.softmax(a_t, dim=-1), torch.softmax(a_c, dim=-1))
    # matmul goes through a dedicated kernel: compare to CPU within low-precision tolerance
    same(a_t @ b_t, a_c @ b_c, atol=2e-2, rtol=2e-2)
    f32 = torch.randn(5, generator=torch.Generator().manual_seed(36))
    same(f32.to("tpu").to(dtype), f32.to(dtype))
    same(f32.to("tpu", dtype), f32.to(dtype))


def test_float64_and_complex():
    c, t = cpu_and_tpu(3, 3, dtype=torch.float64, seed=37)
    same(t @ t, c @ c)
    same(t.sum(dim=0), c.sum(dim=0))
    z_c = torch.complex(c, c.flip(0))
    z_t = z_c.to("tpu")
    same(z_t * z_t, z_c * z_c)
    same(z_t.abs(), z_c.abs())


def test_type_promotion_matches_cpu():
    ic, it = cpu_and_tpu(3, dtype=torch.int32, seed=38)
    fc, ft = cpu_and_tpu(3, dtype=torch.float16, seed=39)
    r = it + ft
    assert r.dtype == (ic + fc).dtype
    same(r, ic + fc)
    r = it * 1.5
    assert r.dtype == (ic * 1.5).dtype
    same(r, ic * 1.5)


# --------------------------------------------------------------------------- 0-dim, .item(), empty tensors


def test_zero_dim_tensors_and_item():
    t = torch.tensor(3.5, device="tpu")
    assert t.dim() == 0 and t.shape == () and t.device == TPU
    assert t.item() == 3.5
    assert isinstance(t.item(), float)
    ti = torch.tensor(7, device="tpu:1")
    assert ti.item() == 7 and isinstance(ti.item(), int)
    tb = torch.tensor(True, device="tpu")
    assert tb.item() is True
    c, tt = cpu_and_tpu(4, 5, seed=40)
    s = tt.sum()
    assert s.dim() == 0 and s.device == TPU
    assert s.item() == pytest.approx(c.sum().item(), rel=1e-6)
    assert tt[2, 3].item() == c[2, 3].item()
    assert float(tt.max()) == float(c.max())
    assert int(tt.argmax()) == int(c.argmax())
    assert bool((tt > 0).any()) == bool((c > 0).any())
    assert tt.tolist() == c.tolist()
    same(t * tt, torch.tensor(3.5) * c)
    half = torch.tensor(1.25, dtype=torch.bfloat16, device="tpu")
    assert half.item() == 1.25


def test_empty_tensors():
    e = torch.empty(0, device="tpu")
    assert e.numel() == 0 and e.device == TPU
    e2 = torch.zeros(3, 0, 4, device="tpu:1")
    assert e2.shape == (3, 0, 4) and e2.device == TPU1
    c = torch.zeros(3, 0, 4)
    same(e2 + 1, c + 1)
    same(e2.sum(dim=1), c.sum(dim=1))  # sum over an empty dim is zeros
    same(e2.sum(), c.sum())
    assert torch.equal(e2.cpu(), c)
    same(torch.cat([e2, torch.ones(3, 2, 4, device="tpu:1")], dim=1), torch.cat([c, torch.ones(3, 2, 4)], dim=1))
    same(torch.ones(0, 3, device="tpu") @ torch.ones(3, 2, device="tpu"), torch.ones(0, 3) @ torch.ones(3, 2))
    same(torch.ones(2, 0, device="tpu") @ torch.ones(0, 3, device="tpu"), torch.ones(2, 0) @ torch.ones(0, 3))
    same(e.reshape(0, 5), torch.empty(0).reshape(0, 5))
    assert torch.empty(0).to("tpu").numel() == 0
    assert e.cpu().numel() == 0
    same(torch.tensor([1.0, 2.0], device="tpu")[2:], torch.tensor([1.0, 2.0])[2:])


# --------------------------------------------------------------------------- where / nonzero / unique


def test_where():
    a_c, a_t = cpu_and_tpu(4, 5, seed=41)
    b_c, b_t = cpu_and_tpu(4, 5, seed=42)
    same(torch.where(a_t > b_t, a_t, b_t), torch.where(a_c > b_c, a_c, b_c))
    same(torch.where(a_t > 0, a_t, 0.0), torch.where(a_c > 0, a_c, 0.0))
    same(torch.where(a_t[:, :1] > 0, 1.0, b_t), torch.where(a_c[:, :1] > 0, 1.0, b_c))
    # single-argument form is nonzero(as_tuple=True)
    for rt, rc in zip(torch.where(a_t > 0), torch.where(a_c > 0)):
        same(rt, rc)


def test_nonzero_data_dependent_shape():
    c, t = cpu_and_tpu(6, 7, seed=43)
    for thresh in (-10.0, 0.0, 0.8, 10.0):  # all, some, few, none
        nz_t = torch.nonzero(t > thresh)
        nz_c = torch.nonzero(c > thresh)
        assert nz_t.shape == nz_c.shape
        same(nz_t, nz_c)
    for rt, rc in zip(torch.nonzero(t > 0, as_tuple=True), torch.nonzero(c > 0, as_tuple=True)):
        same(rt, rc)
    ic, it = cpu_and_tpu(20, dtype=torch.int64, seed=44)
    same(it.nonzero(), ic.nonzero())
    same((it % 3 == 0).nonzero().squeeze(1), (ic % 3 == 0).nonzero().squeeze(1))


def test_unique_and_bincount():
    c = torch.tensor([3, 1, 2, 3, 3, 0, 1, 5])
    t = c.to("tpu")
    ut, inv_t, cnt_t = torch.unique(t, return_inverse=True, return_counts=True)
    uc, inv_c, cnt_c = torch.unique(c, return_inverse=True, return_counts=True)
    same(ut, uc)
    same(inv_t, inv_c)
    same(cnt_t, cnt_c)
    same(torch.bincount(t), torch.bincount(c))
    same(torch.unique_consecutive(t), torch.unique_consecutive(c))


# --------------------------------------------------------------------------- misc shape ops


def test_shape_ops():
    a_c, a_t = cpu_and_tpu(2, 3, seed=45)
    b_c, b_t = cpu_and_tpu(2, 3, seed=46)
    same(torch.stack([a_t, b_t], dim=1), torch.stack([a_c, b_c], dim=1))
    same(torch.cat([a_t, b_t], dim=1), torch.cat([a_c, b_c], dim=1))
    same(a_t.repeat(2, 3), a_c.repeat(2, 3))
    same(a_t.flip(1), a_c.flip(1))
    same(a_t.roll(1, 1), a_c.roll(1, 1))
    same(torch.tril(a_t), torch.tril(a_c))
    same(a_t.repeat_interleave(2, dim=0), a_c.repeat_interleave(2, dim=0))
    for pt, pc in zip(a_t.split([1, 2], dim=1), a_c.split([1, 2], dim=1)):
        same(pt, pc)
    same(torch.nn.functional.pad(a_t, (1, 2)), torch.nn.functional.pad(a_c, (1, 2)))
    same(a_t.clone(memory_format=torch.contiguous_format), a_c.clone())
    cl = a_t.t().clone()
    assert cl.stride() == a_c.t().clone().stride()


def test_storage_geometry_is_checked_as_on_cpu():
    # A negative offset would read and write the bytes before the tensor's block.
    base = torch.arange(8.0, device="tpu")
    for device in ("cpu", "tpu"):
        t = base.to(device)
        with pytest.raises(RuntimeError, match="invalid storage offset -1"):
            t.as_strided((2,), (1,), -1)
        with pytest.raises(RuntimeError, match="invalid storage offset -1"):
            torch.empty(0, device=device).set_(t.untyped_storage(), -1, (2,), (1,))
        with pytest.raises(RuntimeError, match="Negative strides"):
            t.as_strided((2,), (-1,), 4)
    assert_close(base.as_strided((3,), (2,), 1).cpu(), torch.tensor([1.0, 3.0, 5.0]))


@pytest.mark.parametrize("source", ["cpu", "tpu:1"])
def test_set_refuses_a_storage_of_another_device(source):
    t = torch.empty(0, device="tpu:0")
    with pytest.raises(RuntimeError, match="the devices must match"):
        t.set_(torch.ones(3, device=source).untyped_storage(), 0, (3,), (1,))
    with pytest.raises(RuntimeError, match="the devices must match"):
        torch.empty(0).set_(torch.ones(3, device="tpu").untyped_storage(), 0, (3,), (1,))  # CPU's own check
    assert t.device == torch.device("tpu:0") and t.numel() == 0


def test_a_cpu_scalar_tensor_is_an_operand_never_a_result():
    # CUDA's rule: 0-dim cpu tensors mix in as scalars; as out= the kernel resized it in tpu
    # memory and left the caller's tensor without storage (a crash when printed).
    x = torch.ones(3, device="tpu")
    assert_close(torch.mul(x, torch.tensor(2.0)).cpu(), torch.full((3,), 2.0))
    out = torch.tensor(0.0)
    with pytest.raises(RuntimeError, match="result out is on cpu"):
        torch.mul(x, 2, out=out)
    assert out.item() == 0.0
    scalar = torch.tensor(0.0)
    scalar.copy_(x.sum())  # copies into cpu tensors stay allowed
    assert scalar.item() == 3.0


def test_record_stream_is_accepted():
    s = torch.tpu.Stream()
    x = torch.ones(4, device="tpu")
    x.record_stream(s)
    torch.tpu.submit(s, lambda: x.mul_(2)).result(timeout=30)
    assert_close(x.cpu(), torch.full((4,), 2.0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("affine", [True, False])
def test_batch_norm_no_update_matches_cpu(dtype, affine):
    # Its only kernel was composite and called ATen's CPU batch norm directly: on tpu it raised.
    x, xt = cpu_and_tpu(2, 3, 4, 4, dtype=dtype)
    gen = torch.Generator().manual_seed(1)
    weight, bias = (torch.randn(3, generator=gen).to(dtype) if affine else None for _ in range(2))
    mean, var = torch.randn(3, generator=gen).to(dtype), (torch.rand(3, generator=gen) + 0.5).to(dtype)
    expected = torch.ops.aten._batch_norm_no_update(x, weight, bias, mean, var, 0.1, 1e-5)
    on_tpu = [None if t is None else t.to(TPU) for t in (weight, bias, mean, var)]
    got = torch.ops.aten._batch_norm_no_update(xt, *on_tpu, 0.1, 1e-5)
    for g, e in zip(got, expected):
        same(g, e, rtol=0, atol=0)
    assert_close(on_tpu[2].cpu(), mean, rtol=0, atol=0)  # nothing updated
    assert_close(on_tpu[3].cpu(), var, rtol=0, atol=0)
