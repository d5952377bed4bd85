"""Random number generation on tpu (``torch.tpu.manual_seed`` and friends).

Each device has its own default generator, independent of the CPU's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from torch_tpu.device import _device_t, _index, device_count
from torch_tpu.graph_breaks import F, outside_compiled_graphs


def _rng(api: str) -> Callable[[F], F]:
    return outside_compiled_graphs(f"torch.tpu.{api}", "random generator")


@_rng("default_generator")
def default_generator(device: _device_t = None) -> torch.Generator:
    return torch.ops.torch_tpu._default_generator(_index(device))


@_rng("manual_seed")
def manual_seed(seed: int) -> None:
    default_generator().manual_seed(int(seed))


@_rng("manual_seed_all")
def manual_seed_all(seed: int) -> None:
    for idx in range(device_count()):
        default_generator(idx).manual_seed(int(seed))


@_rng("seed")
def seed() -> None:
    default_generator().seed()


@_rng("seed_all")
def seed_all() -> None:
    random_seed = default_generator(0).seed()
    for idx in range(1, device_count()):
        default_generator(idx).manual_seed(random_seed)


@_rng("initial_seed")
def initial_seed() -> int:
    return default_generator().initial_seed()


@_rng("get_rng_state")
def get_rng_state(device: _device_t = "tpu") -> torch.Tensor:
    return default_generator(device).get_state()


@_rng("set_rng_state")
def set_rng_state(new_state: torch.Tensor, device: _device_t = "tpu") -> None:
    default_generator(device).set_state(new_state)


@_rng("get_rng_state_all")
def get_rng_state_all() -> list[torch.Tensor]:
    return [get_rng_state(idx) for idx in range(device_count())]


@_rng("set_rng_state_all")
def set_rng_state_all(new_states: Iterable[torch.Tensor]) -> None:
    for idx, state in enumerate(new_states):
        set_rng_state(state, idx)
