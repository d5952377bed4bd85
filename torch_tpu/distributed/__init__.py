"""Distributed training on tpu devices: the ``tpu_dist`` backend and the collectives gloo lacks.

``torch.distributed.init_process_group("tpu_dist")`` creates a group whose
collectives take tpu and cpu tensors (see ``backend``);
``reduce_scatter_v`` is a reduce-scatter with a chunk size per rank;
``all_to_all_columns`` an all_to_all_single whose blocks, on one side, are
column runs of a 2-D tensor; ``group_transport`` tells whether a group's ranks
share memory (one host) or talk through gloo alone.
"""

from torch_tpu.distributed.all_to_all_columns import all_to_all_columns
from torch_tpu.distributed.backend import BACKEND, register
from torch_tpu.distributed.reduce_scatter_v import reduce_scatter_v
from torch_tpu.distributed.shared_memory import group_transport

__all__ = ["BACKEND", "all_to_all_columns", "group_transport", "reduce_scatter_v", "register"]
