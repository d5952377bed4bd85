"""Op conformance of the tpu device against CPU PyTorch, driven by OpInfo.

PyTorch's own OpInfo database (``op_db``) describes every public op with a
generator of sample inputs. For each op and each dtype it supports on CPU
(of float32, bfloat16 and int64) this module

* runs every sample on CPU, copies the sample to tpu (tensors only, same
  values, same strides and storage offsets) and runs it there, then compares
  the outputs with ``torch.testing.assert_close``: a sample *passes*, *fails*
  (outputs differ) or *errors* (tpu raised where CPU did not). Samples on
  which CPU itself raises are not counted;
* for float32 samples of differentiable ops, compares the gradients of a
  fixed random weighting of the outputs w.r.t. every input that requires grad.

Nothing runs on import. Entry points: :func:`run`, :func:`categorize`,
:func:`resolve_ops`, :data:`EXCLUDED`. ``benchmarks/op_coverage.py`` is the
command line front end and ``tests/test_opinfo.py`` the CI subset.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import re
import time
import traceback
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch.testing._internal.common_methods_invocations import op_db
from torch.testing._internal.opinfo.core import (
    BinaryUfuncInfo,
    DecorateInfo,
    OpInfo,
    ReductionOpInfo,
    ShapeFuncInfo,
    SpectralFuncInfo,
    UnaryUfuncInfo,
)

DEVICE = "tpu"
DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.int64)
BACKWARD_DTYPES: tuple[torch.dtype, ...] = (torch.float32,)

# --------------------------------------------------------------------------
# Exclusions
# --------------------------------------------------------------------------

_RANDOM = "random op: its output depends on the random stream, so it cannot match the CPU run"

EXCLUDED: dict[str, str] = {
    # Random ops (nondeterministic).
    "bernoulli": _RANDOM,
    "cauchy": _RANDOM,
    "exponential": _RANDOM,
    "geometric": _RANDOM,
    "log_normal": _RANDOM,
    "multinomial": _RANDOM,
    "normal": _RANDOM,
    "normal.in_place": _RANDOM,
    "normal.number_mean": _RANDOM,
    "uniform": _RANDOM,
    "rand_like": _RANDOM,
    "randint": _RANDOM,
    "randint_like": _RANDOM,
    "randn": _RANDOM,
    "randn_like": _RANDOM,
    "nn.functional.dropout": _RANDOM,
    "nn.functional.dropout2d": _RANDOM,
    "nn.functional.dropout3d": _RANDOM,
    "nn.functional.alpha_dropout": _RANDOM,
    "nn.functional.feature_alpha_dropout.with_train": _RANDOM,
    "svd_lowrank": "random op: randomized range finder (draws a random projection)",
    "pca_lowrank": "random op: randomized range finder (draws a random projection)",
    # Sparse layouts: the tpu device has dense strided tensors only.
    "to_sparse": "sparse layout: converts to a sparse tensor; tpu has strided tensors only",
    "sparse.sampled_addmm": "sparse layout: takes sparse CSR inputs; tpu has strided tensors only",
    "sparse.mm.reduce": "sparse layout: takes sparse CSR inputs; tpu has strided tensors only",
    # CUDA-only ops (the CPU run raises anyway; listed so they are not counted).
    "jiterator_unary": "requires CUDA (jiterator compiles CUDA kernels)",
    "jiterator_binary": "requires CUDA (jiterator compiles CUDA kernels)",
    "jiterator_binary_return_by_ref": "requires CUDA (jiterator compiles CUDA kernels)",
    "jiterator_2inputs_2outputs": "requires CUDA (jiterator compiles CUDA kernels)",
    "jiterator_4inputs_with_extra_args": "requires CUDA (jiterator compiles CUDA kernels)",
    "bmm.triton_optimized": "requires CUDA (Triton kernel)",
    "torch._scaled_mm": "requires CUDA (fp8 scaled matmul)",
    "torch._scaled_mm_v2": "requires CUDA (fp8 scaled matmul)",
    "torch.ops.aten._flash_attention_forward": "requires CUDA (flash attention kernel)",
    "torch.ops.aten._efficient_attention_forward": "requires CUDA (memory-efficient attention kernel)",
}
"""Ops left out entirely, by full name (``name`` or ``name.variant``), with why.

