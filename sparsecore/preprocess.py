"""Host preprocessing: a KeyedJaggedTensor becomes per-SparseCore COO buffers.

For each stack (sparsecore.stacking) the ids of its features are mapped to
(owning SparseCore, local row), merged within a bag (duplicates sum their
gains), and laid out per *receiving* SparseCore — the one that gets the
bag's batch slice — as CSR-wrapped COO: for receiver ``s`` the entries
owned by SparseCore ``o`` sit in ``[start(s, o), row_pointers[s, o])``, in
bag order (the lookup sums a bag in registers and writes it once; the
backward sorts by row itself), with every group starting at a multiple of 8. A partition is a (receiver, owner)
pair; the SparseCore limits count entries and distinct rows per partition.

Bags are numbered feature-major: for pooled stacks bag ``f * B + b`` is
feature ``f`` (in stack order) of sample ``b`` (walking a stack table by table
keeps each table's rows hot in cache); the lookup writes bag ``f * B + b`` to
output row ``b * F + f``, so a pooled stack's output is its ``(B, F x dim)``
block as it is. For sequence stacks every kept id is its own bag and output
row, numbered in order. Gains fold in the weights and the
combiner: sum ``w``, mean ``w / n``, sqrtn ``w / sqrt(sum w^2)``.

Example, one table of 8 rows on 2 SparseCores, batch 2, feature ``f``
with bags ``[3, 3, 4]`` and ``[5]``::

    ids 3,3 -> SparseCore 1 row 1, merged: one entry, gain 2
    id 4    -> SparseCore 0 row 2;  id 5 -> SparseCore 1 row 2
    receiver 0 (sample 0): owner 0: (row 2, bag 0, gain 1); owner 1, from offset 8: (row 1, bag 0, gain 2)
    receiver 1 (sample 1): owner 1: (row 2, bag 1, gain 1)
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from sparsecore import _library  # noqa: F401  (registers torch.ops.sparsecore)
from sparsecore.errors import InputError, PartitionLimitError
from sparsecore.stacking import StackSpec

ALIGNMENT = 8
"""Every owner group of a receiver's buffer starts at a multiple of this."""

WIDTHS_PER_OCTAVE = 8
"""Buffer widths are rounded up to one of this many steps per power of two (see bucket_width;
csrc/Layout.h has the same rule for the pooled stacks' C++ pass)."""


