"""torch.save / torch.load of tpu tensors and module state dicts.

Values are compared with the CPU source they were made from; devices are
checked for the default load, map_location and weights_only paths.
"""

import io

import pytest
import torch
from torch import nn
from torch.testing import assert_close


def sample(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def make_model():
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))


def save_load(obj, target, **load_kwargs):
    """Saves to a file (tmp_path) or a BytesIO and loads it back."""
    if isinstance(target, io.BytesIO):
        target.seek(0)
        target.truncate()
        torch.save(obj, target)
        target.seek(0)
        return torch.load(target, **load_kwargs)
    torch.save(obj, target)
    return torch.load(target, **load_kwargs)


@pytest.fixture(params=["file", "bytesio"])
def target(request, tmp_path):
    return tmp_path / "checkpoint.pt" if request.param == "file" else io.BytesIO()


def test_default_load_returns_tpu_tensors(target):
    cpu = {"f32": sample(3, 4), "i64": torch.arange(-5, 5), "bf16": sample(5, dtype=torch.bfloat16),
           "bool": sample(4) > 0, "scalar": torch.tensor(2.5), "empty": torch.empty(0, 3)}
    saved = {k: v.to("tpu") for k, v in cpu.items()}
    loaded = save_load(saved, target)
    assert loaded.keys() == cpu.keys()
    for k, v in loaded.items():
        assert v.device == torch.device("tpu:0"), k
        assert v.dtype == cpu[k].dtype and v.shape == cpu[k].shape, k
        assert torch.equal(v.cpu(), cpu[k]), k
        # A fresh copy, not an alias of the saved tensor.
        if v.numel():
            assert v.data_ptr() != saved[k].data_ptr(), k


def test_map_location_cpu(target):
    c = sample(4, 5, seed=1)
    loaded = save_load({"w": c.to("tpu"), "w1": c.to("tpu:1")}, target, map_location="cpu")
    for v in loaded.values():
        assert v.device.type == "cpu"
        assert torch.equal(v, c)


@pytest.mark.parametrize("map_location", ["tpu", "tpu:1", torch.device("tpu:1"), {"tpu:0": "tpu:1"}])
def test_map_location_to_tpu(target, map_location):
    c = sample(3, 3, seed=2)
    loaded = save_load(c.to("tpu:0"), target, map_location=map_location)
    expected = "tpu:0" if map_location == "tpu" else "tpu:1"
    assert loaded.device == torch.device(expected)
    assert torch.equal(loaded.cpu(), c)


def test_cpu_checkpoint_loads_onto_tpu(target):
    c = sample(2, 7, seed=3)
    loaded = save_load(c, target, map_location="tpu:1")
    assert loaded.device == torch.device("tpu:1")
    assert torch.equal(loaded.cpu(), c)


def test_weights_only(target):
    c = sample(4, 2, seed=4)
    obj = {"w": c.to("tpu"), "meta": {"step": 3, "names": ["a", "b"]}, "ints": torch.arange(4, device="tpu:1")}
    loaded = save_load(obj, target, weights_only=True)
    assert loaded["w"].device == torch.device("tpu:0")
    assert loaded["ints"].device == torch.device("tpu:1")
    assert torch.equal(loaded["w"].cpu(), c)
    assert torch.equal(loaded["ints"].cpu(), torch.arange(4))
    assert loaded["meta"] == {"step": 3, "names": ["a", "b"]}
    loaded_cpu = save_load(obj, target, weights_only=True, map_location="cpu")
    assert loaded_cpu["w"].device.type == "cpu" and torch.equal(loaded_cpu["w"], c)


def test_tpu1_tensor_restores_on_tpu1(target):
    c = sample(5, 3, seed=5)
    loaded = save_load({"x": c.to("tpu:1"), "y": c.to("tpu:0")}, target)
    assert loaded["x"].device == torch.device("tpu:1")
    assert loaded["y"].device == torch.device("tpu:0")
    assert torch.equal(loaded["x"].cpu(), c)
    assert torch.equal(loaded["y"].cpu(), c)
    assert loaded["x"].untyped_storage().device == torch.device("tpu:1")
    # The restored tensor is usable on its device.
    assert_close((loaded["x"] * 2).cpu(), c * 2)


