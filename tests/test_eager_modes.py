"""Eager modes (torch_tpu.eager): selection, and Debug's checks (torch_tpu.debug) against Strict."""

import os
import subprocess
import sys
import warnings

import pytest
import torch
from torch import nn
from torchrec import EmbeddingBagConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

import sparsecore
import torch_tpu
from models.dlrm import DLRM
from torch_tpu.eager import EagerMode, mode_from_environment

THIS_FILE = os.path.basename(__file__)


@pytest.fixture(autouse=True)
def strict_after():
    yield
    torch_tpu.set_eager_mode("strict")
    torch_tpu.set_nan_check("raise")


@pytest.mark.parametrize("environ, mode", [
    ({}, EagerMode.STRICT),
    ({"TORCH_TPU_LAUNCH_BLOCKING": "1"}, EagerMode.DEBUG),
    ({"TPU_LAUNCH_BLOCKING": "1"}, EagerMode.DEBUG),
    ({"TORCH_TPU_LAUNCH_BLOCKING": "0"}, EagerMode.STRICT),
    ({"TORCH_TPU_DEFER_AND_FUSE": "1"}, EagerMode.DEFER_AND_FUSE),
])
def test_the_environment_selects_the_mode(environ, mode):
    assert mode_from_environment(environ) is mode


def test_bad_settings_are_clear_errors():
    with pytest.raises(ValueError, match=r"TORCH_TPU_LAUNCH_BLOCKING='yes': expected 1 \(on\) or 0 \(off\)"):
        mode_from_environment({"TORCH_TPU_LAUNCH_BLOCKING": "yes"})
    with pytest.raises(ValueError, match="ask for two eager modes"):
        mode_from_environment({"TPU_LAUNCH_BLOCKING": "1", "TORCH_TPU_DEFER_AND_FUSE": "1"})
    with pytest.raises(ValueError, match=r"eager mode 'fast': expected one of \['strict', 'debug', 'defer_and_fuse'\]"):
        torch_tpu.set_eager_mode("fast")
    with pytest.raises(ValueError, match="nan check 'loud'"):
        torch_tpu.set_nan_check("loud")
    assert torch_tpu.get_eager_mode() is EagerMode.STRICT


