"""data.synthetic: deterministic synthetic Criteo rows, table sizes, Zipf skew, the planted teacher, TSV output.

Expected values come from hand computations (table sizes), plain Python (the
KJT layout, TSV parsing), public-API-only statistics (the teacher's variance
split measured by freezing the dense or the sparse inputs) and an independent
AUC implementation (torchmetrics).
"""

import math
import re

import numpy as np
import pytest
import torch
from torchmetrics.classification import BinaryAUROC

from data import schema
from data.criteo import read_tsv
from data.synthetic import BLOCK_ROWS, SyntheticConfig, SyntheticCriteo, binary_auc

SMALL = dict(scale=1e-5, num_samples=10_000)


def _assert_samples_equal(a, b):
    np.testing.assert_array_equal(a.dense, b.dense)
    np.testing.assert_array_equal(a.labels, b.labels)
    assert len(a.sparse) == len(b.sparse) == schema.NUM_SPARSE
    for x, y in zip(a.sparse, b.sparse):
        np.testing.assert_array_equal(x, y)


def _reference_auc(scores: np.ndarray, labels: np.ndarray) -> float:
    metric = BinaryAUROC(thresholds=None)  # exact: every distinct score is a threshold
    return float(metric(torch.from_numpy(np.asarray(scores, np.float64)), torch.from_numpy(np.asarray(labels).astype(np.int64))))


# ---- determinism ----


@pytest.mark.parametrize("kw", [dict(), dict(ids="zipf"), dict(multi_hot=True, planted=False)],
                         ids=["uniform", "zipf", "multi_hot"])
def test_rows_deterministic_and_range_independent(kw):
    config = SyntheticConfig(**SMALL, **kw)
    a, b = SyntheticCriteo(config), SyntheticCriteo(config)
    whole = a.rows(0, 2 * BLOCK_ROWS)
    _assert_samples_equal(whole, b.rows(0, 2 * BLOCK_ROWS))
    # Sub-ranges inside a block, across the block boundary, starting exactly on it, and the
    # partial last block, each equal to the slice of a larger range.
    for start, stop in [(4000, 4200), (10, 20), (BLOCK_ROWS - 1, BLOCK_ROWS + 1), (BLOCK_ROWS, 2 * BLOCK_ROWS), (0, 1)]:
        _assert_samples_equal(b.rows(start, stop), whole.slice(start, stop))
    tail = b.rows(2 * BLOCK_ROWS - 5, config.num_samples)
    _assert_samples_equal(tail.slice(0, 5), whole.slice(2 * BLOCK_ROWS - 5, 2 * BLOCK_ROWS))
    assert len(tail) == config.num_samples - 2 * BLOCK_ROWS + 5
    # Blocks are independent draws, not repeats of one another.
    firsts = [b.rows(k * BLOCK_ROWS, k * BLOCK_ROWS + 100) for k in range(3)]
    for i in range(3):
        for j in range(i + 1, 3):
            assert (firsts[i].dense != firsts[j].dense).mean() > 0.5
    # Asking in reverse order on a fresh instance changes nothing.
    c = SyntheticCriteo(config)
    late, early = c.rows(5000, 5100), c.rows(100, 200)
    _assert_samples_equal(late, whole.slice(5000, 5100))
    _assert_samples_equal(early, whole.slice(100, 200))


def test_cached_teacher_tables_change_no_value(monkeypatch):
    """At full Criteo-Kaggle size the small tables' teacher rows are cached, the large ones hashed
    per id: rows, logits and labels are those of an instance hashing every table."""
    from data import synthetic

    config = SyntheticConfig(num_samples=2 * BLOCK_ROWS)
    cached = SyntheticCriteo(config)
    monkeypatch.setattr(synthetic, "CACHED_TEACHER_BYTES", 0)
    hashed = SyntheticCriteo(config)
    kept = [t for t, rows in enumerate(cached._tables) if rows is not None]
    assert 0 < len(kept) < schema.NUM_SPARSE and all(rows is None for rows in hashed._tables)
    _assert_samples_equal(cached.rows(0, 2 * BLOCK_ROWS), hashed.rows(0, 2 * BLOCK_ROWS))
    counts, ids, _ = cached.raw_rows(BLOCK_ROWS - 100, BLOCK_ROWS + 100)
    np.testing.assert_array_equal(cached.logits(counts, ids), hashed.logits(counts, ids))


