"""SparseCore ops in StableHLO export (``torch_tpu.export_stablehlo``).

A lookup becomes ``stablehlo.custom_call @sparsecore.lookup`` on the table and
the batch's COO buffers (row pointers, embedding ids, sample ids, gains), with
``num_bags`` and ``batch_size`` in its ``backend_config``: the SparseCore
kernel a TPU runtime would bind to that target. (Export captures the
inference forward, so training's fused lookup never reaches it.) Importing
sparsecore registers this.
"""

from __future__ import annotations

from torch_tpu.stablehlo import LoweringContext, Value, register_lowering

TARGET = "sparsecore.lookup"


@register_lowering("sparsecore::lookup")
def _lookup(cx: LoweringContext, weight: Value, row_pointers: Value, embedding_ids: Value, sample_ids: Value,
            gains: Value, num_bags: int, batch_size: int) -> Value:
    return cx.custom_call(TARGET, [weight, row_pointers, embedding_ids, sample_ids, gains],
                          {"num_bags": num_bags, "batch_size": batch_size})
