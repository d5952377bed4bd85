"""The Criteo feature layout and table-size presets, as plain data.

TorchRec's names are used for the features (``int_0..int_12`` dense,
``cat_0..cat_25`` categorical), so KeyedJaggedTensors built here match what
TorchRec's own Criteo pipeline produces.
"""

from __future__ import annotations

NUM_DENSE = 13
NUM_SPARSE = 26
DENSE_NAMES: tuple[str, ...] = tuple(f"int_{i}" for i in range(NUM_DENSE))
SPARSE_NAMES: tuple[str, ...] = tuple(f"cat_{i}" for i in range(NUM_SPARSE))

KAGGLE_TABLE_SIZES: tuple[int, ...] = (
    1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194, 27,
    14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572,
)
"""Rows per categorical feature of the Criteo Kaggle (dac) dataset."""

TERABYTE_TABLE_SIZES: tuple[int, ...] = (
    40000000, 39060, 17295, 7424, 20265, 3, 7122, 1543, 63, 40000000, 3067956, 405282, 10, 2209,
    11938, 155, 4, 976, 14, 40000000, 40000000, 40000000, 590152, 12973, 108, 36,
)
"""Rows per categorical feature of Criteo 1TB as MLPerf DLRM-DCNv2 caps them."""

MLPERF_MULTI_HOT_SIZES: tuple[int, ...] = (
    3, 2, 1, 2, 6, 1, 1, 1, 1, 7, 3, 8, 1, 6, 9, 5, 1, 1, 1, 12, 100, 27, 10, 3, 1, 1,
)
"""Ids per sample of each categorical feature in MLPerf's multi-hot Criteo 1TB."""

KAGGLE_DAYS = 7
"""The Kaggle file holds 7 days in order: 6 train, the last split half validation, half test.
(Criteo 1TB ships one file per day, day_0 .. day_23, split the same way: data.criteo.)"""
