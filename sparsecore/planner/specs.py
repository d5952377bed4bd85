"""What the planner plans: tables as plain data, read from CSV, JSON or YAML.

One row per table::

    name,num_embeddings,embedding_dim,pooling_factor,zipf_alpha,optimizer,data_type
    t_cat_0,1460,64,1.0,1.05,rowwise_adagrad,fp32

``pooling_factor`` is the mean ids per sample (default 1); ``zipf_alpha`` the
skew of the ids (empty: uniform), which sets how many of them are distinct;
``optimizer`` one of sgd, adagrad, rowwise_adagrad, adam, ftrl (default
rowwise_adagrad); ``data_type`` fp32, fp16 or bf16 (default fp32).
"""

from __future__ import annotations

import csv
import dataclasses
import json
import math
from pathlib import Path
from typing import Any

OPTIMIZER_STATE = {"sgd": 0, "adagrad": -1, "rowwise_adagrad": 1, "adam": -2, "ftrl": -2}
"""fp32 state values per row: a count, or -k for k per element (adagrad: dim; adam, ftrl: 2 x dim)."""
DTYPE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}
REQUIRED = ("name", "num_embeddings", "embedding_dim")
FORMAT_HINT = "one table a row (CSV) or a list of tables, or {\"tables\": [...]} (JSON, YAML)"
LIMITS = {"num_embeddings": 2**40, "embedding_dim": 2**16, "pooling_factor": 2**20}
"""Upper bounds far beyond any real table; past them a table's byte counts overflow int64."""
INTEGER_FIELDS = ("num_embeddings", "embedding_dim")
NUMBER_FIELDS = ("pooling_factor", "zipf_alpha")


