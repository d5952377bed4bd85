"""nn.LSTM, nn.GRU, nn.LSTMCell and nn.GRUCell on tpu against the same modules on CPU.

On any device but the CPU, ATen's recurrent layers call the fused cell ops
(``_thnn_fused_lstm_cell``, ``_thnn_fused_gru_cell`` and their backwards),
which PyTorch implements for CUDA only; torch_tpu.rnn_cells gives them tpu
kernels. The CPU runs its own, unfused cells: an independent reference.
Matmuls run at exact fp32 (conftest's ``exact_fp32``).
"""

import copy

import pytest
import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence
from torch.testing import assert_close

TOL = dict(atol=1e-5, rtol=1e-5)
aten = torch.ops.aten


def _tpu(value):
    if isinstance(value, torch.Tensor):
        return value.detach().to("tpu").requires_grad_(value.requires_grad)
    if isinstance(value, tuple):
        return tuple(_tpu(v) for v in value)
    return value


def _flat(value):
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _flat(v)]
    if value is None:
        return []
    raise TypeError(type(value))


def _leaves(args):
    return [t for t in _flat(args) if t.requires_grad]


def _run(module, args, weights):
    """Forward, then backward of a weighted sum of every output (each output's gradient differs)."""
    out = module(*args)
    outputs = _flat(out)
    loss = sum((o * w.to(o.device)).sum() for o, w in zip(outputs, weights))
    loss.backward()
    return outputs


def assert_same_as_cpu(make, args, tol=TOL):
    """``make()``'s module and its deep copy on tpu, on ``args`` and their tpu copies:
    outputs, states, input/state gradients and every parameter gradient."""
    torch.manual_seed(0)
    cpu = make()
    tpu = copy.deepcopy(cpu).to("tpu")
    tpu_args = _tpu(args)
    with torch.no_grad():
        reference = _flat(cpu(*args))
    gen = torch.Generator().manual_seed(1)
    weights = [torch.randn(r.shape, generator=gen) for r in reference]
    cpu_out = _run(cpu, args, weights)
    tpu_out = _run(tpu, tpu_args, weights)
    assert len(cpu_out) == len(tpu_out)
    for i, (c, t) in enumerate(zip(cpu_out, tpu_out)):
        assert t.device.type == "tpu"
        assert_close(t.detach().cpu(), c.detach(), **tol, msg=lambda m: f"output {i}: {m}")
    for i, (c, t) in enumerate(zip(_leaves(args), _leaves(tpu_args))):
        assert t.grad is not None and t.grad.device.type == "tpu", i
        assert_close(t.grad.cpu(), c.grad, **tol, msg=lambda m: f"gradient of argument {i}: {m}")
    names = [name for name, _ in cpu.named_parameters()]
    assert names
    for name, pc, pt in zip(names, cpu.parameters(), tpu.parameters()):
        assert pc.grad is not None and pt.grad is not None, name
        assert pt.grad.device.type == "tpu", name
        assert_close(pt.grad.cpu(), pc.grad, **tol, msg=lambda m: f"grad of {name}: {m}")
    return cpu, tpu


def _seq(shape, seed=2, requires_grad=True):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).requires_grad_(requires_grad)


@pytest.mark.parametrize("bidirectional", [False, True], ids=["uni", "bi"])
@pytest.mark.parametrize("num_layers", [1, 2])
@pytest.mark.parametrize("batch_first", [False, True], ids=["seq_first", "batch_first"])
@pytest.mark.parametrize("rnn", [nn.LSTM, nn.GRU], ids=["lstm", "gru"])
def test_lstm_and_gru(rnn, bidirectional, num_layers, batch_first):
    shape = (3, 6, 5) if batch_first else (6, 3, 5)
    assert_same_as_cpu(lambda: rnn(5, 7, num_layers=num_layers, bidirectional=bidirectional,
                                   batch_first=batch_first), (_seq(shape),))


@pytest.mark.parametrize("bidirectional", [False, True], ids=["uni", "bi"])
@pytest.mark.parametrize("num_layers", [1, 2])
def test_lstm_with_projections(bidirectional, num_layers):
    assert_same_as_cpu(lambda: nn.LSTM(5, 7, num_layers=num_layers, bidirectional=bidirectional, proj_size=3),
                       (_seq((6, 3, 5)),))


