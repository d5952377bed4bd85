"""Autograd and training on the tpu device against an identical model on CPU.

Each test builds a model on CPU, deep-copies it to tpu, runs the same steps on
both and checks losses, gradients, parameters, buffers and optimizer state.
"""

import copy
import threading

import pytest
import torch
from torch import nn
from torch.testing import assert_close

TOL = dict(atol=1e-5, rtol=1e-5)


def make_cnn():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 4, kernel_size=3, padding=1),
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(4, 6, kernel_size=3, stride=2, padding=1, bias=False),
        nn.BatchNorm2d(6),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(6 * 2 * 2, 5),
    )


def make_mlp():
    torch.manual_seed(1)
    return nn.Sequential(
        nn.Linear(10, 16),
        nn.LayerNorm(16),
        nn.GELU(),
        nn.Dropout(p=0.0),
        nn.Linear(16, 16),
        nn.GELU(approximate="tanh"),
        nn.Linear(16, 3),
    )


def cnn_batch(step):
    gen = torch.Generator().manual_seed(100 + step)
    return torch.randn(4, 3, 8, 8, generator=gen), torch.randint(0, 5, (4,), generator=gen)


def mlp_batch(step):
    gen = torch.Generator().manual_seed(200 + step)
    return torch.randn(8, 10, generator=gen), torch.randint(0, 3, (8,), generator=gen)


def pair(make, device="tpu"):
    cpu = make()
    tpu = copy.deepcopy(cpu).to(device)
    for p in tpu.parameters():
        assert p.device == torch.device(device if ":" in device else "tpu:0")
    return cpu, tpu


def assert_params_match(cpu, tpu, tol=TOL):
    for (name, pc), (_, pt) in zip(cpu.named_parameters(), tpu.named_parameters()):
        assert pt.device.type == "tpu", name
        assert_close(pt.detach().cpu(), pc.detach(), **tol, msg=lambda m: f"{name}: {m}")


def assert_grads_match(cpu, tpu, tol=TOL):
    for (name, pc), (_, pt) in zip(cpu.named_parameters(), tpu.named_parameters()):
        assert pc.grad is not None and pt.grad is not None, name
        assert pt.grad.device == pt.device, name
        assert_close(pt.grad.cpu(), pc.grad, **tol, msg=lambda m: f"grad of {name}: {m}")


def assert_buffers_match(cpu, tpu, tol=TOL):
    for (name, bc), (_, bt) in zip(cpu.named_buffers(), tpu.named_buffers()):
        assert bt.device.type == "tpu", name
        assert_close(bt.cpu(), bc, **tol, msg=lambda m: f"buffer {name}: {m}")


def train_side_by_side(cpu, tpu, opt_cpu, opt_tpu, batch, steps=3, tol=TOL, device="tpu"):
    for step in range(steps):
        x, y = batch(step)
        losses = []
        for model, opt, dev in ((cpu, opt_cpu, "cpu"), (tpu, opt_tpu, device)):
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(x.to(dev)), y.to(dev))
            loss.backward()
            losses.append(loss)
        assert losses[1].device.type == "tpu"
        assert_close(losses[1].detach().cpu(), losses[0].detach(), **tol)
        assert_grads_match(cpu, tpu, tol)
        opt_cpu.step()
        opt_tpu.step()
        assert_params_match(cpu, tpu, tol)
    assert_buffers_match(cpu, tpu, tol)


# --------------------------------------------------------------------------- basic autograd


def test_backward_through_elementwise_views_and_inplace():
    gen = torch.Generator().manual_seed(0)
    xc = torch.randn(4, 5, generator=gen, requires_grad=True)
    xt = xc.detach().to("tpu").requires_grad_()
    assert xt.is_leaf and xt.device.type == "tpu"
    outs = []
    for x in (xc, xt):
        h = x * 2 + 1
        h = h.t()[1:, ::2]  # views
        h = h.clone()
        h.mul_(h.sigmoid())  # in-place on a non-leaf
        h = h.exp().sum(dim=1) + x[:, 0].pow(2)
        (h * torch.arange(4.0, device=x.device)).sum().backward()
        outs.append(h)
    assert xt.grad.device.type == "tpu"
    assert_close(outs[1].detach().cpu(), outs[0].detach(), **TOL)
    assert_close(xt.grad.cpu(), xc.grad, **TOL)


