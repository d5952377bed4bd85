"""torch_tpu.export_stablehlo: the exported MLIR parses and verifies with jaxlib's
StableHLO parser and, run on XLA's CPU backend, gives eager PyTorch's results
(models and single ops: elementwise with broadcasting and type promotion,
matmuls, reductions, shape ops, convolution, gather, scatter). Matmuls carry the
tpu precision; unsupported ops are listed in the error; the DLRM_DCN forward
exports whole, its SparseCore lookup as a custom_call."""

import re

import jax
import jax.extend
import numpy as np
import pytest
import torch
from jax._src.interpreters import mlir
from jax._src.lib.mlir import ir
from torch import nn

import sparsecore
import torch_tpu
from torch_tpu.stablehlo import UnsupportedOpsError, export_program

jax.config.update("jax_enable_x64", True)  # int64 arguments stay int64


def parse(text: str) -> None:
    with mlir.make_ir_context():
        module = ir.Module.parse(text)
        assert module.operation.verify()


def run_on_xla(text: str, arguments: list[torch.Tensor]) -> list[torch.Tensor]:
    backend = jax.extend.backend.get_backend("cpu")
    device = backend.devices()[0]
    executable = backend.compile_and_load(text, backend.devices()[:1])
    buffers = [jax.device_put(np.asarray(t.detach().cpu()), device) for t in arguments]
    return [torch.from_numpy(np.asarray(out).copy()) for out in executable.execute(buffers)]


def check_against_eager(fn, *args, atol=1e-5, rtol=1e-5):
    """Exports ``fn``, runs the export on XLA and compares every output with eager's."""
    with torch.tpu.precision("highest"):
        program = export_program(fn, args)
    parse(program.text)
    with torch.no_grad():
        expected = fn(*args)
    expected = [expected] if isinstance(expected, torch.Tensor) else list(expected)
    actual = run_on_xla(program.text, program.arguments(*args))
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        assert a.dtype == e.dtype and a.shape == e.shape, (a.dtype, e.dtype, a.shape, e.shape)
        torch.testing.assert_close(a, e, atol=atol, rtol=rtol)
    return program


def models() -> dict:
    torch.manual_seed(0)
    return {
        "mlp": (nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.GELU(), nn.Linear(32, 4), nn.Softmax(-1)),
                torch.randn(8, 16)),
        "cnn": (nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, stride=2), nn.BatchNorm2d(8), nn.ReLU(),
                              nn.Conv2d(8, 8, 3, padding=2, dilation=2, groups=4), nn.Flatten(),
                              nn.Linear(8 * 4 * 4, 4)).eval(), torch.randn(4, 3, 8, 8)),
        "transformer block": (nn.TransformerEncoderLayer(d_model=32, nhead=4, dim_feedforward=64, dropout=0.0,
                                                         batch_first=True).eval(), torch.randn(2, 10, 32)),
        "embedding": (nn.Embedding(10, 4), torch.tensor([[1, 2, 3], [0, 9, 4]])),
    }


@pytest.mark.parametrize("name", list(models()))
def test_models_run_on_xla_as_in_eager(name):
    model, x = models()[name]
    if name == "cnn":  # running statistics that are not the identity
        with torch.no_grad():
            model[1].running_mean.uniform_(-1, 1)
            model[1].running_var.uniform_(0.5, 2)
    check_against_eager(model, x)


def test_tpu_inputs_export_like_cpu_ones():
    model, x = models()["mlp"]
    on_tpu = export_program(model.to("tpu"), (x.to("tpu"),))
    on_cpu = export_program(model.cpu(), (x,))
    assert on_tpu.text == on_cpu.text
    assert on_tpu.argument_names == ("0.weight", "0.bias", "1.weight", "1.bias", "3.weight", "3.bias", "[0]")


def test_fused_dot_interaction_exports_as_its_unfused_form():
    # DLRM's interaction on tpu is one torch_tpu op; it lowers to a Gram dot_general and slices.
    from models.dlrm import DotInteraction

    module = DotInteraction(5).to("tpu")
    dense, sparse = torch.randn(4, 8), torch.randn(4, 5, 8)
    with torch.tpu.precision("highest"):
        program = export_program(module, (dense.to("tpu"), sparse.to("tpu")))
        with torch.no_grad():
            expected = module(dense.to("tpu"), sparse.to("tpu")).cpu()
    parse(program.text)
    assert "stablehlo.dot_general" in program.text and "custom_call" not in program.text
    (actual,) = run_on_xla(program.text, program.arguments(dense, sparse))
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)


g = torch.Generator().manual_seed(0)


def randn(*shape):
    return torch.randn(*shape, generator=g)


