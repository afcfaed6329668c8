// ulbtorch._eager: the eager-mode call of the Linear*Bit modules, straight
// from CPython to the C kernel, beside torch.ops.ulb.linear (csrc/ops.cpp).
//
// Why: a one-token GEMV streams its weights in little time, and the
// dispatcher path of a custom op (Python arguments matched to the schema,
// boxed into IValues, through the stable ABI's shims and back) is a real
// share of it when the weight stream has flushed the caches; calling the
// kernel from here costs what PyTorch's own bindings do (benchmarks/op_overhead.py).
//
// What it serves: exactly what the op would compute, bit for bit, through
// the op's own ulb_linear of ulbtorch._C (bound at import, so the thread
// pool, ISA choice and runtime settings are shared). It returns
// NotImplemented for anything else: tensor subclasses and fake tensors,
// functorch-wrapped and functional tensors, active torch function or
// dispatch modes, dispatch keys switched on for the thread (torch.jit.trace,
// vmap and grad transforms, autocast), inputs that need autograd, non-CPU or
// unusual layouts, and every input the op would reject (the rules of
// linear_args.h, which both apply). The caller then runs the op, which
// traces, records and raises as before. The nn.Module internals it reads by
// name are listed in NAMES_READ, which tests/test_eager.py checks.
//
// Unlike ulbtorch._C this module uses the classic C++ API of the torch it
// was built with; ulbtorch binds it only under that same torch version.
#include <Python.h>
#include <cxxabi.h>
#include <dlfcn.h>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/PythonTorchFunctionTLS.h>
#include <ATen/autocast_mode.h>
#include <ATen/record_function.h>
#include <c10/core/DispatchKeySet.h>
#include <c10/core/GradMode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <torch/csrc/autograd/forward_grad.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/csrc/profiler/orchestration/observer.h>

#include "linear_args.h"
#include "ulb/ulb.h"

#ifndef ULB_EAGER_TORCH_VERSION
#error "setup.py defines ULB_EAGER_TORCH_VERSION, the torch this module is built against"
#endif

