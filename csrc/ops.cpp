// torch.ops.ulb.*: argument checks and tensor plumbing over the C kernels.
// Built against the LibTorch stable ABI, so one binary serves torch >= 2.10.
#include <Python.h>

#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/core/ScalarType.h>

#include <cstring>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "ulb/ulb.h"

using torch::headeronly::ScalarType;
using torch::stable::Tensor;

namespace {

const char *dtype_name(ScalarType t) {
  switch (t) {
    case ScalarType::Float: return "float32";
    case ScalarType::BFloat16: return "bfloat16";
    case ScalarType::Half: return "float16";
    case ScalarType::Double: return "float64";
    case ScalarType::Byte: return "uint8";
    case ScalarType::Char: return "int8";
    case ScalarType::Int: return "int32";
    case ScalarType::Long: return "int64";
    default: return "an unsupported dtype";
  }
}

void check_ok(ulb_status st, const char *op) {
  STD_TORCH_CHECK(st == ULB_OK, "ulb.", op, ": ", ulb_status_str(st));
}

void check_cpu(const Tensor &t, const char *op, const char *name) {
  STD_TORCH_CHECK(t.is_cpu(), "ulb.", op, ": ", name,
                  " must be a CPU tensor (use the pure-PyTorch path for other devices)");
}

ulb_dtype act_dtype(const Tensor &t, const char *op, const char *name) {
  const ScalarType st = t.scalar_type();
  STD_TORCH_CHECK(st == ScalarType::Float || st == ScalarType::BFloat16, "ulb.", op, ": ", name,
                  " must be float32 or bfloat16, got ", dtype_name(st));
  return st == ScalarType::Float ? ULB_DT_F32 : ULB_DT_BF16;
}

// A packed weight: 1-D contiguous uint8 whose header validates.
ulb_header check_packed(const Tensor &packed, const char *op) {
  check_cpu(packed, op, "packed weight");
  STD_TORCH_CHECK(packed.scalar_type() == ScalarType::Byte && packed.dim() == 1 &&
                      packed.is_contiguous(),
                  "ulb.", op, ": packed weight must be a 1-D contiguous uint8 tensor made by "
                  "ulb.pack, got dtype ", dtype_name(packed.scalar_type()), " with ", packed.dim(),
                  " dims");
  ulb_header h;
  check_ok(ulb_blob_header(static_cast<const uint8_t *>(packed.const_data_ptr()), packed.numel(), &h),
           op);
  return h;
}

const uint8_t *blob_ptr(const Tensor &packed) {
  return static_cast<const uint8_t *>(packed.const_data_ptr());
}

// A new contiguous CPU tensor. Calls the C shim directly: torch::stable::empty
// looks "aten::empty" up in the dispatcher by name on every call, which
// costs ~1 us, a noticeable share of a decode-sized GEMV.
Tensor new_tensor(const std::vector<int64_t> &shape, ScalarType dtype) {
  std::vector<int64_t> strides(shape.size());
  int64_t stride = 1;
  for (size_t i = shape.size(); i-- > 0;) {
    strides[i] = stride;
    stride *= shape[i] > 1 ? shape[i] : 1;
  }
  AtenTensorHandle out;
  STABLE_TORCH_ERROR_CODE_CHECK(aoti_torch_empty_strided(
      static_cast<int64_t>(shape.size()), shape.data(), strides.data(),
      torch::stable::detail::to<int32_t>(torch::stable::detail::from(dtype)), aoti_torch_device_type_cpu(), 0,
      &out));
  return Tensor(out);
}

Tensor pack(Tensor codes, Tensor scales, int64_t format, int64_t group_size) {
  check_cpu(codes, "pack", "codes");
  check_cpu(scales, "pack", "scales");
  const ulb_format_info *fi = ulb_format_get(static_cast<int>(format));
  STD_TORCH_CHECK(fi != nullptr, "ulb.pack: unknown format id ", format);
  STD_TORCH_CHECK(codes.scalar_type() == ScalarType::Byte && codes.dim() == 2,
                  "ulb.pack: codes must be a 2-D uint8 tensor [out_features, in_features], got ",
                  dtype_name(codes.scalar_type()), " with ", codes.dim(), " dims");
  STD_TORCH_CHECK(scales.scalar_type() == ScalarType::Float && scales.dim() == 2,
                  "ulb.pack: scales must be a 2-D float32 tensor [out_features, n_groups]");
  const int64_t M = codes.size(0), K = codes.size(1);
  const int64_t nbytes = ulb_packed_nbytes(static_cast<int>(format), M, K, group_size);
  if (nbytes < 0) check_ok(static_cast<ulb_status>(-nbytes), "pack");
  const int64_t G = (group_size <= 0 || group_size >= K) ? 1 : (K + group_size - 1) / group_size;
  STD_TORCH_CHECK(scales.size(0) == M && scales.size(1) == G, "ulb.pack: scales must have shape [",
                  M, ", ", G, "] for group_size ", group_size, ", got [", scales.size(0), ", ",
                  scales.size(1), "]");
  codes = torch::stable::contiguous(codes);
  scales = torch::stable::contiguous(scales);
  Tensor out = new_tensor({nbytes}, ScalarType::Byte);
  check_ok(ulb_pack(static_cast<int>(format), M, K, group_size,
                    static_cast<const uint8_t *>(codes.const_data_ptr()), K,
                    static_cast<const float *>(scales.const_data_ptr()),
                    static_cast<uint8_t *>(out.mutable_data_ptr()), nbytes),
           "pack");
  return out;
}

std::tuple<Tensor, Tensor> unpack(Tensor packed) {
  const ulb_header h = check_packed(packed, "unpack");
  Tensor codes = new_tensor({h.M, h.K}, ScalarType::Byte);
  Tensor scales = new_tensor({h.M, h.n_groups}, ScalarType::Float);
  check_ok(ulb_unpack(blob_ptr(packed), packed.numel(), static_cast<uint8_t *>(codes.mutable_data_ptr()),
                      static_cast<float *>(scales.mutable_data_ptr())),
           "unpack");
  return std::make_tuple(codes, scales);
}

Tensor packed_info(Tensor packed) {
  const ulb_header h = check_packed(packed, "packed_info");
  Tensor out = new_tensor({7}, ScalarType::Long);
  int64_t *p = static_cast<int64_t *>(out.mutable_data_ptr());
  const int64_t v[7] = {h.format, h.M, h.K, h.group_size, h.n_groups, h.M_pad, h.K_pad};
  std::memcpy(p, v, sizeof v);
  return out;
}

// Rows of x as (N, row stride, element stride), flattening leading dims.
// Contiguous and 2-D inputs need no new tensor; other layouts are reshaped
// (a view when strides allow, else a copy).
struct Rows {
  Tensor t;
  int64_t N, ld, inc;
};

Rows as_rows(const Tensor &x, int64_t K) {
  const int64_t N = K > 0 ? x.numel() / K : 0;
  if (x.dim() == 2) return {x, N, x.stride(0), x.stride(1)};
  if (x.is_contiguous()) return {x, N, K, 1};
  Tensor r = torch::stable::reshape(x, {N, K});
  return {r, N, r.stride(0), r.stride(1)};
}

// An optional bias of M elements, fp32 or bf16, made contiguous.
struct Bias {
  Tensor t;
  const void *ptr;
  ulb_dtype dt;
};

Bias checked_bias(const std::optional<Tensor> &bias, int64_t M, const char *op) {
  if (!bias.has_value()) return {Tensor(), nullptr, ULB_DT_F32};
  Tensor b = bias->is_contiguous() ? *bias : torch::stable::contiguous(*bias);
  check_cpu(b, op, "bias");
  const ulb_dtype dt = act_dtype(b, op, "bias");
  STD_TORCH_CHECK(b.dim() == 1 && b.size(0) == M, "ulb.", op, ": bias must have shape [", M, "]");
  return {b, b.const_data_ptr(), dt};
}

// The output of a linear op: x's leading dims and dtype, M features.
Tensor new_output(const Tensor &x, int64_t M) {
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = M;
  return new_tensor(shape, x.scalar_type());
}

Tensor linear(Tensor x, Tensor packed, std::optional<Tensor> bias, int64_t out_features) {
  const ulb_header h = check_packed(packed, "linear");
  check_cpu(x, "linear", "input");
  const ulb_dtype xdt = act_dtype(x, "linear", "input");
  STD_TORCH_CHECK(x.dim() >= 1, "ulb.linear: input must have at least 1 dim");
  const int64_t K = x.size(x.dim() - 1);
  STD_TORCH_CHECK(K == h.K, "ulb.linear: input has ", K, " features but the packed weight expects ",
                  h.K);
  STD_TORCH_CHECK(out_features == h.M, "ulb.linear: out_features=", out_features,
                  " but the packed weight has ", h.M, " rows");
  const Bias b = checked_bias(bias, h.M, "linear");
  Tensor y = new_output(x, h.M);
  const Rows rows = as_rows(x, K);
  if (rows.N == 0) return y;
  check_ok(ulb_linear(blob_ptr(packed), packed.numel(), rows.N, rows.t.const_data_ptr(), xdt, rows.ld,
                      rows.inc, b.ptr, b.dt, y.mutable_data_ptr(), xdt, h.M,
                      static_cast<int>(torch::stable::get_num_threads())),
           "linear");
  return y;
}

std::tuple<Tensor, Tensor, Tensor> quantize_act(Tensor x, Tensor packed) {
  const ulb_header h = check_packed(packed, "quantize_act");
  check_cpu(x, "quantize_act", "input");
  const ulb_dtype xdt = act_dtype(x, "quantize_act", "input");
  STD_TORCH_CHECK(x.dim() == 2 && x.size(1) == h.K, "ulb.quantize_act: input must be [N, ", h.K, "]");
  const int64_t N = x.size(0);
  Tensor xq = new_tensor({N, h.K_pad}, ScalarType::Char);
  Tensor xs = new_tensor({N}, ScalarType::Float);
  Tensor xsum = new_tensor({N, h.n_groups}, ScalarType::Int);
  check_ok(ulb_quantize_act(N, h.K, h.K_pad, h.group_size, x.const_data_ptr(), xdt, x.stride(0),
                            x.stride(1), static_cast<int8_t *>(xq.mutable_data_ptr()),
                            static_cast<float *>(xs.mutable_data_ptr()),
                            static_cast<int32_t *>(xsum.mutable_data_ptr())),
           "quantize_act");
  return std::make_tuple(xq, xs, xsum);
}

Tensor int_dots(Tensor packed, Tensor xq, Tensor xsum) {
  const ulb_header h = check_packed(packed, "int_dots");
  check_cpu(xq, "int_dots", "xq");
  STD_TORCH_CHECK(xq.scalar_type() == ScalarType::Char && xq.dim() == 2 && xq.size(1) == h.K_pad,
                  "ulb.int_dots: xq must be int8 [N, ", h.K_pad, "]");
  STD_TORCH_CHECK(xsum.scalar_type() == ScalarType::Int && xsum.dim() == 2 &&
                      xsum.size(0) == xq.size(0) && xsum.size(1) == h.n_groups,
                  "ulb.int_dots: xsum must be int32 [N, ", h.n_groups, "]");
  xq = torch::stable::contiguous(xq);
  xsum = torch::stable::contiguous(xsum);
  const int64_t N = xq.size(0);
  Tensor out = new_tensor({N, h.M, h.n_groups}, ScalarType::Int);
  check_ok(ulb_int_dots(blob_ptr(packed), packed.numel(), N, static_cast<const int8_t *>(xq.const_data_ptr()),
                        static_cast<const int32_t *>(xsum.const_data_ptr()),
                        static_cast<int32_t *>(out.mutable_data_ptr())),
           "int_dots");
  return out;
}

// bf16 x [..., K] through a plain bf16 weight [M, K] (bf16 out, as F.linear):
// one ulb_gemv_bf16 per row of x, so meant for decode (one token); the
// modules send longer inputs to F.linear.
Tensor linear_bf16(Tensor x, Tensor weight, std::optional<Tensor> bias) {
  check_cpu(weight, "linear_bf16", "weight");
  STD_TORCH_CHECK(weight.scalar_type() == ScalarType::BFloat16 && weight.dim() == 2 && weight.stride(1) == 1,
                  "ulb.linear_bf16: weight must be a 2-D bfloat16 tensor with contiguous rows, got ",
                  dtype_name(weight.scalar_type()), " with ", weight.dim(), " dims");
  const int64_t M = weight.size(0), K = weight.size(1);
  STD_TORCH_CHECK(K > 0, "ulb.linear_bf16: weight has no input features");
  check_cpu(x, "linear_bf16", "input");
  STD_TORCH_CHECK(x.scalar_type() == ScalarType::BFloat16, "ulb.linear_bf16: input must be bfloat16 like the weight, got ",
                  dtype_name(x.scalar_type()));
  STD_TORCH_CHECK(x.dim() >= 1 && x.size(x.dim() - 1) == K, "ulb.linear_bf16: input has ",
                  x.dim() ? x.size(x.dim() - 1) : 0, " features but the weight expects ", K);
  const Bias b = checked_bias(bias, M, "linear_bf16");
  Tensor y = new_output(x, M);
  const Rows rows = as_rows(x, K);
  const int nthreads = static_cast<int>(torch::stable::get_num_threads());
  for (int64_t n = 0; n < rows.N; n++)
    check_ok(ulb_gemv_bf16(static_cast<const uint16_t *>(weight.const_data_ptr()), M, K, weight.stride(0),
                           static_cast<const uint16_t *>(rows.t.const_data_ptr()) + n * rows.ld, rows.inc, b.ptr,
                           b.dt, static_cast<uint16_t *>(y.mutable_data_ptr()) + n * M, ULB_DT_BF16, nthreads),
             "linear_bf16");
  return y;
}

}  // namespace

