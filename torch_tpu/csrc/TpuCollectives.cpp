// c10d collectives on tpu tensors, for the tpu_dist backend.
//
// tpu_dist registers one gloo backend for both the cpu and the tpu device. A
// c10d op on tpu tensors reaches the PrivateUse1 key; this boxed kernel swaps
// every tpu tensor for a CPU tensor on the same memory and calls the op's CPU
// kernel, which hands them to gloo. Nothing is copied: gloo reads and writes
// tpu memory. The CPU tensors keep the tpu storage alive, so an async work
// that outlives the caller's tensors still writes into live memory.
//
// Gloo rejects ReduceOp.PREMUL_SUM (FSDP2's gradient divide factor), so it is
// built here: the inputs are multiplied by the factor and summed. In-place
// collectives scale their tensors in place (they are the result anyway);
// reduce-scatters scale a copy, leaving the caller's input as it was.
//
// Within one host the ranks of a group share memory: tpu_dist gives the group
// a shared-memory channel (TpuShmChannel.h, attached from Python when the
// group is made) and the collectives it carries — all_reduce, broadcast,
// all_gather_into_tensor, reduce_scatter_tensor, all_to_all_single — run over
// it on the calling thread and return a completed work. Everything else, and
// every group that spans hosts, goes to gloo.
//
// Which transport carries a collective must not depend on the device of the
// caller's tensors: gloo takes cpu and tpu tensors alike, so a rank passing
// cpu tensors while another passes tpu ones is a valid call, and it would
// hang if one rank went to gloo and the other to the channel. So the carried
// collectives on CPU tensors of a group with a channel go through it too.
// Their kernel is on the CPU key itself - inference-mode tensors skip the
// autograd keys, so a kernel there would miss them - and runs everything the
// channel does not take as torch's CPU kernel does: the group's CPU backend
// with the call's options.
//
// Registered on request (torch.ops.torch_tpu._register_collectives, when a
// tpu_dist group is created), not at load: torch has PrivateUse1 and CPU kernels
// for these ops, and replacing them warns, expectedly, so that warning is dropped.

#include "TpuHost.h"
#include "TpuShmCollectives.h"
#include "TpuStream.h"

#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/ivalue.h>
#include <c10/util/Exception.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Types.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>
#include <torch/library.h>

#include <algorithm>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

namespace torch_tpu {
namespace {

// Gloo walks numel() elements from the data pointer: a strided view would be
// read and written as if it were dense (plain gloo corrupts it silently). The
// view owns a reference to the tpu storage: collectives may run past the call.
at::Tensor collective_host_view(const at::Tensor& t) {
  TORCH_CHECK(t.layout() == c10::kStrided, "tpu_dist: only strided tensors are supported, got ", t.layout());
  TORCH_CHECK(t.is_contiguous(), "tpu_dist: collectives need contiguous tensors, got sizes ", t.sizes(),
              " strides ", t.strides(), "; pass tensor.contiguous() and copy the result back");
  return owning_host_view(t);
}

bool is_list_of_tensor_lists(const c10::IValue& v) {
  const auto& type = v.toList().elementType();
  return type->kind() == c10::ListType::Kind &&
      type->expectRef<c10::ListType>().getElementType()->kind() == c10::TensorType::Kind;
}

// The argument or result with every tensor in it (Tensor, Tensor[], Tensor[][]) mapped by f.
template <typename F>
c10::IValue map_tensors(const c10::IValue& v, const F& f) {
  if (v.isTensor()) {
    return f(v.toTensor());
  }
  if (v.isTensorList()) {
    c10::List<at::Tensor> out;
    for (const at::Tensor& t : v.toTensorList()) out.push_back(f(t));
    return out;
  }
  if (v.isList() && is_list_of_tensor_lists(v)) {
    c10::List<c10::List<at::Tensor>> out;
    for (const c10::IValue& inner : v.toListRef()) out.push_back(map_tensors(inner, f).toTensorList());
    return out;
  }
  return v;
}

// Swaps tpu tensors for their host views and remembers the pairs, so results
// can be handed back as the caller's tpu tensors.
class HostViews {
 public:
  c10::IValue to_host(const c10::IValue& v) {
    return map_tensors(v, [this](const at::Tensor& t) { return view(t); });
  }