def test_rows_shapes_and_dense_transform():
    s = SyntheticCriteo(SyntheticConfig(**SMALL))
    counts, ids, labels = s.raw_rows(300, 500)
    rows = s.rows(300, 500)
    assert counts.shape == (200, 13) and counts.dtype == np.int64 and (counts >= 0).all()
    assert rows.dense.shape == (200, 13) and rows.dense.dtype == np.float32
    np.testing.assert_allclose(rows.dense, [[math.log(1 + int(x)) for x in r] for r in counts], rtol=1e-6)
    assert rows.labels.dtype == np.float32 and set(np.unique(rows.labels)) <= {0.0, 1.0}
    np.testing.assert_array_equal(rows.labels, labels)
    for x, y in zip(rows.sparse, ids):
        np.testing.assert_array_equal(x, y)
    assert len(s.rows(7, 7)) == 0 and len(s.rows(BLOCK_ROWS, BLOCK_ROWS)) == 0
    with pytest.raises(IndexError):
        s.rows(0, SMALL["num_samples"] + 1)
    with pytest.raises(IndexError):
        s.rows(10, 5)


def test_different_seed_gives_different_data():
    a = SyntheticCriteo(SyntheticConfig(**SMALL, seed=0)).rows(0, 2000)
    b = SyntheticCriteo(SyntheticConfig(**SMALL, seed=1)).rows(0, 2000)
    assert (a.dense != b.dense).mean() > 0.5
    assert (a.labels != b.labels).mean() > 0.1  # two Bernoulli(0.25) streams differ on ~37% of rows
    # Table 2 has 101 rows: independent ids agree on ~1% of samples.
    assert (a.sparse[2] != b.sparse[2]).mean() > 0.9


# ---- table sizes, ids, multi-hot, the KJT ----


def test_table_sizes_follow_scaled_preset():
    sizes = SyntheticConfig(scale=1e-5).table_sizes
    assert len(sizes) == 26
    # Hand values: round(n * 1e-5), floored at min(n, 8).
    assert sizes[2] == 101  # 10131227 -> 101.31
    assert sizes[11] == 84  # 8351593 -> 83.5
    assert sizes[15] == 55  # 5461306 -> 54.6
    assert sizes[20] == 70  # 7046547 -> 70.47
    assert sizes[0] == 8  # 1460 -> 0.0146: the min_rows floor
    assert sizes[8] == 3  # 3 rows: kept at 3 (min(size, min_rows))
    assert sizes[19] == 4  # 4 rows
    assert SyntheticConfig(scale=1e-5, min_rows=50).table_sizes[0] == 50
    assert SyntheticConfig(scale=1e-5, min_rows=50).table_sizes[5] == 24  # 24 < 50 rows: whole table
    assert SyntheticConfig(scale=1e-3).table_sizes[9] == 93  # 93145 -> 93.1
    assert SyntheticConfig(scale=1.0).table_sizes == schema.KAGGLE_TABLE_SIZES
    tb = SyntheticConfig(preset="criteo-1tb", scale=1e-5).table_sizes
    assert tb[0] == 400 and tb[10] == 31 and tb[5] == 3 and tb[1] == 8  # 40M, 3067956, 3, 39060
    assert SyntheticCriteo(SyntheticConfig(scale=1e-5, num_samples=10)).table_sizes == sizes


@pytest.mark.parametrize("kw", [dict(), dict(ids="zipf"), dict(multi_hot=True, ids="zipf", zipf_alpha=1.2)],
                         ids=["uniform", "zipf", "multi_hot_zipf"])
def test_ids_in_range(kw):
    s = SyntheticCriteo(SyntheticConfig(scale=1e-5, num_samples=5000, **kw))
    _, ids, _ = s.raw_rows(0, 5000)
    for f, (x, n) in enumerate(zip(ids, s.table_sizes)):
        assert x.dtype.kind == "i"
        assert x.min() >= 0 and x.max() < n, f"feature {f}: ids outside [0, {n})"
    if not kw:
        # Uniform: every row of a small table is drawn, the last one included.
        for f in (5, 8, 16, 19):  # 24, 3, 10, 4 rows
            assert set(np.unique(ids[f])) == set(range(s.table_sizes[f]))


