"""Build of the tpu device core (torch_tpu/csrc) against the installed torch.

Install with `make setup` (no build isolation, autoload off): see Makefile.
"""

import glob
import os

from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")

sources = sorted(glob.glob("torch_tpu/csrc/*.cpp"))

setup(
    ext_modules=[
        CppExtension(
            name="torch_tpu._core",
            sources=sources,
            extra_compile_args=["-O2", "-Wno-unused-parameter"],
        )
    ],
    cmdclass={"build_ext": BuildExtension.with_options(no_python_abi_suffix=True)},
)
