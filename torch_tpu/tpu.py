"""The ``torch.tpu`` module: registered with ``torch._register_device_module``."""

from torch_tpu.compile_cache import compile_cache_stats as _compile_cache_stats
from torch_tpu.device import (
    TpuDeviceProperties,
    _is_in_bad_fork,
    current_device,
    device,
    device_count,
    device_of,
    get_amp_supported_dtype,
    get_device_capability,
    get_device_name,
    get_device_properties,
    init,
    is_available,
    is_bf16_supported,
    is_initialized,
    mark_step,
    set_device,
    synchronize,
)
from torch_tpu.graph_breaks import outside_compiled_graphs
from torch_tpu.memory import (
    empty_cache,
    max_memory_allocated,
    max_memory_reserved,
    mem_get_info,
    memory_allocated,
    memory_reserved,
    memory_stats,
    reset_accumulated_memory_stats,
    reset_peak_memory_stats,
)
from torch_tpu.precision import get_float32_matmul_precision, precision, set_float32_matmul_precision
from torch_tpu.random import (
    default_generator,
    get_rng_state,
    get_rng_state_all,
    initial_seed,
    manual_seed,
    manual_seed_all,
    seed,
    seed_all,
    set_rng_state,
    set_rng_state_all,
)
from torch_tpu.streams import Event, Stream, StreamContext, current_stream, default_stream, set_stream, stream, submit


@outside_compiled_graphs("torch.tpu.compile_cache_stats", "compile cache")
def compile_cache_stats() -> dict[str, dict[str, int]]:
    """Hits and misses per tier of the compile cache since the process started (or the last reset)."""
    # A wrapper, so the mark stays off compile_cache's own function: it takes a lock, which
    # Dynamo cannot enter (its generic message, traced).
    return _compile_cache_stats()


# The device initializes on import. torch.cuda's flag, which torch.utils.checkpoint reads to
# stash and restore the device's RNG state around a recomputed forward (dropout masks).
_initialized = True

__all__ = [
    "Event",
    "Stream",
    "StreamContext",
    "TpuDeviceProperties",
    "compile_cache_stats",
    "current_device",
    "current_stream",
    "default_generator",
    "default_stream",
    "device",
    "device_count",
    "device_of",
    "empty_cache",
    "get_amp_supported_dtype",
    "get_device_capability",
    "get_device_name",
    "get_device_properties",
    "get_float32_matmul_precision",
    "get_rng_state",
    "get_rng_state_all",
    "init",
    "initial_seed",
    "is_available",
    "is_bf16_supported",
    "is_initialized",
    "manual_seed",
    "manual_seed_all",
    "max_memory_allocated",
    "max_memory_reserved",
    "mem_get_info",
    "memory_allocated",
    "memory_reserved",
    "memory_stats",
    "precision",
    "reset_accumulated_memory_stats",
    "reset_peak_memory_stats",
    "seed",
    "seed_all",
    "set_device",
    "set_float32_matmul_precision",
    "set_rng_state",
    "set_rng_state_all",
    "set_stream",
    "stream",
    "submit",
    "synchronize",
    "mark_step",
]
