"""sparsecore.preprocess on hand-built batches: sharding, padding, dedup gains, limits, dropping."""

import dataclasses
import math

import pytest
import torch
from torchrec import EmbeddingBagConfig, EmbeddingConfig
from torchrec.modules.embedding_configs import PoolingType
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from sparsecore.config import SparseCoreEmbeddingConfig, as_sparsecore_config
from sparsecore.errors import InputError, PartitionLimitError
from sparsecore.preprocess import ALIGNMENT, bucket_width, preprocess_stacks
from sparsecore.stacking import plan_stacks


def kjt(features: dict, weights: bool = False, dtype: torch.dtype = torch.int64):
    keys = list(features)
    values = [v for k in keys for bag in features[k] for v in bag]
    lengths = [len(bag) for k in keys for bag in features[k]]
    w = torch.arange(1, len(values) + 1, dtype=torch.float32) if weights else None
    return KeyedJaggedTensor.from_lengths_sync(keys=keys, values=torch.tensor(values, dtype=dtype),
                                               lengths=torch.tensor(lengths), weights=w)


def entries(stack_batch):
    """{(receiver, owner): [(row, bag, gain), ...]} read back through the row pointers."""
    out = {}
    n = stack_batch.row_pointers.shape[0]
    for r in range(n):
        for o in range(n):
            start, end = stack_batch.group_start(r, o), int(stack_batch.row_pointers[r, o])
            assert start % ALIGNMENT == 0
            out[(r, o)] = [(int(stack_batch.embedding_ids[r, i]), int(stack_batch.sample_ids[r, i]),
                            round(float(stack_batch.gains[r, i]), 6)) for i in range(start, end)]
    return out


def one_table(rows=8, n=2, **kw):
    cfg = as_sparsecore_config(EmbeddingBagConfig(name="t", num_embeddings=rows, embedding_dim=4, feature_names=["f"], **kw))
    return plan_stacks([cfg], n)


def test_module_docstring_example():
    stacks = one_table()
    batch = preprocess_stacks(kjt({"f": [[3, 3, 4], [5]]}), stacks).stacks[stacks[0].name]
    assert entries(batch) == {
        (0, 0): [(2, 0, 1.0)], (0, 1): [(1, 0, 2.0)],
        (1, 0): [], (1, 1): [(2, 1, 1.0)],
    }
    assert batch.group_start(0, 1) == 8  # owner 1's group starts on the next multiple of 8
    assert batch.num_bags == 2
    # Padding is inert: no row, no bag, no gain.
    pad = batch.sample_ids == -1
    assert (batch.gains[pad] == 0).all() and (batch.embedding_ids[pad] == 0).all()


def test_mean_and_weighted_and_sqrtn_gains():
    mean = one_table(pooling=PoolingType.MEAN)
    e = entries(preprocess_stacks(kjt({"f": [[3, 3, 4], []]}), mean).stacks[mean[0].name])
    assert e[(0, 1)] == [(1, 0, round(2 / 3, 6))] and e[(0, 0)] == [(2, 0, round(1 / 3, 6))]
    weighted = one_table()
    e = entries(preprocess_stacks(kjt({"f": [[3, 3, 4], [5]]}, weights=True), weighted).stacks[weighted[0].name])
    assert e[(0, 1)] == [(1, 0, 3.0)] and e[(0, 0)] == [(2, 0, 3.0)] and e[(1, 1)] == [(2, 1, 4.0)]
    sqrtn = plan_stacks([dataclasses.replace(as_sparsecore_config(EmbeddingBagConfig(
        name="t", num_embeddings=8, embedding_dim=4, feature_names=["f"])), combiner="sqrtn")], 2)
    e = entries(preprocess_stacks(kjt({"f": [[3, 3, 4], [5]]}, weights=True), sqrtn).stacks[sqrtn[0].name])
    norm = math.sqrt(1 + 4 + 9)
    assert e[(0, 1)] == [(1, 0, round(3 / norm, 6))] and e[(1, 1)] == [(2, 1, 1.0)]


def test_two_features_of_a_stack_take_consecutive_bag_ranges():
    cfgs = [as_sparsecore_config(EmbeddingBagConfig(name=n, num_embeddings=4, embedding_dim=4, feature_names=[f]))
            for n, f in (("a", "fa"), ("b", "fb"))]
    stacks = plan_stacks(cfgs, 2)
    batch = preprocess_stacks(kjt({"fa": [[0], [1]], "fb": [[0], [0]]}), stacks).stacks[stacks[0].name]
    assert batch.num_bags == 4
    e = entries(batch)
    # fa: id0 -> sc0 row0, id1 -> sc1 row0; fb (rotation 1, rows from 2): id0 -> sc1 row 2.
    assert e[(0, 0)] == [(0, 0, 1.0)] and e[(0, 1)] == [(2, 2, 1.0)]
    assert e[(1, 1)] == [(0, 1, 1.0), (2, 3, 1.0)]


