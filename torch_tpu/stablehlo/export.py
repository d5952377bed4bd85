"""``export_stablehlo``: a module's forward as a StableHLO MLIR module.

The forward is captured by ``torch.export`` (for inference: under no_grad)
and decomposed to core ATen; every node is then lowered through the registry
into one ``func.func @main``. Its arguments are the program's state
(parameters, buffers, lifted constants: names as in ``state_dict``) followed
by the tensors of the example inputs in pytree order; its results are the new
values of the buffers and inputs the forward mutates in place (a BatchNorm's
running statistics in training mode, say), then the forward's tensor outputs
(``StableHLOProgram.result_names`` says which is which). Matmuls and convolutions carry the precision of
``torch.tpu``'s float32 matmul precision at export time.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, OutputKind, TensorArgument
from torch.utils import _pytree as pytree

from torch_tpu.precision import get_float32_matmul_precision
from torch_tpu.stablehlo import lowerings as _lowerings  # noqa: F401  (fills the registry)
from torch_tpu.stablehlo.builder import Builder, TensorType, Value
from torch_tpu.stablehlo.registry import LoweringContext, UnsupportedOpsError, lowering_for, op_name

aten = torch.ops.aten

# Composite ops that core ATen keeps but that lower best as their primitives.
_EXTRA_DECOMPOSITIONS = [aten.native_layer_norm, aten._softmax, aten._log_softmax, aten.gelu, aten.silu,
                         aten.native_group_norm, aten.hardtanh, aten.leaky_relu]


@dataclass(frozen=True)
class StableHLOProgram:
    """An exported forward: the MLIR text and how to call it."""

    text: str
    argument_names: tuple[str, ...]
    """One per function argument: a state name (``"dense_arch.0.weight"``) or an input's
    pytree path (``"[1].stacks['t0'].gains"``)."""
    state: dict[str, torch.Tensor]
    """The parameters, buffers and constants among the arguments."""
    result_names: tuple[str, ...] = ()
    """One per function result: ``"output 0"``... for the forward's tensor outputs, in pytree
    order; ``"buffer_mutation bn.running_mean"`` or ``"user_input_mutation x"`` for a mutated
    buffer's or input's new value (torch.export's output kinds)."""

    def __str__(self) -> str:
        return self.text

    def arguments(self, *args: Any, **kwargs: Any) -> list[torch.Tensor]:
        """The function's arguments for inputs shaped like the example's: state, then inputs."""
        inputs = {name: t for name, t in _named_inputs(args, kwargs)}
        return [self.state[name] if name in self.state else inputs[name] for name in self.argument_names]


def export_stablehlo(module_or_fn: torch.nn.Module | Callable[..., Any], example_args: Sequence[Any],
                     example_kwargs: dict[str, Any] | None = None) -> str:
    """StableHLO MLIR text of ``module_or_fn``'s forward on inputs like ``example_args``
    (see :func:`export_program`)."""
    return export_program(module_or_fn, example_args, example_kwargs).text


def export_program(module_or_fn: torch.nn.Module | Callable[..., Any], example_args: Sequence[Any],
                   example_kwargs: dict[str, Any] | None = None) -> StableHLOProgram:
    """Captures and lowers the forward. Raises one UnsupportedOpsError listing every op of the
    captured graph that cannot be lowered: ops without a lowering, and ops whose lowering
    refuses their arguments (a transposed convolution, say)."""
    program = capture(module_or_fn, tuple(example_args), example_kwargs or {})
    name = type(module_or_fn).__name__ if isinstance(module_or_fn, torch.nn.Module) else \
        getattr(module_or_fn, "__name__", "function")
    return lower(program, tuple(example_args), example_kwargs or {}, name)


class _Function(torch.nn.Module):
    def __init__(self, fn: Callable[..., Any]) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)


def capture(module_or_fn: torch.nn.Module | Callable[..., Any], args: tuple, kwargs: dict) -> ExportedProgram:
    """The inference forward as a core-ATen ExportedProgram."""
    module = module_or_fn if isinstance(module_or_fn, torch.nn.Module) else _Function(module_or_fn)
    with torch.no_grad():
        program = torch.export.export(module, args, kwargs)
    table = torch._decomp.core_aten_decompositions()
    table.update(torch._decomp.get_decompositions(_EXTRA_DECOMPOSITIONS))
    return program.run_decompositions(table)


def _named_inputs(args: tuple, kwargs: dict) -> list[tuple[str, Any]]:
    leaves, _ = pytree.tree_flatten_with_path((args, kwargs))
    return [(_input_name(path), leaf) for path, leaf in leaves]


def _input_name(path: tuple) -> str:
    """``[1].stacks['t0'].gains`` for a positional input's leaf, ``labels`` for a keyword's."""
    if path[0].idx == 0:
        return pytree.keystr(path[1:])
    return str(path[1].key) + pytree.keystr(path[2:])