def randint(high, *shape):
    return torch.randint(0, high, shape, generator=g)


OPS = {
    # elementwise, with broadcasting, Python scalars and type promotion
    "arithmetic": (lambda x, y: (x + 2 * y - 1.5) * x / (y.abs() + 1) - torch.pow(x.abs(), 1.5),
                   randn(3, 4), randn(4)),
    "int plus float": (lambda i, x: i + x, randint(5, 3, 1), randn(3, 4)),
    "unary": (lambda x: torch.exp(x).log1p() + torch.tanh(x) + torch.sigmoid(x) + torch.erf(x) + torch.rsqrt(
        x.abs() + 1) + torch.sign(x) + torch.floor(x) + torch.ceil(x) + torch.reciprocal(x + 10) + x.neg().relu(),
        randn(5, 6)),
    "comparisons and where": (lambda x, y: torch.where(x > y, x, y * 2) + (x <= 0.5).float()
                              + torch.clamp(x, -0.5, 0.5) + torch.logical_and(x > 0, y < 0).to(torch.float32),
                              randn(4, 5), randn(5)),
    # rounding is the identity on integers (StableHLO's floor/ceil/round are float-only), and
    # abs and sign of unsigned values need no sign (StableHLO's are signed-only)
    "integer rounding, abs and sign": (lambda i, u, b: (i.floor(), i.ceil(), i.round(), u.floor() + u.ceil(),
                                                       u.round(), u.abs(), u.sign(), i.abs(), i.sign(), b.sign()),
                                       torch.tensor([3, -2, 0, -7]), torch.tensor([0, 5, 255], dtype=torch.uint8),
                                       torch.tensor([True, False])),
    "trunc and frac": (lambda x: (torch.trunc(x), torch.frac(x), torch.trunc(x.to(torch.int32))),
                       torch.tensor([-2.5, -0.5, 0.0, 0.5, 1.5, 7.25, -7.75, 123456.75])),
    "integer comparisons": (lambda i: ((i >= 3) | (i == 0)).to(torch.int64) * i - i.max(), randint(7, 10)),
    # reductions
    "reductions": (lambda x: (x.sum(1, keepdim=True) + x.mean(0) + x.amax(1, keepdim=True) - x.amin(),
                              x.var(1, correction=1), x.prod(1), (x > 1).any(1), (x > -3).all()),
                   randn(4, 5)),
    "integer sum": (lambda i: i.sum(0), randint(100, 6, 3)),
    "softmax and log_softmax": (lambda x: torch.softmax(x, -1) + torch.log_softmax(x, 0), randn(3, 7)),
    # shapes
    "shapes": (lambda x: torch.cat([x.permute(1, 0, 2).reshape(4, -1), x[1:, ::2, 1].reshape(4, -1).expand(4, 2)],
                                   1)[:, 3:-1], randn(3, 4, 5)),
    "select, split, unbind": (lambda x: [p * 2 for p in x.split([2, 1, 3], 1)] + [x[1], x[:, -1]], randn(2, 6)),
    "pad": (lambda x: nn.functional.pad(x, (1, 2, 0, 1), value=-1.0), randn(2, 3)),
    "arange and full": (lambda x: x + torch.arange(2, 11, 3, dtype=torch.float32) + torch.full((3,), 0.25),
                        randn(2, 3)),
    # matmuls
    "matmuls": (lambda a, b, c: (a @ b, torch.bmm(c, c.transpose(1, 2)), torch.addmm(b[0], a, b, beta=0.5, alpha=2)),
                randn(3, 4), randn(4, 5), randn(2, 3, 4)),
    "conv1d": (lambda x, w: nn.functional.conv1d(x, w, stride=2, padding=1), randn(2, 4, 9), randn(6, 4, 3)),
    # gather and scatter
    "index_select and gather": (lambda x, i, j: (x.index_select(1, i), torch.gather(x, 1, j)),
                                randn(4, 6), torch.tensor([5, 0, 2, 2]), randint(6, 4, 3)),
    "advanced indexing": (lambda x, i, j: (x[i], x[:, i, j], x[i, j]), randn(5, 6, 7), torch.tensor([[0, -1], [4, 2]]),
                          torch.tensor([1, 5])),
    # (scatter without accumulation: distinct targets, else which write wins is unspecified)
    "scatter_add and scatter": (lambda x, i, k, s: (x.scatter_add(0, i, s), x.scatter(1, k, s[:, :3])),
                                randn(3, 4), torch.tensor([[0, 1, 2, 0], [2, 2, 1, 0]]),
                                torch.tensor([[3, 0, 1], [1, 2, 3]]), randn(2, 4)),
    "index_put and index_add": (lambda x, i, v, j, s: (x.index_put((i,), v, accumulate=True), x.index_put((i[:2],), v[:2]),
                                                       x.index_put((j[:, None], j), s[:2]), x.index_add(1, j, s)),
                                randn(5, 3), torch.tensor([4, 0, 4]), randn(3, 3), torch.tensor([2, 0]), randn(5, 2)),
}


