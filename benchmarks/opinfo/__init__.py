"""Op conformance of the tpu device against CPU PyTorch, driven by OpInfo.

PyTorch's own OpInfo database (``op_db``) describes every public op with a
generator of sample inputs. For each op and each dtype it supports on CPU
(of float32, bfloat16 and int64) this package

* runs every sample on CPU, copies the sample to tpu (tensors only, same
  values, same strides and storage offsets) and runs it there, then compares
  the outputs with ``torch.testing.assert_close``: a sample *passes*, *fails*
  (outputs differ) or *errors* (tpu raised where CPU did not). Samples on
  which CPU itself raises are not counted;
* for float32 samples of differentiable ops, compares the gradients of a
  fixed random weighting of the outputs w.r.t. every input that requires grad.

Modules: :mod:`.exclusions` (what is left out, and why), :mod:`.categories`,
:mod:`.compare` (moving samples to tpu, tolerances, comparing outputs),
:mod:`.results` (tallies) and :mod:`.runner` (:func:`run`).

Nothing runs on import. ``benchmarks/op_coverage.py`` is the command line
front end and ``tests/test_opinfo.py`` the CI subset.
"""

from __future__ import annotations

from benchmarks.opinfo.categories import CATEGORIES, categorize
from benchmarks.opinfo.compare import DEVICE, compare, to_device
from benchmarks.opinfo.exclusions import (
    CPU_RESIDENT_ARGS,
    EXCLUDED,
    EXCLUDED_BACKWARD,
    SAMPLE_RULES,
    VALUES_UNDEFINED,
    exclusion_reason,
    full_name,
    sample_exclusion_reason,
)
from benchmarks.opinfo.results import DtypeResult, OpResult, Results, Tally, failures, pct
from benchmarks.opinfo.runner import BACKWARD_DTYPES, DTYPES, resolve_ops, run

__all__ = [
    "BACKWARD_DTYPES",
    "CPU_RESIDENT_ARGS",
    "CATEGORIES",
    "DEVICE",
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
