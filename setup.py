"""Build of the tpu device core (torch_tpu/csrc) against the installed torch.

Install with `make setup` (no build isolation, autoload off): see Makefile.
"""

import glob
import os

from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")

COMPILE_ARGS = ["-O3", "-Wno-unused-parameter"]
# `make setup` installs the package (metadata, entry points) with this set, then builds the
# extensions once, in place and incrementally (`build_ext --inplace`): pip's editable build
# would compile them all again in a temporary directory of its own (3 minutes on 2 cores).
METADATA_ONLY = os.environ.get("TORCH_TPU_SKIP_EXTENSIONS") == "1"

setup(
    ext_modules=[] if METADATA_ONLY else [
        # The tpu device core.
        CppExtension(
            name="torch_tpu._core",
            sources=sorted(glob.glob("torch_tpu/csrc/*.cpp")),
            # at::parallel_for is inline: without OpenMP here it runs serially. No
            # -march=native: the bf16 kernel picks its instructions at run time.
            extra_compile_args=COMPILE_ARGS + ["-fopenmp"],
            extra_link_args=["-fopenmp"],
        ),
        # The SparseCore engine's host preprocessing and kernels.
        CppExtension(
            name="sparsecore._kernels",
            sources=sorted(glob.glob("sparsecore/csrc/*.cpp")),
            # OpenMP for the main thread's loops only; elsewhere the kernels run
            # them on threads of their own (csrc/ThreadPool.h says why).
            # -fno-math-errno: sqrt is then one vector instruction, not a call
            # guarded per element (optimizer state is never negative).
            extra_compile_args=COMPILE_ARGS + ["-march=native", "-fno-math-errno", "-fopenmp"],
            extra_link_args=["-fopenmp"],
        ),
    ],
    cmdclass={"build_ext": BuildExtension.with_options(no_python_abi_suffix=True)},
)