Ops that merely fail on tpu are never listed here: they count as failures.
"""

EXCLUDED_BACKWARD: dict[str, str] = {}
"""Ops whose forward is checked but whose backward is left out, with why."""

# Any op whose name or alias matches is random too (a backstop for ops added
# to op_db later). ``feature_alpha_dropout.without_train`` is deterministic
# (training=False is the identity) and stays in.
_RANDOM_NAME = re.compile(
    r"rand|normal(?!ize)|bernoulli|multinomial|dropout|uniform|exponential|geometric|cauchy|"
    r"log_normal|poisson(?!_nll)|randperm"
)
_DETERMINISTIC_DESPITE_NAME = {
    "nn.functional.feature_alpha_dropout.without_train",  # training=False: the identity
    "native_dropout_backward",  # the mask is an input
    "__rand__",  # reflected bitwise and
    "signal.windows.exponential",  # the exponential window, a fixed formula
}

SAMPLE_RULES: list[tuple[str, Callable[[Any], bool], str]] = [
    # (op full name, predicate on a SampleInput, reason)
    (
        "nn.functional.scaled_dot_product_attention",
        lambda s: float(s.kwargs.get("dropout_p", 0.0) or 0.0) > 0.0,
        "random: dropout_p > 0",
    ),
    (
        "nn.functional.multi_head_attention_forward",
        lambda s: bool(s.kwargs.get("training", False)),
        "random: training=True applies dropout",
    ),
    (
        "nn.functional.rrelu",
        lambda s: bool(s.kwargs.get("training", False)),
        "random: training=True draws random slopes",
    ),
    (
        "nn.functional.fractional_max_pool2d",
        lambda s: s.kwargs.get("_random_samples") is None,
        "random: pooling regions are drawn unless _random_samples is given",
    ),
    (
        "nn.functional.fractional_max_pool3d",
        lambda s: s.kwargs.get("_random_samples") is None,
        "random: pooling regions are drawn unless _random_samples is given",
    ),
]
"""Samples left out of otherwise deterministic ops, with why."""

CPU_RESIDENT_ARGS: dict[str, tuple[Callable[[Any], list[Any]], str]] = {
    "tensor_split": (
        lambda s: [a for a in s.args[:1] if isinstance(a, torch.Tensor)],
        "tensor_indices_or_sections must be a CPU tensor whatever the input's device (documented)",
    ),
}
"""Sample tensors that stay on CPU in the tpu run, by op, with why."""

VALUES_UNDEFINED: dict[str, str] = {
    "empty": "uninitialized memory",
    "empty_like": "uninitialized memory",
    "empty_strided": "uninitialized memory",
    "empty_permuted": "uninitialized memory",
    "new_empty": "uninitialized memory",
    "new_empty_strided": "uninitialized memory",
    "resize_": "growing leaves the new elements uninitialized",
    "resize_as_": "growing leaves the new elements uninitialized",
}
"""Ops whose output values are undefined: only shape, dtype and device are compared."""


def full_name(op: OpInfo) -> str:
    return f"{op.name}.{op.variant_test_name}" if op.variant_test_name else op.name


def exclusion_reason(op: OpInfo) -> str | None:
    """Why the whole op is left out, or None."""
    name = full_name(op)
    if name in EXCLUDED:
        return EXCLUDED[name]
    if name in _DETERMINISTIC_DESPITE_NAME:
        return None
    names = [op.name] + [a.name for a in op.aliases]
    if any(_RANDOM_NAME.search(n.rsplit(".", 1)[-1]) for n in names):
        return _RANDOM
    return None


def sample_exclusion_reason(op: OpInfo, sample: Any) -> str | None:
    name = full_name(op)
    for rule_op, predicate, reason in SAMPLE_RULES:
        if rule_op == name:
            try:
                if predicate(sample):
                    return reason
            except Exception:  # noqa: BLE001 - a rule must never break the run
                pass
    return None


# --------------------------------------------------------------------------
# Categories
# --------------------------------------------------------------------------

CATEGORIES = (
    "elementwise unary",
    "elementwise binary",
    "reduction",
    "linalg",
    "shape/view",
    "indexing",
    "nn.functional",
    "fft",
    "factory/conversion",
    "other",
)

_LINALG = {
    "addmm", "addmv", "addbmm", "baddbmm", "addr", "dot", "vdot", "bmm", "mm", "mv", "matmul",
    "__rmatmul__", "outer", "inner", "kron", "tensordot", "einsum", "cholesky", "cholesky_inverse",
    "cholesky_solve", "geqrf", "lu", "lu_solve", "lu_unpack", "matrix_exp", "ormqr", "qr", "svd",
    "pinverse", "logdet", "triangular_solve", "trace", "chain_matmul", "cdist", "dist", "cross",
    "block_diag", "cov", "corrcoef", "diag", "diag_embed", "diagflat", "tril", "triu",
}
_SHAPE = {
    "atleast_1d", "atleast_2d", "atleast_3d", "broadcast_to", "broadcast_tensors", "broadcast_shapes",
    "cat", "_chunk_cat", "chunk", "unsafe_chunk", "column_stack", "contiguous", "clone", "dstack",
    "expand", "expand_as", "expand_copy", "flatten", "flip", "fliplr", "flipud", "hsplit", "hstack",
    "movedim", "mT", "mH", "T", "H", "narrow", "narrow_copy", "permute", "permute_copy", "ravel",
    "repeat", "repeat_interleave", "reshape", "reshape_as", "roll", "rot90", "select", "slice",
    "split", "split_with_sizes", "split_with_sizes_copy", "unsafe_split", "squeeze", "squeeze_copy",
    "stack", "t", "t_copy", "tensor_split", "tile", "transpose", "transpose_copy", "unbind",
    "unbind_copy", "unflatten", "unfold", "unfold_copy", "unsqueeze", "unsqueeze_copy", "view",
    "view_as", "view_copy", "vsplit", "vstack", "dsplit", "as_strided", "as_strided_copy",
    "alias_copy", "diagonal", "diagonal_copy", "sum_to_size", "view_as_real", "view_as_complex",
    "meshgrid", "resize_", "resize_as_", "conj", "conj_physical", "resolve_conj", "resolve_neg",
    "positive", "real", "combinations", "cartesian_prod", "unravel_index", "constant_pad_nd",
}
_INDEXING = {
    "gather", "scatter", "scatter_add", "scatter_reduce", "index_fill", "index_copy",
    "index_select", "index_add", "index_reduce", "index_put", "_unsafe_masked_index",
    "_unsafe_masked_index_put_accumulate", "__getitem__", "put", "take", "take_along_dim",
    "masked_fill", "masked_scatter", "masked_select", "where", "nonzero", "nonzero_static",
    "argwhere", "diagonal_scatter", "select_scatter", "slice_scatter", "as_strided_scatter",
    "sort", "argsort", "msort", "topk", "kthvalue", "unique", "unique_consecutive", "searchsorted",
    "bucketize", "bincount", "histc", "histogram", "histogramdd", "tril_indices", "triu_indices",
    "isin", "_segment_reduce", "fill", "zero_",
}
_FACTORY = {
    "arange", "linspace", "logspace", "eye", "ones", "zeros", "full", "empty", "empty_strided",
    "empty_permuted", "scalar_tensor", "ones_like", "zeros_like", "full_like", "empty_like",
    "new_ones", "new_zeros", "new_full", "new_empty", "new_empty_strided", "to", "item", "complex",
    "polar", "bfloat16", "bool", "byte", "char", "double", "float", "half", "int", "long",
    "short", "cdouble", "cfloat", "chalf", "hash_tensor",
}
_ELEMENTWISE_NARY = {"addcmul", "addcdiv", "clamp", "lerp", "logaddexp2"}
"""Elementwise ops of two or more tensors without a BinaryUfuncInfo: reported as binary."""
_REDUCTION_LIKE = {
    "cumsum", "cumprod", "cummax", "cummin", "logcumsumexp", "logsumexp", "median", "nanmedian",
    "mode", "quantile", "nanquantile", "var_mean", "std_mean", "aminmax", "max", "min", "norm",
    "renorm", "equal", "allclose", "trapz", "trapezoid", "cumulative_trapezoid", "diff", "gradient",
}


def categorize(op: OpInfo) -> str:
    """A coarse category for reporting, from the op's name and OpInfo class."""
    name = op.name
    base = name.split(".")[0] if not name.startswith(("nn.", "linalg.", "fft.", "special.")) else name
    if name.startswith("nn.functional.") or name in {
        "softmax", "log_softmax", "_softmax_backward_data", "native_layer_norm",
        "native_group_norm", "native_batch_norm", "_native_batch_norm_legit",
        "_batch_norm_with_update", "max_pool2d_with_indices_backward", "native_dropout_backward",
        "grid_sampler_2d", "grid_sampler_3d", "_upsample_bilinear2d_aa",
        "torch.ops.aten._safe_softmax.default",
    }:
        return "nn.functional"
    if name.startswith("linalg.") or name in _LINALG:
        return "linalg"
    if name.startswith("fft.") or isinstance(op, SpectralFuncInfo) or name in {"stft", "istft"}:
        return "fft"
    if name in {"max", "min"} and op.variant_test_name == "binary":
        return "elementwise binary"
    if isinstance(op, ReductionOpInfo) or name in _REDUCTION_LIKE:
        return "reduction"
    if isinstance(op, ShapeFuncInfo) or base in _SHAPE:
        return "shape/view"
    if base in _INDEXING:
        return "indexing"
    if base in _FACTORY or name.startswith("signal.windows."):
        return "factory/conversion"
    if isinstance(op, UnaryUfuncInfo):
        return "elementwise unary"
    if isinstance(op, BinaryUfuncInfo) or name in _ELEMENTWISE_NARY:
        return "elementwise binary"
    if name.startswith("special."):
        return "elementwise binary" if name in {"special.xlog1py", "special.zeta"} or "polynomial" in name else "elementwise unary"
    if name.startswith("masked."):
        return "reduction"
    return "other"


