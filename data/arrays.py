"""The binary Criteo store: raw little-endian arrays on disk, memory-mapped to read.

A store is a directory::

    meta.json    {"format": "torch_tpu.criteo-arrays.v1", "rows": N,
                  "table_sizes": [26 ints], "splits": {"train": [0, a], "val": [a, b], "test": [b, N]},
                  ...free-form extras such as "source" and "malformed"}
    dense.f32    (N, 13) float32, log(max(x, 0) + 1) of the integer features
    sparse.i32   (N, 26) int32, ids already reduced mod their table size
    labels.f32   (N,) float32, 0 or 1

Raw files rather than .npy so that a reader needs nothing but the row count to
map them, and a truncated file shows up as a size mismatch. ``ArrayWriter``
streams a store into a temporary sibling directory and renames it into place
only once it is complete, so a crash never leaves a half-written store where a
good one was.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, BinaryIO

import numpy as np

from data.schema import NUM_DENSE, NUM_SPARSE, SPARSE_NAMES

FORMAT = "torch_tpu.criteo-arrays.v1"
"""The ``format`` string of meta.json; a reader refuses any other."""

META_FILE = "meta.json"

_RESERVED_META = ("format", "rows", "table_sizes", "splits")
_INT32_MAX = np.iinfo(np.int32).max


@dataclasses.dataclass(frozen=True)
class _Column:
    """One data file of the store: its name, little-endian dtype and row width (None: 1-D)."""

    file: str
    dtype: str
    width: int | None


_DENSE = _Column("dense.f32", "<f4", NUM_DENSE)
_SPARSE = _Column("sparse.i32", "<i4", NUM_SPARSE)
_LABELS = _Column("labels.f32", "<f4", None)
_COLUMNS = (_DENSE, _SPARSE, _LABELS)


@dataclasses.dataclass(frozen=True)
class CriteoArrays:
    """Rows of a Criteo store as host arrays (memory-mapped when they come from ``open_arrays``)."""

    dense: np.ndarray
    """(N, 13) float32, log(max(x, 0) + 1) already applied."""
    sparse: np.ndarray
    """(N, 26) int32, id of each categorical feature, in [0, table_sizes[f])."""
    labels: np.ndarray
    """(N,) float32, 0 or 1."""
    table_sizes: tuple[int, ...]
    """Rows per categorical feature, e.g. ``data.schema.KAGGLE_TABLE_SIZES``."""

    def __post_init__(self) -> None:
        n = self.labels.shape[0] if self.labels.ndim == 1 else -1
        if n < 0 or self.dense.shape != (n, NUM_DENSE) or self.sparse.shape != (n, NUM_SPARSE):
            raise ValueError(
                f"CriteoArrays: expected dense (N, {NUM_DENSE}), sparse (N, {NUM_SPARSE}) and labels (N,), "
                f"got {self.dense.shape}, {self.sparse.shape} and {self.labels.shape}"
            )
        if len(self.table_sizes) != NUM_SPARSE:
            raise ValueError(f"CriteoArrays: expected {NUM_SPARSE} table sizes, got {len(self.table_sizes)}")

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    def rows(self, start: int, stop: int) -> CriteoArrays:
        """Rows ``start:stop`` as views of the same memory (no copy)."""
        if not 0 <= start <= stop <= len(self):
            raise IndexError(f"rows({start}, {stop}): expected 0 <= start <= stop <= {len(self)}")
        return dataclasses.replace(
            self, dense=self.dense[start:stop], sparse=self.sparse[start:stop], labels=self.labels[start:stop]
        )


def day_splits(day_rows: Sequence[int]) -> dict[str, tuple[int, int]]:
    """The reference split over consecutive days of the given row counts.

    Every day but the last is train; the last day's first half (rounded up) is
    validation, its second half test. E.g. ``day_splits([5, 5, 3])`` is
    ``{"train": (0, 10), "val": (10, 12), "test": (12, 13)}``.
    """
    if not day_rows or any(r < 0 for r in day_rows):
        raise ValueError(f"day_splits: expected one or more non-negative row counts, got {list(day_rows)}")
    last_start = sum(day_rows[:-1])
    rows = last_start + day_rows[-1]
    val_stop = last_start + math.ceil(day_rows[-1] / 2)
    return {"train": (0, last_start), "val": (last_start, val_stop), "test": (val_stop, rows)}


def reference_splits(rows: int, days: int) -> dict[str, tuple[int, int]]:
    """The reference DLRM split of ``rows`` consecutive rows holding ``days`` days of data.

    The days are equal (``rows // days``), the last one also takes the remainder;
    all days but the last are train, the last is halved into validation then test.
    E.g. ``reference_splits(100, 7)`` is ``{"train": (0, 84), "val": (84, 92), "test": (92, 100)}``.
    """
    if rows < 0 or days < 1:
        raise ValueError(f"reference_splits({rows}, {days}): expected rows >= 0 and days >= 1")
    per_day = rows // days
    return day_splits([per_day] * (days - 1) + [rows - per_day * (days - 1)])


class ArrayWriter:
    """Streams rows into a new store; commits it atomically at ``close`` (or at the end of ``with``).

    Everything goes to ``<out_dir>.tmp-<pid>`` first; only a complete store is
    renamed to ``out_dir`` (a previous store there is moved aside, replaced, then
    deleted). An exception inside ``with`` removes the temporary directory and
    leaves ``out_dir`` as it was::

        with ArrayWriter(out, table_sizes) as w:
            for dense, sparse, labels in chunks:
                w.append(dense, sparse, labels)
            w.close(reference_splits(w.rows, 7), source="train.txt")
    """

    def __init__(self, out_dir: str | Path, table_sizes: Sequence[int]) -> None:
        self.out_dir = Path(os.path.abspath(out_dir))
        self.table_sizes = tuple(int(s) for s in table_sizes)
        if len(self.table_sizes) != NUM_SPARSE or not all(0 < s <= _INT32_MAX + 1 for s in self.table_sizes):
            raise ValueError(
                f"table_sizes: expected {NUM_SPARSE} sizes in [1, 2**31], got {list(table_sizes)}"
            )
        _check_replaceable(self.out_dir)
        self.rows = 0
        self._state = "open"
        self._sizes = np.asarray(self.table_sizes, dtype=np.int64)
        self._tmp = self.out_dir.with_name(f"{self.out_dir.name}.tmp-{os.getpid()}")
        if self._tmp.exists():  # left by an earlier crashed writer that had our pid
            shutil.rmtree(self._tmp)
        self._tmp.mkdir(parents=True)
        self._files: dict[str, BinaryIO] = {c.file: open(self._tmp / c.file, "wb") for c in _COLUMNS}

    def __enter__(self) -> ArrayWriter:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._state != "open":
            return
        if exc_type is not None:
            self.abort()
            return
        try:
            self.close()
        except BaseException:
            self.abort()
            raise

    def append(self, dense: np.ndarray, sparse: np.ndarray, labels: np.ndarray) -> None:
        """Appends a chunk: dense (n, 13) float32, sparse (n, 26) int32 in range, labels (n,) float32."""
        if self._state != "open":
            raise RuntimeError(f"ArrayWriter for {self.out_dir} is {self._state}: cannot append")
        _check_array("dense", dense, np.float32, (NUM_DENSE,))
        n = dense.shape[0]
        _check_array("sparse", sparse, np.int32, (NUM_SPARSE,), n)
        _check_array("labels", labels, np.float32, (), n)
        self._check_values(dense, sparse, labels)
        for column, array in zip(_COLUMNS, (dense, sparse, labels)):
            self._files[column.file].write(np.ascontiguousarray(array, dtype=column.dtype).data)
        self.rows += n

    def close(self, splits: Mapping[str, Sequence[int]] | None = None, **extra_meta: Any) -> None:
        """Writes meta.json and renames the finished store into place.

        ``splits`` maps split names to ``(start, stop)`` row ranges; None makes
        every row train (with empty val and test). ``extra_meta`` lands in
        meta.json as is (JSON-serialisable values, e.g. ``source=...``).
        """
        if self._state != "open":
            raise RuntimeError(f"ArrayWriter for {self.out_dir} is {self._state}: cannot close")
        if splits is None:
            splits = {"train": (0, self.rows), "val": (self.rows, self.rows), "test": (self.rows, self.rows)}
        clash = sorted(set(extra_meta) & set(_RESERVED_META))
        if clash:
            raise ValueError(f"extra meta keys {clash} are reserved; use other names")
        meta = {
            "format": FORMAT,
            "rows": self.rows,
            "table_sizes": list(self.table_sizes),
            "splits": _checked_splits(splits, self.rows, f"ArrayWriter({self.out_dir})"),
            **extra_meta,
        }
        for f in self._files.values():
            f.flush()
            os.fsync(f.fileno())
            f.close()
        with open(self._tmp / META_FILE, "w") as f:
            f.write("{\n" + ",\n".join(f" {json.dumps(k)}: {json.dumps(v)}" for k, v in meta.items()) + "\n}\n")
            f.flush()
            os.fsync(f.fileno())
        self._commit()
        self._state = "committed"

    def abort(self) -> None:
        """Drops everything written so far; ``out_dir`` stays as it was."""
        for f in self._files.values():
            f.close()
        shutil.rmtree(self._tmp, ignore_errors=True)
        self._state = "aborted"

    def _check_values(self, dense: np.ndarray, sparse: np.ndarray, labels: np.ndarray) -> None:
        bad = (sparse < 0) | (sparse >= self._sizes)
        if bad.any():
            row, col = (int(i[0]) for i in np.nonzero(bad))
            raise ValueError(
                f"sparse id {int(sparse[row, col])} of feature {SPARSE_NAMES[col]} (column {col}) at row "
                f"{self.rows + row} is outside [0, {self.table_sizes[col]}): reduce ids mod the table size first"
            )
        if not (dense >= 0).all() or not np.isfinite(dense).all():
            row, col = (int(i[0]) for i in np.nonzero(~((dense >= 0) & np.isfinite(dense))))
            raise ValueError(
                f"dense value {float(dense[row, col])} (column {col}) at row {self.rows + row}: expected a finite "
                f"log(max(x, 0) + 1) >= 0"
            )
        if not ((labels == 0) | (labels == 1)).all():
            row = int(np.flatnonzero((labels != 0) & (labels != 1))[0])
            raise ValueError(f"label {float(labels[row])} at row {self.rows + row}: expected 0 or 1")

    def _commit(self) -> None:
        _check_replaceable(self.out_dir)  # something may have appeared there while we wrote
        if not self.out_dir.exists():
            os.replace(self._tmp, self.out_dir)
        else:
            backup = self.out_dir.with_name(f"{self.out_dir.name}.old-{os.getpid()}")
            shutil.rmtree(backup, ignore_errors=True)
            os.replace(self.out_dir, backup)
            try:
                os.replace(self._tmp, self.out_dir)
            except BaseException:
                os.replace(backup, self.out_dir)
                raise
            shutil.rmtree(backup)
        _fsync_dir(self.out_dir.parent)


def read_meta(path: str | Path) -> dict[str, Any]:
    """meta.json of the store at ``path``, checked: format, rows, 26 table sizes, splits in range."""
    meta_path = Path(path) / META_FILE
    if not meta_path.is_file():
        raise FileNotFoundError(
            f"{meta_path}: not found; expected a store written by ArrayWriter "
            f"(python -m data.criteo preprocess IN OUT)"
        )
    try:
        meta = json.loads(meta_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{meta_path}: not valid JSON ({e})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        found = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise ValueError(f"{meta_path}: format {found!r}, expected {FORMAT!r}")
    rows, sizes = meta.get("rows"), meta.get("table_sizes")
    if not isinstance(rows, int) or rows < 0:
        raise ValueError(f"{meta_path}: rows {rows!r}, expected an integer >= 0")
    if not isinstance(sizes, list) or len(sizes) != NUM_SPARSE or not all(isinstance(s, int) and s > 0 for s in sizes):
        raise ValueError(f"{meta_path}: table_sizes {sizes!r}, expected {NUM_SPARSE} positive integers")
    meta["splits"] = _checked_splits(meta.get("splits"), rows, str(meta_path))
    return meta


def open_arrays(path: str | Path) -> dict[str, CriteoArrays]:
    """The splits of the store at ``path``, keyed by name ("train", "val", "test"), memory-mapped read-only."""
    path = Path(path)
    meta = read_meta(path)
    rows = meta["rows"]
    dense, sparse, labels = (_map_column(path, c, rows) for c in _COLUMNS)
    whole = CriteoArrays(dense, sparse, labels, tuple(meta["table_sizes"]))
    return {name: whole.rows(start, stop) for name, (start, stop) in meta["splits"].items()}


def _map_column(path: Path, column: _Column, rows: int) -> np.ndarray:
    """One data file as a read-only memmap, after checking its size against the row count."""
    file = path / column.file
    shape = (rows,) if column.width is None else (rows, column.width)
    expected = math.prod(shape) * 4
    if not file.is_file():
        raise FileNotFoundError(f"{file}: not found; the store at {path} is incomplete")
    actual = file.stat().st_size
    if actual != expected:
        width = 1 if column.width is None else column.width
        raise ValueError(
            f"{file}: {actual} bytes, expected {rows} rows x {width} x 4 = {expected} bytes "
            f"(truncated or not written with this meta.json); re-run the preprocessing"
        )
    if rows == 0:  # mmap cannot map an empty file
        return np.zeros(shape, dtype=column.dtype)
    return np.memmap(file, dtype=column.dtype, mode="r", shape=shape)


def _check_array(
    name: str, array: np.ndarray, dtype: type, row_shape: tuple[int, ...], rows: int | None = None
) -> None:
    """Raises ValueError unless ``array`` is an ndarray of ``dtype`` shaped (rows, *row_shape)."""
    if not isinstance(array, np.ndarray) or array.dtype != dtype:
        got = array.dtype if isinstance(array, np.ndarray) else type(array).__name__
        raise ValueError(f"{name}: expected a {np.dtype(dtype).name} ndarray, got {got}")
    n = array.shape[0] if array.ndim >= 1 else -1
    if array.shape[1:] != row_shape or n < 0 or (rows is not None and n != rows):
        want = ("N" if rows is None else str(rows),) + tuple(str(d) for d in row_shape)
        raise ValueError(f"{name}: expected shape ({', '.join(want)}{',' * (len(want) == 1)}), got {array.shape}")


def _checked_splits(splits: Any, rows: int, where: str) -> dict[str, list[int]]:
    """``splits`` as {name: [start, stop]} after checking 0 <= start <= stop <= rows."""
    if not isinstance(splits, Mapping) or not splits:
        raise ValueError(f"{where}: splits {splits!r}, expected a mapping of names to [start, stop]")
    out = {}
    for name, bounds in splits.items():
        ok = isinstance(bounds, Sequence) and len(bounds) == 2 and all(isinstance(b, (int, np.integer)) for b in bounds)
        if not ok or not 0 <= bounds[0] <= bounds[1] <= rows:
            raise ValueError(
                f"{where}: split {name!r} is {bounds!r}, expected [start, stop] with 0 <= start <= stop <= {rows}"
            )
        out[str(name)] = [int(bounds[0]), int(bounds[1])]
    return out


_STORE_FILES = frozenset([META_FILE, *(c.file for c in _COLUMNS)])


def _check_replaceable(out_dir: Path) -> None:
    """Refuses to overwrite anything but an earlier store (or an empty directory). A store is
    replaced whole, so a directory that also holds other files (a run's checkpoints, the raw
    input itself) is refused with their names: replacing it would delete them."""
    if not out_dir.exists():
        return
    if not out_dir.is_dir():
        raise FileExistsError(f"{out_dir}: exists and is not a directory; choose another output path")
    names = {entry.name for entry in out_dir.iterdir()}
    if not names:
        return
    if META_FILE not in names:
        raise FileExistsError(
            f"{out_dir}: exists and is not a Criteo store (no {META_FILE}); refusing to replace it, "
            f"choose another output path or remove it"
        )
    others = sorted(names - _STORE_FILES)
    if others:
        raise FileExistsError(
            f"{out_dir}: holds a Criteo store and other files ({', '.join(others)}); replacing the store would "
            f"delete them: move them out, or choose another output path"
        )


def _fsync_dir(path: Path) -> None:
    """Makes a rename in ``path`` durable (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