def test_limits_count_per_receiver_owner_pair_and_report_observed_maxima():
    stacks = one_table(rows=16, n=2)
    batch = preprocess_stacks(kjt({"f": [[0, 2, 4, 2], [1]]}), stacks)
    stats = batch.stats[stacks[0].name]
    # receiver 0 / owner 0 gets ids 0, 2, 4 (2 merged within the bag): 3 entries, 3 rows.
    assert (stats.max_ids_per_partition, stats.max_unique_ids_per_partition) == (3, 3)
    # The same ids spread over two samples that land on different receivers stay within 2.
    tight = plan_stacks([dataclasses.replace(stacks[0].tables[0], max_ids_per_partition=2, max_unique_ids_per_partition=2)], 2)
    preprocess_stacks(kjt({"f": [[0, 2], [4]]}), tight)
    with pytest.raises(PartitionLimitError, match=r"receiving SparseCore 0, owning SparseCore 0\) carries 3 ids") as info:
        preprocess_stacks(kjt({"f": [[0, 2, 4], [1]]}), tight)
    assert "max_ids_per_partition>=3" in str(info.value)


def test_dropping_keeps_what_fits_and_counts_the_rest():
    cfg = dataclasses.replace(one_table(rows=32, n=2)[0].tables[0], max_ids_per_partition=3, max_unique_ids_per_partition=2)
    stacks = plan_stacks([cfg], 2)
    # Receiver 0 (samples 0, 1 of 4), owner 0: rows of ids 0,2,4 in sample 0 and 0,2 in sample 1.
    batch = preprocess_stacks(kjt({"f": [[0, 2, 4], [0, 2], [], []]}), stacks, allow_id_dropping=True)
    e = entries(batch.stacks[stacks[0].name])[(0, 0)]
    assert len(e) <= 3 and len({row for row, _, _ in e}) <= 2
    assert batch.stats[stacks[0].name].dropped_ids == 5 - len(e)
    assert batch.stats[stacks[0].name].max_ids_per_partition == 5


def _kept_by_policy(group, max_ids, max_unique):
    """A partition's entries that dropping keeps: in order while they fit, an entry of a row
    already kept always fitting the distinct-row limit."""
    kept, rows = [], set()
    for entry in group:
        if len(kept) == max_ids:
            break
        if entry[0] not in rows:
            if len(rows) == max_unique:
                continue
            rows.add(entry[0])
        kept.append(entry)
    return kept


def test_dropping_keeps_a_row_it_has_kept_after_refusing_another():
    """Rows 0 and 1 fill the distinct-row limit, row 2 is refused, and the last bag's row 0
    (kept already, within the id limit) stays: one id dropped, as the sequence path does."""
    cfg = dataclasses.replace(one_table(rows=8, n=1)[0].tables[0], max_ids_per_partition=10,
                              max_unique_ids_per_partition=2)
    stacks = plan_stacks([cfg], 1)
    batch = preprocess_stacks(kjt({"f": [[0], [1], [2], [0]]}), stacks, allow_id_dropping=True)
    assert entries(batch.stacks[stacks[0].name])[(0, 0)] == [(0, 0, 1.0), (1, 1, 1.0), (0, 3, 1.0)]
    assert batch.stats[stacks[0].name].dropped_ids == 1


@pytest.mark.parametrize("seed", range(4))
def test_dropping_keeps_exactly_what_fits_in_every_partition(seed):
    """Random bags over 200 rows (ids of many rows share a bitmap word), limits below what the
    batch needs: every (receiver, owner) group holds what the policy keeps of the same batch's
    undropped group, and the dropped count is the difference."""
    g = torch.Generator().manual_seed(seed)
    bags = [torch.randint(0, 200, (int(torch.randint(0, 12, (1,), generator=g)),), generator=g).tolist()
            for _ in range(16)]
    table = one_table(rows=200, n=2)[0].tables[0]
    free = plan_stacks([dataclasses.replace(table, max_ids_per_partition=1 << 16,
                                            max_unique_ids_per_partition=1 << 16)], 2)
    limited = plan_stacks([dataclasses.replace(table, max_ids_per_partition=20, max_unique_ids_per_partition=9)], 2)
    full = entries(preprocess_stacks(kjt({"f": bags}), free).stacks[free[0].name])
    batch = preprocess_stacks(kjt({"f": bags}), limited, allow_id_dropping=True)
    got = entries(batch.stacks[limited[0].name])
    expected = {p: _kept_by_policy(group, 20, 9) for p, group in full.items()}
    assert got == expected
    dropped = sum(len(full[p]) - len(expected[p]) for p in full)
    assert dropped > 0 and batch.stats[limited[0].name].dropped_ids == dropped