  c10::IValue to_tpu(const c10::IValue& v) const {
    return map_tensors(v, [this](const at::Tensor& t) { return original(t); });
  }

 private:
  at::Tensor view(const at::Tensor& t) {
    if (!is_tpu(t)) {
      return t;
    }
    if (pairs_.empty()) {
      // As every tpu op: work queued on the current stream comes first
      // (e.g. the stream's kernel that produced the tensor gloo will read).
      wait_current_stream(t.device().index());
    }
    at::Tensor host = collective_host_view(t);
    pairs_.push_back({t, host});
    return host;
  }

  at::Tensor original(const at::Tensor& t) const {
    for (const auto& p : pairs_) {
      if (p.host.unsafeGetTensorImpl() == t.unsafeGetTensorImpl()) return p.tpu;
    }
    return t;
  }

  struct Pair {
    at::Tensor tpu;
    at::Tensor host;
  };
  c10::SmallVector<Pair, 4> pairs_;
};

at::Tensor scaled(const at::Tensor& t, const c10d::PreMulSumSupplement& factor) {
  return factor.tensor_factor.defined() ? t.mul(factor.tensor_factor.to(t.device())) : t.mul(factor.double_factor);
}

void scale_in_place(const at::Tensor& t, const c10d::PreMulSumSupplement& factor) {
  if (factor.tensor_factor.defined()) {
    t.mul_(factor.tensor_factor.to(t.device()));
  } else {
    t.mul_(factor.double_factor);
  }
}

// PREMUL_SUM as gloo's SUM over scaled inputs. Arguments named "tensors" are
// reduced in place; the reduce-scatters' inputs are other names.
void lower_premul_sum(const c10::FunctionSchema& schema, torch::jit::Stack& args) {
  const auto& names = schema.arguments();
  size_t op_index = names.size();
  for (size_t i = 0; i < names.size(); ++i) {
    if (names[i].name() == "reduce_op") op_index = i;
  }
  if (op_index == names.size()) return;
  auto op = args[op_index].toCustomClass<c10d::ReduceOp>();
  if (op->op_ != c10d::ReduceOp::PREMUL_SUM) return;
  const auto* factor = dynamic_cast<const c10d::PreMulSumSupplement*>(op->supplement_.get());
  TORCH_CHECK(factor != nullptr, "tpu_dist: ReduceOp.PREMUL_SUM without a factor; build it with "
              "torch.distributed._make_nccl_premul_sum(factor)");
  for (size_t i = 0; i < names.size(); ++i) {
    const std::string& name = names[i].name();
    c10::IValue& v = args[i];
    if (name == "tensors") {
      for (const at::Tensor& t : v.toTensorList()) scale_in_place(t, *factor);
    } else if (name == "input_tensor" || name == "inputs" || name == "input_tensors") {
      v = map_tensors(v, [factor](const at::Tensor& t) { return scaled(t, *factor); });
    }
  }
  args[op_index] = c10::make_intrusive<c10d::ReduceOp>(c10d::ReduceOp::SUM);
}

// The collectives each group's gloo backend may still be running, issued through
// the kernels here (collectives on tpu tensors; carried ones gloo took): a
// collective the channel carries waits for it first, so a group's collectives
// complete in the order they were issued, as on gloo. (Collectives on cpu
// tensors that the channel never carries reach gloo without passing here.)
class PendingGlooWork {
 public:
  void issued(const std::string& group, c10::intrusive_ptr<c10d::Work> work) {
    std::lock_guard<std::mutex> lock(mu_);
    auto& works = pending_[group];
    works.erase(std::remove_if(works.begin(), works.end(), [](const auto& w) { return w->isCompleted(); }),
                works.end());
    works.push_back(std::move(work));
  }