def align_up(x):
    """``x`` (an int or an integer tensor, >= 0) rounded up to a multiple of ALIGNMENT."""
    return -(-x // ALIGNMENT) * ALIGNMENT


@dataclasses.dataclass(frozen=True, kw_only=True)
class PartitionStats:
    """What a batch needed of one stack's limits, for tuning them."""

    max_ids_per_partition: int
    """Most entries (after in-bag dedup) any partition carried, e.g. ``37``."""
    max_unique_ids_per_partition: int
    """Most distinct rows any partition carried, e.g. ``30``."""
    dropped_ids: int = 0
    """Entries dropped because of the limits (only with allow_id_dropping)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class StackBatch:
    """The COO buffers of one stack for one batch (all int32 but gains)."""

    row_pointers: torch.Tensor
    """(receivers, owners): end offset of each owner group in the receiver's buffer."""
    embedding_ids: torch.Tensor
    """(receivers, L): local row on the owning SparseCore; 0 in padding."""
    sample_ids: torch.Tensor
    """(receivers, L): output row (bag) of the entry; -1 in padding."""
    gains: torch.Tensor
    """(receivers, L) float32: weight times combiner scale; 0 in padding."""
    num_bags: int
    """Output rows of the stack for this batch."""
    batch_size: int
    """Bag ``f * batch_size + b`` goes to output row ``b * F + f`` (F = num_bags / batch_size):
    the batch size for pooled stacks, ``num_bags`` for sequence stacks (rows in bag order)."""
    stats: PartitionStats | None
    """None in a batch preprocessed inside a compiled graph (sparsecore.traced_preprocess)."""

    def group_start(self, receiver: int, owner: int) -> int:
        if owner == 0:
            return 0
        end = int(self.row_pointers[receiver, owner - 1])
        return align_up(end)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PreprocessedBatch:
    """A batch ready for the SparseCore kernels: what ``sparsecore.preprocess`` returns."""

    batch_size: int
    """Samples in the batch, e.g. ``8192``."""
    stacks: dict[str, StackBatch]
    """Per stack name: its COO buffers."""
    lengths: dict[str, torch.Tensor]
    """Per sequence feature: ids kept per sample (after max_seq_len)."""
    id_counts: dict[str, int] = dataclasses.field(default_factory=dict)
    """Per sequence feature, its ids kept (its lengths' sum), where known without reading the
    lengths: in a batch preprocessed inside a compiled graph (sparsecore.traced_preprocess),
    where they are the KJT's ``length_per_key``. Empty otherwise."""

    def id_count(self, feature: str) -> int:
        """The ids kept of a sequence feature: its output's rows."""
        count = self.id_counts.get(feature)
        return int(self.lengths[feature].sum()) if count is None else count

    @property
    def stats(self) -> dict[str, PartitionStats]:
        return {name: s.stats for name, s in self.stacks.items()}


# Pytree nodes, so that torch.export (torch_tpu.export_stablehlo) takes a batch as an input.
for _batch_class in (PartitionStats, StackBatch, PreprocessedBatch):
    torch.export.register_dataclass(_batch_class, serialized_type_name=f"sparsecore.{_batch_class.__name__}")


def _feature_tables(stacks: Sequence[StackSpec]) -> dict[str, tuple[StackSpec, str]]:
    out = {}
    for stack in stacks:
        for table in stack.tables:
            for feature in table.feature_names:
                out[feature] = (stack, table.name)
    return out


def _check_ids(feature: str, table: str, ids: torch.Tensor, num_embeddings: int) -> None:
    if ids.numel() == 0:
        return
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or high >= num_embeddings:
        bad = low if low < 0 else high
        raise InputError(
            f"feature {feature!r} (table {table!r}): id {bad} is out of range; expected 0 <= id < {num_embeddings}"
        )


def _truncate(values: torch.Tensor, lengths: torch.Tensor, max_len: int):
    """Keeps the first max_len ids of every sample (sequence features)."""
    starts = torch.cumsum(lengths, 0) - lengths
    position = torch.arange(values.numel()) - torch.repeat_interleave(starts, lengths)
    return values[position < max_len], lengths.clamp(max=max_len)


def _sequence_entries(stack: StackSpec, kjt: "KjtView", lengths_out: dict):
    """Per-id (owner, local row, bag, receiver, gain) over all features of a sequence stack."""
    n, batch_size = stack.num_sparsecores, kjt.batch_size
    slice_size = max(-(-batch_size // n), 1)  # samples each SparseCore receives
    owners, rows, bags, receivers = [], [], [], []
    num_bags = 0
    for table in stack.tables:
        for feature in table.feature_names:
            values, lengths = kjt.feature(feature)
            if table.max_seq_len is not None:
                values, lengths = _truncate(values, lengths, table.max_seq_len)
            lengths_out[feature] = lengths
            _check_ids(feature, table.name, values, table.num_embeddings)
            owner, row = stack.locate(table.name, values)
            owners.append(owner)
            rows.append(row)
            bags.append(num_bags + torch.arange(values.numel()))
            num_bags += values.numel()
            receivers.append(torch.repeat_interleave(torch.arange(batch_size), lengths) // slice_size)
    cat = lambda xs: torch.cat(xs) if xs else torch.zeros(0, dtype=torch.int64)  # noqa: E731
    owner, row, bag, receiver = cat(owners), cat(rows), cat(bags), cat(receivers)
    return owner, row, bag, receiver, torch.ones(bag.numel()), num_bags


def _rank_within(groups: torch.Tensor) -> torch.Tensor:
    """0, 1, 2, ... within each run of equal values of a sorted tensor."""
    if groups.numel() == 0:
        return groups
    index = torch.arange(groups.numel())
    first = torch.ones_like(groups, dtype=torch.bool)
    first[1:] = groups[1:] != groups[:-1]
    run_start = torch.cummax(torch.where(first, index, torch.zeros_like(index)), 0).values
    return index - run_start


def _distinct_rank_within(partition: torch.Tensor, row: torch.Tensor) -> torch.Tensor:
    """0, 1, 2, ... over the distinct rows of each partition (entries sorted by partition, row)."""
    change = torch.ones_like(partition, dtype=torch.bool)
    change[1:] = (partition[1:] != partition[:-1]) | (row[1:] != row[:-1])
    distinct = torch.cumsum(change.long(), 0) - 1
    run_start = torch.arange(partition.numel()) - _rank_within(partition)
    return distinct - distinct[run_start]


def _limit_error(stack: StackSpec, counts: torch.Tensor, unique_counts: torch.Tensor) -> PartitionLimitError:
    """The error for a batch over the limits, naming the worst partition and what it needs."""
    n = stack.num_sparsecores
    limit_ids, limit_unique = stack.max_ids_per_partition, stack.max_unique_ids_per_partition
    max_ids, max_unique = int(counts.max()), int(unique_counts.max())
    worst = int(torch.argmax(counts if max_ids > limit_ids else unique_counts))
    return PartitionLimitError(
        f"stack {stack.name!r} (tables {[t.name for t in stack.tables]}): partition "
        f"(receiving SparseCore {worst // n}, owning SparseCore {worst % n}) carries "
        f"{int(counts[worst])} ids ({int(unique_counts[worst])} distinct); limits are "
        f"max_ids_per_partition={limit_ids}, max_unique_ids_per_partition={limit_unique}. "
        f"This batch needs max_ids_per_partition>={max_ids} and "
        f"max_unique_ids_per_partition>={max_unique}; raise the limits or enable allow_id_dropping."
    )


def _apply_limits(stack: StackSpec, partition: torch.Tensor, row: torch.Tensor, allow_id_dropping: bool):
    """Checks the per-partition limits; with dropping, keeps what fits. Returns (keep mask, stats)."""
    n = stack.num_sparsecores
    counts = torch.bincount(partition, minlength=n * n)
    distinct = _distinct_rank_within(partition, row) if partition.numel() else partition
    unique_counts = torch.zeros(n * n, dtype=torch.int64).scatter_reduce_(0, partition, distinct + 1, reduce="amax")
    max_ids, max_unique = int(counts.max()), int(unique_counts.max())
    limit_ids, limit_unique = stack.max_ids_per_partition, stack.max_unique_ids_per_partition
    if max_ids <= limit_ids and max_unique <= limit_unique:
        keep = torch.ones_like(partition, dtype=torch.bool)
        return keep, PartitionStats(max_ids_per_partition=max_ids, max_unique_ids_per_partition=max_unique)
    if not allow_id_dropping:
        raise _limit_error(stack, counts, unique_counts)
    # Keep the first distinct rows of each partition, then its first entries.
    kept = (distinct < limit_unique).nonzero().squeeze(1)
    kept = kept[_rank_within(partition[kept]) < limit_ids]
    keep = torch.zeros_like(partition, dtype=torch.bool)
    keep[kept] = True
    return keep, PartitionStats(
        max_ids_per_partition=max_ids, max_unique_ids_per_partition=max_unique, dropped_ids=int((~keep).sum())
    )


def bucket_width(width: int) -> int:
    """The buffer width that ``width`` entries per receiver are padded to: the next of
    WIDTHS_PER_OCTAVE geometric steps per power of two (a multiple of ALIGNMENT). Batches
    then share a few shapes, so a compiled step meets the same shapes again instead of a
    new one per batch (static shapes, as a TPU's infeed), for at most 1/8 more padding,
    which the kernels never visit (they walk the row pointers' groups)."""
    if width <= ALIGNMENT * WIDTHS_PER_OCTAVE:
        return align_up(width)
    step = (1 << ((width - 1).bit_length() - 1)) // WIDTHS_PER_OCTAVE
    return -(-width // step) * step


def _layout(partition, row, bag, gain, n: int):
    """CSR-wrapped COO buffers from entries sorted by (receiver, owner), each partition in bag order."""
    counts = torch.bincount(partition, minlength=n * n).view(n, n)
    padded = align_up(counts)
    starts = torch.cumsum(padded, 1) - padded  # group starts within each receiver
    row_pointers = (starts + counts).to(torch.int32)
    width = bucket_width(int(padded.sum(1).max()) if counts.numel() else 0)
    embedding_ids = torch.zeros(n, width, dtype=torch.int32)
    sample_ids = torch.full((n, width), -1, dtype=torch.int32)
    gains = torch.zeros(n, width, dtype=torch.float32)
    receiver, owner = partition // n, partition % n
    position = starts[receiver, owner] + _rank_within(partition)
    embedding_ids[receiver, position] = row.to(torch.int32)
    sample_ids[receiver, position] = bag.to(torch.int32)
    gains[receiver, position] = gain
    return row_pointers, embedding_ids, sample_ids, gains


_COMBINERS = {"sum": 0, "mean": 1, "sqrtn": 2}

LOOKUP_IN_PASS_MAX_IDS_PER_BAG = 2.0
"""preprocess_and_look_up looks a pooled stack up inside its preprocessing pass when its bags
average at most this many ids (one-hot features, as Criteo's). Measured on 2 cores, 26 tables,
batch 8192, dim 64, the forward took 8.5 ms instead of 10.6 at 1 id a bag and 13.9 instead of
15.0 at 2; at 5 it was even (22.2 / 22.1) and at 20 slower (67.1 / 60.7): long bags' rows are
fetched faster by the lookup over the finished buffers."""


def pooled_stack_args(stack: StackSpec, kjt: "KjtView") -> tuple[list[tuple], tuple]:
    """The stack's slots ((table, feature) in stack order) and what the C++ passes over a
    pooled stack take of the KJT and the stack: values, lengths, weights (empty if none),
    then per slot its feature's index, table size, rotation, row offset and combiner, then
    the SparseCores, batch size and rows per SparseCore."""
    slots = [(table, feature) for table in stack.tables for feature in table.feature_names]
    placements = [stack.placements[table.name] for table, _ in slots]
    return slots, (
        kjt.values, kjt.lengths, kjt.weights if kjt.weights is not None else torch.empty(0),
        [kjt.index[f] for _, f in slots], [t.num_embeddings for t, _ in slots],
        [p.rotation for p in placements], [p.row_offset for p in placements],
        [_COMBINERS[t.combiner_name] for t, _ in slots],
        stack.num_sparsecores, kjt.batch_size, stack.rows_per_sparsecore,
    )


def out_of_range(slots: list[tuple], bad_slot: int, bad_id: int) -> InputError:
    """The error for an id a C++ pass found outside its table (``bad_slot`` indexes ``slots``)."""
    table, feature = slots[bad_slot]
    return InputError(f"feature {feature!r} (table {table.name!r}): id {bad_id} is out of range; "
                      f"expected 0 <= id < {table.num_embeddings}")


def _preprocess_pooled(stack: StackSpec, kjt: "KjtView", allow_id_dropping: bool, device: torch.device,
                       weight: torch.Tensor | None) -> tuple[StackBatch, torch.Tensor | None]:
    """Pooled stacks: the C++ pass (sparsecore/csrc/Preprocess.cpp), reading the KJT in place. With
    ``weight`` (the stack's table) the pass also does the stack's lookup, as each bag is merged,
    and returns its rows (None if ids were dropped: the kept ones are then looked up apart)."""
    slots, common = pooled_stack_args(stack, kjt)
    args = (*common, stack.max_ids_per_partition, stack.max_unique_ids_per_partition, allow_id_dropping, device)
    if weight is None:
        result, rows = torch.ops.sparsecore.preprocess_pooled(*args), None
    else:
        *result, rows = torch.ops.sparsecore.preprocess_lookup_pooled(weight, *args)
    (row_pointers, embedding_ids, sample_ids, gains, counts, dropped, bad_slot, bad_id) = result
    if bad_slot >= 0:
        raise out_of_range(slots, bad_slot, bad_id)
    ids, unique = counts[..., 0].flatten(), counts[..., 1].flatten()
    if not allow_id_dropping and (int(ids.max()) > stack.max_ids_per_partition or int(unique.max()) > stack.max_unique_ids_per_partition):
        raise _limit_error(stack, ids, unique)
    stats = PartitionStats(max_ids_per_partition=int(ids.max()), max_unique_ids_per_partition=int(unique.max()), dropped_ids=dropped)
    batch = StackBatch(row_pointers=row_pointers, embedding_ids=embedding_ids, sample_ids=sample_ids, gains=gains,
                       num_bags=len(slots) * kjt.batch_size, batch_size=kjt.batch_size, stats=stats)
    return batch, None if dropped else rows


def _mean_ids_per_bag(stack: StackSpec, kjt: "KjtView") -> float:
    features = [kjt.index[f] for table in stack.tables for f in table.feature_names]
    bags = len(features) * kjt.batch_size
    return sum(kjt.ids_per_key[i] for i in features) / bags if bags else 0.0


def _preprocess_sequence(stack: StackSpec, kjt: "KjtView", allow_id_dropping: bool, lengths_out: dict) -> StackBatch:
    # Sequence stacks: every id is its own bag, so there is nothing to merge.
    n = stack.num_sparsecores
    owner, row, bag, receiver, gain, num_bags = _sequence_entries(stack, kjt, lengths_out)
    partition = receiver * n + owner
    # The limits are counted over rows in order; the layout keeps bag order within a partition.
    by_row = torch.argsort(partition * (stack.rows_per_sparsecore + 1) + row, stable=True)
    keep_by_row, stats = _apply_limits(stack, partition[by_row], row[by_row], allow_id_dropping)
    if stats.dropped_ids:
        keep = torch.empty_like(keep_by_row)
        keep[by_row] = keep_by_row
        partition, row, bag, gain = partition[keep], row[keep], bag[keep], gain[keep]
    order = torch.argsort(partition, stable=True)
    partition, row, bag, gain = partition[order], row[order], bag[order], gain[order]
    row_pointers, embedding_ids, sample_ids, gains = _layout(partition, row, bag, gain, n)
    return StackBatch(row_pointers=row_pointers, embedding_ids=embedding_ids, sample_ids=sample_ids,
                      gains=gains, num_bags=num_bags, batch_size=num_bags, stats=stats)


@dataclasses.dataclass(frozen=True)
class KjtView:
    """A KJT's tensors on the host, checked: values, lengths (features x batch), weights."""

    values: torch.Tensor
    lengths: torch.Tensor
    weights: torch.Tensor | None
    index: dict[str, int]
    batch_size: int

    @functools.cached_property
    def ids_per_key(self) -> list[int]:
        return self.lengths.sum(1).tolist()

    def feature(self, key: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(values, lengths) of one feature."""
        i = self.index[key]
        start = sum(self.ids_per_key[:i])
        return self.values[start:start + self.ids_per_key[i]].long(), self.lengths[i]


def view_kjt(kjt: KeyedJaggedTensor, stacks: Sequence[StackSpec]) -> KjtView:
    known = _feature_tables(stacks)
    keys = kjt.keys()
    unknown = [k for k in keys if k not in known]
    if unknown:
        raise InputError(f"unknown feature key(s) {unknown}; the tables serve {sorted(known)}")
    missing = [f for f in known if f not in keys]
    if missing:
        raise InputError(f"the batch lacks feature(s) {missing} that the tables expect")
    values = kjt.values()
    if values.dtype not in (torch.int64, torch.int32):
        raise InputError(f"ids must be int64 or int32, got {values.dtype}")
    if kjt.variable_stride_per_key():
        strides = dict(zip(keys, kjt.stride_per_key()))
        raise InputError(f"features with batch sizes of their own (TorchRec's variable batch per feature: {strides}) "
                         f"are not supported; expected every feature to have the batch's samples")
    batch_size = kjt.stride()
    lengths = kjt.lengths().cpu()
    if lengths.numel() != len(keys) * batch_size:
        raise InputError(f"{lengths.numel()} lengths for {len(keys)} features x batch {batch_size}")
    lengths = lengths.long().view(len(keys), batch_size)
    if lengths.numel() and int(lengths.min()) < 0:  # one reduction: a mask and any() cost 5x on every batch
        raise InputError("lengths must be non-negative")
    if int(lengths.sum()) != values.numel():
        raise InputError(f"lengths sum to {int(lengths.sum())} but there are {values.numel()} ids")
    weights = kjt.weights_or_none() if any(s.weighted for s in stacks) else None
    if weights is not None and weights.requires_grad and torch.is_grad_enabled():
        raise InputError("the KJT's weights require grad, but the engine folds them into its lookups as "
                         "constants and gives them no gradient; pass kjt weights detached")
    if weights is not None and weights.numel() != values.numel():
        raise InputError(f"{weights.numel()} weights for {values.numel()} ids; expected one weight per id")
    return KjtView(values=values.cpu(), lengths=lengths, weights=None if weights is None else weights.float().cpu(),
                   index={k: i for i, k in enumerate(keys)}, batch_size=batch_size)


@dataclasses.dataclass(frozen=True)
class Preprocessor:
    """Host preprocessing for one module's stacks, as plain data: a loader's worker
    processes hold this rather than the module (and its tables)."""

    stacks: tuple[StackSpec, ...]
    allow_id_dropping: bool = False

    def __call__(self, kjt: KeyedJaggedTensor) -> PreprocessedBatch:
        return preprocess_stacks(kjt, self.stacks, allow_id_dropping=self.allow_id_dropping, device="cpu")


def suggested_width(stack: StackSpec) -> int | None:
    """The entries per receiver of the stack's suggested buffer size per device, split over
    its receivers in ALIGNMENT steps (None: no table suggests one)."""
    size = stack.coo_buffer_size_per_device
    return None if size is None else align_up(-(-size // stack.num_sparsecores))


def padded_to(batch: StackBatch, width: int) -> StackBatch:
    """``batch`` with its buffers padded to ``width`` entries per receiver (padding entries:
    sample -1, gain 0, which no kernel visits); as it is when as wide or wider."""
    extra = width - batch.embedding_ids.shape[1]
    if extra <= 0:
        return batch
    pad = torch.nn.functional.pad
    return dataclasses.replace(batch, embedding_ids=pad(batch.embedding_ids, (0, extra)),
                               sample_ids=pad(batch.sample_ids, (0, extra), value=-1),
                               gains=pad(batch.gains, (0, extra)))


def _at_least_suggested_size(batch: StackBatch, stack: StackSpec) -> StackBatch:
    """``batch`` padded to the stack's suggested buffer size per device; as it is when wider."""
    width = suggested_width(stack)
    return batch if width is None else padded_to(batch, width)


def preprocess_stacks(
    kjt: KeyedJaggedTensor, stacks: Sequence[StackSpec], *, allow_id_dropping: bool = False,
    device: torch.device | str = "cpu",
) -> PreprocessedBatch:
    """KJT -> COO buffers for every stack (pooled stacks' buffers on ``device``, as a TPU's infeed)."""
    return preprocess_and_look_up(kjt, stacks, {}, allow_id_dropping=allow_id_dropping, device=device)[0]


def preprocess_and_look_up(
    kjt: KeyedJaggedTensor, stacks: Sequence[StackSpec], weights: Mapping[str, torch.Tensor], *,
    allow_id_dropping: bool = False, device: torch.device | str = "cpu",
) -> tuple[PreprocessedBatch, dict[str, torch.Tensor]]:
    """``preprocess_stacks``, and the lookups of the pooled stacks named in ``weights`` (their
    tables) done while their buffers are built: per such stack, what ``sparsecore.kernels.lookup``
    of its buffers returns, to the bit. Only stacks whose bags are short (see
    LOOKUP_IN_PASS_MAX_IDS_PER_BAG) and that dropped no ids have rows here."""
    view = view_kjt(kjt, stacks)
    lengths: dict[str, torch.Tensor] = {}
    built, rows = {}, {}
    for stack in stacks:
        if stack.is_pooled:
            weight = weights.get(stack.name)
            if weight is not None and _mean_ids_per_bag(stack, view) > LOOKUP_IN_PASS_MAX_IDS_PER_BAG:
                weight = None
            built[stack.name], stack_rows = _preprocess_pooled(stack, view, allow_id_dropping, torch.device(device),
                                                               weight)
            if stack_rows is not None:
                rows[stack.name] = stack_rows
        else:
            built[stack.name] = _preprocess_sequence(stack, view, allow_id_dropping, lengths)
        built[stack.name] = _at_least_suggested_size(built[stack.name], stack)
    return PreprocessedBatch(batch_size=view.batch_size, stacks=built, lengths=lengths), rows