@pytest.mark.parametrize("kind", ["lstm", "lstm_proj", "gru"])
def test_given_initial_states_get_gradients(kind):
    directions, layers, batch = 2, 2, 3
    x = _seq((4, batch, 5))
    h0 = _seq((directions * layers, batch, 3 if kind == "lstm_proj" else 7), seed=3)
    c0 = _seq((directions * layers, batch, 7), seed=4)
    if kind == "gru":
        make, state = lambda: nn.GRU(5, 7, num_layers=layers, bidirectional=True), h0
    else:
        proj = 3 if kind == "lstm_proj" else 0
        make, state = lambda: nn.LSTM(5, 7, num_layers=layers, bidirectional=True, proj_size=proj), (h0, c0)
    assert_same_as_cpu(make, (x, state))


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_without_bias(kind):
    cls = nn.LSTM if kind == "lstm" else nn.GRU
    assert_same_as_cpu(lambda: cls(5, 7, num_layers=2, bias=False, bidirectional=True), (_seq((6, 3, 5)),))


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_unbatched_sequence(kind):
    cls = nn.LSTM if kind == "lstm" else nn.GRU
    assert_same_as_cpu(lambda: cls(5, 7, num_layers=2, bidirectional=True), (_seq((6, 5)),))


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_dropout_between_layers(kind):
    cls = nn.LSTM if kind == "lstm" else nn.GRU
    # Eval mode: no dropout on either device.
    cpu, tpu = assert_same_as_cpu(lambda: cls(5, 7, num_layers=2, dropout=0.5).eval(), (_seq((6, 3, 5)),))
    # Training at p=1 zeroes the second layer's input on both devices: the same, deterministically.
    assert_same_as_cpu(lambda: cls(5, 7, num_layers=2, dropout=1.0), (_seq((6, 3, 5)),))
    # Training at p=0.5: random masks differ between the devices; it runs and its gradients are finite.
    model = cls(5, 7, num_layers=2, dropout=0.5).to("tpu")
    out = model(_seq((6, 3, 5)).to("tpu"))[0]
    out.sum().backward()
    assert out.device.type == "tpu"
    assert all(p.grad is not None and torch.isfinite(p.grad.cpu()).all() for p in model.parameters())


@pytest.mark.parametrize("kind", ["lstm", "lstm_proj", "gru"])
@pytest.mark.parametrize("bidirectional", [False, True], ids=["uni", "bi"])
@pytest.mark.parametrize("enforce_sorted", [True, False], ids=["sorted", "unsorted"])
def test_packed_sequence(kind, bidirectional, enforce_sorted):
    lengths = [6, 4, 4, 1] if enforce_sorted else [4, 6, 1, 4]
    x = _seq((6, 4, 5))

    class Packed(nn.Module):
        def __init__(self):
            super().__init__()
            if kind == "gru":
                self.rnn = nn.GRU(5, 7, num_layers=2, bidirectional=bidirectional)
            else:
                self.rnn = nn.LSTM(5, 7, num_layers=2, bidirectional=bidirectional,
                                   proj_size=3 if kind == "lstm_proj" else 0)

        def forward(self, seq):
            packed = pack_padded_sequence(seq, torch.tensor(lengths), enforce_sorted=enforce_sorted)
            out, state = self.rnn(packed)
            assert out.data.device == seq.device
            padded, out_lengths = pad_packed_sequence(out)
            assert out_lengths.tolist() == lengths
            return padded, state

    assert_same_as_cpu(Packed, (x,))


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("given_state", [True, False], ids=["state", "no_state"])
def test_lstm_cell(bias, given_state):
    x = _seq((4, 5))
    args = (x, (_seq((4, 7), seed=3), _seq((4, 7), seed=4))) if given_state else (x,)
    assert_same_as_cpu(lambda: nn.LSTMCell(5, 7, bias=bias), args)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("given_state", [True, False], ids=["state", "no_state"])
def test_gru_cell(bias, given_state):
    x = _seq((4, 5))
    args = (x, _seq((4, 7), seed=3)) if given_state else (x,)
    assert_same_as_cpu(lambda: nn.GRUCell(5, 7, bias=bias), args)


@pytest.mark.parametrize("cls", [nn.LSTMCell, nn.GRUCell], ids=["lstm_cell", "gru_cell"])
def test_unbatched_cell(cls):
    assert_same_as_cpu(lambda: cls(5, 7), (_seq((5,)),))


class _CellLoop(nn.Module):
    """A cell unrolled by hand over a sequence, both outputs of an LSTMCell used."""

    def __init__(self, cls):
        super().__init__()
        self.cell = cls(5, 7)

    def forward(self, seq):
        state, outputs = None, []
        for x in seq.unbind(0):
            state = self.cell(x, state)
            outputs.append(state[0] + 0.5 * state[1] if isinstance(state, tuple) else state)
        return torch.stack(outputs)