  // Waits for the group's pending work (raising its error, if any).
  void wait(const std::string& group) {
    std::vector<c10::intrusive_ptr<c10d::Work>> works;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = pending_.find(group);
      if (it == pending_.end()) return;
      works.swap(it->second);
    }
    for (const auto& w : works) w->wait();
  }

 private:
  std::mutex mu_;
  std::unordered_map<std::string, std::vector<c10::intrusive_ptr<c10d::Work>>> pending_;
};

PendingGlooWork& pending_gloo_work() {
  static auto* pending = new PendingGlooWork();
  return *pending;
}

// Point-to-point ops are not in a group's order: a send completes when its peer
// receives, which the peer may do after a later collective.
bool is_collective(const std::string& op) {
  return op != "c10d::send" && op != "c10d::recv_" && op != "c10d::recv_any_source_";
}

std::string group_name(const c10::FunctionSchema& schema, const torch::jit::Stack& args) {
  return args[*schema.argumentIndexWithName("process_group")].toCustomClass<c10d::ProcessGroup>()->getGroupName();
}

// A collective that finished on the calling thread. Its future holds the
// results: the caller's tensors.
class DoneWork : public c10d::Work {
 public:
  DoneWork(c10d::OpType type, std::vector<at::Tensor> results)
      : Work(-1, type),
        results_(std::move(results)),
        future_(c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()))) {
    future_->markCompleted(c10::IValue(results_));
    finish();
  }
  bool wait(std::chrono::milliseconds /*timeout*/) override { return true; }
  std::vector<at::Tensor> result() override { return results_; }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return future_; }
  c10::intrusive_ptr<c10::ivalue::Future> getFutureResult() override {
    auto done = c10::make_intrusive<c10::ivalue::Future>(c10::IntType::get());
    done->markCompleted(c10::IValue(static_cast<int64_t>(c10d::WorkResult::SUCCESS)));
    return done;
  }

 private:
  std::vector<at::Tensor> results_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

// The collectives a group's shared-memory channel carries (when their arguments allow).
bool is_carried(const std::string& op) {
  return op == "c10d::allreduce_" || op == "c10d::broadcast_" || op == "c10d::_allgather_base_" ||
      op == "c10d::_reduce_scatter_base_" || op == "c10d::alltoall_base_";
}

// The shared-memory channel that would carry this call: its op is carried and
// its group is a tpu_dist group (a custom backend: torch reuses the names of
// destroyed groups, and a plain gloo group may carry a destroyed tpu_dist
// group's name) that has a channel. Null otherwise.
std::shared_ptr<shm::Channel> carrying_channel(const c10::FunctionSchema& schema, const torch::jit::Stack& args) {
  if (!is_carried(schema.name())) return nullptr;
  const auto group = args[*schema.argumentIndexWithName("process_group")].toCustomClass<c10d::ProcessGroup>();
  if (group->getBackendType() != c10d::ProcessGroup::BackendType::CUSTOM) return nullptr;
  return shm::find(group->getGroupName());
}