class SpecError(ValueError):
    """A table list the planner cannot read: names the file, the table and the field."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class TableSpec:
    name: str
    num_embeddings: int
    embedding_dim: int
    pooling_factor: float = 1.0
    zipf_alpha: float | None = None
    optimizer: str = "rowwise_adagrad"
    data_type: str = "fp32"

    def __post_init__(self) -> None:
        def bad(field: str, expected: str) -> SpecError:
            return SpecError(f"table {self.name!r}: {field}={getattr(self, field)!r}; expected {expected}")

        if not self.name:
            raise SpecError("a table has an empty name")
        if not isinstance(self.name, str):
            raise SpecError(f"table name {self.name!r}; expected a string")
        for field in ("num_embeddings", "embedding_dim"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or not 0 < value <= LIMITS[field]:
                raise bad(field, f"a positive integer at most {LIMITS[field]:,}")
        for field in NUMBER_FIELDS:
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, (int, float, type(None))):
                raise bad(field, "a number")
        if not (0 < self.pooling_factor <= LIMITS["pooling_factor"]):
            raise bad("pooling_factor", f"a positive number at most {LIMITS['pooling_factor']:,}")
        if self.zipf_alpha is not None and not (self.zipf_alpha > 0 and math.isfinite(self.zipf_alpha)):
            raise bad("zipf_alpha", "a positive number or empty (uniform ids)")
        if self.optimizer not in OPTIMIZER_STATE:
            raise bad("optimizer", f"one of {sorted(OPTIMIZER_STATE)}")
        if self.data_type not in DTYPE_BYTES:
            raise bad("data_type", f"one of {sorted(DTYPE_BYTES)}")

    @property
    def element_bytes(self) -> int:
        return DTYPE_BYTES[self.data_type]

    def state_values(self, width: int) -> int:
        """fp32 optimizer state values per row of a ``width``-column shard."""
        per = OPTIMIZER_STATE[self.optimizer]
        return per if per >= 0 else -per * width


def _records(path: Path) -> list[dict[str, Any]]:
    import pandas as pd

    suffix = path.suffix.lower()
    try:
        if suffix == ".csv":
            _check_field_counts(path)
            # Every cell as written: no type guessing ("007" stays "007") and no NA words ("NA",
            # "null" are names); _table parses the numbers and reads an empty cell as unset.
            frame = pd.read_csv(path, dtype=str, keep_default_na=False)
        elif suffix == ".json":
            data = json.loads(path.read_text())
            frame = pd.DataFrame(data["tables"] if isinstance(data, dict) else data)
        elif suffix in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(path.read_text())
            frame = pd.DataFrame(data["tables"] if isinstance(data, dict) else data)
        else:
            raise SpecError(f"{path}: unknown table format {suffix!r}; expected .csv, .json, .yaml or .yml")
    except SpecError:
        raise
    except Exception as error:  # pandas', json's and yaml's parse errors have no common base
        reason = " ".join(str(error).split())  # yaml's messages span lines
        raise SpecError(f"{path}: not a readable {suffix[1:].upper()} table list ({type(error).__name__}: "
                        f"{reason}); expected {FORMAT_HINT}") from error
    missing = [c for c in REQUIRED if c not in frame.columns]
    if missing:
        raise SpecError(f"{path}: missing column(s) {missing}; every table needs {list(REQUIRED)}")
    unknown = sorted(set(frame.columns) - {f.name for f in dataclasses.fields(TableSpec)})
    if unknown:
        raise SpecError(f"{path}: unknown column(s) {unknown}")
    return frame.astype(object).where(frame.notna(), None).to_dict("records")


def _check_field_counts(path: Path) -> None:
    """Every line of a CSV table list has as many fields as its header. pandas would read a
    line with one more as an index and shift its values a column left (a table named by its
    size), and one with fewer as unset fields."""
    with open(path, newline="") as f:
        lines = csv.reader(f, strict=True)  # a broken quote: csv.Error, "not a readable CSV table list"
        header = next(lines, None)
        if header is None:
            return  # empty: pandas' own message
        for line, fields in enumerate(lines, start=2):
            if fields and len(fields) != len(header):
                raise SpecError(f"{path}, line {line}: {len(fields)} fields where the header has {len(header)} "
                                f"({','.join(header)}); expected one value per column (an empty one for unset)")


def _integer(value: Any) -> Any:
    """An integer field's value as an int when it is one: 1000, 1000.0 (pandas makes ints of a
    column with gaps floats), "1000"; anything else as given, for TableSpec to refuse."""
    value = _number(value) if isinstance(value, str) else value
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return int(value)
    return value


def _number(value: Any) -> Any:
    """A float field's value as a float when it is a number or a number's text; else as given."""
    if isinstance(value, bool):
        return value
    try:
        return float(value)
    except (TypeError, ValueError, OverflowError):
        return value


def _table(record: dict[str, Any], where: str) -> TableSpec:
    # An empty cell (CSV) or a null (JSON, YAML) is a field left unset, except the name.
    fields = {k: v for k, v in record.items() if v is not None and v != ""}
    if "name" not in fields:
        raise SpecError(f"{where}: the name is empty; expected a table name")
    if not isinstance(fields["name"], str):
        raise SpecError(f"{where}: name {fields['name']!r}; expected a string (quote it)")
    for key in INTEGER_FIELDS:
        if key in fields:
            fields[key] = _integer(fields[key])
    for key in NUMBER_FIELDS:
        if key in fields:
            fields[key] = _number(fields[key])
    try:
        return TableSpec(**fields)
    except (TypeError, ValueError) as error:
        raise SpecError(f"{where}: {error}") from error


def read_tables(path: str | Path) -> list[TableSpec]:
    """The tables of a CSV, JSON (a list, or {"tables": [...]}) or YAML file."""
    path = Path(path)
    tables = [_table(r, f"{path} row {i + 1}") for i, r in enumerate(_records(path))]
    if not tables:
        raise SpecError(f"{path}: no tables")
    names = [t.name for t in tables]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise SpecError(f"{path}: table name(s) {duplicates} appear more than once")
    return tables


PRESETS_DIR = Path(__file__).with_name("presets")


def presets() -> list[str]:
    """The model presets ``read_preset`` knows, e.g. ``"criteo-kaggle"``."""
    return sorted(p.stem for p in PRESETS_DIR.glob("*.csv"))


def read_preset(name: str) -> list[TableSpec]:
    """The tables of a well-known model: ``criteo-kaggle`` (TorchRec's DLRM example: 26 tables,
    dim 128) or ``dlrm-dcnv2-criteo1tb`` (MLPerf: multi-hot Criteo 1TB, dim 128, Adagrad)."""
    if name not in presets():
        raise SpecError(f"--model {name!r}: unknown; expected one of {presets()}")
    return read_tables(PRESETS_DIR / f"{name}.csv")


def tables_of(module, pooling_factors: dict[str, float] | None = None) -> list[TableSpec]:
    """The tables of a SparseCore collection (its configs and optimizer) as planner specs;
    ``pooling_factors``: mean ids per sample per table (default 1, which a module cannot know)."""
    optimizer = type(getattr(module, "_optimizer", None)).__name__.lower()
    # No optimizer (a module for serving): no state, as SGD.
    names = {"sgd": "sgd", "adagrad": "adagrad", "rowwiseadagrad": "rowwise_adagrad", "adam": "adam",
             "ftrl": "ftrl", "nonetype": "sgd"}
    pooling_factors = pooling_factors or {}
    unknown = sorted(set(pooling_factors) - {c.name for c in module._configs})
    if unknown:
        raise SpecError(f"pooling factors for unknown tables {unknown}")
    return [TableSpec(name=c.name, num_embeddings=c.num_embeddings, embedding_dim=c.embedding_dim,
                      pooling_factor=float(pooling_factors.get(c.name, 1.0)),
                      optimizer=names[optimizer], data_type=c.config.data_type.name.lower())
            for c in module._configs]