def test_the_variable_turns_debug_on_in_a_fresh_process():
    code = ("import torch, torch_tpu\n"
            "print(torch_tpu.get_eager_mode().value)\n"
            "torch.ones(3, device='tpu')[torch.tensor([5], device='tpu')]\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "TPU_LAUNCH_BLOCKING": "1"})
    assert out.stdout.strip() == "debug"
    assert "IndexError: aten.index.Tensor: indices[0][0] = 5 is out of range" in out.stderr
    assert "<string>:3 in <module>" in out.stderr


def test_the_context_manager_restores_the_mode():
    with torch_tpu.eager_mode(EagerMode.DEBUG):
        assert torch_tpu.get_eager_mode() is EagerMode.DEBUG
        with torch_tpu.eager_mode("strict"):
            assert torch_tpu.get_eager_mode() is EagerMode.STRICT
        assert torch_tpu.get_eager_mode() is EagerMode.DEBUG
    assert torch_tpu.get_eager_mode() is EagerMode.STRICT


def test_debug_names_the_op_the_tensor_the_value_and_the_users_line():
    weight = torch.randn(10, 4, device="tpu")
    ids = torch.tensor([[1, 2], [3, 12]], device="tpu")
    torch_tpu.set_eager_mode("debug")
    with pytest.raises(IndexError) as raised:
        nn.functional.embedding(ids, weight)  # the line the message must name
    message = str(raised.value)
    assert message.startswith("aten.embedding.default: indices[1, 1] = 12 is out of range for the rows of weight "
                              "of size 10 (expected 0 <= indices < 10); called from ")
    assert f"{THIS_FILE}:" in message and "nn.functional.embedding(ids, weight)" in message


@pytest.mark.parametrize("call, op", [
    (lambda x, i: torch.index_select(x, 1, i), "aten.index_select.default"),
    (lambda x, i: torch.gather(x, 1, i.expand(4, -1)), "aten.gather.default"),
    (lambda x, i: x.scatter_add(1, i.expand(4, -1), torch.ones(4, 2, device="tpu")), "aten.scatter_add.default"),
    (lambda x, i: x[:, i], "aten.index.Tensor"),
    (lambda x, i: x.index_put_((i,), torch.zeros(2, 6, device="tpu")), "aten.index_put_.default"),
    (lambda x, i: nn.functional.embedding_bag(i.view(1, -1), x), "aten._embedding_bag"),
])
def test_debug_bounds_checks_indexing_ops(call, op):
    x = torch.randn(4, 6, device="tpu")
    bad = torch.tensor([0, 9], device="tpu")  # 9: past both dims
    torch_tpu.set_eager_mode("debug")
    with pytest.raises(IndexError, match=f"^{op}.*= 9 is out of range"):
        call(x, bad)
    call(x, torch.tensor([0, 3], device="tpu"))  # in range: runs


def test_nan_and_inf_raise_warn_or_pass():
    x = torch.tensor([-1.0, 0.0], device="tpu")
    torch_tpu.set_eager_mode("debug")
    with pytest.raises(FloatingPointError, match=r"^aten.log.default: output 0 holds NaN; called from .*torch.log"):
        torch.log(x)
    with pytest.raises(FloatingPointError, match="aten.reciprocal.default: output 0 holds Inf"):
        torch.reciprocal(x[1:])
    torch_tpu.set_nan_check("warn")
    with pytest.warns(RuntimeWarning, match="aten.log.default: output 0 holds NaN"):
        out = torch.log(x)
    assert torch.isnan(out.cpu()[0])
    torch_tpu.set_nan_check("off")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch.log(x)
    torch_tpu.set_eager_mode("strict")
    torch_tpu.set_nan_check("raise")
    assert torch.isnan(torch.log(x).cpu()[0])  # Strict does not check


def zoo() -> dict:
    torch.manual_seed(0)
    cnn = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 6 * 6, 4))
    block = nn.TransformerEncoderLayer(d_model=32, nhead=4, dim_feedforward=64, dropout=0.0, batch_first=True)
    return {"mlp": (nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4)), torch.randn(8, 16)),
            "cnn with batchnorm": (cnn, torch.randn(4, 3, 8, 8)),
            "transformer block": (block, torch.randn(2, 10, 32))}