def test_views_share_storage_after_load(target):
    c = sample(4, 6, seed=6)
    base = c.to("tpu")
    view = base.t()[1:]
    loaded = save_load({"base": base, "view": view}, target)
    lb, lv = loaded["base"], loaded["view"]
    assert lv.untyped_storage().data_ptr() == lb.untyped_storage().data_ptr()
    assert lv.stride() == view.stride() and lv.storage_offset() == view.storage_offset()
    assert torch.equal(lv.cpu(), c.t()[1:])
    lb.zero_()  # the sharing is real: writes through the base show in the view
    assert torch.equal(lv.cpu(), torch.zeros_like(c.t()[1:]))


def test_parameter_round_trip(target):
    c = sample(3, seed=7)
    p = nn.Parameter(c.to("tpu"))
    loaded = save_load(p, target)
    assert isinstance(loaded, nn.Parameter) and loaded.requires_grad
    assert loaded.device == torch.device("tpu:0")
    assert torch.equal(loaded.detach().cpu(), c)


def test_state_dict_round_trip(target):
    model = make_model().to("tpu")
    model(torch.randn(4, 6).to("tpu"))  # update BatchNorm running stats
    reference = {k: v.cpu() for k, v in model.state_dict().items()}
    loaded = save_load(model.state_dict(), target)
    assert loaded.keys() == reference.keys()
    for k, v in loaded.items():
        assert v.device.type == "tpu", k
        assert torch.equal(v.cpu(), reference[k]), k
    loaded_cpu = save_load(model.state_dict(), target, map_location="cpu", weights_only=True)
    for k, v in loaded_cpu.items():
        assert v.device.type == "cpu" and torch.equal(v, reference[k]), k


@pytest.mark.parametrize("map_location", [None, "cpu"])
def test_load_state_dict_into_fresh_tpu_module(target, map_location):
    trained = make_model()
    with torch.no_grad():
        for p in trained.parameters():
            p.mul_(-2).add_(0.5)  # differ from a freshly initialised model
    trained = trained.to("tpu")
    trained(torch.randn(4, 6).to("tpu"))
    state = save_load(trained.state_dict(), target, map_location=map_location, weights_only=True)

    torch.manual_seed(99)
    fresh = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2)).to("tpu")
    assert not torch.equal(fresh[0].weight.detach().cpu(), trained[0].weight.detach().cpu())
    result = fresh.load_state_dict(state)
    assert not result.missing_keys and not result.unexpected_keys
    for (k, v), (_, ref) in zip(fresh.state_dict().items(), trained.state_dict().items()):
        assert v.device.type == "tpu", k
        assert torch.equal(v.cpu(), ref.cpu()), k

    # The loaded module computes exactly what the trained one (and its CPU copy) does.
    x = torch.randn(5, 6)
    fresh.eval()
    trained.eval()
    cpu_copy = make_model()
    cpu_copy.load_state_dict({k: v.cpu() for k, v in trained.state_dict().items()})
    cpu_copy.eval()
    out = fresh(x.to("tpu"))
    assert torch.equal(out.detach().cpu(), trained(x.to("tpu")).detach().cpu())
    assert_close(out.detach().cpu(), cpu_copy(x).detach(), atol=1e-5, rtol=1e-5)


def test_optimizer_state_dict_round_trip(target):
    model = make_model().to("tpu")
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model(torch.randn(4, 6).to("tpu")).sum().backward()
    opt.step()
    loaded = save_load(opt.state_dict(), target, weights_only=True)
    for pid, state in opt.state_dict()["state"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            assert loaded["state"][pid][key].device.type == "tpu"
            assert torch.equal(loaded["state"][pid][key].cpu(), state[key].cpu())
    opt2 = torch.optim.Adam(model.parameters(), lr=1e-2)
    opt2.load_state_dict(loaded)
    for p in model.parameters():
        assert opt2.state[p]["exp_avg"].device.type == "tpu"
        assert torch.equal(opt2.state[p]["exp_avg"].cpu(), opt.state[p]["exp_avg"].cpu())
