"""Host preprocessing of a KJT inside a ``torch.compile`` graph.

A module called with a raw KeyedJaggedTensor in a traced step preprocesses it
with one opaque op, ``sparsecore::preprocess_kjt``, instead of tracing the
preprocessing's Python (whose id checks and limit counts read
tensor values: a graph break at each, and an error under ``fullgraph=True``).
The op runs the eager preprocessing unchanged - every check and error, the
module's observed limits and dropped ids - and returns each stack's COO
buffers padded to a width fixed by the stack's limits, as a TPU's infeed
buffers are: the graph's shapes never depend on the ids, so the step compiles
once whatever the batches hold. The kernels walk the row pointers' groups and
never visit the padding. A sequence module's output has a row per id: its
sizes are the KJT's id counts per feature (``length_per_key``), which Dynamo
makes symbolic once they vary, as it does for TorchRec's EmbeddingCollection.

The op takes the module as a string key (``register``), since an op's schema
holds no Python objects.
"""

from __future__ import annotations

import itertools
import weakref
from typing import TYPE_CHECKING, Optional

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from sparsecore.preprocess import PreprocessedBatch, StackBatch, align_up, bucket_width, padded_to, suggested_width
from sparsecore.stacking import StackSpec

if TYPE_CHECKING:
    from sparsecore.collection import SparseCoreCollection

_MODULES: weakref.WeakValueDictionary[str, "SparseCoreCollection"] = weakref.WeakValueDictionary()
_SERIALS = itertools.count()
KEY_SEPARATOR = "\x1f"  # ASCII's unit separator, which no feature name holds


def register(module: "SparseCoreCollection") -> str:
    """A key naming ``module`` to the op, fresh for every module (copies included)."""
    key = f"{type(module).__name__}#{next(_SERIALS)}"
    _MODULES[key] = module
    return key


def registered(key: str) -> "SparseCoreCollection":
    """The module ``register`` gave ``key``."""
    module = _MODULES.get(key)
    if module is None:
        raise RuntimeError(f"sparsecore::preprocess_kjt: module {key!r} no longer exists")
    return module


def static_width(stack: StackSpec) -> int:
    """The entries per receiver that any batch within the stack's limits fits in: every
    owner group holds at most max_ids_per_partition entries and starts aligned, and the
    buffers are at least the suggested size."""
    width = bucket_width(stack.num_sparsecores * align_up(stack.max_ids_per_partition))
    return max(width, suggested_width(stack) or 0)


def _buffers(batch: StackBatch, stack: StackSpec) -> list[torch.Tensor]:
    """The stack's buffers of ``batch``, ``static_width`` wide."""
    width = static_width(stack)
    if batch.embedding_ids.shape[1] > width:
        raise RuntimeError(f"stack {stack.name!r}: {batch.embedding_ids.shape[1]} entries per receiver passed "
                           f"the {width} its limits allow")
    batch = padded_to(batch, width)
    return [batch.row_pointers, batch.embedding_ids, batch.sample_ids, batch.gains]


@torch.library.custom_op("sparsecore::preprocess_kjt", mutates_args=())
def preprocess_kjt(values: torch.Tensor, lengths: torch.Tensor, weights: Optional[torch.Tensor], keys: str,
                   stride: int, module: str, device: torch.device) -> list[torch.Tensor]:
    """``module``'s preprocessing of the KJT (``keys`` joined by KEY_SEPARATOR: a schema
    holds no list of strings; values, lengths, weights, stride): per
    stack in order, row pointers, embedding ids, sample ids and gains, the last
    three ``static_width`` wide, on ``device`` (the module's)."""
    owner = registered(module)
    kjt = KeyedJaggedTensor(keys=keys.split(KEY_SEPARATOR), values=values, lengths=lengths, weights=weights, stride=stride)
    batch = owner.preprocess(kjt)
    return [t for stack in owner.stacks for t in _buffers(batch.stacks[stack.name], stack)]


@preprocess_kjt.register_fake
def _preprocess_kjt_fake(values, lengths, weights, keys, stride, module, device):
    out = []
    for stack in registered(module).stacks:
        n, width = stack.num_sparsecores, static_width(stack)
        out.append(torch.empty((n, n), dtype=torch.int32, device=device))
        out += [torch.empty((n, width), dtype=dtype, device=device)
                for dtype in (torch.int32, torch.int32, torch.float32)]
    return out


def traced_batch(module: "SparseCoreCollection", kjt: KeyedJaggedTensor, key: str,
                 device: torch.device) -> PreprocessedBatch:
    """The PreprocessedBatch of ``kjt`` for ``module``, through the op: what a traced forward
    looks up. Its stacks carry no statistics (``stats`` None): the op observes them into the
    module when it runs. A sequence module's tables keep every id (no ``max_seq_len``: the
    ids kept would be counted from the lengths' values)."""
    weights = kjt.weights_or_none() if module.is_weighted() else None
    buffers = preprocess_kjt(kjt.values(), kjt.lengths(), None if weights is None else weights.detach(),
                             KEY_SEPARATOR.join(kjt.keys()), kjt.stride(), key, device)
    sequence = [f for s in module.stacks if not s.is_pooled for f in s.feature_names]
    counts, lengths = _sequence_lengths(kjt, sequence)
    stacks = {}
    for i, stack in enumerate(module.stacks):
        row_pointers, embedding_ids, sample_ids, gains = buffers[4 * i:4 * i + 4]
        if stack.is_pooled:
            num_bags, batch_size = len(stack.feature_names) * kjt.stride(), kjt.stride()
        else:
            num_bags = batch_size = sum(counts[f] for f in stack.feature_names)
        stacks[stack.name] = StackBatch(row_pointers=row_pointers, embedding_ids=embedding_ids, sample_ids=sample_ids,
                                        gains=gains, num_bags=num_bags, batch_size=batch_size, stats=None)
    return PreprocessedBatch(batch_size=kjt.stride(), stacks=stacks, lengths=lengths, id_counts=counts)


def _sequence_lengths(kjt: KeyedJaggedTensor, features: list[str]) -> tuple[dict[str, int], dict[str, torch.Tensor]]:
    """Per sequence feature, its id count and its lengths. A sequence stack's output has a row
    per id: its size is the features' id counts, the KJT's ``length_per_key``, which Dynamo
    makes symbolic sizes of the graph as TorchRec's EmbeddingCollection's. A feature the KJT
    lacks is traced as an empty one: the op refuses it when it runs, with eager's InputError
    (a KeyError here would stop the trace with Dynamo's "Observed exception" instead)."""
    if not features:
        return {}, {}
    keys = kjt.keys()
    counts = dict(zip(keys, kjt.length_per_key()))
    lengths = dict(zip(keys, kjt.lengths().view(len(keys), kjt.stride())))
    empty = kjt.lengths().new_zeros(kjt.stride())
    return {f: counts.get(f, 0) for f in features}, {f: lengths.get(f, empty) for f in features}
