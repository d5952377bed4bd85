// Compiled graphs run directly on tpu tensors (torch_tpu/inductor.py).
//
// Inductor's CPU wrapper code hands its kernels data pointers, and a tpu
// tensor's data pointer is host memory: a graph compiled for cpu can run on
// the tpu tensors themselves, with no host views in and no adoption out, if
// its buffers are tpu tensors too. Its wrapper allocates them all through one
// module global, `empty_strided_cpu`; the Python layer points that global at
// `empty_strided` below, which allocates tpu memory while the thread runs a
// graph directly and CPU memory otherwise (a module may be shared with a
// CPU compile of the same code).
//
// check_layouts, for every compiled graph (direct or on host views): the
// sizes and strides of all its tensor inputs in one call, which Inductor's
// wrapper would check with an assert_size_stride call per input (an
// optimizer's graph has a hundred and more).
//
// These are Python builtins, not torch ops: a graph allocates dozens of
// buffers a call, and a torch op costs microseconds to call from Python.

#include "TpuDevice.h"
#include "TpuStorage.h"
#include "TpuStream.h"

#include <ATen/EmptyTensor.h>
#include <Python.h>
#include <c10/util/SmallVector.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/autograd/python_variable.h>

#include <sstream>

namespace torch_tpu {
namespace {

thread_local c10::DeviceIndex t_direct_device = -1;

bool read_ints(PyObject* sequence, const char* what, c10::SmallVector<int64_t, 6>& out) {
  PyObject* fast = PySequence_Fast(sequence, what);
  if (fast == nullptr) return false;
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
  PyObject** items = PySequence_Fast_ITEMS(fast);
  out.resize(n);
  for (Py_ssize_t i = 0; i < n; ++i) {
    out[i] = PyLong_AsLongLong(items[i]);
    if (out[i] == -1 && PyErr_Occurred()) {
      Py_DECREF(fast);
      return false;
    }
  }
  Py_DECREF(fast);
  return true;
}

// empty_strided(size, stride, dtype): Inductor's _empty_strided_cpu, on the
// tpu while the thread runs a graph directly.
PyObject* empty_strided(PyObject* /*self*/, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 3 || !THPDtype_Check(args[2])) {
    PyErr_SetString(PyExc_TypeError, "empty_strided(size, stride, dtype): takes two int sequences and a torch.dtype");
    return nullptr;
  }
  c10::SmallVector<int64_t, 6> size, stride;
  if (!read_ints(args[0], "empty_strided: size must be a sequence of ints", size) ||
      !read_ints(args[1], "empty_strided: stride must be a sequence of ints", stride)) {
    return nullptr;
  }
  const auto dtype = reinterpret_cast<THPDtype*>(args[2])->scalar_type;
  try {
    if (t_direct_device < 0) {
      return THPVariable_Wrap(at::detail::empty_strided_cpu(size, stride, dtype));
    }
    return THPVariable_Wrap(empty_strided_on(t_direct_device, size, stride, dtype));
  } catch (const std::exception& error) {  // an out-of-memory error, mostly
    PyErr_SetString(PyExc_RuntimeError, error.what());
    return nullptr;
  }
}

// enter_direct(device) -> previous: after the device's queued stream work (as
// every tpu op waits for it), graphs on this thread allocate on that tpu.
PyObject* enter_direct(PyObject* /*self*/, PyObject* arg) {
  const long device = PyLong_AsLong(arg);
  if (device == -1 && PyErr_Occurred()) return nullptr;
  if (device < 0 || device >= device_count()) {
    PyErr_Format(PyExc_ValueError, "enter_direct: no tpu device %ld (%d devices)", device,
                 static_cast<int>(device_count()));
    return nullptr;
  }
  try {
    wait_current_stream(static_cast<c10::DeviceIndex>(device));
  } catch (const std::exception& error) {
    PyErr_SetString(PyExc_RuntimeError, error.what());
    return nullptr;
  }
  const auto previous = t_direct_device;
  t_direct_device = static_cast<c10::DeviceIndex>(device);
  return PyLong_FromLong(previous);
}

// exit_direct(previous): back to what enter_direct returned.
PyObject* exit_direct(PyObject* /*self*/, PyObject* arg) {
  const long previous = PyLong_AsLong(arg);
  if (previous == -1 && PyErr_Occurred()) return nullptr;
  t_direct_device = static_cast<c10::DeviceIndex>(previous);
  Py_RETURN_NONE;
}

// The layout an input was compiled for: a tuple (position, sizes, strides).
bool layout_matches(const at::Tensor& t, PyObject* sizes, PyObject* strides) {
  const Py_ssize_t dims = PyTuple_GET_SIZE(sizes);
  if (t.dim() != dims) return false;
  for (Py_ssize_t d = 0; d < dims; ++d) {
    const int64_t size = PyLong_AsLongLong(PyTuple_GET_ITEM(sizes, d));
    if (t.size(d) != size) return false;
    // A dim of size 0 or 1 is never stepped over: its stride is free (as for assert_size_stride).
    if (size > 1 && t.stride(d) != PyLong_AsLongLong(PyTuple_GET_ITEM(strides, d))) return false;
  }
  return true;
}

std::string tuple_text(PyObject* ints) {
  std::ostringstream out;
  out << "(";
  for (Py_ssize_t d = 0; d < PyTuple_GET_SIZE(ints); ++d) {
    out << (d ? ", " : "") << PyLong_AsLongLong(PyTuple_GET_ITEM(ints, d));
  }
  out << (PyTuple_GET_SIZE(ints) == 1 ? ",)" : ")");
  return out.str();
}

// check_layouts(args, layouts): for every (position, sizes, strides) of
// `layouts`, args[position] is a tensor of those sizes and, in every dim of
// size > 1, those strides; else an AssertionError naming the first input that
// is not. Inductor's kernels index their inputs by the strides they were
// compiled for.
PyObject* check_layouts(PyObject* /*self*/, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 2 || !PyTuple_Check(args[1])) {
    PyErr_SetString(PyExc_TypeError, "check_layouts(args, layouts): takes a sequence and a tuple of layouts");
    return nullptr;
  }
  PyObject* values = PySequence_Fast(args[0], "check_layouts: args must be a sequence");
  if (values == nullptr) return nullptr;
  const Py_ssize_t count = PySequence_Fast_GET_SIZE(values);
  PyObject** items = PySequence_Fast_ITEMS(values);
  for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(args[1]); ++k) {
    PyObject* layout = PyTuple_GET_ITEM(args[1], k);
    if (!PyTuple_Check(layout) || PyTuple_GET_SIZE(layout) != 3 || !PyTuple_Check(PyTuple_GET_ITEM(layout, 1)) ||
        !PyTuple_Check(PyTuple_GET_ITEM(layout, 2)) ||
        PyTuple_GET_SIZE(PyTuple_GET_ITEM(layout, 1)) != PyTuple_GET_SIZE(PyTuple_GET_ITEM(layout, 2))) {
      Py_DECREF(values);
      PyErr_SetString(PyExc_TypeError, "check_layouts: a layout is a tuple (position, sizes, strides) of equal ranks");
      return nullptr;
    }
    const Py_ssize_t position = PyLong_AsSsize_t(PyTuple_GET_ITEM(layout, 0));
    PyObject* sizes = PyTuple_GET_ITEM(layout, 1);
    PyObject* strides = PyTuple_GET_ITEM(layout, 2);
    PyObject* value = position < count ? items[position] : nullptr;
    if (value != nullptr && THPVariable_Check(value) && layout_matches(THPVariable_Unpack(value), sizes, strides)) {
      continue;
    }
    std::ostringstream what;
    what << "compiled graph input " << position << ": compiled for size " << tuple_text(sizes) << " and stride "
         << tuple_text(strides) << ", got ";
    if (value == nullptr || !THPVariable_Check(value)) {
      what << (value == nullptr ? "no argument" : Py_TYPE(value)->tp_name);
    } else {
      const at::Tensor& t = THPVariable_Unpack(value);
      what << "size " << t.sizes() << " and stride " << t.strides();
    }
    Py_DECREF(values);
    PyErr_SetString(PyExc_AssertionError, what.str().c_str());
    return nullptr;
  }
  Py_DECREF(values);
  Py_RETURN_NONE;
}

