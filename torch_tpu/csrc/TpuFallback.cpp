// The boxed fallback: every aten op without a tpu kernel of its own runs the
// CPU kernel on zero-copy views of the tpu tensors (see TpuHost.h), so
// mutations land in tpu memory and fresh results are allocated there.

#include "TpuFallback.h"
#include "TpuGenerator.h"
#include "TpuHost.h"
#include "TpuStream.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <torch/library.h>

#include <mutex>
#include <string>
#include <unordered_set>

namespace torch_tpu {
namespace {

bool is_generator_arg(const c10::Argument& arg) {
  const auto& type = arg.type();
  if (type->kind() == c10::TypeKind::GeneratorType) {
    return true;
  }
  if (type->kind() == c10::TypeKind::OptionalType) {
    return type->castRaw<c10::OptionalType>()->getElementType()->kind() ==
        c10::TypeKind::GeneratorType;
  }
  return false;
}

// Index tensors of these ops may stay on the CPU, as on CUDA.
bool allows_cpu_tensors(const c10::OperatorName& name) {
  static const std::unordered_set<std::string> ops = {
      "aten::index", "aten::index_put", "aten::index_put_", "aten::_index_put_impl_",
      "aten::_unsafe_index", "aten::_unsafe_index_put"};
  return ops.count(name.name) > 0;
}

// Where the op runs: the device its tpu tensors share (checked, as CUDA
// checks), or its tpu device argument. `to_cpu` is set when the op names the
// cpu as its target device, so its results stay in CPU memory.
c10::DeviceIndex find_device(const c10::FunctionSchema& schema, c10::ArrayRef<c10::IValue> args,
                             bool* to_cpu) {
  c10::DeviceIndex device = -1;
  *to_cpu = false;
  const char* op = schema.name().c_str();
  const bool allow_cpu = allows_cpu_tensors(schema.operator_name());
  for (size_t i = 0; i < args.size(); ++i) {
    const auto& v = args[i];
    if (v.isTensor()) {
      const at::Tensor& t = v.toTensor();
      const auto* alias = schema.arguments()[i].alias_info();
      // A 0-dim cpu tensor mixes in as a scalar operand, never as a result (as on CUDA): the
      // kernel would resize it in tpu memory and leave the caller's tensor without storage.
      TORCH_CHECK(!t.defined() || is_tpu(t) || alias == nullptr || !alias->isWrite() ||
                      schema.name() == "aten::copy_",  // copies go into cpu tensors too
                  "Expected all tensors to be on the same device, but found at least two devices, ", t.device(),
                  " and tpu! (in ", op, ": the result ", schema.arguments()[i].name(), " is on ", t.device(), ")");
      check_operand_device(op, t, &device, allow_cpu);
    } else if (v.isTensorList()) {
      for (const at::Tensor& t : v.toTensorList()) {
        check_operand_device(op, t, &device, allow_cpu);
      }
    } else if (v.isOptionalTensorList()) {
      for (const std::optional<at::Tensor>& t : v.toOptionalTensorList()) {
        if (t.has_value()) {
          check_operand_device(op, *t, &device, allow_cpu);
        }
      }
    }
  }
  for (const auto& v : args) {
    if (!v.isDevice()) {
      continue;
    }
    const auto d = v.toDevice();
    if (d.type() == c10::DeviceType::CPU) {
      *to_cpu = true;
    } else if (device < 0 && d.type() == c10::DeviceType::PrivateUse1) {
      device = d.has_index() ? d.index() : current_device();
    }
  }
  return device < 0 ? current_device() : device;
}

c10::IValue to_host(c10::IValue v, const c10::Argument& arg, HostScope& scope) {
  if (v.isTensor()) {
    return scope.view(v.toTensor());
  }
  if (v.isTensorList()) {
    // A new list: the caller's list must keep its tpu tensors.
    c10::List<at::Tensor> out;
    const auto in = v.toTensorList();
    out.reserve(in.size());
    for (const at::Tensor& t : in) {
      out.push_back(scope.view(t));
    }
    return out;
  }
  if (v.isOptionalTensorList()) {
    c10::List<std::optional<at::Tensor>> out;
    const auto in = v.toOptionalTensorList();
    out.reserve(in.size());
    for (const std::optional<at::Tensor>& t : in) {
      out.push_back(t.has_value() ? std::optional<at::Tensor>(scope.view(*t)) : std::nullopt);
    }
    return out;
  }
  if (v.isDevice() && v.toDevice().type() == c10::DeviceType::PrivateUse1) {
    return c10::Device(c10::DeviceType::CPU);
  }
  if ((v.isNone() || v.isGenerator()) && is_generator_arg(arg)) {
    std::optional<at::Generator> gen;
    if (v.isGenerator()) {
      gen = v.toGenerator();
    }
    return host_generator(gen, scope.device());
  }
  return v;
}

c10::IValue to_tpu(c10::IValue v, HostScope& scope) {
  if (v.isTensor()) {
    return scope.adopt(v.toTensor());
  }
  if (v.isTensorList()) {
    auto list = v.toTensorList();
    for (size_t i = 0; i < list.size(); ++i) {
      list.set(i, scope.adopt(list.get(i)));
    }
    return list;
  }
  return v;
}

void tpu_fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const auto& schema = op.schema();
  const auto& arguments = schema.arguments();
  const size_t num_args = arguments.size();
  const size_t args_begin = stack->size() - num_args;
  auto args = torch::jit::last(*stack, num_args);