// Runs a carried collective on `channel` (carrying_channel's); returns the
// work, or null to leave it to gloo (arguments the channel does not take).
// `args` hold host views (and PREMUL_SUM already lowered to SUM).
c10::intrusive_ptr<c10d::Work> run_on_channel(const c10::FunctionSchema& schema, const torch::jit::Stack& args,
                                              shm::Channel& channel) {
  auto arg = [&](const char* name) -> const c10::IValue& { return args[*schema.argumentIndexWithName(name)]; };
  const std::string& op = schema.name();
  auto reduce_op = [&] { return arg("reduce_op").toCustomClass<c10d::ReduceOp>()->op_; };
  const shm::Timeout timeout(arg("timeout").toInt());

  pending_gloo_work().wait(group_name(schema, args));
  std::lock_guard<std::mutex> lock(channel.mutex());
  if (op == "c10d::allreduce_") {
    const auto tensors = arg("tensors").toTensorVector();
    if (tensors.size() != 1 || !arg("sparse_indices").isNone() || !shm::supports(reduce_op())) return nullptr;
    shm::all_reduce(channel, tensors[0], reduce_op(), timeout);
    return c10::make_intrusive<DoneWork>(c10d::OpType::ALLREDUCE, tensors);
  }
  if (op == "c10d::broadcast_") {
    const auto tensors = arg("tensors").toTensorVector();
    if (tensors.size() != 1) return nullptr;
    shm::broadcast(channel, tensors[0], arg("root_rank").toInt(), timeout);
    return c10::make_intrusive<DoneWork>(c10d::OpType::BROADCAST, tensors);
  }
  if (op == "c10d::alltoall_base_") {
    const at::Tensor& out = arg("output").toTensor();
    shm::all_to_all(channel, out, arg("input").toTensor(), arg("output_split_sizes").toIntVector(),
                    arg("input_split_sizes").toIntVector(), timeout);
    return c10::make_intrusive<DoneWork>(c10d::OpType::ALLTOALL_BASE, std::vector<at::Tensor>{out});
  }
  const at::Tensor& out = arg("output_tensor").toTensor();
  const at::Tensor& in = arg("input_tensor").toTensor();
  if (op == "c10d::_allgather_base_") {
    shm::all_gather_into(channel, out, in, timeout);
    return c10::make_intrusive<DoneWork>(c10d::OpType::_ALLGATHER_BASE, std::vector<at::Tensor>{out});
  }
  if (!shm::supports(reduce_op())) return nullptr;
  shm::reduce_scatter_into(channel, out, in, reduce_op(), timeout);
  return c10::make_intrusive<DoneWork>(c10d::OpType::_REDUCE_SCATTER_BASE, std::vector<at::Tensor>{out});
}

// Replaces the op's arguments on the stack by its returns: the caller's
// tensors (the first argument), if the op returns them, and the work.
void push_returns(const c10::FunctionSchema& schema, torch::jit::Stack* stack, c10::IValue tensors,
                  c10::intrusive_ptr<c10d::Work> work) {
  torch::jit::drop(*stack, schema.arguments().size());
  if (schema.returns().size() == 2) stack->push_back(std::move(tensors));
  stack->push_back(c10::IValue(std::move(work)));
}

// A carried collective's strided tensors (a transposed view), through contiguous
// copies: the channel takes them, and the results are copied back. Which
// transport carries a call must not depend on one rank's layouts: a rank on
// gloo and another on the channel would wait for each other until the timeout.
class Staging {
 public:
  void stage(const c10::FunctionSchema& schema, torch::jit::Stack& args) {
    for (size_t i = 0; i < args.size(); ++i) {
      const std::string& name = schema.arguments()[i].name();
      const bool written = name == "tensors" || name == "output_tensor" || name == "output";
      args[i] = map_tensors(args[i], [&](const at::Tensor& t) {
        if (!t.defined() || t.layout() != c10::kStrided || t.is_contiguous()) return t;
        at::Tensor copy = t.contiguous();
        pairs_.push_back({t, copy, written});
        return copy;
      });
    }
  }

  // After the channel ran: the results into the caller's tensors.
  void copy_back() const {
    for (const auto& p : pairs_) {
      if (p.written) p.original.copy_(p.copy);
    }
  }

  // For a call the channel did not take: gloo would read a strided view as dense.
  void refuse(const c10::FunctionSchema& schema) const {
    TORCH_CHECK(pairs_.empty(), "tpu_dist: ", schema.name(), " of non-contiguous tensors in a form the shared "
                "memory does not carry; pass tensor.contiguous() and copy the result back");
  }

  at::Tensor original(const at::Tensor& t) const {
    for (const auto& p : pairs_) {
      if (p.copy.unsafeGetTensorImpl() == t.unsafeGetTensorImpl()) return p.original;
    }
    return t;
  }

