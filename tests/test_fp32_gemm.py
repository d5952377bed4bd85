"""Highest precision's fp32 GEMM engine: oneDNN or ATen's BLAS, exact fp32 either way."""

import os
import subprocess
import sys

import pytest
import torch


def exact(fn, *tensors):
    return fn(*(t.double() for t in tensors))


def on_tpu(fn, *tensors):
    with torch.tpu.precision("highest"):
        return fn(*(t.to("tpu") for t in tensors)).cpu()


def operand(rows, cols, transposed, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(cols, rows, generator=g).t() if transposed else torch.randn(rows, cols, generator=g)


# Shapes above and below the size where oneDNN takes over (AMD hosts), with
# each operand row-major or transposed (a Linear's forward reads its weight
# transposed, its weight gradient the activations).
@pytest.mark.parametrize("m, k, n", [(256, 256, 256), (300, 96, 520), (24, 40, 8)])
@pytest.mark.parametrize("layout", ["nn", "nt", "tn"])
def test_mm_and_addmm_are_fp32_exact(m, k, n, layout):
    a, b = operand(m, k, layout[0] == "t", 0), operand(k, n, layout[1] == "t", 1)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(2))
    # fp32 products and sums: errors of a few ulps of the partial sums, where
    # one bf16 rounding of the operands would cost ~1e-2.
    tol = dict(rtol=1e-5, atol=2e-5 * k**0.5)
    torch.testing.assert_close(on_tpu(torch.mm, a, b), exact(torch.mm, a, b).float(), **tol)
    torch.testing.assert_close(on_tpu(torch.addmm, bias, a, b), exact(torch.addmm, bias, a, b).float(), **tol)
    scaled = lambda c, x, y: torch.addmm(c, x, y, beta=0.5, alpha=2.0)
    full_bias = torch.randn(m, n)
    torch.testing.assert_close(on_tpu(scaled, full_bias, a, b), exact(scaled, full_bias, a, b).float(), **tol)


# The product and its bias are added apart on oneDNN: every bias ATen broadcasts,
# on tpu tensors and through the MXU op that compiled graphs call on host tensors.
@pytest.mark.parametrize("bias_shape", [(), (1, 320), (256, 1), (1, 1)])
def test_addmm_broadcasts_every_bias_shape(bias_shape):
    a, b = operand(256, 192, False, 0), operand(192, 320, True, 1)
    bias = torch.randn(bias_shape, generator=torch.Generator().manual_seed(2))
    scaled = lambda c, x, y: torch.addmm(c, x, y, beta=-1.5, alpha=0.5)
    want = exact(scaled, bias, a, b).float()
    tol = dict(rtol=1e-5, atol=2e-5 * 192**0.5)
    torch.testing.assert_close(on_tpu(scaled, bias, a, b), want, **tol)
    with torch.tpu.precision("highest"):
        compiled_op = torch.ops.torch_tpu.mxu_addmm(bias, a, b, beta=-1.5, alpha=0.5)
    torch.testing.assert_close(compiled_op, want, **tol)


def test_beta_zero_ignores_the_bias_and_the_bias_is_left_alone():
    a, b = operand(256, 256, False, 0), operand(256, 256, True, 1)
    nan_bias = torch.full((256, 256), float("nan"))
    got = on_tpu(lambda c, x, y: torch.addmm(c, x, y, beta=0.0), nan_bias, a, b)
    torch.testing.assert_close(got, exact(torch.mm, a, b).float(), rtol=1e-5, atol=4e-4)
    bias = torch.randn(256, 256)
    bias_tpu = bias.to("tpu")
    with torch.tpu.precision("highest"):
        torch.addmm(bias_tpu, a.to("tpu"), b.to("tpu"))
    assert torch.equal(bias_tpu.cpu(), bias)


def bf16_mode_for_onednn():
    torch.backends.mkldnn.matmul.fp32_precision = "bf16"


def medium_cpu_matmuls():
    torch.set_float32_matmul_precision("medium")  # sets oneDNN's fp32 matmul mode to bf16 too