def test_sequence_features_keep_every_id_as_its_own_row_and_truncate():
    cfg = SparseCoreEmbeddingConfig(config=EmbeddingConfig(name="s", num_embeddings=8, embedding_dim=4, feature_names=["q"]), max_seq_len=2)
    stacks = plan_stacks([cfg], 2)
    batch = preprocess_stacks(kjt({"q": [[3, 3, 5], [1]]}), stacks)
    assert batch.lengths["q"].tolist() == [2, 1]
    e = entries(batch.stacks[stacks[0].name])
    assert sorted(x for v in e.values() for x in v) == [(0, 2, 1.0), (1, 0, 1.0), (1, 1, 1.0)]


@pytest.mark.parametrize(
    "features, message",
    [
        ({"f": [[8]]}, "feature 'f' \\(table 't'\\): id 8 is out of range; expected 0 <= id < 8"),
        ({"f": [[-1]]}, "id -1 is out of range"),
        ({"g": [[1]]}, "unknown feature key\\(s\\) \\['g'\\]"),
    ],
)
def test_bad_input_is_named(features, message):
    with pytest.raises(InputError, match=message):
        preprocess_stacks(kjt(features), one_table())


def test_missing_feature_and_float_ids_are_refused():
    stacks = plan_stacks([as_sparsecore_config(EmbeddingBagConfig(name=n, num_embeddings=4, embedding_dim=4, feature_names=[n]))
                          for n in ("a", "b")], 2)
    with pytest.raises(InputError, match="lacks feature"):
        preprocess_stacks(kjt({"a": [[1]]}), stacks)
    bad = KeyedJaggedTensor.from_lengths_sync(keys=["a", "b"], values=torch.tensor([1.0, 2.0]), lengths=torch.tensor([1, 1]))
    with pytest.raises(InputError, match="ids must be int64 or int32"):
        preprocess_stacks(bad, stacks)
    # Lengths that sum to the ids but one is negative: refused before any bag is read.
    negative = KeyedJaggedTensor(keys=["a", "b"], values=torch.tensor([1, 2, 3]), lengths=torch.tensor([4, -1]))
    with pytest.raises(InputError, match="lengths must be non-negative"):
        preprocess_stacks(negative, stacks)


def test_a_batch_size_per_feature_is_refused_by_name():
    """TorchRec's variable batch per feature (VBE): before, the error spoke of a count of lengths."""
    stacks = plan_stacks([as_sparsecore_config(EmbeddingBagConfig(name="t", num_embeddings=4, embedding_dim=4,
                                                                  feature_names=["a", "b"]))], 2)
    vbe = KeyedJaggedTensor(keys=["a", "b"], values=torch.tensor([1, 2, 3]), lengths=torch.tensor([1, 1, 1]),
                            stride_per_key_per_rank=[[2], [1]])
    with pytest.raises(InputError, match=r"batch sizes of their own .*\{'a': 2, 'b': 1\}"):
        preprocess_stacks(vbe, stacks)


def test_empty_batch_and_empty_bags():
    stacks = one_table()
    batch = preprocess_stacks(kjt({"f": [[], [], []]}), stacks).stacks[stacks[0].name]
    assert batch.num_bags == 3 and all(v == [] for v in entries(batch).values())