  c10::IValue original(const c10::IValue& v) const {
    return map_tensors(v, [this](const at::Tensor& t) { return original(t); });
  }

 private:
  struct Pair {
    at::Tensor original;
    at::Tensor copy;
    bool written;  // an argument the collective writes
  };
  c10::SmallVector<Pair, 2> pairs_;
};

// `work`'s results mapped by `to_caller` (host views and staged copies to the caller's
// tensors), in a completed work of its own.
template <typename F>
c10::intrusive_ptr<c10d::Work> handed_back(const c10::intrusive_ptr<c10d::Work>& work, const F& to_caller) {
  std::vector<at::Tensor> results;
  for (const at::Tensor& t : work->result()) results.push_back(to_caller(t));
  return c10::make_intrusive<DoneWork>(work->retrieveOpType(), std::move(results));
}

void collective_on_host(const c10::OperatorHandle& op, c10::DispatchKeySet, torch::jit::Stack* stack) {
  const auto& schema = op.schema();
  const size_t num_args = schema.arguments().size();
  HostViews views;
  torch::jit::Stack args(stack->end() - num_args, stack->end());
  Staging staging;
  const auto channel = carrying_channel(schema, args);
  if (channel) staging.stage(schema, args);
  for (auto& v : args) v = views.to_host(v);
  lower_premul_sum(schema, args);
  if (channel) {
    if (auto work = run_on_channel(schema, args, *channel)) {
      staging.copy_back();
      auto to_caller = [&](const at::Tensor& t) { return staging.original(views.to_tpu(t).toTensor()); };
      push_returns(schema, stack, staging.original(views.to_tpu(args[0])), handed_back(work, to_caller));
      return;
    }
    staging.refuse(schema);
  }
  const std::string group = group_name(schema, args);
  std::copy(args.begin(), args.end(), stack->end() - num_args);
  op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::CPU), stack);
  const size_t num_returns = schema.returns().size();
  for (auto it = stack->end() - num_returns; it != stack->end(); ++it) *it = views.to_tpu(*it);
  if (is_collective(schema.name()) && stack->back().isCustomClass()) {
    pending_gloo_work().issued(group, stack->back().toCustomClass<c10d::Work>());
  }
}

bool all_dense_cpu(const torch::jit::Stack& args) {
  bool dense = true;
  for (const auto& v : args) {
    map_tensors(v, [&dense](const at::Tensor& t) {
      dense = dense && t.device().is_cpu() && t.layout() == c10::kStrided;  // strided ones are staged
      return t;
    });
  }
  return dense;
}

// What torch's CPU kernel of a carried collective does (c10d's Ops.cpp): the
// call on the group's CPU backend with the call's options; its work.
c10::intrusive_ptr<c10d::Work> run_on_cpu_backend(const c10::FunctionSchema& schema, const torch::jit::Stack& args) {
  auto arg = [&](const char* name) -> const c10::IValue& { return args[*schema.argumentIndexWithName(name)]; };
  const auto backend = arg("process_group").toCustomClass<c10d::ProcessGroup>()->getBackend(c10::DeviceType::CPU);
  const std::chrono::milliseconds timeout(arg("timeout").toInt());
  const bool async_op = arg("async_op").toBool();
  auto reduce_op = [&] { return *arg("reduce_op").toCustomClass<c10d::ReduceOp>(); };
  const std::string& op = schema.name();
  if (op == "c10d::allreduce_") {
    auto tensors = arg("tensors").toTensorVector();
    return backend->allreduce(tensors, c10d::AllreduceOptions{reduce_op(), timeout, async_op});
  }
  if (op == "c10d::broadcast_") {
    auto tensors = arg("tensors").toTensorVector();
    return backend->broadcast(
        tensors, c10d::BroadcastOptions{arg("root_rank").toInt(), arg("root_tensor").toInt(), timeout, async_op});
  }
  if (op == "c10d::alltoall_base_") {
    at::Tensor out = arg("output").toTensor(), in = arg("input").toTensor();
    auto output_splits = arg("output_split_sizes").toIntVector(), input_splits = arg("input_split_sizes").toIntVector();
    return backend->alltoall_base(out, in, output_splits, input_splits, c10d::AllToAllOptions{timeout, async_op});
  }
  at::Tensor out = arg("output_tensor").toTensor(), in = arg("input_tensor").toTensor();
  if (op == "c10d::_allgather_base_") {
    return backend->_allgather_base(out, in, c10d::AllgatherOptions{timeout, async_op});
  }
  TORCH_CHECK(op == "c10d::_reduce_scatter_base_", "tpu_dist: no CPU kernel for ", op);
  return backend->_reduce_scatter_base(out, in, c10d::ReduceScatterOptions{reduce_op(), timeout, async_op});
}

