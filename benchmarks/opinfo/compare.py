"""Moving samples to the tpu and comparing its outputs with CPU's."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
from torch.testing._comparison import default_tolerances
from torch.testing._internal.opinfo.core import DecorateInfo, OpInfo

DEVICE = "tpu"


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


def _tol_for(t: torch.Tensor, tol: Tolerance) -> tuple[float, float] | tuple[None, None]:
    if tol.atol is None and tol.rtol is None:
        return None, None
    rtol, atol = default_tolerances(t)  # assert_close's defaults; (0, 0) for exact dtypes
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