@pytest.mark.parametrize("cpu_setting", [bf16_mode_for_onednn, medium_cpu_matmuls])
def test_highest_stays_fp32_under_a_cpu_setting_that_lets_onednn_round(cpu_setting):
    # The CPU settings let oneDNN (and ATen's fp32 matmuls, which go to oneDNN
    # then) multiply in bf16 where it has bf16 math: on AMX CPUs; elsewhere
    # oneDNN stays fp32 and only the settings' restoration is at stake. The
    # tpu's highest precision must not follow them, on either GEMM engine
    # (a large mm goes to oneDNN off Intel, a small one to ATen), and must
    # leave them as they were.
    a, b = operand(512, 256, False, 0), operand(256, 384, True, 1)
    small_a, small_b = operand(24, 40, False, 2), operand(40, 8, False, 3)
    a3, b3 = torch.randn(4, 64, 96), torch.randn(4, 96, 80)
    vec = torch.randn(256)
    before = torch.backends.mkldnn.matmul.fp32_precision, torch.get_float32_matmul_precision()
    try:
        cpu_setting()
        setting = torch.backends.mkldnn.matmul.fp32_precision
        got = on_tpu(torch.mm, a, b)
        got_small = on_tpu(torch.mm, small_a, small_b)
        got_bmm = on_tpu(torch.bmm, a3, b3)
        got_mv = on_tpu(torch.mv, a, vec)
        assert torch.backends.mkldnn.matmul.fp32_precision == setting == "bf16"
    finally:
        torch.set_float32_matmul_precision(before[1])
        torch.backends.mkldnn.matmul.fp32_precision = before[0]
    torch.testing.assert_close(got, exact(torch.mm, a, b).float(), rtol=1e-5, atol=4e-4)
    torch.testing.assert_close(got_small, exact(torch.mm, small_a, small_b).float(), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(got_bmm, exact(torch.bmm, a3, b3).float(), rtol=1e-5, atol=2e-4)
    torch.testing.assert_close(got_mv, exact(torch.mv, a, vec).float(), rtol=1e-5, atol=2e-4)


ENGINE_CHECK = """
import torch, torch_tpu
g = torch.Generator().manual_seed(0)
a, b, bias = torch.randn(256, 320, generator=g), torch.randn(384, 320, generator=g).t(), torch.randn(384, generator=g)
with torch.tpu.precision("highest"):
    got = torch.mm(a.to("tpu"), b.to("tpu")).cpu()
    got_addmm = torch.addmm(bias.to("tpu"), a.to("tpu"), b.to("tpu")).cpu()
ref = (a.double() @ b.double()).float()
torch.testing.assert_close(got, ref, rtol=1e-5, atol=4e-4)
torch.testing.assert_close(got_addmm, (bias.double() + a.double() @ b.double()).float(), rtol=1e-5, atol=4e-4)
print("same-as-cpu" if torch.equal(got, a @ b) else "other-order")
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("engine", ["blas", "onednn"])
def test_each_engine_can_be_forced(engine):
    # oneDNN's verbose mode prints a line per primitive it runs: the mm and the
    # addmm are its matmuls on "onednn", none on "blas", whose results are
    # then CPU torch.mm's bits (the same BLAS call).
    env = {**os.environ, "TORCH_TPU_FP32_GEMM": engine, "ONEDNN_VERBOSE": "1"}
    done = subprocess.run([sys.executable, "-c", ENGINE_CHECK], env=env, capture_output=True, text=True, timeout=100)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    onednn_matmuls = sum("exec,cpu,matmul" in line for line in lines)
    if engine == "onednn":
        assert onednn_matmuls == 2
    else:
        assert onednn_matmuls == 0
        assert lines[-1] == "same-as-cpu"


@pytest.mark.timeout(120)
def test_an_unknown_engine_is_refused():
    env = {**os.environ, "TORCH_TPU_FP32_GEMM": "mkl"}
    done = subprocess.run([sys.executable, "-c", ENGINE_CHECK], env=env, capture_output=True, text=True, timeout=100)
    assert done.returncode != 0
    assert "TORCH_TPU_FP32_GEMM must be 'onednn' or 'blas', got 'mkl'" in done.stderr


def test_a_bias_of_the_wrong_size_raises_as_on_cpu():
    a, b, bias = torch.randn(256, 256), torch.randn(256, 256), torch.randn(255)
    with pytest.raises(RuntimeError) as on_cpu:
        torch.addmm(bias, a, b)
    with pytest.raises(RuntimeError) as on_tpu_device:
        with torch.tpu.precision("highest"):
            torch.addmm(bias.to("tpu"), a.to("tpu"), b.to("tpu"))
    assert str(on_tpu_device.value) == str(on_cpu.value)


@pytest.mark.parametrize("use_gelu", [True, False])
def test_addmm_activation_is_cpus_exact_gelu_or_relu(use_gelu):
    """torch._addmm_activation (the linear + activation some paths fuse): ATen's CPU kernel
    applies the exact GELU (erf), not the tanh approximation CUDA uses (1.5e-4 apart at 1)."""
    g = torch.Generator().manual_seed(0)
    bias, a, b = torch.randn(24, generator=g), torch.randn(16, 32, generator=g), torch.randn(32, 24, generator=g)
    want = torch._addmm_activation(bias, a, b, use_gelu=use_gelu)
    with torch.tpu.precision("highest"):
        got = torch._addmm_activation(bias.to("tpu"), a.to("tpu"), b.to("tpu"), use_gelu=use_gelu).cpu()
    torch.testing.assert_close(got, want)