@pytest.mark.parametrize("cls", [nn.LSTMCell, nn.GRUCell], ids=["lstm_cell", "gru_cell"])
def test_cell_unrolled_over_a_sequence(cls):
    assert_same_as_cpu(lambda: _CellLoop(cls), (_seq((5, 3, 5)),))


def test_lstm_only_cell_state_used():
    """Only cy carries a gradient into the last step's cell (grad_hy is undefined there)."""

    class LastCell(nn.Module):
        def __init__(self):
            super().__init__()
            self.cell = nn.LSTMCell(5, 7)

        def forward(self, x, h, c):
            return self.cell(x, (h, c))[1]

    assert_same_as_cpu(LastCell, (_seq((4, 5)), _seq((4, 7), seed=3), _seq((4, 7), seed=4)))


class _Tagger(nn.Module):
    def __init__(self, kind):
        super().__init__()
        rnn = nn.LSTM if kind == "lstm" else nn.GRU
        self.rnn = rnn(5, 8, num_layers=2, bidirectional=True, batch_first=True)
        self.head = nn.Linear(16, 3)

    def forward(self, x):
        return self.head(self.rnn(x)[0])


@pytest.mark.parametrize("kind", ["lstm", "gru"])
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_optimizer_steps_match_cpu(kind, optimizer):
    torch.manual_seed(0)
    cpu = _Tagger(kind)
    tpu = copy.deepcopy(cpu).to("tpu")

    def make_opt(model):
        if optimizer == "sgd":
            return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        return torch.optim.Adam(model.parameters(), lr=1e-2)

    opts = make_opt(cpu), make_opt(tpu)
    for step in range(4):
        gen = torch.Generator().manual_seed(10 + step)
        x, y = torch.randn(4, 6, 5, generator=gen), torch.randint(0, 3, (4, 6), generator=gen)
        losses = []
        for model, opt, device in zip((cpu, tpu), opts, ("cpu", "tpu")):
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(x.to(device)).flatten(0, 1), y.to(device).flatten())
            loss.backward()
            opt.step()
            losses.append(loss.item())
        assert losses[1] == pytest.approx(losses[0], rel=1e-5, abs=1e-5), step
    for (name, pc), (_, pt) in zip(cpu.named_parameters(), tpu.named_parameters()):
        assert pt.device.type == "tpu", name
        assert_close(pt.detach().cpu(), pc.detach(), **TOL, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_double_backward(kind):
    """create_graph: autograd differentiates the cells through the composite _thnn_differentiable_* ops."""
    torch.manual_seed(0)
    cpu = (nn.LSTM if kind == "lstm" else nn.GRU)(4, 5)
    tpu = copy.deepcopy(cpu).to("tpu")
    results = []
    for model, device in ((cpu, "cpu"), (tpu, "tpu")):
        x = _seq((3, 2, 4)).detach().to(device).requires_grad_()
        out = model(x)[0]
        (gx,) = torch.autograd.grad(out.pow(2).sum(), x, create_graph=True)
        gx.pow(2).sum().backward()
        results.append([gx.detach(), x.grad] + [p.grad for p in model.parameters()])
    for c, t in zip(*results):
        assert t.device.type == "tpu"
        assert_close(t.cpu(), c, **TOL)


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_no_grad_inference(kind):
    torch.manual_seed(0)
    cpu = (nn.LSTM if kind == "lstm" else nn.GRU)(5, 7, num_layers=2, bidirectional=True)
    tpu = copy.deepcopy(cpu).to("tpu")
    x = _seq((6, 3, 5), requires_grad=False)
    with torch.inference_mode():
        expected, got = _flat(cpu(x)), _flat(tpu(x.to("tpu")))
    for c, t in zip(expected, got):
        assert_close(t.cpu(), c, **TOL)


# The kernels themselves, against the formulas of PyTorch's CUDA kernels (RNN.cu) at fp64 on CPU.


def _lstm_reference(ig, hg, cx, bi, bh):
    gates = ig + hg + (bi + bh if bi is not None else 0)
    i, f, g, o = gates.chunk(4, 1)
    i, f, g, o = i.sigmoid(), f.sigmoid(), g.tanh(), o.sigmoid()
    cy = f * cx + i * g
    return o * cy.tanh(), cy, torch.cat([i, f, g, o], 1)


def _gru_reference(ig, hg, hx, bi, bh):
    if bi is not None:
        ig, hg = ig + bi, hg + bh
    ir, iz, in_ = ig.chunk(3, 1)
    hr, hz, hn = hg.chunk(3, 1)
    r, z = (ir + hr).sigmoid(), (iz + hz).sigmoid()
    n = (in_ + r * hn).tanh()
    return n + z * (hx - n), torch.cat([r, z, n, hx, hn], 1)


def _cell_inputs(factor, bias, batch=3, hidden=4):
    gen = torch.Generator().manual_seed(7)
    rand = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    ig, hg, state = rand(batch, factor * hidden), rand(batch, factor * hidden), rand(batch, hidden)
    bi, bh = (rand(factor * hidden), rand(factor * hidden)) if bias else (None, None)
    return ig, hg, state, bi, bh


def _to_tpu(*ts):
    return [None if t is None else t.to("tpu") for t in ts]


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("grads", ["both", "hy", "cy"])
def test_fused_lstm_cell_kernels(bias, grads):
    ig, hg, cx, bi, bh = _cell_inputs(4, bias)
    hy, cy, workspace = aten._thnn_fused_lstm_cell(*_to_tpu(ig, hg, cx, bi, bh))
    for got, want in zip((hy, cy, workspace), _lstm_reference(ig, hg, cx, bi, bh)):
        assert got.device.type == "tpu" and got.dtype == torch.float64
        assert_close(got.cpu(), want)

    leaves = [t.clone().requires_grad_() for t in (ig, hg, cx)]
    ref_hy, ref_cy, _ = _lstm_reference(*leaves, bi, bh)
    gen = torch.Generator().manual_seed(8)
    grad_hy = torch.randn(3, 4, generator=gen, dtype=torch.float64) if grads != "cy" else None
    grad_cy = torch.randn(3, 4, generator=gen, dtype=torch.float64) if grads != "hy" else None
    outputs = [o for o, g in ((ref_hy, grad_hy), (ref_cy, grad_cy)) if g is not None]
    want_ig, want_hg, want_cx = torch.autograd.grad(outputs, leaves, [g for g in (grad_hy, grad_cy) if g is not None])
    assert_close(want_ig, want_hg)

    grad_gates, grad_cx, grad_bias = aten._thnn_fused_lstm_cell_backward_impl(
        *_to_tpu(grad_hy, grad_cy, cx, cy.cpu(), workspace.cpu()), bias)
    assert_close(grad_gates.cpu(), want_ig)
    assert_close(grad_cx.cpu(), want_cx)
    if bias:
        assert_close(grad_bias.cpu(), want_ig.sum(0))
    else:
        assert grad_bias is None
    # The composite over the _impl: gates' gradient twice, the bias gradient twice.
    with torch.no_grad():  # as autograd calls it
        full = aten._thnn_fused_lstm_cell_backward(*_to_tpu(grad_hy, grad_cy, cx, cy.cpu(), workspace.cpu()), bias)
    assert_close(full[0].cpu(), want_ig)
    assert_close(full[1].cpu(), want_ig)
    assert_close(full[2].cpu(), want_cx)
    assert aten._thnn_fused_lstm_cell_backward_impl(None, None, *_to_tpu(cx, cy, workspace), bias) == (
        None, None, None)


@pytest.mark.parametrize("bias", [True, False])
def test_fused_gru_cell_kernels(bias):
    ig, hg, hx, bi, bh = _cell_inputs(3, bias)
    hy, workspace = aten._thnn_fused_gru_cell(*_to_tpu(ig, hg, hx, bi, bh))
    want_hy, want_workspace = _gru_reference(ig, hg, hx, bi, bh)
    assert hy.device.type == workspace.device.type == "tpu"
    assert workspace.shape == (3, 5 * 4)
    assert_close(hy.cpu(), want_hy)
    assert_close(workspace.cpu(), want_workspace)

    leaves = [t.clone().requires_grad_() for t in (ig, hg, hx)]
    grad_hy = torch.randn(3, 4, generator=torch.Generator().manual_seed(8), dtype=torch.float64)
    want = torch.autograd.grad(_gru_reference(*leaves, bi, bh)[0], leaves, grad_hy)
    result = aten._thnn_fused_gru_cell_backward(grad_hy.to("tpu"), workspace, bias)
    for got, w in zip(result[:3], want):
        assert got.device.type == "tpu"
        assert_close(got.cpu(), w)
    if bias:
        assert_close(result[3].cpu(), want[0].sum(0))
        assert_close(result[4].cpu(), want[1].sum(0))
    else:
        assert result[3] is None and result[4] is None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_reduced_precision_cells_compute_at_fp32(dtype):
    """As CUDA's kernels: fp32 arithmetic, each result rounded once; the backward reads the rounded workspace."""
    ig, hg, cx, bi, bh = (t.to(dtype).to("tpu") for t in _cell_inputs(4, True))
    hy, cy, workspace = aten._thnn_fused_lstm_cell(ig, hg, cx, bi, bh)
    wide = aten._thnn_fused_lstm_cell(ig.float(), hg.float(), cx.float(), bi.float(), bh.float())
    for got, want in zip((hy, cy, workspace), wide):
        assert got.dtype == dtype
        assert torch.equal(got.cpu(), want.to(dtype).cpu())
    grad_hy = torch.randn(3, 4, dtype=dtype).to("tpu")
    back = aten._thnn_fused_lstm_cell_backward_impl(grad_hy, None, cx, cy, workspace, True)
    wide_back = aten._thnn_fused_lstm_cell_backward_impl(grad_hy.float(), None, cx.float(), cy.float(),
                                                         workspace.float(), False)
    assert back[0].dtype == back[1].dtype == dtype
    assert torch.equal(back[0].cpu(), wide_back[0].to(dtype).cpu())
    assert torch.equal(back[1].cpu(), wide_back[1].to(dtype).cpu())

    ig, hg, hx, bi, bh = (t.to(dtype).to("tpu") for t in _cell_inputs(3, True))
    hy, workspace = aten._thnn_fused_gru_cell(ig, hg, hx, bi, bh)
    wide = aten._thnn_fused_gru_cell(ig.float(), hg.float(), hx.float(), bi.float(), bh.float())
    assert torch.equal(hy.cpu(), wide[0].to(dtype).cpu())
    assert torch.equal(workspace.cpu(), wide[1].to(dtype).cpu())
    back = aten._thnn_fused_gru_cell_backward(grad_hy, workspace, True)
    wide_back = aten._thnn_fused_gru_cell_backward(grad_hy.float(), workspace.float(), False)
    for got, want in zip(back[:3], wide_back[:3]):
        assert got.dtype == dtype
        assert torch.equal(got.cpu(), want.to(dtype).cpu())


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_bf16_module_close_to_fp32(kind):
    torch.manual_seed(0)
    cpu = (nn.LSTM if kind == "lstm" else nn.GRU)(5, 7, num_layers=2)
    tpu = copy.deepcopy(cpu).to("tpu", torch.bfloat16)
    x = _seq((6, 3, 5), requires_grad=False)
    out = tpu(x.to("tpu", torch.bfloat16))[0]
    assert out.dtype == torch.bfloat16
    assert_close(out.float().cpu(), cpu(x)[0].detach(), atol=3e-2, rtol=3e-2)
    out.float().sum().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.bfloat16 for p in tpu.parameters())