@pytest.mark.parametrize("name", list(OPS))
def test_ops_run_on_xla_as_in_eager(name):
    fn, *args = OPS[name]
    check_against_eager(fn, *args)


def test_matmuls_carry_the_tpu_precision():
    model = nn.Sequential(nn.Conv1d(2, 3, 3), nn.Flatten(), nn.Linear(3 * 4, 2))
    x = randn(1, 2, 6)
    for precision, expected in [("highest", "HIGHEST"), ("high", "HIGH"), ("medium", "DEFAULT")]:
        with torch.tpu.precision(precision):
            text = torch_tpu.export_stablehlo(model, (x,))
        configs = re.findall(r"precision_config = \[([^\]]*)\]", text)
        assert len(configs) == 2  # the convolution and the matmul
        assert all(c == f"#stablehlo<precision {expected}>, #stablehlo<precision {expected}>" for c in configs)


def test_unsupported_ops_are_listed():
    def fn(x):
        return torch.cumsum(x, 0) + torch.cumsum(x, 1) + torch.sort(x, 1).values

    with pytest.raises(UnsupportedOpsError) as error:
        export_program(fn, (randn(3, 3),))
    assert error.value.ops == {"aten::cumsum.default": 2, "aten::sort.default": 1}
    assert "cumsum" in str(error.value) and "sort" in str(error.value)


@pytest.mark.parametrize("fn, args, refused", [
    # a transposed convolution: its lowering refuses it, once the graph is lowered
    (lambda x, w: nn.functional.conv_transpose1d(x, w).cumsum(0), (randn(1, 2, 5), randn(2, 3, 3)),
     {"aten::convolution.default": "transposed convolution"}),
    # index tensors on non-consecutive dims, a boolean mask
    (lambda x, i, j: x[i, :, j].cumsum(0) * 2, (randn(3, 4, 5), torch.tensor([0, 2]), torch.tensor([1, 4])),
     {"aten::index.Tensor": "non-consecutive"}),
    (lambda x: x.index_put((x > 0,), torch.tensor(0.0)).cumsum(0), (randn(4),),
     {"aten::index_put.default": "boolean mask"}),
])
def test_ops_whose_lowering_refuses_their_arguments_are_listed_with_the_others(fn, args, refused):
    """Before, these were refused while lowering, after the check for ops without a lowering:
    the first error named only cumsum, and the next only showed once cumsum was gone."""
    with pytest.raises(UnsupportedOpsError) as error:
        export_program(fn, args)
    (op, reason), = refused.items()
    assert error.value.ops == {op: 1, "aten::cumsum.default": 1}
    assert reason in error.value.reasons[op] and reason in str(error.value) and "cumsum" in str(error.value)


def test_training_batch_norm_runs_on_xla_with_its_new_running_statistics_among_the_results():
    """A training-mode BatchNorm: the output normalized by the batch's statistics, and the
    running mean and variance (momentum, the unbiased variance) and batch count it updates,
    all as eager computes them. Before, its op had no lowering."""
    import copy

    torch.manual_seed(0)
    for module, x in [(nn.BatchNorm1d(3), randn(6, 3)),
                      (nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4, momentum=0.3), nn.ReLU()),
                       randn(2, 3, 6, 6)),
                      (nn.BatchNorm1d(4, affine=False).double(), randn(3, 4, 5).double()),
                      (nn.BatchNorm2d(3, track_running_stats=False), randn(2, 3, 4, 4))]:
        module.train()
        with torch.no_grad():
            for name, buffer in module.named_buffers():
                if name.endswith("running_mean"):
                    buffer.uniform_(-1, 1)
                elif name.endswith("running_var"):
                    buffer.uniform_(0.5, 2)
        eager = copy.deepcopy(module)
        with torch.tpu.precision("highest"):
            program = export_program(module, (x,))
            with torch.no_grad():
                expected = {"output 0": eager(x)}
        expected.update({f"buffer_mutation {name}": b for name, b in eager.named_buffers()})
        assert sorted(program.result_names) == sorted(expected)
        parse(program.text)
        for name, actual in zip(program.result_names, run_on_xla(program.text, program.arguments(x))):
            assert actual.dtype == expected[name].dtype, name
            torch.testing.assert_close(actual, expected[name], atol=1e-5, rtol=1e-5, msg=name)