def test_multi_hot_pooling():
    s = SyntheticCriteo(SyntheticConfig(scale=1e-5, num_samples=300, multi_hot=True, planted=False))
    rows = s.rows(0, 300)
    mlperf = (3, 2, 1, 2, 6, 1, 1, 1, 1, 7, 3, 8, 1, 6, 9, 5, 1, 1, 1, 12, 100, 27, 10, 3, 1, 1)
    assert [x.shape for x in rows.sparse] == [(300, p) for p in mlperf]
    one_hot = SyntheticCriteo(SyntheticConfig(scale=1e-5, num_samples=300)).rows(0, 300)
    assert [x.shape for x in one_hot.sparse] == [(300, 1)] * 26
    # The 100 ids of a bag are drawn independently, not repeated.
    assert all(len(np.unique(r)) > 10 for r in rows.sparse[20][:20])


@pytest.mark.parametrize("multi_hot", [False, True])
def test_kjt_matches_arrays(multi_hot):
    s = SyntheticCriteo(SyntheticConfig(scale=1e-5, num_samples=100, multi_hot=multi_hot, planted=False))
    rows = s.rows(40, 57)
    kjt = rows.kjt()
    assert kjt.keys() == [f"cat_{i}" for i in range(26)]
    # Manual construction: feature-major, then sample, then the sample's ids in order.
    lengths, values = [], []
    for f in range(26):
        for b in range(17):
            bag = [int(v) for v in rows.sparse[f][b]]
            lengths.append(len(bag))
            values.extend(bag)
    assert kjt.values().dtype == torch.int64 and kjt.lengths().dtype == torch.int64
    assert kjt.lengths().tolist() == lengths
    assert kjt.values().tolist() == values
    assert kjt.stride() == 17
    per_key = kjt.to_dict()
    for f in range(26):
        assert per_key[f"cat_{f}"].values().tolist() == rows.sparse[f].reshape(-1).tolist()