# --------------------------------------------------------------------------
# Moving samples and comparing outputs
# --------------------------------------------------------------------------


def _copy_tensor(t: torch.Tensor, device: str) -> torch.Tensor:
    """``t`` on ``device`` with the same values, strides and storage offset.

    Copies the whole storage so that non-contiguous, offset and overlapping
    (expanded) layouts reach the device as they are on CPU; falls back to
    ``Tensor.to`` for what has no plain storage (e.g. sparse).
    """
    src = t.detach()
    try:
        if src.layout != torch.strided or src.is_conj() or src.is_neg():
            raise TypeError
        storage = src.untyped_storage()
        itemsize = src.element_size()
        if storage.nbytes() % itemsize:
            raise TypeError
        flat = torch.empty(0, dtype=src.dtype).set_(storage, 0, (storage.nbytes() // itemsize,), (1,))
        dev_flat = flat.to(device)
        out = torch.empty(0, dtype=src.dtype, device=device)
        out.set_(dev_flat.untyped_storage(), src.storage_offset(), src.size(), src.stride())
    except TypeError:
        out = src.to(device)
    if t.requires_grad:
        out.requires_grad_(True)
    return out


def _is_cpu_device(value: Any) -> bool:
    if isinstance(value, str):
        return value in ("cpu", "cpu:0")
    return isinstance(value, torch.device) and value.type == "cpu"


def to_device(obj: Any, device: str = DEVICE, memo: dict[int, Any] | None = None) -> Any:
    """``obj`` with every tensor copied to ``device`` (recursively, keeping aliasing).

    Besides tensors, devices naming the cpu (``torch.device("cpu")`` or the
    string ``"cpu"``) are mapped to ``device``, so that factory ops
    (``arange``, ``ones``, ``to``...) create their results there.
    """
    if memo is None:
        memo = {}
    if isinstance(obj, torch.Tensor):
        key = id(obj)
        if key not in memo:
            memo[key] = _copy_tensor(obj, device)
        return memo[key]
    if _is_cpu_device(obj):
        return device if isinstance(obj, str) else torch.device(device)
    if isinstance(obj, dict):
        return {k: to_device(v, device, memo) for k, v in obj.items()}
    if isinstance(obj, list):
        return [to_device(v, device, memo) for v in obj]
    if isinstance(obj, tuple) and not isinstance(obj, torch.Size):
        items = [to_device(v, device, memo) for v in obj]
        if hasattr(obj, "_fields"):  # namedtuple
            return type(obj)(*items)
        return type(obj)(items) if type(obj) is not tuple else tuple(items)
    return obj


def _tensors(obj: Any) -> list[torch.Tensor]:
    """Tensors in ``obj`` in a deterministic order, each once."""
    out: list[torch.Tensor] = []
    seen: set[int] = set()

    def visit(x: Any) -> None:
        if isinstance(x, torch.Tensor):
            if id(x) not in seen:
                seen.add(id(x))
                out.append(x)
        elif isinstance(x, dict):
            for v in x.values():
                visit(v)
        elif isinstance(x, (list, tuple)) and not isinstance(x, torch.Size):
            for v in x:
                visit(v)

    visit(obj)
    return out


class Mismatch(AssertionError):
    pass


@dataclasses.dataclass(frozen=True)
class Tolerance:
    atol: float | None = None
    rtol: float | None = None


def opinfo_tolerance(op: OpInfo, dtype: torch.dtype) -> Tolerance:
    """The loosest tolerance the OpInfo's own decorators give ``dtype`` on CPU.

    Taken from ``toleranceOverride``/``precisionOverride`` decorators of the
    OpInfo's consistency tests (not its gradcheck ones); None when it has none.
    """
    atol = rtol = None
    for info in op.decorators or ():
        if not isinstance(info, DecorateInfo):
            continue
        if info.device_type not in (None, "cpu"):
            continue
        if info.cls_name not in (None, "TestCommon", "TestOps", "TestCompositeCompliance", "TestUnaryUfuncs", "TestBinaryUfuncs", "TestReductions", "TestDecomp"):
            continue
        if info.dtypes is not None and dtype not in info.dtypes:
            continue
        for dec in info.decorators:
            tols = getattr(dec, "d", None)
            if not isinstance(tols, dict) or dtype not in tols:
                continue
            value = tols[dtype]
            if hasattr(value, "atol"):
                atol = max(atol or 0.0, value.atol)
                rtol = max(rtol or 0.0, value.rtol)
            elif isinstance(value, (int, float)):
                atol = max(atol or 0.0, float(value))
    return Tolerance(atol, rtol)


_DEFAULT_TOL = {
    # (rtol, atol): assert_close's defaults.
    torch.float16: (1e-3, 1e-5),
    torch.bfloat16: (1.6e-2, 1e-5),
    torch.float32: (1.3e-6, 1e-5),
    torch.float64: (1e-7, 1e-7),
    torch.complex64: (1.3e-6, 1e-5),
    torch.complex128: (1e-7, 1e-7),
}


def _tol_for(t: torch.Tensor, tol: Tolerance) -> tuple[float, float] | tuple[None, None]:
    if tol.atol is None and tol.rtol is None:
        return None, None
    rtol, atol = _DEFAULT_TOL.get(t.dtype, (0.0, 0.0))
    return max(rtol, tol.rtol or 0.0), max(atol, tol.atol or 0.0)


def compare(actual: Any, expected: Any, tol: Tolerance = Tolerance(), *, values: bool = True, path: str = "out") -> None:
    """Raises :class:`Mismatch` unless the tpu output ``actual`` matches ``expected``.

    Tensors must have the same shape, dtype and layout, live on the tpu when
    the CPU result is a tensor, and match within tolerance (NaNs equal).
    """
    if isinstance(expected, torch.Tensor):
        if not isinstance(actual, torch.Tensor):
            raise Mismatch(f"{path}: expected a tensor, got {type(actual).__name__}")
        if actual.device.type != DEVICE:
            raise Mismatch(f"{path}: result is on {actual.device}, not on {DEVICE}")
        if actual.shape != expected.shape or actual.dtype != expected.dtype:
            raise Mismatch(
                f"{path}: got {tuple(actual.shape)} {actual.dtype}, expected {tuple(expected.shape)} {expected.dtype}"
            )
        if not values:
            return
        a = actual.detach().cpu()
        e = expected.detach()
        rtol, atol = _tol_for(e, tol)
        try:
            torch.testing.assert_close(a, e, rtol=rtol, atol=atol, equal_nan=True, check_device=False)
        except AssertionError as error:
            raise Mismatch(f"{path}: {error}") from None
        return
    if isinstance(expected, (list, tuple)) and not isinstance(expected, torch.Size):
        if not isinstance(actual, (list, tuple)) or len(actual) != len(expected):
            raise Mismatch(f"{path}: expected a sequence of {len(expected)}, got {actual!r:.200}")
        for i, (a, e) in enumerate(zip(actual, expected)):
            compare(a, e, tol, values=values, path=f"{path}[{i}]")
        return
    if isinstance(expected, dict):
        if not isinstance(actual, dict) or actual.keys() != expected.keys():
            raise Mismatch(f"{path}: dict keys differ")
        for k in expected:
            compare(actual[k], expected[k], tol, values=values, path=f"{path}[{k!r}]")
        return
    if isinstance(expected, float) and isinstance(actual, (int, float)):
        if math.isnan(expected) and math.isnan(actual):
            return
        rtol, atol = (tol.rtol or 1.3e-6), (tol.atol or 1e-5)
        if values and not math.isclose(actual, expected, rel_tol=rtol, abs_tol=atol):
            raise Mismatch(f"{path}: {actual!r} != {expected!r}")
        return
    if isinstance(expected, complex):
        if values and not (actual == expected or abs(actual - expected) <= (tol.atol or 1e-5) + (tol.rtol or 1.3e-6) * abs(expected)):
            raise Mismatch(f"{path}: {actual!r} != {expected!r}")
        return
    if values and actual != expected:
        raise Mismatch(f"{path}: {actual!r:.200} != {expected!r:.200}")


# --------------------------------------------------------------------------
# Results
# --------------------------------------------------------------------------


@dataclasses.dataclass
class Tally:
    passed: int = 0
    failed: int = 0
    errored: int = 0
    first_fail: str | None = None
    first_error: str | None = None

    @property
    def total(self) -> int:
        return self.passed + self.failed + self.errored

    def add(self, other: Tally) -> None:
        self.passed += other.passed
        self.failed += other.failed
        self.errored += other.errored
        self.first_fail = self.first_fail or other.first_fail
        self.first_error = self.first_error or other.first_error

    @property
    def first_message(self) -> str | None:
        if self.first_error:
            return f"[error] {self.first_error}"
        if self.first_fail:
            return f"[fail] {self.first_fail}"
        return None


@dataclasses.dataclass
class DtypeResult:
    forward: Tally = dataclasses.field(default_factory=Tally)
    backward: Tally = dataclasses.field(default_factory=Tally)
    cpu_errors: int = 0
    """Samples on which the CPU run raised (not counted)."""
    excluded_samples: int = 0
    """Samples left out by :data:`SAMPLE_RULES`."""
    no_tpu_input: int = 0
    """Samples with no tensor or device to move to the tpu (not counted)."""
    sample_error: str | None = None
    """Generating the samples raised (CPU side, nothing counted after it)."""
    seconds: float = 0.0


@dataclasses.dataclass
class OpResult:
    name: str
    category: str
    excluded: str | None = None
    dtypes: dict[str, DtypeResult] = dataclasses.field(default_factory=dict)

    @property
    def forward(self) -> Tally:
        t = Tally()
        for r in self.dtypes.values():
            t.add(r.forward)
        return t

    @property
    def backward(self) -> Tally:
        t = Tally()
        for r in self.dtypes.values():
            t.add(r.backward)
        return t


@dataclasses.dataclass
class Results:
    ops: dict[str, OpResult] = dataclasses.field(default_factory=dict)
    excluded: dict[str, str] = dataclasses.field(default_factory=dict)
    """Excluded ops that were asked for, with their reasons."""
    excluded_backward: dict[str, str] = dataclasses.field(default_factory=dict)
    """Ops run forward only, with the reasons their backward is left out."""
    not_run: list[str] = dataclasses.field(default_factory=list)
    """Ops skipped because the time budget ran out."""
    seconds: float = 0.0

    def by_category(self) -> dict[str, tuple[Tally, Tally]]:
        out: dict[str, tuple[Tally, Tally]] = {}
        for r in self.ops.values():
            fwd, bwd = out.setdefault(r.category, (Tally(), Tally()))
            fwd.add(r.forward)
            bwd.add(r.backward)
        return out

    def totals(self) -> tuple[Tally, Tally]:
        fwd, bwd = Tally(), Tally()
        for r in self.ops.values():
            fwd.add(r.forward)
            bwd.add(r.backward)
        return fwd, bwd

    def worst(self, n: int = 25) -> list[OpResult]:
        """Ops with the most failing or erroring samples (forward + backward)."""
        def bad(r: OpResult) -> int:
            f, b = r.forward, r.backward
            return f.failed + f.errored + b.failed + b.errored

        ranked = sorted((r for r in self.ops.values() if bad(r)), key=lambda r: (-bad(r), r.name))
        return ranked[:n]

    def to_json(self) -> dict[str, Any]:
        return {
            "seconds": round(self.seconds, 1),
            "excluded": self.excluded,
            "excluded_backward": self.excluded_backward,
            "not_run": self.not_run,
            "ops": {name: dataclasses.asdict(r) for name, r in self.ops.items()},
        }


# --------------------------------------------------------------------------
# Running
# --------------------------------------------------------------------------


def resolve_ops(op_names: Iterable[str] | None = None) -> list[OpInfo]:
    """OpInfos for ``op_names`` (all of op_db if None).

    A name matches an op's full name (``div.floor_rounding``), its base name
    (``div``: every variant) or one of its aliases (``nn.functional.softmax``).
    """
    if op_names is None:
        return list(op_db)
    wanted = list(op_names)
    out: list[OpInfo] = []
    for name in wanted:
        matches = [op for op in op_db if full_name(op) == name]
        if not matches:
            matches = [op for op in op_db if op.name == name]
        if not matches:
            matches = [op for op in op_db if any(a.name == name for a in op.aliases)]
        if not matches:
            raise KeyError(f"no OpInfo named {name!r}")
        out.extend(m for m in matches if m not in out)
    return out


def _short(error: BaseException) -> str:
    text = f"{type(error).__name__}: {error}".strip()
    text = re.sub(r"\s+", " ", text)
    return text[:500]


def _call(op: OpInfo, sample: Any) -> Any:
    return op(sample.input, *sample.args, **sample.kwargs)


def _weighted_loss(outputs: list[torch.Tensor], weights: list[torch.Tensor]) -> torch.Tensor:
    total = None
    for out, w in zip(outputs, weights):
        o = torch.view_as_real(out) if out.is_complex() else out
        term = (o * w).sum()
        total = term if total is None else total + term
    assert total is not None
    return total


def _differentiable_outputs(out: Any) -> list[torch.Tensor]:
    return [t for t in _tensors(out) if t.requires_grad and (t.is_floating_point() or t.is_complex())]


def _grads(op: OpInfo, sample: Any, weights: list[torch.Tensor] | None, seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
    """Weights and grads of a random weighting of the sample's outputs."""
    inputs = [t for t in _tensors([sample.input, sample.args, sample.kwargs]) if t.requires_grad]
    out = op.gradcheck_wrapper(op.get_op(), sample.input, *sample.args, **sample.kwargs)
    out = sample.output_process_fn_grad(out)
    outputs = _differentiable_outputs(out)
    if not outputs:
        raise LookupError("no differentiable output")
    if weights is None:
        gen = torch.Generator().manual_seed(seed)
        weights = [
            torch.randn(torch.view_as_real(o).shape if o.is_complex() else o.shape, generator=gen, dtype=o.real.dtype if o.is_complex() else o.dtype)
            for o in outputs
        ]
    else:
        weights = [w.to(outputs[i].device) for i, w in enumerate(weights)]
    loss = _weighted_loss(outputs, weights)
    grads = torch.autograd.grad(loss, inputs, allow_unused=True)
    return weights, list(grads)


def _compare_grads(actual: list[torch.Tensor | None], expected: list[torch.Tensor | None], tol: Tolerance) -> None:
    if len(actual) != len(expected):
        raise Mismatch(f"{len(actual)} grads, expected {len(expected)}")
    for i, (a, e) in enumerate(zip(actual, expected)):
        if e is None and a is None:
            continue
        if e is None:
            if a is not None and bool(a.detach().cpu().ne(0).any()):
                raise Mismatch(f"grad[{i}]: expected no gradient, got a nonzero one")
            continue
        if a is None:
            if bool(e.ne(0).any()):
                raise Mismatch(f"grad[{i}]: expected a gradient, got None")
            continue
        compare(a, e, tol, path=f"grad[{i}]")


def _run_forward(op: OpInfo, dtype: torch.dtype, result: DtypeResult, max_samples: int | None) -> None:
    name = full_name(op)
    tol = opinfo_tolerance(op, dtype)
    values = name not in VALUES_UNDEFINED
    tally = result.forward
    samples = iter(op.sample_inputs("cpu", dtype, requires_grad=False))
    count = 0
    while max_samples is None or count < max_samples:
        try:
            sample = next(samples)
        except StopIteration:
            break
        except Exception as error:  # noqa: BLE001 - a broken sample generator ends this dtype
            result.sample_error = _short(error)
            break
        if sample_exclusion_reason(op, sample):
            result.excluded_samples += 1
            continue
        memo: dict[int, Any] = {}
        try:
            # Copied before the CPU run: that one may mutate its inputs.
            tpu_sample = _sample_to_device(op, sample, memo)
        except Exception as error:  # noqa: BLE001
            tally.errored += 1
            tally.first_error = tally.first_error or f"copying the sample to {DEVICE}: {_short(error)}"
            count += 1
            continue
        moved = _on_device(memo) or _mentions_device(tpu_sample.kwargs) or _mentions_device(tpu_sample.args)
        try:
            expected = _call(op, sample)
        except Exception:  # noqa: BLE001 - CPU raising is not counted
            result.cpu_errors += 1
            continue
        if not moved:
            result.no_tpu_input += 1
            continue
        count += 1
        try:
            actual = _call(op, tpu_sample)
        except Exception as error:  # noqa: BLE001
            tally.errored += 1
            tally.first_error = tally.first_error or _short(error)
            continue
        try:
            compare(actual, expected, tol, values=values)
        except Exception as error:  # noqa: BLE001 - includes errors copying results back
            tally.failed += 1
            tally.first_fail = tally.first_fail or _short(error)[:500]
            continue
        tally.passed += 1


def _sample_to_device(op: OpInfo, sample: Any, memo: dict[int, Any]) -> Any:
    """A shallow copy of ``sample`` with its tensors on the tpu (fills ``memo``)."""
    rule = CPU_RESIDENT_ARGS.get(full_name(op))
    if rule is not None:
        for t in rule[0](sample):
            memo[id(t)] = t
    out = copy.copy(sample)
    out.input = to_device(sample.input, DEVICE, memo)
    out.args = to_device(sample.args, DEVICE, memo)
    out.kwargs = to_device(sample.kwargs, DEVICE, memo)
    return out


def _on_device(memo: dict[int, Any]) -> bool:
    return any(t.device.type == DEVICE for t in memo.values())


def _mentions_device(obj: Any) -> bool:
    if isinstance(obj, torch.device):
        return obj.type == DEVICE
    if isinstance(obj, str):
        return obj == DEVICE
    if isinstance(obj, dict):
        return any(_mentions_device(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return any(_mentions_device(v) for v in obj)
    return False


def _run_backward(op: OpInfo, dtype: torch.dtype, result: DtypeResult, max_samples: int | None) -> None:
    tol = opinfo_tolerance(op, dtype)
    tally = result.backward
    try:
        samples = iter(op.sample_inputs("cpu", dtype, requires_grad=True))
    except Exception:  # noqa: BLE001
        return
    index = 0
    count = 0
    while max_samples is None or count < max_samples:
        try:
            sample = next(samples)
        except StopIteration:
            break
        except Exception:  # noqa: BLE001 - already reported by the forward pass
            break
        index += 1
        if sample_exclusion_reason(op, sample):
            continue
        memo: dict[int, Any] = {}
        try:
            tpu_sample = _sample_to_device(op, sample, memo)
        except Exception as error:  # noqa: BLE001
            tally.errored += 1
            tally.first_error = tally.first_error or f"copying the sample to {DEVICE}: {_short(error)}"
            count += 1
            continue
        try:
            weights, expected = _grads(op, sample, None, seed=index)
        except Exception:  # noqa: BLE001 - not differentiable here, or CPU raised: not counted
            continue
        if not _on_device(memo) or not expected:
            continue
        count += 1
        try:
            _, actual = _grads(op, tpu_sample, weights, seed=index)
        except Exception as error:  # noqa: BLE001
            tally.errored += 1
            tally.first_error = tally.first_error or _short(error)
            continue
        try:
            _compare_grads(actual, expected, tol)
        except Exception as error:  # noqa: BLE001
            tally.failed += 1
            tally.first_fail = tally.first_fail or _short(error)
            continue
        tally.passed += 1


def run(
    op_names: Iterable[str] | None = None,
    dtypes: Sequence[torch.dtype] = DTYPES,
    backward: bool = True,
    time_budget: float | None = None,
    *,
    max_samples: int | None = None,
    progress: Callable[[str], None] | None = None,
    matmul_precision: str = "highest",
) -> Results:
    """Runs the conformance check; returns per-op, per-dtype tallies.

    ``op_names``: names as for :func:`resolve_ops` (None: all of op_db).
    ``backward``: also compare gradients, for dtypes in :data:`BACKWARD_DTYPES`.
    ``time_budget``: seconds; ops not started by then are listed in
    ``Results.not_run``. ``max_samples``: cap per op, dtype and direction.
    ``progress`` is called with each op's name before it runs.
    ``matmul_precision``: the tpu fp32 matmul precision during the run
    ("highest": exact fp32, comparable with CPU).
    """
    ops = resolve_ops(op_names)
    results = Results()
    start = time.monotonic()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.tpu.precision(matmul_precision):
            _run_ops(ops, dtypes, backward, time_budget, max_samples, progress, results, start)
    results.seconds = time.monotonic() - start
    return results


def _run_ops(
    ops: list[OpInfo],
    dtypes: Sequence[torch.dtype],
    backward: bool,
    time_budget: float | None,
    max_samples: int | None,
    progress: Callable[[str], None] | None,
    results: Results,
    start: float,
) -> None:
    for op in ops:
        name = full_name(op)
        if progress is not None:
            progress(name)
        reason = exclusion_reason(op)
        if reason is not None:
            results.excluded[name] = reason
            continue
        if time_budget is not None and time.monotonic() - start > time_budget:
            results.not_run.append(name)
            continue
        if backward and name in EXCLUDED_BACKWARD:
            results.excluded_backward[name] = EXCLUDED_BACKWARD[name]
        op_result = OpResult(name=name, category=categorize(op))
        supported = op.supported_dtypes("cpu")
        for dtype in dtypes:
            if dtype not in supported:
                continue
            dtype_result = DtypeResult()
            t0 = time.monotonic()
            try:
                _run_forward(op, dtype, dtype_result, max_samples)
                if (
                    backward
                    and op.supports_autograd
                    and dtype in BACKWARD_DTYPES
                    and name not in EXCLUDED_BACKWARD
                ):
                    _run_backward(op, dtype, dtype_result, max_samples)
            except Exception as error:  # noqa: BLE001 - never let one op stop the run
                dtype_result.sample_error = "harness: " + _short(error) + " | " + traceback.format_exc(limit=3)[-300:]
            dtype_result.seconds = round(time.monotonic() - t0, 3)
            op_result.dtypes[str(dtype).removeprefix("torch.")] = dtype_result
        results.ops[name] = op_result


def failures(result: OpResult) -> list[str]:
    """Human-readable failures of one op (for test assertions)."""
    out = []
    for dtype, r in result.dtypes.items():
        for direction, tally in (("forward", r.forward), ("backward", r.backward)):
            if tally.failed or tally.errored:
                out.append(
                    f"{result.name} {dtype} {direction}: {tally.failed} failed, {tally.errored} errored "
                    f"of {tally.total}; first: {tally.first_message}"
                )
    return out


def pct(tally: Tally) -> float:
    return 100.0 * tally.passed / tally.total if tally.total else float("nan")


__all__ = [
    "BACKWARD_DTYPES",
    "CPU_RESIDENT_ARGS",
    "CATEGORIES",
    "DTYPES",
    "EXCLUDED",
    "EXCLUDED_BACKWARD",
    "SAMPLE_RULES",
    "VALUES_UNDEFINED",
    "DtypeResult",
    "OpResult",
    "Results",
    "Tally",
    "categorize",
    "compare",
    "exclusion_reason",
    "failures",
    "full_name",
    "pct",
    "resolve_ops",
    "run",
    "sample_exclusion_reason",
    "to_device",
]