def test_autocast_runs_the_cell_in_bf16():
    torch.manual_seed(0)
    cpu = nn.LSTM(5, 7)
    tpu = copy.deepcopy(cpu).to("tpu")
    x = _seq((6, 3, 5), requires_grad=False)
    with torch.autocast("tpu", dtype=torch.bfloat16):
        out, (h, c) = tpu(x.to("tpu"))
    assert out.dtype == torch.bfloat16
    assert_close(out.float().cpu(), cpu(x)[0].detach(), atol=3e-2, rtol=3e-2)
    out.float().sum().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in tpu.parameters())


def test_cells_check_sizes():
    ig, hg, cx = torch.randn(3, 16, device="tpu"), torch.randn(3, 16, device="tpu"), torch.randn(3, 4, device="tpu")
    with pytest.raises(RuntimeError, match="differ in size"):
        aten._thnn_fused_lstm_cell(ig, hg[:, :12], cx)
    with pytest.raises(RuntimeError, match="elements"):
        aten._thnn_fused_lstm_cell(ig, hg, cx[:, :3])
    with pytest.raises(RuntimeError, match="input_bias"):
        aten._thnn_fused_gru_cell(ig[:, :12], hg[:, :12], cx, torch.randn(9, device="tpu"),
                                  torch.randn(9, device="tpu"))
    with pytest.raises(RuntimeError, match="workspace"):
        aten._thnn_fused_gru_cell_backward(cx, torch.randn(3, 16, device="tpu"), True)