def test_zipf_ids_are_skewed_uniform_are_not():
    def top_share(ids: np.ndarray, n: int) -> float:
        counts = np.bincount(ids.reshape(-1), minlength=n)
        top = max(1, n // 100)
        return float(np.sort(counts)[::-1][:top].sum() / counts.sum())

    rows = 40_000
    zipf = SyntheticCriteo(SyntheticConfig(scale=1e-4, num_samples=rows, ids="zipf", planted=False))
    uniform = SyntheticCriteo(SyntheticConfig(scale=1e-4, num_samples=rows, planted=False))
    _, zipf_ids, _ = zipf.raw_rows(0, rows)
    _, uniform_ids, _ = uniform.raw_rows(0, rows)
    for f in (2, 11, 15, 20):  # 1013, 835, 546, 705 rows
        n = zipf.table_sizes[f]
        assert n >= 500
        # Continuous power law with alpha 1.05: the top 1% of ranks carries ~35-40% of the mass;
        # uniform gives ~1% (~40-70 draws per id, the top ids a few sigma above).
        assert top_share(zipf_ids[f], n) > 0.25, f
        assert top_share(uniform_ids[f], n) < 0.025, f
        # The hot ids are scattered over the table, not the first rows.
        hottest = np.argsort(np.bincount(zipf_ids[f].reshape(-1), minlength=n))[::-1][: n // 100]
        assert hottest.max() - hottest.min() > n // 4


# ---- the planted teacher ----


@pytest.fixture(scope="module")
def planted():
    return SyntheticCriteo(SyntheticConfig(scale=1e-5, num_samples=60_000))


def test_click_rate_matches_config(planted):
    _, _, labels = planted.raw_rows(0, 60_000)
    assert abs(labels.mean() - 0.25) < 0.02
    other = SyntheticCriteo(SyntheticConfig(scale=1e-5, num_samples=50_000, ctr=0.1, seed=3, multi_hot=True))
    assert abs(other.raw_rows(0, 50_000)[2].mean() - 0.1) < 0.02


def test_teacher_auc_and_labels_from_sigmoid_of_logits(planted):
    counts, ids, labels = planted.raw_rows(40_000, 60_000)
    logits = planted.logits(counts, ids)
    auc = binary_auc(logits, labels)
    assert planted.teacher_auc(40_000, 60_000) == auc
    assert auc > 0.75
    assert auc == pytest.approx(_reference_auc(logits, labels), abs=1e-6)  # torchmetrics returns float32
    # Labels are Bernoulli(sigmoid(logit)): per decile of the probability, the click rate matches it.
    p = 1 / (1 + np.exp(-logits))
    order = np.argsort(p)
    for part in np.array_split(order, 10):  # 2000 rows each: binomial std <= 0.011
        assert abs(labels[part].mean() - p[part].mean()) < 0.05
    # The logit's standard deviation is the configured one.
    assert np.std(logits) == pytest.approx(2.0, rel=0.1)


@pytest.mark.parametrize("share", [0.5, 0.7, 0.9])
def test_embedding_variance_share(share):
    s = SyntheticCriteo(SyntheticConfig(scale=1e-5, num_samples=20_000, embedding_share=share, seed=int(share * 10)))
    measured = s.embedding_variance_share()
    assert abs(measured - share) < 0.05
    if share > 0.5:
        assert measured >= 0.5
    # Independently, through logits() only: the logit is dense part + embedding part, so freezing
    # the dense inputs (every row gets row 0's counts) leaves the embedding variance, and freezing
    # the ids leaves the dense variance.
    counts, ids, _ = s.raw_rows(0, 20_000)
    frozen_counts = np.broadcast_to(counts[0], counts.shape)
    frozen_ids = [np.broadcast_to(x[0], x.shape) for x in ids]
    var_embedding = np.var(s.logits(frozen_counts, ids))
    var_dense = np.var(s.logits(counts, frozen_ids))
    assert abs(var_embedding / (var_embedding + var_dense) - share) < 0.05
    assert var_embedding + var_dense == pytest.approx(np.var(s.logits(counts, ids)), rel=0.05)


def test_unplanted_labels_carry_no_signal():
    s = SyntheticCriteo(SyntheticConfig(scale=1e-5, num_samples=30_000, planted=False))
    counts, ids, labels = s.raw_rows(10_000, 30_000)
    auc = s.teacher_auc(10_000, 30_000)
    assert abs(auc - 0.5) < 0.03  # AUC std on 20k rows at ctr 0.25 is ~0.005
    assert auc == binary_auc(s.logits(counts, ids), labels)
    assert abs(labels.mean() - 0.25) < 0.02
    # Nor do the rows depend on it: dense and ids are the planted data set's.
    planted_rows = SyntheticCriteo(SyntheticConfig(scale=1e-5, num_samples=30_000)).raw_rows(10_000, 10_100)
    np.testing.assert_array_equal(planted_rows[0], counts[:100])


# ---- binary_auc ----


def test_binary_auc_hand_values():
    assert binary_auc(np.array([0.1, 0.4, 0.35, 0.8]), np.array([0, 0, 1, 1])) == 0.75
    # A tie between a positive and a negative counts one half: (0.5 + 1) / 2.
    assert binary_auc(np.array([1.0, 1.0, 2.0]), np.array([0.0, 1.0, 1.0])) == 0.75
    assert binary_auc(np.array([3.0, 3.0, 3.0, 3.0]), np.array([0, 1, 0, 1])) == 0.5
    assert binary_auc(np.array([1.0, 2.0]), np.array([1, 0])) == 0.0
    with pytest.raises(ValueError):
        binary_auc(np.array([1.0, 2.0]), np.array([1.0, 1.0]))


@pytest.mark.parametrize("seed", range(4))
def test_binary_auc_matches_torchmetrics_with_ties(seed):
    rng = np.random.default_rng(seed)
    n = 3000
    labels = (rng.random(n) < 0.3).astype(np.float32)
    # Few distinct values (heavy ties), shifted by the label so the AUC is away from 0.5.
    scores = rng.integers(0, 12, n).astype(np.float64) + 3 * labels * (seed % 2)
    expected = _reference_auc(scores, labels)
    assert binary_auc(scores, labels) == pytest.approx(expected, abs=1e-6)  # float32 result
    # Brute force over all pairs on a subsample.
    s, y = scores[:400], labels[:400] > 0.5
    diff = s[y][:, None] - s[~y][None, :]
    brute = ((diff > 0) + 0.5 * (diff == 0)).mean()
    assert binary_auc(s, labels[:400]) == pytest.approx(brute, abs=1e-12)


# ---- TSV output ----


def _parse_tsv(path):
    labels, counts, cats = [], [], []
    with open(path) as f:
        for line in f:
            assert line.endswith("\n")
            fields = line[:-1].split("\t")
            assert len(fields) == 40
            assert fields[0] in ("0", "1")
            assert all(re.fullmatch(r"[0-9]+", x) for x in fields[1:14]), fields[1:14]
            assert all(re.fullmatch(r"[0-9a-f]{8}", x) for x in fields[14:]), fields[14:]
            labels.append(int(fields[0]))
            counts.append([int(x) for x in fields[1:14]])
            cats.append([int(x, 16) for x in fields[14:]])
    return np.array(labels), np.array(counts, dtype=np.int64).reshape(-1, 13), np.array(cats, dtype=np.int64).reshape(-1, 26)


def test_write_tsv_is_criteo_format_and_round_trips(tmp_path):
    s = SyntheticCriteo(SyntheticConfig(scale=1e-3, num_samples=5000, ids="zipf"))
    path = tmp_path / "part.txt"
    s.write_tsv(path, 4000, 4300)  # crosses the 4096 block boundary
    assert sorted(p.name for p in tmp_path.iterdir()) == ["part.txt"]
    labels, counts, cats = _parse_tsv(path)
    want_counts, want_ids, want_labels = s.raw_rows(4000, 4300)
    assert len(labels) == 300
    np.testing.assert_array_equal(labels, want_labels.astype(np.int64))
    np.testing.assert_array_equal(counts, want_counts)
    np.testing.assert_array_equal(cats, np.concatenate(want_ids, axis=1))
    # The project's own TSV reader agrees, with no malformed lines.
    chunks = list(read_tsv(path, chunk_rows=128))
    assert chunks[-1].report.good == chunks[-1].report.lines == 300
    np.testing.assert_array_equal(np.concatenate([c.labels for c in chunks]), labels)
    np.testing.assert_array_equal(np.concatenate([c.dense for c in chunks]), counts)
    np.testing.assert_array_equal(np.concatenate([c.categorical for c in chunks]).astype(np.int64), cats)


def test_write_tsv_whole_dataset(tmp_path):
    s = SyntheticCriteo(SyntheticConfig(scale=1e-5, num_samples=250))
    path = tmp_path / "all.txt"
    s.write_tsv(str(path))
    labels, counts, cats = _parse_tsv(path)
    want_counts, want_ids, want_labels = s.raw_rows(0, 250)
    np.testing.assert_array_equal(labels, want_labels)
    np.testing.assert_array_equal(counts, want_counts)
    np.testing.assert_array_equal(cats, np.concatenate(want_ids, axis=1))


def test_write_tsv_refuses_multi_hot(tmp_path):
    s = SyntheticCriteo(SyntheticConfig(scale=1e-5, num_samples=100, multi_hot=True, planted=False))
    with pytest.raises(ValueError, match="multi-hot"):
        s.write_tsv(tmp_path / "x.txt")
    assert not any(tmp_path.iterdir())


# ---- config validation ----


@pytest.mark.parametrize(
    "kw, field",
    [
        (dict(preset="criteo-2tb"), "preset"),
        (dict(ids="normal"), "ids"),
        (dict(embedding_share=0.49), "embedding_share"),
        (dict(embedding_share=1.0), "embedding_share"),
        (dict(interaction_share=1.5), "interaction_share"),
        (dict(ctr=0.0), "ctr"),
        (dict(scale=0.0), "scale"),
        (dict(zipf_alpha=1.0), "zipf_alpha"),
    ],
)
def test_config_validation(kw, field):
    with pytest.raises(ValueError, match=rf"^{field}\b"):
        SyntheticConfig(**kw)