// A carried collective on CPU tensors (the CPU key): over the group's channel
// if it has one, as the same call on tpu tensors would go (strided views
// staged); else as torch's CPU kernel (gloo). Sparse tensors go to gloo,
// which decides about them.
void collective_on_cpu(const c10::OperatorHandle& op, c10::DispatchKeySet, torch::jit::Stack* stack) {
  const auto& schema = op.schema();
  const size_t num_args = schema.arguments().size();
  torch::jit::Stack args(stack->end() - num_args, stack->end());
  const auto channel = carrying_channel(schema, args);
  if (channel && all_dense_cpu(args)) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;  // PREMUL_SUM's scaling is not differentiated
    Staging staging;
    staging.stage(schema, args);
    lower_premul_sum(schema, args);  // in place for reductions in place: gloo gets the lowered call too
    if (auto work = run_on_channel(schema, args, *channel)) {
      staging.copy_back();
      push_returns(schema, stack, staging.original(args[0]),
                   handed_back(work, [&](const at::Tensor& t) { return staging.original(t); }));
      return;
    }
    staging.refuse(schema);
  }
  {
    // Gloo has no PREMUL_SUM: lowered here as over the channel and on tpu tensors, so the
    // same call works whichever transport carries it (a no-op if the channel block lowered it).
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    lower_premul_sum(schema, args);
  }
  auto work = run_on_cpu_backend(schema, args);
  pending_gloo_work().issued(group_name(schema, args), work);
  push_returns(schema, stack, args[0], std::move(work));
}

bool takes_process_group(const c10::FunctionSchema& schema) {
  for (const auto& arg : schema.arguments()) {
    if (arg.name() == "process_group") return true;
  }
  return false;
}

// Swallows the dispatcher's "Overriding a previously registered kernel".
class DropWarnings : public c10::WarningHandler {
 public:
  void process(const c10::Warning&) override {}
};

void register_collectives() {
  static std::once_flag once;
  std::call_once(once, [] {
    DropWarnings drop;
    c10::WarningUtils::WarningHandlerGuard guard(&drop);
    static auto* library =
        new torch::Library(torch::Library::IMPL, "c10d", c10::DispatchKey::PrivateUse1, __FILE__, __LINE__);
    static auto* cpu_library =
        new torch::Library(torch::Library::IMPL, "c10d", c10::DispatchKey::CPU, __FILE__, __LINE__);
    for (const c10::OperatorName& name : c10::Dispatcher::singleton().getAllOpNames()) {
      if (name.name.rfind("c10d::", 0) != 0 || !name.overload_name.empty()) continue;
      auto handle = c10::Dispatcher::singleton().findOp(name);
      if (!handle || !takes_process_group(handle->schema())) continue;
      library->impl(name.name.substr(6).c_str(), torch::CppFunction::makeFromBoxedFunction<&collective_on_host>());
      if (is_carried(name.name)) {
        cpu_library->impl(name.name.substr(6).c_str(), torch::CppFunction::makeFromBoxedFunction<&collective_on_cpu>());
      }
    }
  });
}

} // namespace