def test_gru_meta_kernels_give_the_tpu_kernels_shapes():
    """PyTorch has Meta kernels for the LSTM cell's ops only; torch_tpu.rnn_cells adds the GRU cell's
    (DeferAndFuse records from them, FakeTensor traces with them)."""
    for bias in (True, False):
        ig, hg, hx, bi, bh = _cell_inputs(3, bias, batch=2, hidden=5)
        for tpu, meta in zip(aten._thnn_fused_gru_cell(*_to_tpu(ig, hg, hx, bi, bh)),
                             aten._thnn_fused_gru_cell(*[None if t is None else t.to("meta")
                                                         for t in (ig, hg, hx, bi, bh)])):
            assert (meta.shape, meta.stride(), meta.dtype) == (tpu.shape, tpu.stride(), tpu.dtype)
        grad, workspace = torch.randn(2, 5, dtype=torch.float64), torch.randn(2, 25, dtype=torch.float64)
        tpu = aten._thnn_fused_gru_cell_backward(grad.to("tpu"), workspace.to("tpu"), bias)
        meta = aten._thnn_fused_gru_cell_backward(grad.to("meta"), workspace.to("meta"), bias)
        for t, m in zip(tpu, meta):
            assert (t is None) == (m is None)
            if t is not None:
                assert (m.shape, m.stride(), m.dtype) == (t.shape, t.stride(), t.dtype)


