"""Running OpInfo samples on CPU and on the tpu: forward, backward, whole runs."""

from __future__ import annotations

import copy
import re
import time
import traceback
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch.testing._internal.common_methods_invocations import op_db
from torch.testing._internal.opinfo.core import OpInfo

from benchmarks.opinfo.categories import categorize
from benchmarks.opinfo.compare import DEVICE, Mismatch, Tolerance, compare, opinfo_tolerance, to_device
from benchmarks.opinfo.exclusions import (
    CPU_RESIDENT_ARGS,
    EXCLUDED_BACKWARD,
    VALUES_UNDEFINED,
    exclusion_reason,
    full_name,
    sample_exclusion_reason,
)
from benchmarks.opinfo.results import DtypeResult, OpResult, Results, Tally

DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.int64)
BACKWARD_DTYPES: tuple[torch.dtype, ...] = (torch.float32,)


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
        # Copied before the CPU run: that one may mutate its inputs.
        tpu_sample = _copy_or_record(op, sample, memo, tally)
        if tpu_sample is None:
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
        _score(tally, lambda: _call(op, tpu_sample), lambda actual: compare(actual, expected, tol, values=values))


def _score(tally: Tally, run_on_tpu: Callable[[], Any], check: Callable[[Any], None]) -> None:
    """Runs one sample on the tpu and counts it: errored (the tpu raised), failed (the
    check raised, including errors copying results back) or passed."""
    try:
        actual = run_on_tpu()
    except Exception as error:  # noqa: BLE001
        tally.errored += 1
        tally.first_error = tally.first_error or _short(error)
        return
    try:
        check(actual)
    except Exception as error:  # noqa: BLE001
        tally.failed += 1
        tally.first_fail = tally.first_fail or _short(error)
        return
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


def _copy_or_record(op: OpInfo, sample: Any, memo: dict[int, Any], tally: Any) -> Any:
    """The sample on the device, or None with the failure counted as an error."""
    try:
        return _sample_to_device(op, sample, memo)
    except Exception as error:  # noqa: BLE001
        tally.errored += 1
        tally.first_error = tally.first_error or f"copying the sample to {DEVICE}: {_short(error)}"
        return None


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
        tpu_sample = _copy_or_record(op, sample, memo, tally)
        if tpu_sample is None:
            count += 1
            continue
        try:
            weights, expected = _grads(op, sample, None, seed=index)
        except Exception:  # noqa: BLE001 - not differentiable here, or CPU raised: not counted
            continue
        if not _on_device(memo) or not expected:
            continue
        count += 1
        _score(tally, lambda: _grads(op, tpu_sample, weights, seed=index)[1],
               lambda actual: _compare_grads(actual, expected, tol))


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