// Maps the group's shared-memory segment; false if this process cannot (the
// segment is on another host), so the group keeps to gloo.
bool open_shared_memory(const std::string& group, const std::string& path, int64_t rank, int64_t world,
                        int64_t slot_bytes, bool create, int64_t timeout_ms) {
  try {
    shm::attach(group, std::make_shared<shm::Channel>(path, rank, world, slot_bytes, create,
                                                      std::chrono::milliseconds(timeout_ms)));
    return true;
  } catch (const c10::Error&) {
    return false;
  }
}

void close_shared_memory(const std::string& group) {
  shm::attach(group, nullptr);
}

bool has_shared_memory(const std::string& group) {
  return shm::find(group) != nullptr;
}

namespace {

// (peer, column, width) triples, in block order per peer: the runs per peer
// (every peer's list, empty ones too); None: that side has no column runs.
std::vector<std::vector<shm::ColumnRun>> runs_per_peer(at::OptionalIntArrayRef columns, int world, const char* which) {
  std::vector<std::vector<shm::ColumnRun>> runs;
  if (!columns.has_value()) return runs;
  const c10::IntArrayRef triples = *columns;
  TORCH_CHECK(triples.size() % 3 == 0, "tpu_dist all_to_all_columns: ", which,
              " columns are (rank, column, width) triples, got ", triples.size(), " numbers");
  runs.resize(world);
  for (size_t i = 0; i < triples.size(); i += 3) {
    TORCH_CHECK(triples[i] >= 0 && triples[i] < world, "tpu_dist all_to_all_columns: ", which,
                " column run for rank ", triples[i], " outside the group of ", world);
    runs[triples[i]].push_back({triples[i + 1], triples[i + 2]});
  }
  return runs;
}

at::Tensor dense_host_view(HostViews& views, const at::Tensor& t, const char* which) {
  TORCH_CHECK(t.layout() == c10::kStrided && t.is_contiguous() && (t.is_cpu() || is_tpu(t)),
              "tpu_dist all_to_all_columns: the ", which, " must be a contiguous cpu or tpu tensor");
  return views.to_host(t).toTensor();
}

// all_to_all_single over the group's shared-memory channel with column runs of
// a 2-D tensor on one side (shm::all_to_all_columns): the sharded embeddings'
// output dist places received blocks straight into their columns.
void all_to_all_columns(const at::Tensor& output, const at::Tensor& input, c10::IntArrayRef output_split_sizes,
                        c10::IntArrayRef input_split_sizes, at::OptionalIntArrayRef output_columns,
                        at::OptionalIntArrayRef input_columns, const std::string& group) {
  const auto channel = shm::find(group);
  TORCH_CHECK(channel != nullptr, "tpu_dist all_to_all_columns: group ", group,
              " has no shared-memory channel (torch_tpu.distributed.group_transport tells)");
  HostViews views;
  const at::Tensor out = dense_host_view(views, output, "output");
  const at::Tensor in = dense_host_view(views, input, "input");
  pending_gloo_work().wait(group);  // after the group's async gloo works, as every collective over it
  std::lock_guard<std::mutex> lock(channel->mutex());
  shm::all_to_all_columns(*channel, out, in, output_split_sizes, input_split_sizes,
                          runs_per_peer(output_columns, channel->world(), "output"),
                          runs_per_peer(input_columns, channel->world(), "input"), shm::Timeout(-1));
}

} // namespace

TORCH_LIBRARY_FRAGMENT(torch_tpu, m) {
  m.def("_register_collectives() -> ()", register_collectives);
  m.def("_open_shared_memory(str group, str path, int rank, int world, int slot_bytes, bool create, "
        "int timeout_ms) -> bool", open_shared_memory);
  m.def("_close_shared_memory(str group) -> ()", close_shared_memory);
  m.def("_has_shared_memory(str group) -> bool", has_shared_memory);
  m.def("_all_to_all_columns(Tensor(a!) output, Tensor input, int[] output_split_sizes, int[] input_split_sizes, "
        "int[]? output_columns, int[]? input_columns, str group) -> ()", all_to_all_columns);
}

} // namespace torch_tpu
