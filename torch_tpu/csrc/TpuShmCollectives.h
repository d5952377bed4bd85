#pragma once
// Collectives over a shared-memory Channel (TpuShmChannel.h).
//
// Tensors are CPU tensors on the callers' memory (host views of tpu tensors),
// contiguous; each rank copies its part into its slot and reads the others'
// from theirs, one round per slot's worth of bytes. Reductions run in rank
// order on every rank, so all ranks get the same bits. The first round checks
// that every rank called the same collective on agreeing tensors and raises,
// on every rank, an error naming each rank's tensor when they disagree.

#include "TpuShmChannel.h"

#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>
#include <torch/csrc/distributed/c10d/Types.hpp>

#include <chrono>
#include <vector>

namespace torch_tpu {
namespace shm {

using Timeout = std::chrono::milliseconds;  // < 0: the group's

bool supports(c10d::ReduceOp::RedOpType op);

void all_reduce(Channel& channel, const at::Tensor& tensor, c10d::ReduceOp::RedOpType op, Timeout timeout);
void broadcast(Channel& channel, const at::Tensor& tensor, int64_t root, Timeout timeout);
void all_gather_into(Channel& channel, const at::Tensor& output, const at::Tensor& input, Timeout timeout);
void reduce_scatter_into(Channel& channel, const at::Tensor& output, const at::Tensor& input,
                         c10d::ReduceOp::RedOpType op, Timeout timeout);
// Splits count rows (dim 0); empty splits mean even ones.
void all_to_all(Channel& channel, const at::Tensor& output, const at::Tensor& input,
                c10::IntArrayRef output_splits, c10::IntArrayRef input_splits, Timeout timeout);

// Columns [column, column + width) of a 2-D tensor, in elements.
struct ColumnRun {
  int64_t column;
  int64_t width;
};

// all_to_all whose blocks, on one side, are column runs of a 2-D tensor rather
// than its rows: the block exchanged with peer p is every row of the runs
// columns[p], side by side (its split sizes are then implied; pass none). The
// bytes on the wire are all_to_all_single's, so peers may call either.
void all_to_all_columns(Channel& channel, const at::Tensor& output, const at::Tensor& input,
                        c10::IntArrayRef output_splits, c10::IntArrayRef input_splits,
                        const std::vector<std::vector<ColumnRun>>& output_columns,
                        const std::vector<std::vector<ColumnRun>>& input_columns, Timeout timeout);

} // namespace shm
} // namespace torch_tpu
