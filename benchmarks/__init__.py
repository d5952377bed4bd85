"""Benchmarks run from the checkout: ``python -m benchmarks.<name>``.

Importing the package (which ``-m`` does before the module imports torch) sets
libgomp's spinning for the process, unless the environment already does. The
SparseCore executor's kernels start OpenMP parallel regions from a thread of
their own, which gives libgomp a second thread pool; managing more threads than
CPUs, libgomp then spins only 100 times before its workers sleep, so every small
parallel op after that waits for them to wake - the anchors measured in the same
process too (a 256x256 add 8x slower). ``OMP_WAIT_POLICY=ACTIVE`` with the
default ``GOMP_SPINCOUNT`` keeps the usual spinning and raises that to 1000.
"""

import os

os.environ.setdefault("OMP_WAIT_POLICY", "ACTIVE")
os.environ.setdefault("GOMP_SPINCOUNT", "300000")