def test_symbolic_shapes_are_refused():
    batch = torch.export.Dim("batch")
    program = torch.export.export(nn.Linear(3, 2), (randn(4, 3),), dynamic_shapes=({0: batch},))
    from torch_tpu.stablehlo.export import lower

    with pytest.raises(ValueError, match="symbolic size"):
        lower(program.run_decompositions(), (randn(4, 3),), {})


# -- DLRM_DCN with SparseCore embeddings -------------------------------------------------------------

def dlrm_dcn():
    from tests.models.test_dlrm import batch, build_pair, make_data

    source = make_data(multi_hot=True)
    _, model = build_pair("dcn", source, optimizer=sparsecore.optim.Adam(lr=0.05), weighted=True)
    dense, kjt, _ = batch(source, weighted=True)
    ebc = model.sparse_arch.embedding_bag_collection
    return model, dense.to("tpu"), ebc.preprocess(kjt)


def test_the_dlrm_dcn_forward_exports_with_the_lookup_as_a_custom_call():
    model, dense, batch = dlrm_dcn()
    program = export_program(model, (dense, batch))
    parse(program.text)
    calls = [line for line in program.text.splitlines() if "stablehlo.custom_call" in line]
    assert len(calls) == len(model.sparse_arch.embedding_bag_collection._stacks) == 1
    (stack_name, coo), = batch.stacks.items()
    assert f"num_bags = {coo.num_bags} : i64" in calls[0] and f"batch_size = {coo.batch_size} : i64" in calls[0]
    operands = re.search(r'custom_call"\(([^)]*)\)', calls[0]).group(1).split(", ")
    named = [program.argument_names[int(o.removeprefix("%arg"))] for o in operands]
    assert named == [f"sparse_arch.embedding_bag_collection._weights.{stack_name}",
                     *(f"[1].stacks['{stack_name}'].{f}" for f in ("row_pointers", "embedding_ids", "sample_ids",
                                                                 "gains"))]
    # The lookup's operands are what the engine itself reads.
    arguments = dict(zip(program.argument_names, program.arguments(dense, batch)))
    assert torch.equal(arguments[named[3]], coo.sample_ids)


def test_a_raw_kjt_is_refused_with_what_to_export_instead():
    """Before, export traced the host preprocessing and failed on a data-dependent check."""
    from tests.models.test_dlrm import batch, build_pair, make_data

    source = make_data(multi_hot=True)
    _, model = build_pair("dcn", source, optimizer=None, weighted=True)
    dense, kjt, _ = batch(source, weighted=True)
    with pytest.raises(sparsecore.InputError, match=r"takes its batch preprocessed \(module.preprocess\(kjt\)\)"):
        export_program(model, (dense.to("tpu"), kjt))


def test_the_dlrm_dcn_graph_without_the_lookup_runs_on_xla_as_in_eager():
    model, dense, batch = dlrm_dcn()

    def after_the_lookup(dense_features, embedded):
        return model.forward_from_pooled(model.dense_arch(dense_features), embedded)

    with torch.no_grad(), torch.tpu.precision("highest"):
        expected = model(dense, batch)
        embedded = model.sparse_arch.embedding_bag_collection(batch).values()
        program = export_program(after_the_lookup, (dense, embedded))
    assert "custom_call" not in program.text
    parse(program.text)
    (actual,) = run_on_xla(program.text, program.arguments(dense, embedded))
    torch.testing.assert_close(actual, expected.cpu(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("fn, op", [
    (lambda x: x.view(torch.int32) + 1, "aten::view.dtype"),  # a bitcast: the reshape's lowering would convert
    (lambda x: torch.div(x, 3, rounding_mode="trunc"), "aten::div.Tensor_mode"),
    (lambda x: x.round(decimals=1), "aten::round.decimals"),
    (lambda x: torch.max(x, 1).values, "aten::max.dim"),
])
def test_an_overload_without_a_lowering_is_listed_not_lowered_as_another(fn, op):
    with pytest.raises(UnsupportedOpsError) as error:
        export_program(fn, (randn(2, 3),))
    assert op in error.value.ops


def test_mutated_state_and_inputs_are_named_among_the_results():
    class Counting(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("count", torch.zeros(()))

        def forward(self, x):
            self.count.add_(1)
            x.add_(1)
            return x * 2, x.sum()

    program = export_program(Counting(), (randn(3),))
    assert sorted(program.result_names) == ["buffer_mutation count", "output 0", "output 1", "user_input_mutation x"]
    assert program.text.count("tensor<") >= 4
    plain = export_program(nn.Linear(3, 2), (randn(4, 3),))
    assert plain.result_names == ("output 0",)