@pytest.mark.parametrize("where", ["main", "another thread"])
def test_backward_runs_on_the_calling_thread(where):
    """As on CPU, not on autograd's tpu device thread: a third thread's OpenMP regions would
    give libgomp a second pool, and make it stop spinning for every op of the process."""
    ran_on, done_by = [], []

    def step():
        x = torch.randn(64, 64, device="tpu", requires_grad=True)
        h = x @ x
        h.register_hook(lambda grad: ran_on.append(threading.get_ident()))
        h.sum().backward()
        done_by.append(threading.get_ident())

    if where == "main":
        step()
    else:
        worker = threading.Thread(target=step)
        worker.start()
        worker.join(timeout=60)
    assert len(done_by) == 1 and ran_on == done_by


def test_backward_through_indexing_matmul_and_reductions():
    gen = torch.Generator().manual_seed(1)
    ac = torch.randn(5, 4, generator=gen, requires_grad=True)
    bc = torch.randn(4, 3, generator=gen, requires_grad=True)
    at = ac.detach().to("tpu").requires_grad_()
    bt = bc.detach().to("tpu").requires_grad_()
    idx = torch.tensor([4, 0, 0, 2])
    for a, b in ((ac, bc), (at, bt)):
        h = (a[idx.to(a.device)] @ b).softmax(dim=-1)
        h = torch.where(h > 0.3, h, h * 0.1)
        loss = h.max(dim=1).values.sum() + h.norm() + torch.gather(h, 1, idx[:, None].to(a.device) % 3).mean()
        loss.backward()
    assert_close(at.grad.cpu(), ac.grad, **TOL)
    assert_close(bt.grad.cpu(), bc.grad, **TOL)


def test_autograd_grad_and_retain_grad():
    xc = torch.linspace(-2, 2, 7, requires_grad=True)
    xt = xc.detach().to("tpu").requires_grad_()
    results = []
    for x in (xc, xt):
        y = torch.tanh(x) * x
        y.retain_grad()
        (g,) = torch.autograd.grad(y.sum(), x, create_graph=True)
        (gg,) = torch.autograd.grad(g.sum(), x, retain_graph=True)  # second derivative
        z = (y**2).sum()
        z.backward()
        results.append((g.detach(), gg, y.grad, x.grad))
    for t, c in zip(results[1], results[0]):
        assert t.device.type == "tpu"
        assert_close(t.cpu(), c, **TOL)


def test_gradient_accumulates_across_backwards():
    wc = torch.randn(3, 3, generator=torch.Generator().manual_seed(2), requires_grad=True)
    wt = wc.detach().to("tpu").requires_grad_()
    for w in (wc, wt):
        for k in range(3):
            (w * (k + 1)).pow(2).sum().backward()
    assert_close(wt.grad.cpu(), wc.grad, **TOL)


CONV_LAYERS = {
    "conv1d": (lambda: nn.Conv1d(3, 4, 3, padding=1), (2, 3, 9)),
    "conv3d": (lambda: nn.Conv3d(2, 3, 3, padding=1), (1, 2, 4, 4, 4)),
    "groups_dilation": (lambda: nn.Conv2d(4, 6, 3, groups=2, dilation=2, padding=2), (2, 4, 7, 7)),
    "stride_reflect": (lambda: nn.Conv2d(3, 4, 3, stride=2, padding=1, padding_mode="reflect"), (2, 3, 7, 7)),
    "depthwise_no_bias": (lambda: nn.Conv2d(4, 4, 3, groups=4, bias=False), (2, 4, 6, 6)),
    "transposed": (lambda: nn.ConvTranspose2d(3, 4, 3, stride=2, padding=1, output_padding=1), (2, 3, 5, 5)),
    "channels_last": (lambda: nn.Conv2d(3, 4, 3).to(memory_format=torch.channels_last), (2, 3, 6, 6)),
}