_DEFER_CODE = """
import copy, torch, torch_tpu
from torch import nn
from torch_tpu import defer
torch.manual_seed(0)
for cls in (nn.LSTM, nn.GRU):
    cpu = cls(5, 7, num_layers=2, bidirectional=True)
    tpu = copy.deepcopy(cpu).to("tpu")
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (cpu, tpu)]
    x = torch.randn(4, 3, 5)
    defer.reset_stats()
    with torch.tpu.precision("highest"), torch_tpu.eager_mode("defer_and_fuse"):
        for step in range(12):
            opts[1].zero_grad(); tpu(x.to("tpu"))[0].pow(2).sum().backward(); opts[1].step()
            torch.tpu.synchronize()
    for step in range(12):
        opts[0].zero_grad(); cpu(x)[0].pow(2).sum().backward(); opts[0].step()
    stats = defer.stats()
    assert not any("thnn" in str(op) for op in stats.not_recorded), stats
    assert stats.compiled_runs > 0, stats
    for pc, pt in zip(cpu.parameters(), tpu.parameters()):
        torch.testing.assert_close(pt.detach().cpu(), pc.detach(), atol=1e-5, rtol=1e-5)
print("ok")
"""


def test_defer_and_fuse_records_and_compiles_the_cells():
    import os
    import subprocess
    import sys

    env = {**os.environ, "TORCH_TPU_DEFER_COMPILE": "sync"}
    result = subprocess.run([sys.executable, "-W", "ignore", "-c", _DEFER_CODE], capture_output=True, text=True,
                            timeout=600, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "ok"


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_torch_compile(kind):
    """Dynamo leaves nn.LSTM/nn.GRU out of its graphs (a graph break: they run eagerly, on these
    kernels, which Dynamo must not trace); nn.LSTMCell/nn.GRUCell compile."""
    import torch._dynamo
    import torch._dynamo.utils

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn = (nn.LSTM if kind == "lstm" else nn.GRU)(5, 7, bidirectional=True)
            self.cell = (nn.LSTMCell if kind == "lstm" else nn.GRUCell)(14, 6)

        def forward(self, x):
            out = self.rnn(x)[0]
            state = self.cell(out[-1])
            return (state[0] if isinstance(state, tuple) else state).tanh()

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    torch.manual_seed(0)
    cpu = Model()
    tpu = copy.deepcopy(cpu).to("tpu")
    compiled = torch.compile(tpu, backend="tpu")
    x = _seq((4, 3, 5), requires_grad=False)
    for _ in range(2):
        tpu.zero_grad()
        out = compiled(x.to("tpu"))
        out.pow(2).sum().backward()
    cpu(x).pow(2).sum().backward()
    assert_close(out.detach().cpu(), cpu(x).detach(), **TOL)
    for (name, pc), pt in zip(cpu.named_parameters(), tpu.parameters()):
        assert_close(pt.grad.cpu(), pc.grad, **TOL, msg=lambda m: f"grad of {name}: {m}")
    breaks = torch._dynamo.utils.counters["graph_break"]
    assert all("RNN, GRU, or LSTM" in reason for reason in breaks), dict(breaks)
    torch._dynamo.reset()
