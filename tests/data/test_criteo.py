"""data.criteo and data.arrays: reading real-format Criteo TSV, preprocessing, the binary store, the CLI.

The TSV files are written here from seeded random rows, with malformed lines of
every kind mixed in; expected values are computed from the rows with plain
Python (int(), int(x, 16), math.log1p), independently of the numpy parser.
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from data import arrays
from data.arrays import ArrayWriter, CriteoArrays, day_splits, open_arrays, read_meta, reference_splits
from data.criteo import ReadReport, preprocess, read_tsv
from data.schema import KAGGLE_TABLE_SIZES, NUM_DENSE, NUM_SPARSE

REPO = Path(__file__).resolve().parents[2]


def _replaced(fields: list[str], index: int, value: str) -> list[str]:
    return fields[:index] + [value] + fields[index + 1 :]


# (the reason a line must be counted under, how a good line is spoiled into it)
MALFORMED = [
    ("wrong_field_count", lambda f: f[:-1]),  # 39 fields
    ("wrong_field_count", lambda f: f + ["1a"]),  # 41 fields
    ("wrong_field_count", lambda f: []),  # a blank line
    ("non_integer_dense", lambda f: _replaced(f, 3, "abc")),
    ("non_integer_dense", lambda f: _replaced(f, 7, "1.5")),
    ("non_hex_categorical", lambda f: _replaced(f, 20, "zzzz")),
    ("bad_label", lambda f: _replaced(f, 0, "2")),
    ("bad_label", lambda f: _replaced(_replaced(f, 0, "x"), 2, "abc")),  # the first reason wins
    ("non_integer_dense", lambda f: _replaced(f, 13, "-")),
    ("non_hex_categorical", lambda f: _replaced(f, 39, "1" * 17)),  # does not fit 64 bits
]
EXPECTED_COUNTS = {"wrong_field_count": 3, "bad_label": 2, "non_integer_dense": 3, "non_hex_categorical": 2}


def _dense_field(rng: np.random.Generator) -> str:
    r = rng.random()
    if r < 0.15:
        return ""
    if r < 0.25:
        return str(-int(rng.integers(1, 5)))
    if r < 0.28:
        return str(int(rng.integers(10**17, 10**18)))  # 18 digits, the longest accepted
    return str(int(rng.integers(0, 10**5)))


def _cat_field(rng: np.random.Generator) -> str:
    r = rng.random()
    if r < 0.1:
        return ""
    if r < 0.15:
        return f"{int(rng.integers(0, 2**32)):08X}"  # upper case
    if r < 0.2:
        return f"{int(rng.integers(0, 16)):x}"  # one digit
    if r < 0.25:
        return f"{int(rng.integers(2**63, 2**64 - 1, dtype=np.uint64)):016x}"  # 16 digits, above int64
    return f"{int(rng.integers(0, 2**32)):08x}"


def random_rows(n: int, seed: int) -> list[list[str]]:
    """n well-formed Criteo rows as lists of 40 field strings."""
    rng = np.random.default_rng(seed)
    return [
        [str(int(rng.integers(0, 2)))]
        + [_dense_field(rng) for _ in range(NUM_DENSE)]
        + [_cat_field(rng) for _ in range(NUM_SPARSE)]
        for _ in range(n)
    ]


def write_tsv(path: Path, rows: list[list[str]], malformed: list = (), seed: int = 0) -> list[tuple[int, str]]:
    """Writes ``rows`` with the ``malformed`` spoilers' lines inserted at seeded positions.

    Some lines end in CRLF and the file has no final newline, as real files may.
    Returns the (1-based line number, reason) of every malformed line.
    """
    rng = np.random.default_rng(seed)
    lines = [("\t".join(r), None) for r in rows]
    for reason, spoil in malformed:
        at = int(rng.integers(0, len(lines) + 1))
        lines.insert(at, ("\t".join(spoil(rows[at % len(rows)])), reason))
    ends = ["\r\n" if i % 17 == 5 else "\n" for i in range(len(lines))]
    ends[-1] = ""
    path.write_bytes("".join(text + end for (text, _), end in zip(lines, ends)).encode())
    return [(i + 1, reason) for i, (_, reason) in enumerate(lines) if reason]


def expected_ints(rows: list[list[str]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    labels = np.array([int(r[0]) for r in rows], dtype=np.int64)
    dense = np.array([[int(x) if x else 0 for x in r[1 : 1 + NUM_DENSE]] for r in rows], dtype=np.int64)
    cats = np.array([[int(x, 16) if x else 0 for x in r[1 + NUM_DENSE :]] for r in rows], dtype=np.uint64)
    return labels, dense, cats


def expected_store(rows: list[list[str]], sizes=KAGGLE_TABLE_SIZES) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    dense = np.array([[math.log1p(max(int(x) if x else 0, 0)) for x in r[1 : 1 + NUM_DENSE]] for r in rows])
    sparse = np.array([[int(x, 16) % s if x else 0 for x, s in zip(r[1 + NUM_DENSE :], sizes)] for r in rows])
    return dense.astype(np.float32), sparse.astype(np.int32), np.array([float(r[0]) for r in rows], np.float32)


def whole(splits: dict[str, CriteoArrays]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The rows of train, val and test back to back (they tile the store in that order here)."""
    parts = [splits[name] for name in ("train", "val", "test")]
    return tuple(np.concatenate([getattr(p, f) for p in parts]) for f in ("dense", "sparse", "labels"))