def lower(program: ExportedProgram, args: tuple, kwargs: dict, name: str = "main") -> StableHLOProgram:
    """The ExportedProgram (captured from ``args``/``kwargs``) as a StableHLO module named ``name``.

    Raises one UnsupportedOpsError for every op that cannot be lowered: those without a lowering
    and those whose lowering refuses its arguments (it raises UnsupportedOpsError). Those only show
    when lowering, so the whole graph is lowered before raising, each refused node's result
    standing in by its recorded type for the nodes that use it."""
    graph = program.graph_module.graph
    env, arguments = _arguments(program, args, kwargs)
    builder, precision = Builder(), get_float32_matmul_precision()
    refused: collections.Counter[str] = collections.Counter()
    reasons: dict[str, list[str]] = {}
    results: list[Value] = []
    result_names: tuple[str, ...] = ()
    for node in graph.nodes:
        if node.op == "call_function":
            if lowering_for(node.target) is None:
                refused[op_name(node.target)] += 1
                env[node] = _stand_in(node)
                continue
            try:
                env[node] = _lower_node(builder, node, env, precision)
            except UnsupportedOpsError as error:
                refused.update(error.ops)
                for op, reason in error.reasons.items():
                    if reason not in reasons.setdefault(op, []):
                        reasons[op].append(reason)
                env[node] = _stand_in(node)
            except Exception:
                if not refused:
                    raise
                # After a refusal this may only be a stand-in's consequence: the refusals are
                # what to report (a real error here shows once they are lowered).
                env[node] = _stand_in(node)
        elif node.op == "output":
            leaves = pytree.tree_leaves(node.args[0])
            results = [env[n] for n in leaves if isinstance(n, torch.fx.Node)]
            result_names = _result_names(program, leaves)
    if refused:
        raise UnsupportedOpsError(dict(refused), reasons={op: "; ".join(r) for op, r in reasons.items()})
    signature = ", ".join(f"{value.name}: {value.type}" for value in arguments.values())
    result_types = ", ".join(str(r.type) for r in results)
    text = (f"module @\"{name}\" {{\n  func.func public @main({signature}) -> ({result_types}) {{\n"
            + "\n".join(builder.lines)
            + f"\n    return {', '.join(r.name for r in results)} : {result_types}\n  }}\n}}\n")
    state = {**program.state_dict, **program.constants}
    return StableHLOProgram(text, tuple(arguments), {k: v for k, v in state.items() if k in arguments}, result_names)


def _stand_in(node: torch.fx.Node) -> Any:
    """A node's result as its recorded type (for a node that was not lowered): Values, lists of
    them, or the recorded Python value."""
    def of(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return Value(f"%{node.name}", _tensor_type(value, node))
        if isinstance(value, (list, tuple)):
            return [of(v) for v in value]
        return value
    return of(node.meta.get("val"))


def _result_names(program: ExportedProgram, leaves: list) -> tuple[str, ...]:
    """The names of the output node's tensor leaves (see StableHLOProgram.result_names)."""
    names, outputs = [], 0
    for leaf, spec in zip(leaves, program.graph_signature.output_specs, strict=True):
        if spec.kind == OutputKind.USER_OUTPUT:
            if isinstance(leaf, torch.fx.Node):
                names.append(f"output {outputs}")
            outputs += 1
        elif isinstance(leaf, torch.fx.Node):
            names.append(f"{spec.kind.name.lower()} {spec.target}")
    return tuple(names)


def _arguments(program: ExportedProgram, args: tuple, kwargs: dict) -> tuple[dict, dict[str, Value]]:
    """The graph's placeholders bound: tensors to function arguments (returned by name, in
    order), Python constants (ints of a pytree input) to their values."""
    named_inputs = iter(_named_inputs(args, kwargs))
    state = {**program.state_dict, **program.constants}
    env: dict[torch.fx.Node, Any] = {}
    arguments: dict[str, Value] = {}
    placeholders = [n for n in program.graph_module.graph.nodes if n.op == "placeholder"]
    for node, spec in zip(placeholders, program.graph_signature.input_specs):
        if spec.kind == InputKind.USER_INPUT:
            name, example = next(named_inputs)
        else:
            name, example = spec.target, state[spec.target]
        value = node.meta.get("val")
        if not isinstance(spec.arg, TensorArgument) or not isinstance(value, torch.Tensor):
            env[node] = example  # a Python constant the graph was specialized to
            continue
        env[node] = arguments[name] = Value(f"%arg{len(arguments)}", _tensor_type(value, node))
    return env, arguments


def _tensor_type(value: Any, node: torch.fx.Node) -> TensorType:
    symbolic = [size for size in value.shape if not isinstance(size, int)]
    if symbolic:
        raise ValueError(f"StableHLO export: {node.name} has a symbolic size {symbolic[0]}; export static shapes "
                         "(no dynamic_shapes)")
    return TensorType(tuple(value.shape), value.dtype)


def _result_type(value: Any, node: torch.fx.Node) -> TensorType | tuple | None:
    if isinstance(value, torch.Tensor):
        return _tensor_type(value, node)
    if isinstance(value, (list, tuple)):
        return tuple(_result_type(v, node) for v in value)
    return None


def _lower_node(builder: Builder, node: torch.fx.Node, env: dict, precision: str) -> Any:
    def value(a: Any) -> Any:
        return env[a] if isinstance(a, torch.fx.Node) else a

    args = pytree.tree_map(value, node.args, is_leaf=lambda a: isinstance(a, torch.fx.Node))
    kwargs = pytree.tree_map(value, node.kwargs, is_leaf=lambda a: isinstance(a, torch.fx.Node))
    examples = [a.meta.get("val") if isinstance(a, torch.fx.Node) else a for a in node.args]
    cx = LoweringContext(builder, _result_type(node.meta.get("val"), node), examples, precision)
    return lowering_for(node.target)(cx, *args, **kwargs)