STABLE_TORCH_LIBRARY(ulb, m) {
  m.def("pack(Tensor codes, Tensor scales, int format, int group_size) -> Tensor");
  m.def("unpack(Tensor packed) -> (Tensor, Tensor)");
  m.def("packed_info(Tensor packed) -> Tensor");
  m.def("linear(Tensor x, Tensor packed, Tensor? bias, int out_features) -> Tensor");
  m.def("quantize_act(Tensor x, Tensor packed) -> (Tensor, Tensor, Tensor)");
  m.def("int_dots(Tensor packed, Tensor xq, Tensor xsum) -> Tensor");
  m.def("linear_bf16(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
}

STABLE_TORCH_LIBRARY_IMPL(ulb, CPU, m) {
  m.impl("pack", TORCH_BOX(&pack));
  m.impl("unpack", TORCH_BOX(&unpack));
  m.impl("packed_info", TORCH_BOX(&packed_info));
  m.impl("linear", TORCH_BOX(&linear));
  m.impl("quantize_act", TORCH_BOX(&quantize_act));
  m.impl("int_dots", TORCH_BOX(&int_dots));
  m.impl("linear_bf16", TORCH_BOX(&linear_bf16));
}

namespace {

// Run ulbtorch's parallel regions on PyTorch's own intra-op pool (one OpenMP
// runtime per process); each task index is one share of the work split.
void torch_runner(int n, ulb_task_fn task, void *ctx) {
  torch::stable::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; i++) task(ctx, static_cast<int>(i));
  });
}

}  // namespace