@pytest.mark.parametrize("name", sorted(CONV_LAYERS))
def test_conv_variants_forward_backward(name):
    make, shape = CONV_LAYERS[name]
    torch.manual_seed(0)
    cpu = make()
    tpu = copy.deepcopy(cpu).to("tpu")
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(5))
    xc = x.clone().requires_grad_()
    xt = x.to("tpu").requires_grad_()
    out_c, out_t = cpu(xc), tpu(xt)
    assert out_t.device.type == "tpu" and out_t.shape == out_c.shape
    assert_close(out_t.detach().cpu(), out_c.detach(), **TOL)
    out_c.square().sum().backward()
    out_t.square().sum().backward()
    assert_close(xt.grad.cpu(), xc.grad, **TOL)
    assert_grads_match(cpu, tpu)


def test_conv_double_backward():
    gen = torch.Generator().manual_seed(6)
    w = torch.randn(4, 3, 3, 3, generator=gen)
    x = torch.randn(2, 3, 5, 5, generator=gen)
    grads = []
    for dev in ("cpu", "tpu"):
        wd = w.to(dev, copy=True).requires_grad_()
        xd = x.to(dev, copy=True).requires_grad_()
        y = nn.functional.conv2d(xd, wd, padding=1)
        (gx,) = torch.autograd.grad(y.square().sum(), xd, create_graph=True)
        gx.square().sum().backward()
        grads.append(wd.grad)
    assert grads[1].device.type == "tpu"
    assert_close(grads[1].cpu(), grads[0], atol=1e-4, rtol=1e-5)


# --------------------------------------------------------------------------- models


def test_cnn_forward_backward_matches_cpu():
    cpu, tpu = pair(make_cnn)
    x, y = cnn_batch(0)
    xc = x.clone().requires_grad_()
    xt = x.to("tpu").requires_grad_()
    out_c = cpu(xc)
    out_t = tpu(xt)
    assert out_t.device.type == "tpu"
    assert_close(out_t.detach().cpu(), out_c.detach(), **TOL)
    nn.functional.cross_entropy(out_c, y).backward()
    nn.functional.cross_entropy(out_t, y.to("tpu")).backward()
    assert_grads_match(cpu, tpu)
    assert_close(xt.grad.cpu(), xc.grad, **TOL)  # gradient w.r.t. the conv input


def test_cnn_training_sgd_momentum():
    cpu, tpu = pair(make_cnn)
    opt_c = torch.optim.SGD(cpu.parameters(), lr=0.1, momentum=0.9)
    opt_t = torch.optim.SGD(tpu.parameters(), lr=0.1, momentum=0.9)
    train_side_by_side(cpu, tpu, opt_c, opt_t, cnn_batch, steps=3)


def test_batchnorm_running_stats_update_on_tpu():
    cpu, tpu = pair(make_cnn)
    bn_t = tpu[1]
    before = bn_t.running_mean.clone()
    for step in range(3):
        x, _ = cnn_batch(step)
        cpu(x)
        tpu(x.to("tpu"))
    assert bn_t.running_mean.device.type == "tpu"
    assert bn_t.running_var.device.type == "tpu"
    assert not torch.equal(bn_t.running_mean.cpu(), before.cpu())  # it did update
    for i in (1, 5):
        assert_close(tpu[i].running_mean.cpu(), cpu[i].running_mean, **TOL)
        assert_close(tpu[i].running_var.cpu(), cpu[i].running_var, **TOL)
        assert int(tpu[i].num_batches_tracked) == int(cpu[i].num_batches_tracked) == 3
    # Eval mode uses the running statistics.
    cpu.eval()
    tpu.eval()
    x, _ = cnn_batch(9)
    assert_close(tpu(x.to("tpu")).detach().cpu(), cpu(x).detach(), **TOL)
    before = tpu[1].running_mean.cpu()
    tpu(x.to("tpu"))
    assert torch.equal(tpu[1].running_mean.cpu(), before)  # no update in eval


def test_mlp_training_matches_cpu():
    cpu, tpu = pair(make_mlp)
    opt_c = torch.optim.SGD(cpu.parameters(), lr=0.05)
    opt_t = torch.optim.SGD(tpu.parameters(), lr=0.05)
    train_side_by_side(cpu, tpu, opt_c, opt_t, mlp_batch, steps=4)


