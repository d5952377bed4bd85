"""Device registration, topology from the environment, device management."""

import os
import subprocess
import sys

import pytest
import torch

from torch_tpu import chips


def run_python(code: str, **env: str) -> subprocess.CompletedProcess:
    full_env = {**os.environ, **env}
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=full_env, timeout=120
    )


def test_import_torch_alone_sees_the_device_and_prints_nothing():
    result = run_python("import torch; x = torch.ones(2, device='tpu'); assert x.device.type == 'tpu'")
    assert result.returncode == 0, result.stderr
    assert result.stdout == ""
    assert result.stderr == ""


def test_importing_torch_tpu_first_prints_nothing():
    result = run_python("import torch_tpu, torch; assert torch.tpu.is_available()")
    assert result.returncode == 0, result.stderr
    assert (result.stdout, result.stderr) == ("", "")


def test_autoload_can_be_turned_off():
    result = run_python("import torch; print(hasattr(torch, 'tpu'))", TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


def test_bad_environment_fails_soft_with_a_warning():
    result = run_python("import torch; print(torch.ones(1).sum().item())", TORCH_TPU_CHIP="v99")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "1.0"
    assert "TORCH_TPU_CHIP must be one of" in result.stderr


def test_device_count_and_chip_come_from_the_environment():
    code = (
        "import torch; p = torch.tpu.get_device_properties(2);"
        "print(torch.tpu.device_count(), p.chip, p.sparsecores_per_chip, p.total_memory)"
    )
    result = run_python(code, TORCH_TPU_NUM_DEVICES="3", TORCH_TPU_CHIP="v6e", TORCH_TPU_HBM_BYTES="123456789")
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["3", "v6e", "2", "123456789"]


@pytest.mark.parametrize("name", sorted(chips.CHIPS))
def test_default_capacity_is_the_chip_capped_by_the_host(name):
    topo = chips.topology_from_env({"TORCH_TPU_CHIP": name, "TORCH_TPU_NUM_DEVICES": "2"})
    host_cap = int(chips.host_memory_bytes() * chips.HOST_SHARE) // 2
    assert topo.hbm_bytes == min(chips.CHIPS[name].hbm_bytes, host_cap)
    assert topo.hbm_capped == (host_cap < chips.CHIPS[name].hbm_bytes)


@pytest.mark.parametrize(
    "env, message",
    [
        ({"TORCH_TPU_CHIP": "v3"}, "TORCH_TPU_CHIP must be one of"),
        ({"TORCH_TPU_NUM_DEVICES": "0"}, "TORCH_TPU_NUM_DEVICES must be a positive integer"),
        ({"TORCH_TPU_NUM_DEVICES": "two"}, "TORCH_TPU_NUM_DEVICES must be a positive integer"),
        ({"TORCH_TPU_HBM_BYTES": "-5"}, "TORCH_TPU_HBM_BYTES must be a positive integer"),
    ],
)
def test_invalid_environment_is_named(env, message):
    with pytest.raises(ValueError, match=message):
        chips.topology_from_env(env)


def test_module_basics():
    assert torch.tpu.is_available()
    assert torch.tpu.device_count() == 2
    assert torch.tpu.is_bf16_supported()
    assert torch.tpu.get_device_name() == f"TPU {chips.DEFAULT_CHIP} (emulated)"
    props = torch.tpu.get_device_properties("tpu:1")
    assert props.chip == chips.DEFAULT_CHIP and props.emulated
    assert torch.accelerator.current_accelerator().type == "tpu"


def test_set_device_and_device_context():
    assert torch.tpu.current_device() == 0
    with torch.tpu.device(1):
        assert torch.tpu.current_device() == 1
        x = torch.empty(3, device="tpu")
        assert x.device == torch.device("tpu:1")
    assert torch.tpu.current_device() == 0
    torch.tpu.set_device("tpu:1")
    try:
        assert torch.ones(1, device="tpu").device.index == 1
    finally:
        torch.tpu.set_device(0)


def test_invalid_device_index_names_the_range():
    with pytest.raises(RuntimeError, match=r"Invalid tpu device index 5: valid indices are 0\.\.1"):
        torch.empty(1, device="tpu:5")
    for query in (torch.tpu.get_device_name, torch.tpu.get_device_properties):
        with pytest.raises(ValueError, match=r"Invalid tpu device index 5: valid indices are 0\.\.1"):
            query(5)


def test_cross_device_copies_and_device_guard():
    x = torch.arange(6.0, device="tpu:0")
    y = x.to("tpu:1")
    assert y.device == torch.device("tpu:1")
    torch.testing.assert_close(y.cpu(), torch.arange(6.0))
    z = (y * 2).to("tpu:0")
    assert z.device.index == 0
    torch.testing.assert_close(z.cpu(), torch.arange(6.0) * 2)
    # Results follow the inputs' device, whatever the current device is.
    assert (y + 1).device.index == 1
    before = torch.tpu.memory_allocated(1)
    w = torch.ones(1024, device="tpu:1") + y.sum()
    assert torch.tpu.memory_allocated(1) - before == w.nbytes
    assert w.device.index == 1