PyMethodDef kMethods[] = {
    {"empty_strided", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(empty_strided)), METH_FASTCALL,
     "Inductor's empty_strided_cpu, allocating tpu memory while the thread runs a graph directly."},
    {"enter_direct", enter_direct, METH_O, "Graphs on this thread allocate on the given tpu; returns the previous."},
    {"exit_direct", exit_direct, METH_O, "Restores what enter_direct returned."},
    {"check_layouts", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(check_layouts)), METH_FASTCALL,
     "Checks the sizes and strides of a compiled graph's tensor inputs."},
    {nullptr, nullptr, 0, nullptr},
};

} // namespace
} // namespace torch_tpu

// A dict of the builtins above, for torch_tpu/_backend.py (through ctypes.PyDLL).
extern "C" PyObject* torch_tpu_direct_run_functions() {
  PyObject* functions = PyDict_New();
  if (functions == nullptr) return nullptr;
  for (PyMethodDef* def = torch_tpu::kMethods; def->ml_name != nullptr; ++def) {
    PyObject* fn = PyCFunction_New(def, nullptr);
    if (fn == nullptr || PyDict_SetItemString(functions, def->ml_name, fn) != 0) {
      Py_XDECREF(fn);
      Py_DECREF(functions);
      return nullptr;
    }
    Py_DECREF(fn);
  }
  return functions;
}