def test_mlp_training_on_tpu1():
    cpu, tpu = pair(make_mlp, device="tpu:1")
    opt_c = torch.optim.Adam(cpu.parameters(), lr=1e-2)
    opt_t = torch.optim.Adam(tpu.parameters(), lr=1e-2)
    train_side_by_side(cpu, tpu, opt_c, opt_t, mlp_batch, steps=3, device="tpu:1", tol=dict(atol=1e-4, rtol=1e-4))
    for p in tpu.parameters():
        assert p.device == torch.device("tpu:1")
        assert p.grad.device == torch.device("tpu:1")
    for state in opt_t.state.values():
        assert state["exp_avg"].device == torch.device("tpu:1")


# --------------------------------------------------------------------------- optimizers

OPTIMIZERS = {
    "sgd_momentum": (torch.optim.SGD, dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-2)),
    "adam": (torch.optim.Adam, dict(lr=1e-2, weight_decay=1e-3)),
    "adam_amsgrad": (torch.optim.Adam, dict(lr=1e-2, amsgrad=True)),
    "adamw": (torch.optim.AdamW, dict(lr=1e-2, weight_decay=1e-2)),
}


@pytest.mark.parametrize("impl", ["default", "foreach", "fused"])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_optimizer_matches_cpu(name, impl):
    cls, kwargs = OPTIMIZERS[name]
    cpu, tpu = pair(make_mlp)
    flags = {} if impl == "default" else {impl: True}
    opt_c = cls(cpu.parameters(), **kwargs)  # CPU reference: the plain for-loop implementation
    opt_t = cls(tpu.parameters(), **kwargs, **flags)
    tol = dict(atol=1e-4, rtol=1e-4) if cls is not torch.optim.SGD else TOL
    train_side_by_side(cpu, tpu, opt_c, opt_t, mlp_batch, steps=3, tol=tol)
    for pc, pt in zip(cpu.parameters(), tpu.parameters()):
        state_c, state_t = opt_c.state[pc], opt_t.state[pt]
        assert state_c.keys() == state_t.keys()
        for key, value in state_c.items():
            if torch.is_tensor(value) and value.dim() > 0:
                assert state_t[key].device.type == "tpu", key
                assert_close(state_t[key].cpu(), value, **tol)
            elif key == "step":  # a 0-dim tensor (on tpu or cpu, depending on the implementation)
                assert float(state_t[key]) == float(value)


# --------------------------------------------------------------------------- gradient clipping


@pytest.mark.parametrize("foreach", [False, True])
@pytest.mark.parametrize("norm_type", [2.0, 1.0, float("inf")])
def test_clip_grad_norm_matches_cpu(norm_type, foreach):
    cpu, tpu = pair(make_cnn)
    x, y = cnn_batch(0)
    nn.functional.cross_entropy(cpu(x), y).backward()
    nn.functional.cross_entropy(tpu(x.to("tpu")), y.to("tpu")).backward()
    max_norm = 0.05
    norm_c = nn.utils.clip_grad_norm_(cpu.parameters(), max_norm, norm_type=norm_type, foreach=foreach)
    norm_t = nn.utils.clip_grad_norm_(tpu.parameters(), max_norm, norm_type=norm_type, foreach=foreach)
    assert norm_t.device.type == "tpu"
    assert norm_c.item() > max_norm  # clipping actually happened
    assert_close(norm_t.cpu(), norm_c, **TOL)
    assert_grads_match(cpu, tpu)
    clipped = nn.utils.get_total_norm([p.grad for p in tpu.parameters()], norm_type=norm_type)
    assert_close(clipped.cpu(), torch.tensor(max_norm), atol=1e-5, rtol=1e-4)


def test_clip_grad_value_matches_cpu():
    cpu, tpu = pair(make_mlp)
    x, y = mlp_batch(0)
    nn.functional.cross_entropy(cpu(x), y).backward()
    nn.functional.cross_entropy(tpu(x.to("tpu")), y.to("tpu")).backward()
    nn.utils.clip_grad_value_(cpu.parameters(), 0.01)
    nn.utils.clip_grad_value_(tpu.parameters(), 0.01)
    assert_grads_match(cpu, tpu)
