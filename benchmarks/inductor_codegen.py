"""Inductor's native codegen for the tpu device (scalar C++) against CPU Inductor.

``python -m benchmarks.inductor_codegen`` times a matmul-free pointwise/reduction
function (``gelu(layer_norm(x * w + b)) * sigmoid(x)``, 4 times) in CPU eager,
compiled on CPU tensors (vectorized CPU codegen: what torch_tpu runs on zero-copy
host views of tpu tensors) and compiled on tpu tensors with the tpu device
registered with Inductor's CppScheduling, which torch 2.13 only accepts with
``cpp.simdlen=0`` (scalar kernels). The gap between the last two is why torch_tpu
compiles graphs for cpu instead of generating code for its own device;
``--tpu-vectorized`` adds tpu codegen with ``tpu_backend="cpp"`` (outside the
config's declared Literal), which gets vectorized kernels for tpu too.
"""

from __future__ import annotations

import argparse
import statistics
import time
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from unittest import mock

import torch
import torch.nn.functional as F

from benchmarks import report

LAYERS = 4
SHAPES: tuple[tuple[int, int], ...] = ((256, 1024), (4096, 256))
WORKLOAD = f"(gelu(layer_norm(x*w+b))*sigmoid(x)) x{LAYERS}"
VEC_MARKER = "at::vec::Vectorized"

# Config for native tpu codegen on torch 2.13. loop_reindexing_after_fusion:
# Scheduler._try_reindex_pointwise_for_reduction skips only `node.is_cpu()`
# nodes and assumes SIMD (numel, rnumel) groups, so it crashes on CppScheduling
# groups for any other device. cpp.simdlen=0: the CSE proxy propagates dtypes
# only when get_current_backend() is "cpp" (for tpu it is config.tpu_backend,
# "pallas"), so vectorized kernels assert in CppVecKernel.broadcast.
TPU_SCALAR_CONFIG: dict[str, Any] = {"loop_reindexing_after_fusion": False, "cpp.simdlen": 0}
TPU_VECTOR_CONFIG: dict[str, Any] = {"loop_reindexing_after_fusion": False, "tpu_backend": "cpp"}


