"""Observed SparseCore id maxima: what a module records, and limits seeded from them."""

import pytest

import sparsecore
from sparsecore.config import SparseCoreEmbeddingConfig
from sparsecore.errors import PartitionLimitError
from sparsecore.modules import SparseCoreEmbeddingBagCollection
from tests.sparsecore.test_modules import TABLES, random_kjt


def test_observed_limits_are_the_maxima_of_the_batches_stats():
    engine = SparseCoreEmbeddingBagCollection(TABLES, sparsecore.optim.SGD(lr=0.1), device="tpu", num_sparsecores=2)
    assert all(v == {"max_ids_per_partition": 0, "max_unique_ids_per_partition": 0}
               for v in engine.observed_limits().values())
    batches = [random_kjt(TABLES, batch=16, seed=s, max_len=1 + 3 * s) for s in range(4)]
    for i, kjt in enumerate(batches):  # every path a batch can take: sync, async, prefetched, preprocessed
        if i == 0:
            engine(kjt).values().sum().backward()
        elif i == 1:
            engine.forward_async(kjt).result()
        elif i == 2:
            engine.prefetch(kjt)
            engine(kjt)
        else:
            engine(sparsecore.preprocess(kjt, engine))
    # Independently: each batch's own statistics from a fresh preprocessing, per stack.
    expected = {}
    for kjt in batches:
        for stack, stats in engine.preprocess(kjt).stats.items():
            ids, unique = expected.get(stack, (0, 0))
            expected[stack] = (max(ids, stats.max_ids_per_partition), max(unique, stats.max_unique_ids_per_partition))
    observed = engine.observed_limits()
    assert list(observed) == [t.name for t in TABLES]
    for stack in engine.stacks:
        for table in stack.tables:
            assert (observed[table.name]["max_ids_per_partition"],
                    observed[table.name]["max_unique_ids_per_partition"]) == expected[stack.name]
    assert max(v["max_ids_per_partition"] for v in observed.values()) > 0


def test_limits_seeded_from_observed_maxima_hold_the_same_batches():
    batches = [random_kjt(TABLES, batch=32, seed=s, max_len=6) for s in range(3)]
    first = SparseCoreEmbeddingBagCollection(TABLES, device="tpu", num_sparsecores=2)
    for kjt in batches:
        first(kjt)
    observed = first.observed_limits()
    tables = sparsecore.with_observed_limits([SparseCoreEmbeddingConfig(config=t) for t in TABLES], observed,
                                             headroom=1.0)
    assert [t.max_ids_per_partition for t in tables] == [max(1, observed[t.name]["max_ids_per_partition"])
                                                         for t in TABLES]
    tight = SparseCoreEmbeddingBagCollection(tables, device="tpu", num_sparsecores=2)
    for kjt in batches:  # exactly enough
        tight(kjt)
    # One id fewer than observed is not enough (for the busiest stack, at least).
    smaller = {t: {k: max(1, v - 1) for k, v in seen.items()} for t, seen in observed.items()}
    too_tight = SparseCoreEmbeddingBagCollection(
        sparsecore.with_observed_limits([SparseCoreEmbeddingConfig(config=t) for t in TABLES], smaller, 1.0),
        device="tpu", num_sparsecores=2)
    with pytest.raises(PartitionLimitError):
        for kjt in batches:
            too_tight(kjt)


def test_headroom_rounds_up_and_bad_limits_are_named():
    tables = [SparseCoreEmbeddingConfig(config=t) for t in TABLES]
    seeded = sparsecore.with_observed_limits(
        tables, {"small": {"max_ids_per_partition": 10, "max_unique_ids_per_partition": 9}}, headroom=1.25)
    assert (seeded[2].max_ids_per_partition, seeded[2].max_unique_ids_per_partition) == (13, 12)
    assert seeded[0] is tables[0]  # not named: unchanged
    with pytest.raises(ValueError, match="unknown tables \\['nope'\\]"):
        sparsecore.with_observed_limits(tables, {"nope": {"max_ids_per_partition": 1,
                                                          "max_unique_ids_per_partition": 1}})
    with pytest.raises(ValueError, match="headroom 0.5"):
        sparsecore.with_observed_limits(tables, {}, headroom=0.5)