def run(model: nn.Module, x: torch.Tensor, mode: str) -> list[torch.Tensor]:
    """Forward, backward and one SGD step under ``mode``: the output, the gradients, the weights."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    from torch_tpu.debug import DebugChecks

    model = model.to("tpu")
    with torch_tpu.eager_mode(mode):
        # The checks really run in Debug (and not in Strict).
        assert any(isinstance(m, DebugChecks) for m in _get_current_dispatch_mode_stack()) == (mode == "debug")
        out = model(x.to("tpu"))
        out.float().square().mean().backward()
        torch.optim.SGD(model.parameters(), lr=0.1).step()
    return [out.detach().cpu()] + [p.grad.cpu() for p in model.parameters()] + [p.detach().cpu()
                                                                              for p in model.parameters()]


@pytest.mark.parametrize("name", ["mlp", "cnn with batchnorm", "transformer block"])
def test_debug_results_equal_strict(name):
    strict = run(*zoo()[name], "strict")
    debug = run(*zoo()[name], "debug")
    for a, b in zip(strict, debug):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def dlrm_step(mode: str) -> list[torch.Tensor]:
    torch.manual_seed(0)
    configs = [sparsecore.SparseCoreEmbeddingConfig(
        config=EmbeddingBagConfig(name=f"t{i}", num_embeddings=rows, embedding_dim=8, feature_names=[f"f{i}"]),
        max_ids_per_partition=256, max_unique_ids_per_partition=256) for i, rows in enumerate([50, 200, 7])]
    ebc = sparsecore.SparseCoreEmbeddingBagCollection(configs, sparsecore.optim.RowWiseAdagrad(lr=0.1), "tpu")
    model = DLRM(ebc, 4, [8, 8], [8, 1]).to("tpu")
    g = torch.Generator().manual_seed(1)
    kjt = KeyedJaggedTensor(keys=["f0", "f1", "f2"], values=torch.cat([torch.randint(0, r, (32,), generator=g)
                                                                      for r in (50, 200, 7)]),
                            lengths=torch.full((48,), 2))
    with torch_tpu.eager_mode(mode):
        out = model(torch.randn(16, 4, generator=g).to("tpu"), kjt)
        out.sum().backward()
        torch.tpu.synchronize()
    return [out.detach().cpu(), *(p.grad.cpu() for p in model.parameters() if p.grad is not None),
            *(ebc.table_weight(c.name).cpu() for c in configs)]


def test_debug_dlrm_step_equals_strict_and_runs_the_engine_synchronously():
    for a, b in zip(dlrm_step("strict"), dlrm_step("debug")):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    torch_tpu.set_eager_mode("debug")
    done = torch.tpu.submit(torch.tpu.Stream(), lambda: 7)
    assert done.done() and done.result() == 7  # no worker thread: it ran before submit returned


def test_debug_allows_what_pytorch_allows():
    x = torch.arange(60.0, device="tpu").view(2, 3, 10)
    mask = torch.tensor([[True, False, True], [False, True, False]], device="tpu")
    torch_tpu.set_eager_mode("debug")
    torch.testing.assert_close(x[:, :, torch.tensor([-1], device="tpu")].cpu(), x.cpu()[:, :, [-1]])
    torch.testing.assert_close(x[mask, torch.tensor([7], device="tpu")].cpu(),
                               x.cpu()[mask.cpu(), torch.tensor([7])])  # a 2-d mask takes two dims
    with pytest.raises(IndexError, match=r"aten.index_select.default: index\[0\] = -1 is out of range"):
        torch.index_select(x, 2, torch.tensor([-1], device="tpu"))  # index_select takes no negative index
    # Uninitialized memory (here a freed buffer of -1 ints, read as floats: NaN) is not an op's result.
    del x
    garbage = torch.full((1024,), -1, dtype=torch.int32, device="tpu")
    del garbage
    torch.empty(1024, device="tpu")
    torch.ones(4, device="tpu").new_empty(1024)


def test_leaving_debug_under_a_later_dispatch_mode_is_refused():
    from torch.utils._python_dispatch import TorchDispatchMode

    class Passthrough(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    torch_tpu.set_eager_mode("debug")
    with Passthrough():
        with pytest.raises(RuntimeError, match="entered after it is active \\(Passthrough\\)"):
            torch_tpu.set_eager_mode("strict")
    torch_tpu.set_eager_mode("strict")
    assert torch_tpu.get_eager_mode() is EagerMode.STRICT


def test_debug_checks_complex_outputs_and_tensors_made_on_the_tpu_from_nothing():
    torch_tpu.set_eager_mode("debug")
    with pytest.raises(FloatingPointError, match="aten.div.Tensor: output 0 holds Inf"):
        torch.tensor([1 + 1j], device="tpu") / 0
    with pytest.raises(FloatingPointError, match="aten.full.default: output 0 holds NaN"):
        torch.full((2, 2), float("nan"), device="tpu")
    with pytest.raises(FloatingPointError, match="output 0 holds Inf"):
        torch.tensor([float("inf")]).to("tpu")
    torch.full((2,), float("nan"))  # cpu: not checked
    torch_tpu.set_eager_mode("strict")