  bool to_cpu = false;
  const c10::DeviceIndex device = find_device(schema, args, &to_cpu);
  HostScope scope(device, /*redirect=*/!to_cpu);  // after the current stream's queued work
  for (size_t i = 0; i < num_args; ++i) {
    auto& slot = (*stack)[args_begin + i];
    slot = to_host(std::move(slot), arguments[i], scope);
  }

  op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::CPU), stack);

  scope.write_back();
  if (to_cpu) {
    return;
  }
  const size_t num_returns = schema.returns().size();
  const size_t returns_begin = stack->size() - num_returns;
  for (size_t i = 0; i < num_returns; ++i) {
    auto& slot = (*stack)[returns_begin + i];
    slot = to_tpu(std::move(slot), scope);
  }
}

} // namespace

TORCH_LIBRARY_IMPL(_, PrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&tpu_fallback>());
}

// Ops with a CPU kernel of their own reach other backends through generic
// composite kernels: a structured op's functional form as "allocate, then run
// the out= kernel" (which for some ops, mse_loss among them, warns about
// resizing), and a few ops (native_layer_norm, native_group_norm, addr) as
// decompositions that round bf16 intermediates differently from the CPU
// kernel. Send them straight to their CPU kernels: one call, CPU's results.
// Runs once the library is loaded, so every kernel registered in this
// library (matmuls, dropout, ...) is already there and is left alone.
void route_composites_to_cpu() {
  static std::once_flag once;
  std::call_once(once, [] {
    static auto* library = new torch::Library(
        torch::Library::IMPL, "aten", c10::DispatchKey::PrivateUse1, __FILE__, __LINE__);
    auto& dispatcher = c10::Dispatcher::singleton();
    for (const auto& name : dispatcher.getAllOpNames()) {
      if (name.name.rfind("aten::", 0) != 0) {
        continue;
      }
      auto op = dispatcher.findOp(name);
      if (!op || op->hasKernelForDispatchKey(c10::DispatchKey::PrivateUse1) ||
          !op->hasKernelForDispatchKey(c10::DispatchKey::CPU) ||
          !(op->hasKernelForDispatchKey(c10::DispatchKey::CompositeExplicitAutogradNonFunctional) ||
            op->hasKernelForDispatchKey(c10::DispatchKey::CompositeExplicitAutograd))) {
        continue;
      }
      const std::string qualified = name.overload_name.empty()
          ? name.name.substr(6)
          : name.name.substr(6) + "." + name.overload_name;
      library->impl(qualified.c_str(), torch::CppFunction::makeFromBoxedFunction<&tpu_fallback>());
    }
  });
}

} // namespace torch_tpu