namespace {

decltype(&ulb_linear) linear_fn = nullptr;
decltype(&ulb_blob_header) header_fn = nullptr;

// bind(path of ulbtorch._C): take that module's kernel entry points.
PyObject *bind(PyObject *, PyObject *path) {
  const char *p = PyUnicode_AsUTF8(path);
  if (!p) return nullptr;
  void *lib = dlopen(p, RTLD_NOW | RTLD_NOLOAD);  // already loaded by `import ulbtorch._C`
  if (lib) {
    linear_fn = reinterpret_cast<decltype(&ulb_linear)>(dlsym(lib, "ulb_linear"));
    header_fn = reinterpret_cast<decltype(&ulb_blob_header)>(dlsym(lib, "ulb_blob_header"));
    dlclose(lib);  // drops the reference NOLOAD took; Python keeps the module loaded
  }
  return PyBool_FromLong(linear_fn && header_fn);
}

// A dense CPU tensor and nothing more: the dispatch keys of one, with or
// without autograd's, so no wrapper (functorch, functionalisation, Python
// subclass, conj or neg view) and no other device or layout.
bool plain_cpu(const at::Tensor &t) {
  static const c10::DispatchKeySet plain = c10::DispatchKeySet(c10::DispatchKey::CPU) |
                                           c10::DispatchKeySet(c10::DispatchKey::AutogradCPU) |
                                           c10::DispatchKeySet(c10::DispatchKey::ADInplaceOrView) |
                                           c10::DispatchKeySet(c10::DispatchKey::AutocastCPU);
  return plain.isSupersetOf(t.key_set()) && t.layout() == at::kStrided && t.has_storage();
}

// No dispatch key switched on for this thread beyond the defaults (tracing
// and functorch transforms add one) and autocast off (it un-excludes one).
bool default_thread_keys() {
  return (c10::impl::tls_local_dispatch_key_set().included_ - c10::default_included_set).empty() &&
         !at::autocast::is_autocast_enabled(at::kCPU);
}

// A tangent of forward-mode AD (torch.autograd.forward_ad) rides on the
// tensor's autograd metadata: the kernel would drop it.
bool has_tangent(const at::Tensor &t) {
  const auto *meta = torch::autograd::impl::get_autograd_meta(t);
  return meta && meta->fw_grad_ && !meta->fw_grad_->empty();
}

// What linear_args' rules read of t; a tensor that is not plain_cpu counts
// as on another device. No message is ever made here (dtype_name stays "").
linear_args::TensorInfo info(const at::Tensor &t) {
  linear_args::TensorInfo i;
  const at::ScalarType s = t.scalar_type();
  i.device = plain_cpu(t) ? linear_args::Device::Cpu : linear_args::Device::Other;
  i.dtype = s == at::kFloat      ? linear_args::Dtype::F32
            : s == at::kBFloat16 ? linear_args::Dtype::BF16
            : s == at::kByte     ? linear_args::Dtype::U8
                                 : linear_args::Dtype::Other;
  i.dim = t.dim();
  i.sizes = t.sizes().data();
  i.strides = t.strides().data();
  return i;
}

// The fail of linear_args' rules: the caller returns NotImplemented instead.
const auto ignore = [](const auto &...) {};

// linear(x, packed, bias or None, out_features): torch.ops.ulb.linear's
// result, or NotImplemented where that op should run instead.
PyObject *linear_unchecked(PyObject *const *args, Py_ssize_t nargs) {
  if (nargs != 4) {
    PyErr_SetString(PyExc_TypeError, "ulbtorch._eager.linear takes (x, packed, bias, out_features)");
    return nullptr;
  }
  if (!linear_fn || !THPVariable_CheckExact(args[0]) || !THPVariable_CheckExact(args[1]) ||
      (args[2] != Py_None && !THPVariable_CheckExact(args[2])) || !PyLong_CheckExact(args[3]))
    Py_RETURN_NOTIMPLEMENTED;
  if (at::impl::torch_function_mode_enabled() || c10::impl::TorchDispatchModeTLS::any_modes_set() ||
      !default_thread_keys())
    Py_RETURN_NOTIMPLEMENTED;
  const at::Tensor &x = THPVariable_Unpack(args[0]);
  const at::Tensor &packed = THPVariable_Unpack(args[1]);
  const at::Tensor *bias = args[2] != Py_None ? &THPVariable_Unpack(args[2]) : nullptr;
  if (x.numel() == 0) Py_RETURN_NOTIMPLEMENTED;
  if (c10::GradMode::is_enabled() && (x.requires_grad() || (bias && bias->requires_grad())))
    Py_RETURN_NOTIMPLEMENTED;
  if (has_tangent(x) || (bias && has_tangent(*bias))) Py_RETURN_NOTIMPLEMENTED;
  const int64_t out_features = PyLong_AsLongLong(args[3]);
  if (out_features == -1 && PyErr_Occurred()) {
    PyErr_Clear();  // an out_features beyond int64: the op says what is wrong
    Py_RETURN_NOTIMPLEMENTED;
  }
  const linear_args::TensorInfo mx = info(x), mw = info(packed);
  const std::optional<linear_args::TensorInfo> mb = bias ? std::optional(info(*bias)) : std::nullopt;
  const uint8_t *blob =
      mw.device == linear_args::Device::Cpu ? static_cast<const uint8_t *>(packed.const_data_ptr()) : nullptr;
  linear_args::Layer l;
  // The op's rules; and the layouts it would copy (a strided bias, x's rows
  // reshaped) go to the op.
  if (!linear_args::layer(mx, mw, blob, header_fn, mb ? &*mb : nullptr, out_features, "linear", &l, ignore) ||
      (mb && !mb->contiguous()) || l.rows.reshape)
    Py_RETURN_NOTIMPLEMENTED;
  const ulb_header &h = l.h;
  const int64_t nbytes = mw.sizes[0];
  RECORD_FUNCTION("ulb::linear", std::vector<c10::IValue>());
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = h.M;
  at::Tensor y = at::empty(shape, x.options());
  const int nthreads = at::get_num_threads();
  ulb_status st;
  Py_BEGIN_ALLOW_THREADS;
  st = linear_fn(blob, nbytes, l.rows.N, x.const_data_ptr(), l.xdt, l.rows.ld, l.rows.inc,
                 bias ? bias->const_data_ptr() : nullptr, l.bdt, y.mutable_data_ptr(), l.xdt, h.M, nthreads);
  Py_END_ALLOW_THREADS;
  if (st != ULB_OK) Py_RETURN_NOTIMPLEMENTED;  // the op raises the kernel's error
  return THPVariable_Wrap(std::move(y));
}

// What module_linear reads and compares against, bound once (bind_module).
struct ModuleNames {
  PyObject *nn_module = nullptr;         // torch.nn.Module
  PyObject *wrapped_call_impl = nullptr; // nn.Module._wrapped_call_impl, which is nn.Module.__call__
  PyObject *call_impl = nullptr;         // nn.Module._call_impl
  PyObject *nn_globals = nullptr;        // torch.nn.modules.module.__dict__: the global hook tables
  PyObject *compiler_globals = nullptr;  // torch.compiler.__dict__: _is_compiling_flag
  PyObject *forward = nullptr;           // LowBitLinear.forward
  PyObject *ordered_dict = nullptr;      // collections.OrderedDict, as nn.Module's tables are
  PyObject *global_hooks[4] = {};
  PyObject *instance_hooks[4] = {};
  PyObject *call_name, *wrapped_call_impl_name, *call_impl_name, *compiling_flag, *compiled_call_impl,
      *forward_name, *force_reference, *buffers, *parameters, *packed, *bias, *out_features, *ordered_dict_name;
  bool interned = false;
} names;

// A reference released on every way out, C++ exceptions included.
struct Owned {
  PyObject *p;
  explicit Owned(PyObject *o) : p(o) {}
  Owned(const Owned &) = delete;
  Owned &operator=(const Owned &) = delete;
  ~Owned() { Py_XDECREF(p); }
};

// Every name module_linear reads, by where it reads it: the modules' NAMES_READ,
// which tests/test_eager.py checks against torch, so that a torch that moves
// one fails a test rather than turning the fast path off unseen.
struct Name {
  PyObject **slot;
  const char *name;
};
const Name module_class_names[] = {{&names.call_name, "__call__"},
                                   {&names.wrapped_call_impl_name, "_wrapped_call_impl"},
                                   {&names.call_impl_name, "_call_impl"},
                                   {&names.compiled_call_impl, "_compiled_call_impl"}};
const Name layer_class_names[] = {{&names.forward_name, "forward"}};
const Name module_globals_names[] = {{&names.global_hooks[0], "_global_backward_pre_hooks"},
                                     {&names.global_hooks[1], "_global_backward_hooks"},
                                     {&names.global_hooks[2], "_global_forward_hooks"},
                                     {&names.global_hooks[3], "_global_forward_pre_hooks"},
                                     {&names.ordered_dict_name, "OrderedDict"}};
const Name compiler_globals_names[] = {{&names.compiling_flag, "_is_compiling_flag"}};
const Name layer_names[] = {{&names.force_reference, "force_reference"},
                            {&names.buffers, "_buffers"},
                            {&names.parameters, "_parameters"},
                            {&names.out_features, "out_features"},
                            {&names.instance_hooks[0], "_backward_hooks"},
                            {&names.instance_hooks[1], "_backward_pre_hooks"},
                            {&names.instance_hooks[2], "_forward_hooks"},
                            {&names.instance_hooks[3], "_forward_pre_hooks"}};
const Name buffer_names[] = {{&names.packed, "packed"}};
const Name parameter_names[] = {{&names.bias, "bias"}};

struct NameGroup {
  const char *where;
  const Name *names;
  size_t count;
};
#define ULB_GROUP(where, table) {where, table, sizeof table / sizeof table[0]}
const NameGroup name_groups[] = {
    ULB_GROUP("torch.nn.Module", module_class_names),      // its class attributes
    ULB_GROUP("LowBitLinear", layer_class_names),          // the layer's class attributes
    ULB_GROUP("torch.nn.modules.module", module_globals_names),  // that module's globals
    ULB_GROUP("torch.compiler", compiler_globals_names),   // that module's globals
    ULB_GROUP("layer", layer_names),                       // the layer instance's __dict__
    ULB_GROUP("layer._buffers", buffer_names),
    ULB_GROUP("layer._parameters", parameter_names),
};
#undef ULB_GROUP

bool intern_names() {
  if (names.interned) return true;
  for (const NameGroup &g : name_groups)
    for (size_t i = 0; i < g.count; i++)
      if (!(*g.names[i].slot = PyUnicode_InternFromString(g.names[i].name))) return false;
  return names.interned = true;
}

// {where: (name, ...)} of name_groups.
PyObject *names_read() {
  Owned d(PyDict_New());
  if (!d.p) return nullptr;
  for (const NameGroup &g : name_groups) {
    Owned t(PyTuple_New(static_cast<Py_ssize_t>(g.count)));
    if (!t.p) return nullptr;
    for (size_t i = 0; i < g.count; i++) {
      PyObject *n = PyUnicode_FromString(g.names[i].name);
      if (!n) return nullptr;
      PyTuple_SET_ITEM(t.p, static_cast<Py_ssize_t>(i), n);
    }
    if (PyDict_SetItemString(d.p, g.where, t.p) < 0) return nullptr;
  }
  Py_INCREF(d.p);
  return d.p;
}

// d[key] when d is a dict holding it, else nullptr (borrowed; no error set).
PyObject *item(PyObject *d, PyObject *key) {
  if (!d || !PyDict_Check(d)) return nullptr;
  PyObject *v = PyDict_GetItemWithError(d, key);
  if (!v) PyErr_Clear();
  return v;
}

// A dict or OrderedDict itself (a subclass may read or count otherwise).
bool plain_dict(PyObject *d) {
  return d && (PyDict_CheckExact(d) || reinterpret_cast<PyObject *>(Py_TYPE(d)) == names.ordered_dict);
}

bool empty_table(PyObject *d) { return plain_dict(d) && PyDict_GET_SIZE(d) == 0; }

// bind_module(torch.nn.Module, torch.nn.modules.module.__dict__, torch.compiler.__dict__,
// LowBitLinear.forward) -> bool
PyObject *bind_module(PyObject *, PyObject *const *args, Py_ssize_t nargs) {
  if (nargs != 4 || !PyType_Check(args[0]) || !PyDict_Check(args[1]) || !PyDict_Check(args[2])) {
    PyErr_SetString(PyExc_TypeError,
                    "bind_module takes (nn.Module, its module's globals, torch.compiler's globals, forward)");
    return nullptr;
  }
  if (!intern_names()) return nullptr;
  PyTypeObject *module_type = reinterpret_cast<PyTypeObject *>(args[0]);
  PyObject *wrapped = _PyType_Lookup(module_type, names.wrapped_call_impl_name);
  PyObject *call_impl = _PyType_Lookup(module_type, names.call_impl_name);
  PyObject *ordered = item(args[1], names.ordered_dict_name);
  if (!wrapped || !call_impl || _PyType_Lookup(module_type, names.call_name) != wrapped || !ordered ||
      !PyType_Check(ordered))
    Py_RETURN_FALSE;  // an nn.Module unlike torch 2.13's: the modules call it as before
  for (PyObject *o : {args[0], wrapped, call_impl, args[1], args[2], args[3], ordered}) Py_INCREF(o);
  Py_XSETREF(names.nn_module, args[0]);
  Py_XSETREF(names.wrapped_call_impl, wrapped);
  Py_XSETREF(names.call_impl, call_impl);
  Py_XSETREF(names.nn_globals, args[1]);
  Py_XSETREF(names.compiler_globals, args[2]);
  Py_XSETREF(names.forward, args[3]);
  Py_XSETREF(names.ordered_dict, ordered);
  Py_RETURN_TRUE;
}

// module_linear(module, x): module(x) for a LowBitLinear whose call
// nn.Module.__call__ would hand straight to LowBitLinear.forward, and forward
// straight to the kernel: linear(x, packed, bias, out_features) read from the
// module's own dicts. NotImplemented unless nothing could tell the two apart:
// no hook of any kind, nn.Module's call methods as torch defines them (FX
// patches __call__; a subclass may override _call_impl), not compiled with
// module.compile(), forward neither overridden by a subclass nor patched on
// the instance (accelerate's hooks), force_reference off, torch.compiler not
// tracing, and no profiler running (it finds modules by nn.Module.__call__).
PyObject *module_linear_unchecked(PyObject *const *args, Py_ssize_t nargs) {
  if (nargs != 2) {
    PyErr_SetString(PyExc_TypeError, "ulbtorch._eager.module_linear takes (module, x)");
    return nullptr;
  }
  if (!names.forward || torch::profiler::impl::profilerEnabled()) Py_RETURN_NOTIMPLEMENTED;
  for (PyObject *name : names.global_hooks)
    if (!empty_table(item(names.nn_globals, name))) Py_RETURN_NOTIMPLEMENTED;
  PyTypeObject *type = Py_TYPE(args[0]);
  if (item(names.compiler_globals, names.compiling_flag) != Py_False ||
      _PyType_Lookup(reinterpret_cast<PyTypeObject *>(names.nn_module), names.call_name) != names.wrapped_call_impl ||
      _PyType_Lookup(type, names.wrapped_call_impl_name) != names.wrapped_call_impl ||
      _PyType_Lookup(type, names.call_impl_name) != names.call_impl ||
      _PyType_Lookup(type, names.forward_name) != names.forward)
    Py_RETURN_NOTIMPLEMENTED;
  Owned dict(PyObject_GenericGetDict(args[0], nullptr));
  if (!dict.p) {
    PyErr_Clear();
    Py_RETURN_NOTIMPLEMENTED;
  }
  PyObject *compiled = item(dict.p, names.compiled_call_impl);  // set by module.compile(); else nn.Module's None
  if (!compiled) compiled = _PyType_Lookup(type, names.compiled_call_impl);
  bool plain = compiled == Py_None && item(dict.p, names.force_reference) == Py_False;
  for (PyObject *name : {names.forward_name, names.call_impl_name, names.wrapped_call_impl_name})
    plain = plain && !item(dict.p, name);
  for (PyObject *name : names.instance_hooks) plain = plain && empty_table(item(dict.p, name));
  PyObject *buffers = item(dict.p, names.buffers), *parameters = item(dict.p, names.parameters);
  if (!plain || !plain_dict(buffers) || !plain_dict(parameters)) Py_RETURN_NOTIMPLEMENTED;
  // Held through the call: the module may drop them while the GIL is released.
  PyObject *largs[4] = {args[1], item(buffers, names.packed), item(parameters, names.bias),
                        item(dict.p, names.out_features)};
  if (!largs[1] || !largs[2] || !largs[3]) Py_RETURN_NOTIMPLEMENTED;
  Py_INCREF(largs[1]), Py_INCREF(largs[2]), Py_INCREF(largs[3]);
  Owned packed(largs[1]), bias(largs[2]), out_features(largs[3]);
  return linear_unchecked(largs, 4);
}

// No C++ exception may cross into CPython: one that the checks above did not
// foresee (say, an allocation failing) sends the call to the op, which
// raises it as a Python error.
template <PyObject *(*unchecked)(PyObject *const *, Py_ssize_t)>
PyObject *guarded(PyObject *, PyObject *const *args, Py_ssize_t nargs) {
  try {
    return unchecked(args, nargs);
  } catch (abi::__forced_unwind &) {
    throw;  // a thread cancelled (daemon threads at exit) must unwind, not return
  } catch (...) {
    PyErr_Clear();
    Py_RETURN_NOTIMPLEMENTED;
  }
}

PyMethodDef methods[] = {
    {"bind", bind, METH_O, "bind(path of ulbtorch._C) -> bool: use that module's kernels"},
    {"linear", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(guarded<linear_unchecked>)),
     METH_FASTCALL,
     "linear(x, packed, bias, out_features) -> Tensor, or NotImplemented where torch.ops.ulb.linear must run"},
    {"bind_module", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(bind_module)), METH_FASTCALL,
     "bind_module(nn.Module, torch.nn.modules.module.__dict__, torch.compiler.__dict__, LowBitLinear.forward)"
     " -> bool"},
    {"module_linear", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(guarded<module_linear_unchecked>)),
     METH_FASTCALL,
     "module_linear(module, x) -> module(x) for a LowBitLinear called plainly, or NotImplemented"},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_eager", nullptr, -1, methods};

}  // namespace

// Touches nothing of torch, so that importing it under another torch is safe
// until ulbtorch has compared TORCH_VERSION.
extern "C" PyObject *PyInit__eager(void) {
  PyObject *m = PyModule_Create(&module_def);
  if (!m) return nullptr;
  PyObject *read = names_read();
  if (PyModule_AddStringConstant(m, "TORCH_VERSION", ULB_EAGER_TORCH_VERSION) < 0 || !read ||
      PyModule_AddObject(m, "NAMES_READ", read) < 0) {
    Py_XDECREF(read);
    Py_DECREF(m);
    return nullptr;
  }
  return m;
}
