"""data.loader: BatchLoader epochs, shuffling, rank slicing, resuming, worker processes, SparseCore preprocessing.

Every yielded batch is checked against rows taken straight from the source
(``source.rows``) or written by hand into a binary store, never against the
loader's own bookkeeping (``order``, ``batch``).
"""

import numpy as np
import pytest
import torch
from torchrec import EmbeddingBagConfig

import sparsecore
from data import schema
from data.arrays import ArrayWriter, open_arrays
from data.loader import ArraySource, Batch, BatchLoader
from data.synthetic import SyntheticConfig, SyntheticCriteo

ROWS, BATCH = 1000, 64  # 15 global batches; the last 40 rows are dropped


@pytest.fixture(scope="module")
def source():
    return SyntheticCriteo(SyntheticConfig(scale=1e-5, num_samples=ROWS, seed=5))


@pytest.fixture(scope="module")
def global_batches(source):
    """The rows of every global batch, straight from the source."""
    return [source.rows(i * BATCH, (i + 1) * BATCH) for i in range(ROWS // BATCH)]


def _which(batch: Batch, global_batches) -> int:
    """The index of the global batch whose rows ``batch`` holds (exactly one must match)."""
    hits = [i for i, g in enumerate(global_batches) if np.array_equal(batch.dense.numpy(), g.dense)]
    assert len(hits) == 1, hits
    return hits[0]


def _assert_batch_is(batch: Batch, samples) -> None:
    """``batch`` holds exactly ``samples``: dense, labels and the KJT, feature by feature."""
    assert batch.dense.dtype == torch.float32 and batch.labels.dtype == torch.float32
    np.testing.assert_array_equal(batch.dense.numpy(), samples.dense)
    np.testing.assert_array_equal(batch.labels.numpy(), samples.labels)
    kjt = batch.sparse
    assert kjt.keys() == list(schema.SPARSE_NAMES)
    per_key = kjt.to_dict()
    for f, name in enumerate(schema.SPARSE_NAMES):
        ids = samples.sparse[f]
        assert per_key[name].lengths().tolist() == [ids.shape[1]] * len(ids)
        assert per_key[name].values().tolist() == ids.reshape(-1).tolist()


def _assert_same_batch(a: Batch, b: Batch) -> None:
    torch.testing.assert_close(a.dense, b.dense, rtol=0, atol=0)
    torch.testing.assert_close(a.labels, b.labels, rtol=0, atol=0)
    if isinstance(a.sparse, sparsecore.PreprocessedBatch):
        assert isinstance(b.sparse, sparsecore.PreprocessedBatch)
        assert a.sparse.batch_size == b.sparse.batch_size
        assert a.sparse.stacks.keys() == b.sparse.stacks.keys()
        for name, x in a.sparse.stacks.items():
            y = b.sparse.stacks[name]
            for field in ("row_pointers", "embedding_ids", "sample_ids", "gains"):
                torch.testing.assert_close(getattr(x, field), getattr(y, field), rtol=0, atol=0)
            assert (x.num_bags, x.batch_size, x.stats) == (y.num_bags, y.batch_size, y.stats)
    else:
        assert a.sparse.keys() == b.sparse.keys()
        torch.testing.assert_close(a.sparse.values(), b.sparse.values(), rtol=0, atol=0)
        torch.testing.assert_close(a.sparse.lengths(), b.sparse.lengths(), rtol=0, atol=0)


# ---- epochs and order ----


def test_len_and_epoch_visits_every_batch_once(source, global_batches):
    loader = BatchLoader(source, BATCH, seed=3)
    assert len(loader) == 15
    for epoch in (0, 1):
        loader.set_epoch(epoch)
        batches = list(loader)
        assert len(batches) == 15
        seen = [_which(b, global_batches) for b in batches]
        assert sorted(seen) == list(range(15))
        for b, i in zip(batches, seen):
            _assert_batch_is(b, global_batches[i])
    assert len(BatchLoader(source, 1000)) == 1 and len(BatchLoader(source, 999)) == 1 and len(BatchLoader(source, 7)) == 142


def test_order_depends_on_seed_and_epoch_and_is_reproducible(source, global_batches):
    def visit(seed, epoch):
        loader = BatchLoader(source, BATCH, seed=seed)
        loader.set_epoch(epoch)
        return [_which(b, global_batches) for b in loader]

    base = visit(0, 0)
    assert visit(0, 0) == base  # a fresh loader, the same (seed, epoch)
    others = [visit(0, 1), visit(1, 0), visit(0, 2)]
    for other in others:
        assert sorted(other) == list(range(15))
        assert other != base
    assert others[0] != others[2]
    assert base != list(range(15))  # shuffled (15! orders: in order by chance is impossible in practice)
    # The same loader object gives the same epoch again when asked again.
    loader = BatchLoader(source, BATCH, seed=0)
    loader.set_epoch(1)
    first = [_which(b, global_batches) for b in loader]
    loader.set_epoch(0)
    loader.set_epoch(1)
    assert [_which(b, global_batches) for b in loader] == first == others[0]


def test_no_shuffle_is_in_order(source, global_batches):
    loader = BatchLoader(source, BATCH, shuffle=False, seed=9)
    for epoch in (0, 4):
        loader.set_epoch(epoch)
        batches = list(loader)
        assert len(batches) == 15
        for b, g in zip(batches, global_batches):
            _assert_batch_is(b, g)


def test_multi_hot_batches():
    src = SyntheticCriteo(SyntheticConfig(scale=1e-5, num_samples=200, multi_hot=True, planted=False))
    for b, i in zip(BatchLoader(src, 50, shuffle=False), range(4)):
        _assert_batch_is(b, src.rows(i * 50, (i + 1) * 50))
        assert b.sparse.to_dict()["cat_20"].lengths().tolist() == [100] * 50


# ---- ranks ----


@pytest.mark.parametrize("multi_hot", [False, True])
def test_rank_slices_concatenate_to_the_global_batch(multi_hot):
    src = SyntheticCriteo(SyntheticConfig(scale=1e-5, num_samples=600, multi_hot=multi_hot, planted=False, seed=2))
    loaders = [BatchLoader(src, 40, seed=7, rank=r, world_size=2) for r in range(2)]
    single = BatchLoader(src, 40, seed=7)
    for loader in (*loaders, single):
        loader.set_epoch(3)
    full = list(single)
    parts = [list(loader) for loader in loaders]
    assert len(full) == len(parts[0]) == len(parts[1]) == 15
    for whole, r0, r1 in zip(full, *parts):
        assert len(r0) == len(r1) == 20
        torch.testing.assert_close(torch.cat([r0.dense, r1.dense]), whole.dense, rtol=0, atol=0)
        torch.testing.assert_close(torch.cat([r0.labels, r1.labels]), whole.labels, rtol=0, atol=0)
        d0, d1, dw = r0.sparse.to_dict(), r1.sparse.to_dict(), whole.sparse.to_dict()
        for name in schema.SPARSE_NAMES:
            torch.testing.assert_close(torch.cat([d0[name].values(), d1[name].values()]), dw[name].values(), rtol=0, atol=0)
            torch.testing.assert_close(torch.cat([d0[name].lengths(), d1[name].lengths()]), dw[name].lengths(), rtol=0, atol=0)
        # And rank r's rows are the r-th half of a global batch of the source.
        start = _start_row(whole, src, 40)
        _assert_batch_is(r0, src.rows(start, start + 20))
        _assert_batch_is(r1, src.rows(start + 20, start + 40))


def _start_row(batch: Batch, src, size: int) -> int:
    for i in range(len(src) // size):
        if np.array_equal(src.rows(i * size, i * size + 1).dense[0], batch.dense[0].numpy()):
            return i * size
    raise AssertionError("batch not found in the source")


def test_four_ranks(source, global_batches):
    parts = [list(BatchLoader(source, BATCH, seed=1, rank=r, world_size=4)) for r in range(4)]
    for quarters in zip(*parts):
        dense = torch.cat([q.dense for q in quarters])
        hits = [i for i, g in enumerate(global_batches) if np.array_equal(dense.numpy(), g.dense)]
        assert len(hits) == 1
        np.testing.assert_array_equal(torch.cat([q.labels for q in quarters]).numpy(), global_batches[hits[0]].labels)


# ---- resuming ----


def test_set_epoch_start_batch_yields_the_tail(source, global_batches):
    loader = BatchLoader(source, BATCH, seed=4)
    loader.set_epoch(2)
    full = [_which(b, global_batches) for b in loader]
    for k in (0, 1, 7, 14, 15):
        resumed = BatchLoader(source, BATCH, seed=4)
        resumed.set_epoch(2, start_batch=k)
        batches = list(resumed)
        assert [_which(b, global_batches) for b in batches] == full[k:]
        for b, i in zip(batches, full[k:]):
            _assert_batch_is(b, global_batches[i])
    # The next epoch starts from its beginning again.
    loader.set_epoch(2, start_batch=10)
    assert len(list(loader)) == 5
    loader.set_epoch(3)
    assert len(list(loader)) == 15
    with pytest.raises(ValueError, match="start_batch"):
        loader.set_epoch(0, start_batch=16)
    with pytest.raises(ValueError, match="start_batch"):
        loader.set_epoch(0, start_batch=-1)


# ---- worker processes and SparseCore preprocessing ----


@pytest.mark.timeout(120)
def test_workers_yield_the_same_batches(source, global_batches):
    reference = BatchLoader(source, BATCH, seed=6, num_workers=0)
    workers = BatchLoader(source, BATCH, seed=6, num_workers=2)
    for loader in (reference, workers):
        loader.set_epoch(1, start_batch=2)
    expected, got = list(reference), list(workers)
    assert len(got) == len(expected) == 13
    for a, b in zip(got, expected):
        assert a.dense.is_shared() and not b.dense.is_shared()  # a came from a worker process
        _assert_same_batch(a, b)
        _assert_batch_is(a, global_batches[_which(a, global_batches)])


def _sparsecore_module(table_sizes, batch: int):
    tables = [
        sparsecore.SparseCoreEmbeddingConfig(
            config=EmbeddingBagConfig(name=f"t_{name}", num_embeddings=n, embedding_dim=8, feature_names=[name]),
            max_ids_per_partition=batch * 26,
            max_unique_ids_per_partition=batch * 26,
        )
        for name, n in zip(schema.SPARSE_NAMES, table_sizes)
    ]
    torch.manual_seed(0)
    return sparsecore.SparseCoreEmbeddingBagCollection(tables, device="tpu")


@pytest.mark.timeout(120)
def test_workers_with_sparsecore_preprocessor(source):
    batch = 32
    module = _sparsecore_module(source.table_sizes, batch)
    preprocessor = module.preprocessor()
    plain = BatchLoader(source, batch, seed=8)
    inline = BatchLoader(source, batch, seed=8, preprocessor=preprocessor)
    workers = BatchLoader(source, batch, seed=8, preprocessor=preprocessor, num_workers=2)
    plain_batches = list(plain)[:6]
    inline_batches = list(inline)[:6]
    worker_batches = list(workers)
    assert len(worker_batches) == len(plain) == ROWS // batch
    weights = {name: module.table_weight(f"t_{name}").cpu() for name in schema.SPARSE_NAMES}
    assert all(w.abs().max() > 0 for w in weights.values())  # initialised, so the comparisons mean something
    with torch.no_grad():
        for p, i, w in zip(plain_batches, inline_batches, worker_batches):
            assert isinstance(w.sparse, sparsecore.PreprocessedBatch) and isinstance(i.sparse, sparsecore.PreprocessedBatch)
            assert w.sparse.batch_size == batch and w.dense.is_shared()  # from a worker process
            _assert_same_batch(w, i)
            torch.testing.assert_close(w.dense, p.dense, rtol=0, atol=0)
            torch.testing.assert_close(w.labels, p.labels, rtol=0, atol=0)
            from_kjt = module(p.sparse)
            from_preprocessed = module(w.sparse)
            assert from_preprocessed.keys() == from_kjt.keys() == list(schema.SPARSE_NAMES)
            torch.testing.assert_close(from_preprocessed.values(), from_kjt.values())
            # Independently: one id per feature, so each feature's pooled row is its table row.
            ids = p.sparse.to_dict()
            expected = torch.cat([weights[name][ids[name].values()] for name in schema.SPARSE_NAMES], dim=1)
            torch.testing.assert_close(from_preprocessed.values().cpu(), expected)


# ---- the binary store ----


def _write_store(path, rows: int, table_sizes):
    rng = np.random.default_rng(11)
    dense = (rng.integers(0, 50, (rows, 13)) / 4).astype(np.float32)
    sparse = (rng.integers(0, 1 << 30, (rows, 26)) % np.asarray(table_sizes)).astype(np.int32)
    labels = (rng.random(rows) < 0.3).astype(np.float32)
    with ArrayWriter(path, table_sizes) as w:
        w.append(dense[:100], sparse[:100], labels[:100])
        w.append(dense[100:], sparse[100:], labels[100:])
        w.close({"train": (0, rows - 60), "val": (rows - 60, rows), "test": (rows, rows)})
    return dense, sparse, labels


def test_array_source_batches_equal_written_rows(tmp_path):
    sizes = [5 + 97 * f for f in range(26)]
    dense, sparse, labels = _write_store(tmp_path / "store", 300, sizes)
    splits = open_arrays(tmp_path / "store")
    train, val = ArraySource(splits["train"]), ArraySource(splits["val"])
    assert len(train) == 240 and len(val) == 60

    def check(batch: Batch, offset: int, n: int) -> None:
        np.testing.assert_array_equal(batch.dense.numpy(), dense[offset:offset + n])
        np.testing.assert_array_equal(batch.labels.numpy(), labels[offset:offset + n])
        kjt = batch.sparse
        assert kjt.keys() == list(schema.SPARSE_NAMES)
        assert kjt.values().dtype == torch.int64
        assert kjt.lengths().tolist() == [1] * (26 * n)  # one-hot
        want = [int(sparse[offset + b, f]) for f in range(26) for b in range(n)]
        assert kjt.values().tolist() == want

    in_order = list(BatchLoader(train, 48, shuffle=False))
    assert len(in_order) == 5
    for i, b in enumerate(in_order):
        check(b, 48 * i, 48)
    # Shuffled: every batch is one of the five, each once.
    starts = []
    for b in BatchLoader(train, 48, seed=2):
        start = next(s for s in range(0, 240, 48) if np.array_equal(b.dense.numpy(), dense[s:s + 48]))
        check(b, start, 48)
        starts.append(start)
    assert sorted(starts) == [0, 48, 96, 144, 192]
    # The validation split starts at row 240 of the store; rank 1 of 2 takes the second half.
    (b,) = list(BatchLoader(val, 60, shuffle=False, rank=1, world_size=2))
    check(b, 270, 30)


# ---- bad arguments ----


def test_bad_arguments(source):
    with pytest.raises(ValueError, match="world_size"):
        BatchLoader(source, 63, world_size=2)
    with pytest.raises(ValueError, match="batch_size"):
        BatchLoader(source, 0)
    with pytest.raises(ValueError, match="rank"):
        BatchLoader(source, 64, rank=2, world_size=2)
    with pytest.raises(ValueError, match="rank"):
        BatchLoader(source, 64, rank=-1, world_size=2)
    with pytest.raises(ValueError, match="fewer than one batch"):
        BatchLoader(source, ROWS + 1)
    small = SyntheticCriteo(SyntheticConfig(scale=1e-5, num_samples=10, planted=False))
    with pytest.raises(ValueError, match="10 rows"):
        BatchLoader(small, 16)
    assert len(BatchLoader(small, 10)) == 1  # exactly one batch is enough