extern "C" void ulbtorch_use_torch_threads(int on) { ulb_set_parallel_runner(on ? &torch_runner : nullptr); }

namespace {
const int kTorchThreadsByDefault = (ulbtorch_use_torch_threads(1), 0);
}  // namespace

// The C runtime API that Python reaches with ctypes (ulbtorch/runtime.py):
// referenced here so the linker keeps it from the static kernel library.
extern "C" const void *const ulb_runtime_api[] = {
    reinterpret_cast<const void *>(&ulb_packed_nbytes),   reinterpret_cast<const void *>(&ulb_isa_active),
    reinterpret_cast<const void *>(&ulb_isa_supported),   reinterpret_cast<const void *>(&ulb_isa_set),
    reinterpret_cast<const void *>(&ulb_sched_stats_get), reinterpret_cast<const void *>(&ulb_sched_reset),
    reinterpret_cast<const void *>(&ulb_sched_set_static), reinterpret_cast<const void *>(&ulb_sched_set_slowdown),
    reinterpret_cast<const void *>(&ulb_read_probe), reinterpret_cast<const void *>(&ulbtorch_use_torch_threads),
    reinterpret_cast<const void *>(&ulb_lut1_enable), reinterpret_cast<const void *>(&ulb_lut1_enabled),
    reinterpret_cast<const void *>(&ulb_lut1_available), reinterpret_cast<const void *>(&ulb_prefetch_get),
    reinterpret_cast<const void *>(&ulb_prefetch_set), reinterpret_cast<const void *>(&ulb_prefetch_resolve)};

// Importing ulbtorch._C registers the ops above; the module itself is empty.
extern "C" PyObject *PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module_def);
}
