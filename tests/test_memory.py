"""Emulated HBM accounting: exact statistics, peaks, capacity and OOM."""

import gc

import pytest
import torch

MiB = 1 << 20


@pytest.fixture(autouse=True)
def no_collection_during_counts():
    """Counts must move only with the test's own tensors: no garbage collection meanwhile."""
    gc.collect()
    gc.disable()
    yield
    gc.enable()


def test_allocation_moves_the_count_by_exactly_its_size():
    base = torch.tpu.memory_allocated()
    x = torch.empty(4 * MiB, dtype=torch.uint8, device="tpu")
    assert torch.tpu.memory_allocated() - base == 4 * MiB
    assert torch.accelerator.memory_allocated(0) - base == 4 * MiB
    assert torch.tpu.memory_reserved() >= torch.tpu.memory_allocated()
    del x
    assert torch.tpu.memory_allocated() == base


def test_fresh_op_outputs_are_counted_and_freed():
    a = torch.ones(1000, device="tpu")
    base = torch.tpu.memory_allocated()
    b = a * 2  # allocated by the CPU kernel, in tpu memory
    assert torch.tpu.memory_allocated() - base == b.nbytes
    del b
    assert torch.tpu.memory_allocated() == base


def test_peak_and_reset():
    torch.tpu.reset_peak_memory_stats()
    base = torch.tpu.memory_allocated()
    x = torch.empty(MiB, dtype=torch.uint8, device="tpu")
    y = torch.empty(2 * MiB, dtype=torch.uint8, device="tpu")
    del x, y
    assert torch.tpu.max_memory_allocated() - base == 3 * MiB
    torch.tpu.reset_peak_memory_stats()
    assert torch.tpu.max_memory_allocated() == torch.tpu.memory_allocated()


def test_memory_stats_and_mem_get_info_agree():
    x = torch.empty(MiB, dtype=torch.uint8, device="tpu")
    stats = torch.tpu.memory_stats()
    assert stats["allocated_bytes.all.current"] == torch.tpu.memory_allocated()
    free, total = torch.tpu.mem_get_info()
    assert total == torch.tpu.get_device_properties().total_memory
    assert free == total - torch.tpu.memory_reserved()
    del x


def test_devices_are_accounted_separately():
    base0, base1 = torch.tpu.memory_allocated(0), torch.tpu.memory_allocated(1)
    x = torch.empty(MiB, dtype=torch.uint8, device="tpu:1")
    assert torch.tpu.memory_allocated(1) - base1 == MiB
    assert torch.tpu.memory_allocated(0) == base0
    del x


def test_over_capacity_raises_oom_naming_the_numbers_and_recovers():
    capacity = torch.tpu.get_device_properties().total_memory
    in_use = torch.tpu.memory_allocated()
    ooms = torch.tpu.memory_stats().get("num_ooms", 0)
    with pytest.raises(torch.OutOfMemoryError) as info:
        torch.empty(capacity - in_use + 1, dtype=torch.uint8, device="tpu")
    message = str(info.value)
    assert f"tried to allocate {capacity - in_use + 1} bytes" in message
    assert f"{in_use} bytes" in message and f"{capacity} bytes" in message
    assert torch.tpu.memory_stats()["num_ooms"] == ooms + 1
    assert torch.tpu.memory_allocated() == in_use
    y = torch.ones(10, device="tpu") * 3
    assert y.sum().item() == 30


def test_oom_inside_an_op_leaves_inputs_intact():
    capacity = torch.tpu.get_device_properties().total_memory
    x = torch.ones(8, device="tpu")
    with pytest.raises(torch.OutOfMemoryError):
        x.new_empty(capacity // 4 + 1)  # float32: over capacity
    torch.testing.assert_close(x.cpu(), torch.ones(8))


def test_freed_blocks_are_cached_and_reused():
    torch.tpu.empty_cache()
    x = torch.empty(3 * MiB, dtype=torch.uint8, device="tpu")
    address = x.data_ptr()
    reserved = torch.tpu.memory_reserved()
    del x
    assert torch.tpu.memory_reserved() == reserved  # kept for reuse
    y = torch.empty(3 * MiB, dtype=torch.uint8, device="tpu")
    assert y.data_ptr() == address
    assert torch.tpu.memory_reserved() == reserved
    del y


def test_a_slightly_larger_request_reuses_a_cached_block():
    # Steps ask for slightly different sizes (a batch's touched rows): size classes let the cache serve them.
    torch.tpu.empty_cache()
    x = torch.empty(5 * MiB + 1000, dtype=torch.uint8, device="tpu")
    address = x.data_ptr()
    del x
    fresh = torch.tpu.memory_stats()["num_device_alloc"]
    y = torch.empty(5 * MiB + 90_000, dtype=torch.uint8, device="tpu")
    assert y.data_ptr() == address
    assert torch.tpu.memory_stats()["num_device_alloc"] == fresh
    del y


def test_empty_cache_releases_reserved_but_keeps_live_counts():
    x = torch.ones(100, device="tpu")
    torch.empty(2 * MiB, dtype=torch.uint8, device="tpu")  # freed at once: cached
    allocated, reserved = torch.tpu.memory_allocated(), torch.tpu.memory_reserved()
    assert reserved >= allocated + 2 * MiB
    torch.tpu.empty_cache()
    assert torch.tpu.memory_allocated() == allocated
    assert torch.tpu.memory_reserved() <= reserved - 2 * MiB
    del x


def test_a_request_that_needs_the_cache_releases_it_instead_of_failing():
    capacity = torch.tpu.get_device_properties().total_memory
    torch.tpu.empty_cache()
    in_use = torch.tpu.memory_allocated()
    big = (capacity - in_use) // 2
    torch.empty(big, dtype=torch.uint8, device="tpu")  # freed: cached
    retries = torch.tpu.memory_stats()["num_alloc_retries"]
    # Needs the cached bytes (and is too big for the cached block, rounded up as it is).
    y = torch.empty(big + big // 4, dtype=torch.uint8, device="tpu")
    assert torch.tpu.memory_stats()["num_alloc_retries"] == retries + 1
    # The cached block was released; a large block is rounded up by at most 1/16 of it.
    assert torch.tpu.memory_reserved() - torch.tpu.memory_allocated() <= (big + big // 4) // 16 + MiB
    del y
    torch.tpu.empty_cache()
