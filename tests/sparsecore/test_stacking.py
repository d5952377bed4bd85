"""sparsecore.stacking: grouping tables into stacks, mod sharding with rotation."""

import pytest
from torchrec import EmbeddingBagConfig, EmbeddingConfig

from sparsecore.config import SparseCoreEmbeddingConfig, as_sparsecore_config
from sparsecore.stacking import plan_stacks


def table(name, rows, dim=4, **kw):
    return as_sparsecore_config(EmbeddingBagConfig(name=name, num_embeddings=rows, embedding_dim=dim, feature_names=[f"f_{name}"], **kw))


def test_mod_sharding_with_rotation_is_a_bijection_onto_the_rows():
    stack, = plan_stacks([table("a", 5), table("b", 3), table("c", 7)], num_sparsecores=2)
    places = {(name, i): stack.locate(name, i) for name, rows in [("a", 5), ("b", 3), ("c", 7)] for i in range(rows)}
    assert len(set(places.values())) == len(places)  # no two ids share a row
    for (name, i), (sc, row) in places.items():
        p = stack.placements[name]
        assert sc == (i + p.rotation) % 2
        assert p.row_offset <= row < p.row_offset + p.rows_per_sparsecore
    assert [stack.placements[n].rotation for n in "abc"] == [0, 1, 0]
    assert stack.locate("b", 0) == (1, 3)  # table b's row 0 starts on SparseCore 1
    assert stack.rows_per_sparsecore == 3 + 2 + 4


def test_tables_group_by_dim_and_kind_or_by_name():
    seq = SparseCoreEmbeddingConfig(config=EmbeddingConfig(name="s", num_embeddings=4, embedding_dim=4, feature_names=["fs"]))
    stacks = plan_stacks([table("a", 5), table("b", 3, dim=8), table("c", 2), seq], num_sparsecores=4)
    assert sorted(tuple(t.name for t in s.tables) for s in stacks) == [("a", "c"), ("b",), ("s",)]
    named = [SparseCoreEmbeddingConfig(config=t.config, stack_table_name="mine") for t in (table("a", 5), table("c", 2))]
    assert [s.name for s in plan_stacks(named, 4)] == ["mine"]


def test_incompatible_tables_under_one_name_are_refused():
    a = SparseCoreEmbeddingConfig(config=table("a", 5).config, stack_table_name="x")
    b = SparseCoreEmbeddingConfig(config=table("b", 5, dim=8).config, stack_table_name="x")
    with pytest.raises(ValueError, match="cannot share a physical table"):
        plan_stacks([a, b], 2)
