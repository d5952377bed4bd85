"""Typed errors of the SparseCore engine, each naming what was wrong and the fix."""

from __future__ import annotations


class SparseCoreError(ValueError):
    """Base class: bad configuration or bad input to the SparseCore engine."""


class ConfigError(SparseCoreError):
    """A table configuration value outside its allowed range."""

    def __init__(self, table: str, field: str, value: object, allowed: str):
        super().__init__(f"table {table!r}: {field}={value!r} is invalid; expected {allowed}")
        self.table, self.field, self.value, self.allowed = table, field, value, allowed


class InputError(SparseCoreError):
    """A batch that does not fit the tables: ids out of range, bad lengths, unknown keys."""


class PartitionLimitError(SparseCoreError):
    """More ids in a partition than its SparseCore limit allows (and dropping is off)."""
