"""StableHLO export of captured graphs, for interoperability with XLA.

``export_stablehlo(module_or_fn, example_args) -> str`` gives the MLIR text;
``export_program`` also gives the argument order and state to call it with.
Libraries lower their own custom ops with ``register_lowering`` (SparseCore's
lookup becomes a ``stablehlo.custom_call``).
"""

from torch_tpu.stablehlo.builder import Builder, TensorType, Value
from torch_tpu.stablehlo.export import StableHLOProgram, export_program, export_stablehlo
from torch_tpu.stablehlo.registry import LoweringContext, UnsupportedOpsError, register_lowering

__all__ = ["Builder", "LoweringContext", "StableHLOProgram", "TensorType", "UnsupportedOpsError", "Value",
           "export_program", "export_stablehlo", "register_lowering"]