@pytest.mark.parametrize("bag_length", [40, 120, 300])  # the hashed and the sorted merge
def test_long_bags_merge_duplicates(bag_length):
    stacks = one_table(rows=50, n=2)
    g = torch.Generator().manual_seed(bag_length)
    ids = torch.randint(0, 50, (bag_length,), generator=g).tolist()
    batch = preprocess_stacks(kjt({"f": [ids, []]}), stacks).stacks[stacks[0].name]
    expected = {}
    for i in ids:
        key = (i % 2, i // 2)  # (owner, row) with rotation 0
        expected[key] = expected.get(key, 0) + 1
    got = {(owner, row): gain for (receiver, owner), entries in entries(batch).items() for row, bag, gain in entries}
    assert got == expected


def short_bags():
    """Bags of 2 to 40 ids and around 64 and 128 (the merge screens bags of up to 128 for
    repeats, in octets): without repeats, with one repeat (within an octet, across octets, the
    last id repeating the first), and holding id 0 where the length leaves part of an octet empty."""
    g = torch.Generator().manual_seed(0)
    bags = []
    for length in [*range(2, 41), 63, 64, 65, 127, 128, 129]:
        distinct = (torch.randperm(1000, generator=g)[:length] + 1).tolist()
        bags.append(distinct)
        bags.append(distinct[:-1] + [distinct[0]])
        bags.append(distinct[:length // 2] + [distinct[1]] + distinct[length // 2 + 1:])
        bags.append([0] + distinct[1:])
    return bags


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_short_bags_merge_exactly_their_repeats(dtype):
    table = dataclasses.replace(one_table(rows=1001, n=4)[0].tables[0], max_ids_per_partition=4096,
                                max_unique_ids_per_partition=4096)
    stacks = plan_stacks([table], 4)
    bags = short_bags()
    batch = preprocess_stacks(kjt({"f": bags}, dtype=dtype), stacks).stacks[stacks[0].name]
    got = {}
    for (receiver, owner), group in entries(batch).items():
        for row, bag, gain in group:
            got.setdefault(bag, []).append((row * 4 + owner, gain))
    for bag, ids in enumerate(bags):
        counts = {}
        for i in ids:  # every id once, with its multiplicity as its gain
            counts[i] = counts.get(i, 0) + 1
        assert sorted(got[bag]) == sorted((i, float(c)) for i, c in counts.items()), f"bag {bag} of {len(ids)} ids"


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_a_bags_merged_entries_keep_first_occurrence_order_and_sum_gains_in_bag_order(dtype):
    """Bags of up to 128 ids, most repeating (ids from a 12-row table), with weights whose fp32
    sum depends on its order (1e8 + 1 - 1e8 is 0, 1e8 - 1e8 + 1 is 1): within each (receiver,
    owner) group a bag's entries come in the order of their first occurrence, and each gain is
    the float32 sum of its id's weights in bag order, to the bit."""
    import numpy as np

    n, rows = 4, 12
    stacks = plan_stacks([dataclasses.replace(one_table(rows=rows, n=n)[0].tables[0], max_ids_per_partition=1 << 16,
                                              max_unique_ids_per_partition=1 << 16)], n)
    g = torch.Generator().manual_seed(3)
    bags = [torch.randint(0, rows, (length,), generator=g).tolist()
            for length in [*range(1, 40), 63, 64, 65, 100, 127, 128] for _ in range(2)]
    palette = torch.tensor([1e8, 1.0, -1e8, 0.5, 3.0, -2.25])
    weights = palette[torch.randint(0, len(palette), (sum(map(len, bags)),), generator=g)]
    features = KeyedJaggedTensor.from_lengths_sync(
        keys=["f"], values=torch.tensor([i for bag in bags for i in bag], dtype=dtype),
        lengths=torch.tensor([len(bag) for bag in bags]), weights=weights)
    batch = preprocess_stacks(features, stacks).stacks[stacks[0].name]

    got = {}  # (bag, owner) -> [(row, gain)] in buffer order
    for r in range(n):
        for o in range(n):
            start, end = batch.group_start(r, o), int(batch.row_pointers[r, o])
            for i in range(start, end):
                got.setdefault((int(batch.sample_ids[r, i]), o), []).append(
                    (int(batch.embedding_ids[r, i]), float(batch.gains[r, i])))
    expected, at = {}, 0
    for b, bag in enumerate(bags):
        sums: dict[int, np.float32] = {}  # insertion order: first occurrences
        for i in bag:
            w = np.float32(weights[at])
            sums[i] = w if i not in sums else np.float32(sums[i] + w)
            at += 1
        for i, total in sums.items():
            expected.setdefault((b, i % n), []).append((i // n, float(total)))
    assert got == expected


def test_buffer_widths_are_bucketed():
    """Widths round up to a few shapes (8 steps per power of two, multiples of ALIGNMENT),
    wasting at most an eighth. (Lookups through padded buffers are what every other test runs.)"""
    widths = range(1, 5000)
    buckets = [bucket_width(w) for w in widths]
    assert all(b >= w and b % ALIGNMENT == 0 for w, b in zip(widths, buckets))
    assert all(b - w <= max(ALIGNMENT - 1, w // 8) for w, b in zip(widths, buckets))
    assert buckets == sorted(buckets)
    assert len(set(b for w, b in zip(widths, buckets) if 1024 < w <= 2048)) == 8
    assert bucket_width(1025) == 1152 and bucket_width(1152) == 1152 and bucket_width(1153) == 1280