def small_store(path: Path, rows: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Writes a store of random valid arrays (all rows train); returns them."""
    rng = np.random.default_rng(seed)
    dense = rng.random((rows, NUM_DENSE), dtype=np.float32)
    sparse = (rng.integers(0, 2**31, (rows, NUM_SPARSE)) % np.array(KAGGLE_TABLE_SIZES)).astype(np.int32)
    labels = rng.integers(0, 2, rows).astype(np.float32)
    with ArrayWriter(path, KAGGLE_TABLE_SIZES) as w:
        w.append(dense[:3], sparse[:3], labels[:3])
        w.append(dense[3:], sparse[3:], labels[3:])
    return dense, sparse, labels


def leftovers(out: Path) -> list[str]:
    return sorted(p.name for p in out.parent.iterdir() if p.name.startswith(out.name + "."))


# ---- reading TSV ----


def test_read_tsv_counts_every_malformed_kind_and_reads_good_lines_exactly(tmp_path):
    rows = random_rows(300, seed=1)
    bad = write_tsv(tmp_path / "train.txt", rows, MALFORMED)
    report = ReadReport(max_examples=len(MALFORMED))
    chunks = list(read_tsv(tmp_path / "train.txt", chunk_rows=64, report=report))

    assert len(chunks) == math.ceil((300 + len(MALFORMED)) / 64)
    assert report.counts() == EXPECTED_COUNTS
    assert (report.lines, report.good, report.malformed) == (300 + len(MALFORMED), 300, len(MALFORMED))
    assert [(e.line, e.reason) for e in report.examples] == bad
    labels, dense, cats = expected_ints(rows)
    np.testing.assert_array_equal(np.concatenate([c.labels for c in chunks]), labels)
    np.testing.assert_array_equal(np.concatenate([c.dense for c in chunks]), dense)
    got_cats = np.concatenate([c.categorical for c in chunks])
    assert got_cats.dtype == np.uint64
    np.testing.assert_array_equal(got_cats, cats)


def test_read_report_names_the_bad_field_and_keeps_the_first_five(tmp_path):
    rows = random_rows(40, seed=2)
    write_tsv(tmp_path / "day_0", rows, MALFORMED)
    report = ReadReport()
    for _ in read_tsv([tmp_path / "day_0"], chunk_rows=7, report=report):
        pass
    assert len(report.examples) == 5 and report.malformed == len(MALFORMED)
    full = ReadReport(max_examples=99)
    for _ in read_tsv(tmp_path / "day_0", report=full):
        pass
    texts = [f"{e.reason}: {e.detail}" for e in full.examples]
    assert "non_integer_dense: field 8 (int_6) '1.5'" in texts
    assert "non_hex_categorical: field 21 (cat_6) 'zzzz'" in texts
    assert "bad_label: label '2'" in texts
    assert "wrong_field_count: 41 fields, expected 40" in texts
    assert "day_0:" in report.summary() and "wrong_field_count 3" in report.summary()


# ---- splits ----


def test_reference_splits_by_hand():
    # 100 rows over 7 days: 14 a day, the last day 14 + 2 = 16 rows, halved.
    assert reference_splits(100, 7) == {"train": (0, 84), "val": (84, 92), "test": (92, 100)}
    # 101 rows: the last day has 17, validation takes the larger half.
    assert reference_splits(101, 7) == {"train": (0, 84), "val": (84, 93), "test": (93, 101)}
    assert reference_splits(10, 1) == {"train": (0, 0), "val": (0, 5), "test": (5, 10)}
    assert reference_splits(3, 7) == {"train": (0, 0), "val": (0, 2), "test": (2, 3)}
    assert day_splits([5, 5, 3]) == {"train": (0, 10), "val": (10, 12), "test": (12, 13)}
    with pytest.raises(ValueError, match="days"):
        reference_splits(10, 0)


# ---- preprocess and the store ----


def test_preprocess_round_trip(tmp_path):
    rows = random_rows(300, seed=3)
    write_tsv(tmp_path / "train.txt", rows, MALFORMED)
    report = preprocess([tmp_path / "train.txt"], tmp_path / "store", chunk_rows=50, progress=False)

    assert report.counts() == EXPECTED_COUNTS
    splits = open_arrays(tmp_path / "store")
    # 300 rows, 7 days of 42 (the last also takes 300 - 7 * 42 = 6), last day halved.
    assert {k: (len(v)) for k, v in splits.items()} == {"train": 252, "val": 24, "test": 24}
    assert read_meta(tmp_path / "store")["splits"] == {"train": [0, 252], "val": [252, 276], "test": [276, 300]}
    dense, sparse, labels = whole(splits)
    want_dense, want_sparse, want_labels = expected_store(rows)
    assert (dense.dtype, sparse.dtype, labels.dtype) == (np.float32, np.int32, np.float32)
    np.testing.assert_allclose(dense, want_dense, rtol=1e-6, atol=0)
    np.testing.assert_array_equal(sparse, want_sparse)
    np.testing.assert_array_equal(labels, want_labels)

    train = splits["train"]
    assert isinstance(train.dense, np.memmap) and not train.dense.flags.writeable
    assert train.table_sizes == KAGGLE_TABLE_SIZES
    sub = train.rows(10, 20)
    assert len(sub) == 10 and np.shares_memory(sub.sparse, train.sparse)
    np.testing.assert_array_equal(sub.labels, want_labels[10:20])
    meta = read_meta(tmp_path / "store")
    assert meta["malformed"] == EXPECTED_COUNTS and meta["rows"] == 300
    assert leftovers(tmp_path / "store") == []


def test_preprocess_several_files_splits_by_file(tmp_path):
    days = [random_rows(n, seed=10 + i) for i, n in enumerate((30, 20, 11))]
    paths = [tmp_path / f"day_{i}" for i in range(3)]
    for i, (path, rows) in enumerate(zip(paths, days)):
        write_tsv(path, rows, MALFORMED[:2] if i == 1 else [])
    report = preprocess(paths, tmp_path / "store", chunk_rows=8, progress=False)

    assert report.counts()["wrong_field_count"] == 2 and report.good == 61
    assert read_meta(tmp_path / "store")["splits"] == {"train": [0, 50], "val": [50, 56], "test": [56, 61]}
    dense, sparse, labels = whole(open_arrays(tmp_path / "store"))
    want = [np.concatenate(parts) for parts in zip(*(expected_store(rows) for rows in days))]
    np.testing.assert_array_equal(sparse, want[1])
    np.testing.assert_array_equal(labels, want[2])
    with pytest.raises(ValueError, match="one day each"):
        preprocess(paths, tmp_path / "other", days=7, progress=False)


def test_open_arrays_reports_missing_truncated_and_foreign_stores(tmp_path):
    with pytest.raises(FileNotFoundError, match="meta.json"):
        open_arrays(tmp_path)
    store = tmp_path / "store"
    dense, sparse, labels = small_store(store, rows=9, seed=4)
    got = open_arrays(store)["train"]
    np.testing.assert_array_equal(got.sparse, sparse)
    np.testing.assert_array_equal(got.dense, dense)
    assert len(open_arrays(store)["val"]) == 0

    with open(store / "labels.f32", "ab") as f:
        f.write(bytes(4))
    with pytest.raises(ValueError, match=r"labels\.f32: 40 bytes, expected 9 rows x 1 x 4 = 36"):
        open_arrays(store)
    with open(store / "labels.f32", "r+b") as f:
        f.truncate(36)
    with open(store / "sparse.i32", "r+b") as f:
        f.truncate(9 * NUM_SPARSE * 4 - 4)
    with pytest.raises(ValueError, match=r"sparse\.i32: 932 bytes, expected 9 rows x 26 x 4 = 936"):
        open_arrays(store)
    (store / "sparse.i32").unlink()
    with pytest.raises(FileNotFoundError, match=r"sparse\.i32"):
        open_arrays(store)

    meta = json.loads((store / "meta.json").read_text())
    (store / "meta.json").write_text(json.dumps({**meta, "format": "npz"}))
    with pytest.raises(ValueError, match="format 'npz', expected 'torch_tpu.criteo-arrays.v1'"):
        open_arrays(store)


def test_writer_checks_chunks(tmp_path):
    out = tmp_path / "store"
    dense = np.zeros((4, NUM_DENSE), np.float32)
    sparse = np.zeros((4, NUM_SPARSE), np.int32)
    labels = np.zeros(4, np.float32)
    big = sparse.copy()
    big[2, 8] = KAGGLE_TABLE_SIZES[8]  # 3: one past the last row of cat_8
    cases = [
        ((dense, big, labels), r"sparse id 3 of feature cat_8 \(column 8\) at row 2 is outside \[0, 3\)"),
        ((dense, sparse - 1, labels), "sparse id -1 of feature cat_0"),
        ((dense, sparse.astype(np.int64), labels), "sparse: expected a int32 ndarray, got int64"),
        ((dense[:, :12], sparse, labels), r"dense: expected shape \(N, 13\)"),
        ((dense, sparse[:3], labels), r"sparse: expected shape \(4, 26\)"),
        ((dense, sparse, labels + 2), "label 2.0 at row 0"),
        ((dense - 1, sparse, labels), "dense value -1.0"),
    ]
    for chunk, message in cases:
        with pytest.raises(ValueError, match=message):
            with ArrayWriter(out, KAGGLE_TABLE_SIZES) as w:
                w.append(*chunk)
        assert not out.exists() and leftovers(out) == []
    with pytest.raises(ValueError, match="26 sizes"):
        ArrayWriter(out, KAGGLE_TABLE_SIZES[:-1])


def test_writer_crash_keeps_the_previous_store(tmp_path, monkeypatch):
    out = tmp_path / "store"
    old = small_store(out, rows=6, seed=5)
    with pytest.raises(RuntimeError, match="boom"):
        with ArrayWriter(out, KAGGLE_TABLE_SIZES) as w:
            w.append(*(a[:2] for a in old))
            assert (tmp_path / f"store.tmp-{os.getpid()}" / "dense.f32").exists()
            raise RuntimeError("boom")
    assert leftovers(out) == []
    np.testing.assert_array_equal(open_arrays(out)["train"].sparse, old[1])

    # A failure at the final rename puts the previous store back.
    real_replace = os.replace

    def failing_replace(src, dst):
        if ".tmp-" in str(src):
            raise OSError("disk gone")
        real_replace(src, dst)

    monkeypatch.setattr(arrays.os, "replace", failing_replace)
    with pytest.raises(OSError, match="disk gone"):
        with ArrayWriter(out, KAGGLE_TABLE_SIZES) as w:
            w.append(*(a[:2] for a in old))
    monkeypatch.undo()
    assert leftovers(out) == []
    np.testing.assert_array_equal(open_arrays(out)["train"].labels, old[2])

    new = small_store(out, rows=4, seed=6)  # a good write replaces it
    np.testing.assert_array_equal(open_arrays(out)["train"].sparse, new[1])
    assert leftovers(out) == []


def test_writer_refuses_to_replace_other_directories(tmp_path):
    (tmp_path / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="not a Criteo store"):
        ArrayWriter(tmp_path, KAGGLE_TABLE_SIZES)
    assert (tmp_path / "notes.txt").read_text() == "keep me"


def test_writer_keeps_a_store_directory_holding_other_files(tmp_path):
    """A store's directory that also holds other files (a run's checkpoint, the raw input) is
    not replaced: replacing the store whole would delete them."""
    out = tmp_path / "store"
    old = small_store(out, rows=4, seed=5)
    (out / "checkpoint.pt").write_bytes(b"a run's checkpoint")
    with pytest.raises(FileExistsError, match=r"other files \(checkpoint.pt\)"):
        ArrayWriter(out, KAGGLE_TABLE_SIZES)
    assert (out / "checkpoint.pt").read_bytes() == b"a run's checkpoint"
    np.testing.assert_array_equal(open_arrays(out)["train"].labels, old[2])


# ---- CLI ----


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "data.criteo", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=60)


def test_cli_preprocess(tmp_path):
    rows = random_rows(100, seed=7)
    write_tsv(tmp_path / "train.txt", rows, MALFORMED[:2])
    result = run_cli("preprocess", str(tmp_path / "train.txt"), str(tmp_path / "out"), "--no-progress",
                     "--chunk-rows", "30")
    assert result.returncode == 0, result.stderr
    assert "train 84, val 8, test 8 rows" in result.stdout
    assert "wrong_field_count 2" in result.stdout
    np.testing.assert_array_equal(whole(open_arrays(tmp_path / "out"))[1], expected_store(rows)[1])


def test_cli_reports_a_missing_input(tmp_path):
    result = run_cli("preprocess", str(tmp_path / "day_0"), str(tmp_path / "nope.tsv"), str(tmp_path / "out"))
    assert result.returncode != 0
    assert "input file not found" in result.stderr and "day_0" in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "out").exists()


def test_import_prints_nothing():
    result = subprocess.run([sys.executable, "-c", "import data.criteo"], cwd=REPO, capture_output=True, text=True,
                            timeout=60)
    assert (result.returncode, result.stdout, result.stderr) == (0, "", "")


def test_gzip_inputs_and_inputs_without_a_good_line_are_errors_that_keep_the_store(tmp_path):
    import gzip

    rows = random_rows(50, seed=5)
    write_tsv(tmp_path / "good.txt", rows, [])
    preprocess([tmp_path / "good.txt"], tmp_path / "store", progress=False)
    (tmp_path / "day_0.gz").write_bytes(gzip.compress((tmp_path / "good.txt").read_bytes()))
    with pytest.raises(ValueError, match="gzip-compressed; expected the tab-separated text"):
        preprocess([tmp_path / "day_0.gz"], tmp_path / "store", progress=False)
    (tmp_path / "bad.txt").write_text("1\t2\t3\n" * 10)
    with pytest.raises(ValueError, match="no well-formed line"):
        preprocess([tmp_path / "bad.txt"], tmp_path / "store", progress=False)
    result = run_cli("preprocess", str(tmp_path / "day_0.gz"), str(tmp_path / "store"), "--no-progress")
    assert result.returncode != 0 and "gzip" in result.stderr and "Traceback" not in result.stderr
    np.testing.assert_array_equal(whole(open_arrays(tmp_path / "store"))[1], expected_store(rows)[1])  # kept