def workload(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    for i in range(LAYERS):
        x = F.gelu(F.layer_norm(x * w[i] + b[i], x.shape[-1:])) * torch.sigmoid(x)
    return x


# ---------------------------------------------------------------- registration

_registered = False


def register_tpu_with_inductor() -> None:
    """Makes Inductor generate CPU C++ kernels (CppScheduling) for the tpu device.

    torch 2.13 ships its own "tpu" entries (Pallas scheduling, which needs jax;
    a TpuInterface; CPU op overrides). They are installed lazily and the device
    interface and op overrides unconditionally, so each built-in registration is
    forced first and then overwritten.
    """
    global _registered
    if _registered:
        return
    from torch._dynamo import device_interface
    from torch._inductor.codegen import common
    from torch._inductor.codegen.cpp import CppScheduling
    from torch._inductor.codegen.cpu_device_op_overrides import CpuDeviceOpOverrides
    from torch._inductor.codegen.wrapper import PythonWrapperCodegen, SubgraphPythonWrapperCodegen
    from torch._inductor.virtualized import V

    class TpuHostInterface(device_interface.DeviceInterface):
        device = torch.tpu.device  # type: ignore[assignment]
        Stream = torch.tpu.Stream  # type: ignore[assignment]

        class Worker:
            @staticmethod
            def set_device(device: int) -> None:
                torch.tpu.set_device(device)

            @staticmethod
            def current_device() -> int:
                return torch.tpu.current_device()

            @staticmethod
            def get_device_properties(device: torch.types.Device = None) -> Any:
                return torch.tpu.get_device_properties(device)  # has multi_processor_count

        @staticmethod
        def current_device() -> int:
            return torch.tpu.current_device()

        @staticmethod
        def set_device(device: torch.types.Device) -> None:
            torch.tpu.set_device(device)

        @staticmethod
        def device_count() -> int:
            return torch.tpu.device_count()

        @staticmethod
        def is_available() -> bool:
            return torch.tpu.is_available()

        @staticmethod
        def stream(stream: torch.Stream) -> Any:
            return torch.tpu.stream(stream)

        @staticmethod
        def current_stream() -> torch.Stream:
            return torch.tpu.current_stream()

        @staticmethod
        def set_stream(stream: torch.Stream) -> None:
            torch.tpu.set_stream(stream)

        @staticmethod
        def get_raw_stream(device_idx: int) -> int:
            return 0

        @staticmethod
        def synchronize(device: torch.types.Device = None) -> None:
            torch.tpu.synchronize(device)

        @staticmethod
        def get_compute_capability(device: torch.types.Device = None) -> Any:
            return ""

        @staticmethod
        def is_bf16_supported(including_emulation: bool = False) -> bool:
            return torch.tpu.is_bf16_supported()

        @staticmethod
        def memory_allocated(device: torch.types.Device = None) -> int:
            return torch.tpu.memory_allocated(device)

    class TpuHostOpOverrides(CpuDeviceOpOverrides):
        def set_device(self, device_idx: int) -> str:
            return f"torch.tpu.set_device({device_idx})"

        def synchronize(self) -> str:
            return "torch.tpu.synchronize()"

        def device_guard(self, device_idx: int) -> str:
            return f"torch.tpu.device({device_idx})"

    class HostKernelCalls:
        """PythonWrapperCodegen raises "device tpu nyi" for non-triton kernel
        calls on devices other than cpu/mps/cuda/xpu; call them as on cpu."""

        def _generate_kernel_call_helper(self, kernel_name: str, call_args: Any, *,
                                         device: torch.device | None = None, triton: bool = True,
                                         **kwargs: Any) -> None:
            device = device or V.graph.get_current_device_or_throw()
            if not triton and device.type == "tpu":
                self.writeline(self.wrap_kernel_call(kernel_name, call_args))  # type: ignore[attr-defined]
                return
            super()._generate_kernel_call_helper(  # type: ignore[misc]
                kernel_name, call_args, device=device, triton=triton, **kwargs)

    class TpuSubgraphWrapper(HostKernelCalls, SubgraphPythonWrapperCodegen):
        pass

    class TpuWrapper(HostKernelCalls, PythonWrapperCodegen):
        @staticmethod
        def create(is_subgraph: bool, subgraph_name: str | None, parent_wrapper: Any,
                   partition_signatures: Any = None) -> PythonWrapperCodegen:
            if is_subgraph:
                return TpuSubgraphWrapper(subgraph_name, parent_wrapper, partition_signatures)
            return TpuWrapper()

    device_interface.get_registered_device_interfaces()  # built-in table first (it sets tpu too)
    device_interface.register_interface_for_device("tpu", TpuHostInterface)
    common.init_backend_registration()  # tpu -> PallasScheduling unless already set
    common.register_backend_for_device("tpu", CppScheduling, TpuWrapper)
    common._initialize_device_op_overrides()  # would overwrite tpu with CpuDeviceOpOverrides
    common.register_device_op_overrides("tpu", TpuHostOpOverrides())
    _registered = True


# ---------------------------------------------------------------- measuring

@contextmanager
def nothing() -> Iterator[None]:
    yield


def median_ms(fn: Callable[[], Any], sync: Callable[[], None], iters: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def own_copy(fn: Callable[..., Any], suffix: str) -> Callable[..., Any]:
    """`fn` with its own code object. Dynamo keeps compiled graphs per code object
    and guards only on the inputs, so variants compiled from one function for the
    same device (scalar and vectorized tpu) would share, and run, one graph."""
    name = f"{fn.__name__}_{suffix}"
    code = fn.__code__.replace(co_name=name, co_qualname=name)
    return types.FunctionType(code, fn.__globals__, name, fn.__defaults__, fn.__closure__)


def compile_variant(key: str, device: str, config: dict[str, Any] | None, inputs: tuple[torch.Tensor, ...],
                    expected: torch.Tensor, code_path: Path | None = None) -> dict[str, Any]:
    """Compiles `workload` for `device` under `config`; checks it against eager and
    returns the timing closure plus facts about the generated code."""
    from torch._inductor.graph import GraphLowering

    args = tuple(t.to(device) for t in inputs)
    compiled = torch.compile(own_copy(workload, key), fullgraph=True, dynamic=False)
    codes: list[str] = []
    # As torch._inductor.utils.run_and_get_code, without its torch._dynamo.reset(),
    # which would drop the graphs of the variants compiled before.
    with (torch._inductor.config.patch(config) if config else nothing()), \
            mock.patch.object(GraphLowering, "save_output_code", codes.append):
        out = compiled(*args)
    torch.testing.assert_close(out.cpu(), expected, msg=lambda m: f"{key}: {m}")
    code = "\n".join(codes)
    if code_path is not None:
        code_path.parent.mkdir(parents=True, exist_ok=True)
        code_path.write_text(code)
    sync = torch.tpu.synchronize if device == "tpu" else (lambda: None)
    # The config only matters while compiling; the timed calls run outside it and
    # under the "fail_on_recompile" stance.
    return {"run": lambda: compiled(*args), "sync": sync, "vectorized": VEC_MARKER in code,
            "kernels": code.count("async_compile.cpp_pybinding("), "out_device": str(out.device)}


def measure(shape: tuple[int, int], iters: int, warmup: int, rounds: int, tpu_vectorized: bool,
            code_dir: Path | None = None) -> dict[str, Any]:
    torch.manual_seed(0)
    rows, cols = shape
    inputs = (torch.randn(rows, cols), torch.randn(LAYERS, cols), torch.randn(LAYERS, cols))
    expected = workload(*inputs)

    def code_path(key: str) -> Path | None:
        return code_dir / f"{key}_{rows}x{cols}.py" if code_dir is not None else None

    # CPU codegen first, with the default config; the tpu variants patch theirs.
    torch._dynamo.reset()
    specs: dict[str, tuple[str, dict[str, Any] | None]] = {
        "cpu_codegen": ("cpu", None), "tpu_scalar_codegen": ("tpu", TPU_SCALAR_CONFIG)}
    if tpu_vectorized:
        specs["tpu_vec_codegen"] = ("tpu", TPU_VECTOR_CONFIG)
    variants: dict[str, dict[str, Any] | None] = {"eager": None}
    for key, (device, config) in specs.items():
        variants[key] = compile_variant(key, device, config, inputs, expected, code_path(key))
    times: dict[str, list[float]] = {k: [] for k in variants}
    with torch.compiler.set_stance("fail_on_recompile"):
        for _ in range(rounds):  # interleaved, so drifts of the machine hit all variants alike
            for key, v in variants.items():
                if v is None:
                    times[key].append(median_ms(lambda: workload(*inputs), lambda: None, iters, warmup))
                else:
                    times[key].append(median_ms(v["run"], v["sync"], iters, warmup))
    ms = {k: min(t) for k, t in times.items()}
    row: dict[str, Any] = {
        "workload": WORKLOAD, "shape": f"{rows}x{cols}",
        "eager_ms": ms["eager"], "cpu_codegen_ms": ms["cpu_codegen"],
        "tpu_scalar_codegen_ms": ms["tpu_scalar_codegen"],
        "scalar/cpu_codegen": ms["tpu_scalar_codegen"] / ms["cpu_codegen"],
    }
    if tpu_vectorized:
        row["tpu_vec_codegen_ms"] = ms["tpu_vec_codegen"]
        row["tpu_vec/cpu_codegen"] = ms["tpu_vec_codegen"] / ms["cpu_codegen"]
    for key, v in variants.items():
        if v is not None:
            row[f"{key}_vectorized"] = v["vectorized"]
            row[f"{key}_kernels"] = v["kernels"]
            row[f"{key}_out_device"] = v["out_device"]
    return row


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iters", type=int, default=50, help="timed calls per round (median)")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (min of medians)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tpu-vectorized", action="store_true",
                        help='also time tpu codegen with tpu_backend="cpp" (vectorized)')
    parser.add_argument("--code-dir", type=Path, default=None,
                        help="write each variant's generated Inductor module here")
    parser.add_argument("--out", type=Path, default=report.DEFAULT_DIR)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    register_tpu_with_inductor()
    rows = [measure(s, args.iters, args.warmup, args.rounds, args.tpu_vectorized, args.code_dir) for s in SHAPES]

    columns = ["workload", "shape", "eager_ms", "cpu_codegen_ms", "tpu_scalar_codegen_ms", "scalar/cpu_codegen"]
    if args.tpu_vectorized:
        columns += ["tpu_vec_codegen_ms", "tpu_vec/cpu_codegen"]
    table = report.markdown_table(rows, columns)
    code_columns = ["shape"] + [f"{k}_{f}" for k in ("cpu_codegen", "tpu_scalar_codegen", "tpu_vec_codegen")
                                for f in ("kernels", "vectorized") if f"{k}_{f}" in rows[0]]
    notes = (f"ms/call: min over {args.rounds} interleaved rounds of the median of {args.iters} calls "
             f"({args.warmup} warm-up), {torch.get_num_threads()} threads, fp32. Generated code "
             f"(`vectorized` = contains `{VEC_MARKER}`):")
    print(table)
    print()
    print(report.markdown_table(rows, code_columns))
    report.write("inductor_codegen",
                 {"workload": WORKLOAD, "iters": args.iters, "warmup": args.warmup, "rounds": args.rounds,
                  "tpu_scalar_config": TPU_SCALAR_CONFIG,
                  "tpu_vector_config": TPU_VECTOR_CONFIG if args.tpu_vectorized else None,
                  "rows": rows},
                 f"{table}\n\n{notes}\n\n{report.markdown_table(rows, code_columns)}", args.out)
    return rows


if __name__ == "__main__":
    main()
