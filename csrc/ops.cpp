// torch.ops.ulb.*: argument checks and tensor plumbing over the C kernels.
// Built against the LibTorch stable ABI, so one binary serves torch >= 2.10.
#include <Python.h>

#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>

#include <climits>
#include <cstdio>
#include <cstring>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <tuple>
#include <vector>

#include "ulb/ulb.h"
#include "ulb/ulb_testing.h"
#include "linear_args.h"

using torch::stable::Tensor;

std::ostream &linear_args::operator<<(std::ostream &os, StatusText s) { return os << ulb_status_str(s.st); }

namespace {

// STD_TORCH_CHECK, but the message alone: PyTorch's macro puts the C++
// function, file and line in front, which tell a Python caller nothing. The
// std::runtime_error reaches Python as a RuntimeError either way.
template <typename... Args>
[[noreturn]] void fail(const Args &...args) {
  std::ostringstream msg;
  (msg << ... << args);
  throw std::runtime_error(msg.str());
}
#define ULB_CHECK(cond, ...)        \
  do {                              \
    if (!(cond)) fail(__VA_ARGS__); \
  } while (0)

// The shim's codes for the dtypes and device the ops meet, read once at load:
// Tensor::scalar_type() compares a tensor's code with one out-of-line shim
// getter per dtype in turn, several times a call, and a one-token call runs
// between weight streams that flush the caches.
const int32_t kU8 = aoti_torch_dtype_uint8(), kI8 = aoti_torch_dtype_int8(), kI32 = aoti_torch_dtype_int32(),
              kI64 = aoti_torch_dtype_int64(), kF16 = aoti_torch_dtype_float16(), kF32 = aoti_torch_dtype_float32(),
              kF64 = aoti_torch_dtype_float64(), kBF16 = aoti_torch_dtype_bfloat16();
const int32_t kCPU = aoti_torch_device_type_cpu();

const char *dtype_name(int32_t code) {
  if (code == kF32) return "float32";
  if (code == kBF16) return "bfloat16";
  if (code == kF16) return "float16";
  if (code == kF64) return "float64";
  if (code == kU8) return "uint8";
  if (code == kI8) return "int8";
  if (code == kI32) return "int32";
  if (code == kI64) return "int64";
  return "an unsupported dtype";
}

// What the ops read of a tensor, one shim call per field: the fields the
// rules of linear_args.h read, and the shim's dtype code. sizes and strides
// are borrowed from the tensor, which outlives the op's use of them. An
// undefined tensor (None passed for a Tensor argument) has device None,
// which check_cpu, the first check of every argument, names.
constexpr int32_t kNone = -1;
struct Meta : linear_args::TensorInfo {
  int32_t code = kNone;  // the shim's dtype code

  explicit Meta(const Tensor &t) {
    if (!t.defined()) return;
    AtenTensorHandle h = t.get();
    int32_t device_type;
    TORCH_ERROR_CODE_CHECK(aoti_torch_get_dtype(h, &code));
    TORCH_ERROR_CODE_CHECK(aoti_torch_get_device_type(h, &device_type));
    TORCH_ERROR_CODE_CHECK(aoti_torch_get_dim(h, &dim));
    TORCH_ERROR_CODE_CHECK(aoti_torch_get_sizes(h, const_cast<int64_t **>(&sizes)));
    TORCH_ERROR_CODE_CHECK(aoti_torch_get_strides(h, const_cast<int64_t **>(&strides)));
    device = device_type == kCPU ? linear_args::Device::Cpu : linear_args::Device::Other;
    dtype = code == kF32    ? linear_args::Dtype::F32
            : code == kBF16 ? linear_args::Dtype::BF16
            : code == kU8   ? linear_args::Dtype::U8
                            : linear_args::Dtype::Other;
    dtype_name = ::dtype_name(code);
  }
};

// The fail of linear_args' rules: the message, thrown.
const auto raise = [](const auto &...args) { fail(args...); };

void check_ok(ulb_status st, const char *op) {
  ULB_CHECK(st == ULB_OK, "ulb.", op, ": ", ulb_status_str(st));
}

void check_cpu(const Meta &m, const char *op, const char *name) { linear_args::on_cpu(m, op, name, raise); }

ulb_dtype act_dtype(const Meta &m, const char *op, const char *name) {
  ulb_dtype dt;
  linear_args::act_dtype(m, op, name, &dt, raise);
  return dt;
}

// A packed weight: 1-D contiguous uint8 whose header validates.
struct Packed {
  const uint8_t *blob;
  int64_t nbytes;
  ulb_header h;
};

Packed check_packed(const Tensor &packed, const char *op) {
  const Meta m(packed);
  Packed p{m.device == linear_args::Device::Cpu ? static_cast<const uint8_t *>(packed.const_data_ptr()) : nullptr,
           0, {}};
  linear_args::packed(m, p.blob, &ulb_blob_header, op, &p.h, raise);
  p.nbytes = m.sizes[0];
  return p;
}

// A new contiguous CPU tensor. Calls the C shim directly: torch::stable::empty
// looks "aten::empty" up in the dispatcher by name on every call, a
// noticeable share of a decode-sized GEMV.
Tensor new_tensor(const std::vector<int64_t> &shape, int32_t dtype) {
  std::vector<int64_t> strides(shape.size());
  int64_t stride = 1;
  for (size_t i = shape.size(); i-- > 0;) {
    strides[i] = stride;
    stride *= shape[i] > 1 ? shape[i] : 1;
  }
  AtenTensorHandle out;
  TORCH_ERROR_CODE_CHECK(aoti_torch_empty_strided(static_cast<int64_t>(shape.size()), shape.data(),
                                                  strides.data(), dtype, kCPU, 0, &out));
  return Tensor(out);
}

// A tile-order argument as C's int: a value past int's range names no order
// either, and must not narrow into one.
int tiles_arg(int64_t tiles) {
  return tiles >= INT_MIN && tiles <= INT_MAX ? static_cast<int>(tiles) : ULB_TILES_COUNT;
}

// The kernels' ULB_ERR_TILES for format fi, with the orders it offers.
[[noreturn]] void fail_tiles(const char *op, const ulb_format_info *fi, int64_t tiles) {
  std::ostringstream offered;
  for (int t = 0; t < ULB_TILES_COUNT; t++)
    if (fi->tiles >> t & 1u) offered << t << " = " << ulb_tiles_name(t) << ", ";
  fail("ulb.", op, ": tile order ", tiles, " is not offered for format ", fi->name, " (it offers ", offered.str(),
       ULB_TILES_PREFERRED, " = this CPU's preferred)");
}

// What ulb_pack (kernels/src/format.c, which holds the rules on values) said
// of these arguments, with their context.
[[noreturn]] void fail_pack(ulb_status st, const ulb_format_info *fi, int64_t M, int64_t K, int64_t group_size,
                            int64_t G, int64_t tiles) {
  switch (st) {
  case ULB_ERR_SHAPE:
    fail("ulb.pack: codes of shape [", M, ", ", K, "]: packed weights hold 1 to ", ULB_MAX_M, " out_features and 1 to ",
         ULB_MAX_K, " in_features");
  case ULB_ERR_GROUP:
    fail("ulb.pack: ", ulb_status_str(st), " (group_size ", group_size, " for format ", fi->name, ", in_features ", K,
         ")");
  case ULB_ERR_TILES: fail_tiles("pack", fi, tiles);
  case ULB_ERR_CODE:
    fail("ulb.pack: ", ulb_status_str(st), ": codes exceed ", fi->max_code, ", the largest code of format '", fi->name,
         "' (codes of shape [", M, ", ", K, "])");
  case ULB_ERR_SCALE: fail("ulb.pack: ", ulb_status_str(st), " (scales of shape [", M, ", ", G, "])");
  default: fail("ulb.pack: ", ulb_status_str(st));
  }
}

Tensor pack(Tensor codes, Tensor scales, int64_t format, int64_t group_size, int64_t tiles) {
  const Meta mc(codes), ms(scales);
  check_cpu(mc, "pack", "codes");
  check_cpu(ms, "pack", "scales");
  const ulb_format_info *fi = format >= 0 && format <= INT_MAX ? ulb_format_get(static_cast<int>(format)) : nullptr;
  ULB_CHECK(fi != nullptr, "ulb.pack: unknown format id ", format);
  ULB_CHECK(mc.code == kU8 && mc.dim == 2,
            "ulb.pack: codes must be a 2-D uint8 tensor [out_features, in_features], got ",
            mc.dtype_name, " with ", mc.dim, " dims");
  ULB_CHECK(ms.code == kF32 && ms.dim == 2,
            "ulb.pack: scales must be a 2-D float32 tensor [out_features, n_groups]");
  const int64_t M = mc.sizes[0], K = mc.sizes[1];
  // One group per row, or ceil(K / group_size): the M x G floats C reads.
  const int64_t G = (group_size <= 0 || group_size >= K) ? 1 : (K + group_size - 1) / group_size;
  const int64_t nbytes = ulb_packed_nbytes(fi->id, M, K, group_size);
  if (nbytes < 0) fail_pack(static_cast<ulb_status>(-nbytes), fi, M, K, group_size, G, tiles);
  ULB_CHECK(ms.sizes[0] == M && ms.sizes[1] == G, "ulb.pack: scales must have shape [", M, ", ", G,
            "] for group_size ", group_size, ", got [", ms.sizes[0], ", ", ms.sizes[1], "]");
  codes = torch::stable::contiguous(codes);
  scales = torch::stable::contiguous(scales);
  Tensor out = new_tensor({nbytes}, kU8);
  const ulb_status st =
      ulb_pack_tiles(fi->id, tiles_arg(tiles), M, K, group_size, static_cast<const uint8_t *>(codes.const_data_ptr()),
                     K, static_cast<const float *>(scales.const_data_ptr()),
                     static_cast<uint8_t *>(out.mutable_data_ptr()), nbytes);
  if (st != ULB_OK) fail_pack(st, fi, M, K, group_size, G, tiles);
  return out;
}

Tensor retile(Tensor packed, int64_t tiles) {
  const Packed p = check_packed(packed, "retile");
  Tensor out = new_tensor({p.nbytes}, kU8);
  const ulb_status st =
      ulb_retile(p.blob, p.nbytes, tiles_arg(tiles), static_cast<uint8_t *>(out.mutable_data_ptr()));
  if (st == ULB_ERR_TILES) fail_tiles("retile", ulb_format_get(p.h.format), tiles);
  check_ok(st, "retile");
  return out;
}

std::tuple<Tensor, Tensor> unpack(Tensor packed) {
  const Packed p = check_packed(packed, "unpack");
  Tensor codes = new_tensor({p.h.M, p.h.K}, kU8);
  Tensor scales = new_tensor({p.h.M, p.h.n_groups}, kF32);
  check_ok(ulb_unpack(p.blob, p.nbytes, static_cast<uint8_t *>(codes.mutable_data_ptr()),
                      static_cast<float *>(scales.mutable_data_ptr())),
           "unpack");
  return std::make_tuple(codes, scales);
}

Tensor packed_info(Tensor packed) {
  const ulb_header h = check_packed(packed, "packed_info").h;
  Tensor out = new_tensor({8}, kI64);
  int64_t *p = static_cast<int64_t *>(out.mutable_data_ptr());
  const int64_t v[8] = {h.format, h.M, h.K, h.group_size, h.n_groups, h.M_pad, h.K_pad, h.tiles};
  std::memcpy(p, v, sizeof v);
  return out;
}

// The whole blob checked as a loader needs it (ulb_blob_verify): [1] where a
// checksum vouched for its bytes, [0] for a blob of version 2, which has none.
Tensor verify_packed(Tensor packed) {
  const Packed p = check_packed(packed, "verify_packed");
  int checked = 0;
  check_ok(ulb_blob_verify(p.blob, p.nbytes, &checked), "verify_packed");
  Tensor out = new_tensor({1}, kI64);
  *static_cast<int64_t *>(out.mutable_data_ptr()) = checked;
  return out;
}

// The rows of x [..., K] as linear_args::rows reads them, x reshaped where
// they say so (a view where strides allow, else a copy, kept alive here).
struct Rows {
  const void *data;
  int64_t N, ld, inc;
  std::optional<Tensor> copy;
};

Rows as_rows(const Tensor &x, const linear_args::Rows &r) {
  if (!r.reshape) return {x.const_data_ptr(), r.N, r.ld, r.inc, std::nullopt};
  Tensor flat = torch::stable::reshape(x, {r.N, r.ld});  // ld is K where rows reshape
  const Meta mf(flat);
  return {flat.const_data_ptr(), r.N, mf.strides[0], mf.strides[1], flat};
}

// An optional bias of M elements, fp32 or bf16, made contiguous.
struct Bias {
  const void *ptr;
  ulb_dtype dt;
  std::optional<Tensor> keep;
};

std::optional<Meta> meta_of(const std::optional<Tensor> &t) {
  return t.has_value() ? std::optional<Meta>(Meta(*t)) : std::nullopt;
}

// bias (described by m), checked by linear_args::bias (bdt: the dtype it found), made contiguous.
Bias contiguous_bias(const std::optional<Tensor> &bias, const std::optional<Meta> &m, ulb_dtype bdt) {
  if (!bias.has_value()) return {nullptr, ULB_DT_F32, std::nullopt};
  Tensor b = m->contiguous() ? *bias : torch::stable::contiguous(*bias);
  return {b.const_data_ptr(), bdt, b};
}

Bias checked_bias(const std::optional<Tensor> &bias, int64_t M, const char *op) {
  const std::optional<Meta> m = meta_of(bias);
  ulb_dtype bdt;
  linear_args::bias(m ? &*m : nullptr, M, op, &bdt, raise);
  return contiguous_bias(bias, m, bdt);
}

// The output of a linear op: x's leading dims and dtype, M features.
Tensor new_output(const Meta &x, int64_t M) {
  std::vector<int64_t> shape(x.sizes, x.sizes + x.dim);
  shape.back() = M;
  return new_tensor(shape, x.code);
}

// One layer of linear or linear_many, its arguments checked as `op` names
// them: the packed weight, x's dtype and rows, the bias.
struct Layer {
  Packed p;
  Meta mx;
  ulb_dtype xdt;
  Bias b;
  Rows rows;
};

Layer checked_layer(const Tensor &x, const Tensor &packed, const std::optional<Tensor> &bias, int64_t out_features,
                    const char *op) {
  const Meta mw(packed), mx(x);
  const std::optional<Meta> mb = meta_of(bias);
  const uint8_t *blob =
      mw.device == linear_args::Device::Cpu ? static_cast<const uint8_t *>(packed.const_data_ptr()) : nullptr;
  linear_args::Layer l;
  linear_args::layer(mx, mw, blob, &ulb_blob_header, mb ? &*mb : nullptr, out_features, op, &l, raise);
  return {{blob, mw.sizes[0], l.h}, mx, l.xdt, contiguous_bias(bias, mb, l.bdt), as_rows(x, l.rows)};
}

Tensor linear(Tensor x, Tensor packed, std::optional<Tensor> bias, int64_t out_features) {
  const Layer l = checked_layer(x, packed, bias, out_features, "linear");
  Tensor y = new_output(l.mx, l.p.h.M);
  if (l.rows.N == 0) return y;
  check_ok(ulb_linear(l.p.blob, l.p.nbytes, l.rows.N, l.rows.data, l.xdt, l.rows.ld, l.rows.inc, l.b.ptr, l.b.dt,
                      y.mutable_data_ptr(), l.xdt, l.p.h.M, static_cast<int>(torch::stable::get_num_threads())),
           "linear");
  return y;
}

// The rows of linear(x[i], packed[i], bias[i]) for each i, one layer's after
// another's: layers of one width (the experts a batch of tokens visits) in
// one parallel region (ulb_linear_many), each to the bit as linear gives it.
Tensor linear_many(std::vector<Tensor> x, std::vector<Tensor> packed, std::vector<Tensor> bias,
                   int64_t out_features) {
  const size_t n = packed.size();
  ULB_CHECK(n > 0 && n <= INT_MAX, "ulb.linear_many: takes 1 to ", INT_MAX, " layers, got ", n);
  ULB_CHECK(x.size() == n, "ulb.linear_many: ", x.size(), " inputs for ", n, " packed weights");
  ULB_CHECK(bias.empty() || bias.size() == n, "ulb.linear_many: ", bias.size(), " biases for ", n,
            " packed weights (give none, or one a layer)");
  std::vector<Layer> checked;  // holds the copies some inputs and biases need until the kernel has run
  checked.reserve(n);
  std::vector<ulb_linear_args> layers(n);
  int64_t total = 0;
  for (size_t i = 0; i < n; i++) {
    char op[48];  // on the stack: a heap string a layer would show in a decode-sized call
    std::snprintf(op, sizeof op, "linear_many, layer %zu", i);
    const Layer &l = checked.emplace_back(
        checked_layer(x[i], packed[i], bias.empty() ? std::nullopt : std::optional<Tensor>(bias[i]), out_features, op));
    ULB_CHECK(l.xdt == checked[0].xdt, "ulb.", op, ": input is ", l.mx.dtype_name, " but layer 0's is ",
              checked[0].mx.dtype_name);
    ULB_CHECK(l.b.dt == checked[0].b.dt, "ulb.", op, ": bias dtype differs from layer 0's");
    layers[i] = {l.p.blob, l.p.nbytes, l.rows.N, l.rows.data, l.rows.ld, l.rows.inc, l.b.ptr, nullptr, out_features};
    total += l.rows.N;
  }
  const ulb_dtype xdt = checked[0].xdt;
  Tensor y = new_tensor({total, out_features}, checked[0].mx.code);
  char *out = static_cast<char *>(y.mutable_data_ptr());
  const size_t row_bytes = static_cast<size_t>(out_features) * (xdt == ULB_DT_F32 ? 4 : 2);
  for (size_t i = 0; i < n; out += row_bytes * static_cast<size_t>(layers[i].N), i++) layers[i].y = out;
  check_ok(ulb_linear_many(layers.data(), static_cast<int>(n), xdt, checked[0].b.dt, xdt,
                           static_cast<int>(torch::stable::get_num_threads())),
           "linear_many");
  return y;
}

std::tuple<Tensor, Tensor, Tensor> quantize_act(Tensor x, Tensor packed) {
  const ulb_header h = check_packed(packed, "quantize_act").h;
  const Meta mx(x);
  check_cpu(mx, "quantize_act", "input");
  const ulb_dtype xdt = act_dtype(mx, "quantize_act", "input");
  ULB_CHECK(mx.dim == 2 && mx.sizes[1] == h.K, "ulb.quantize_act: input must be [N, ", h.K, "]");
  const int64_t N = mx.sizes[0];
  Tensor xq = new_tensor({N, h.K_pad}, kI8);
  Tensor xs = new_tensor({N}, kF32);
  Tensor xsum = new_tensor({N, h.n_groups}, kI32);
  check_ok(ulb_quantize_act(N, h.K, h.K_pad, h.group_size, x.const_data_ptr(), xdt, mx.strides[0], mx.strides[1],
                            static_cast<int8_t *>(xq.mutable_data_ptr()), static_cast<float *>(xs.mutable_data_ptr()),
                            static_cast<int32_t *>(xsum.mutable_data_ptr())),
           "quantize_act");
  return std::make_tuple(xq, xs, xsum);
}

Tensor int_dots(Tensor packed, Tensor xq, Tensor xsum) {
  const Packed p = check_packed(packed, "int_dots");
  const Meta mq(xq), ms(xsum);
  check_cpu(mq, "int_dots", "xq");
  ULB_CHECK(mq.code == kI8 && mq.dim == 2 && mq.sizes[1] == p.h.K_pad, "ulb.int_dots: xq must be int8 [N, ",
            p.h.K_pad, "]");
  ULB_CHECK(ms.code == kI32 && ms.dim == 2 && ms.sizes[0] == mq.sizes[0] && ms.sizes[1] == p.h.n_groups,
            "ulb.int_dots: xsum must be int32 [N, ", p.h.n_groups, "]");
  const int64_t N = mq.sizes[0];
  xq = torch::stable::contiguous(xq);
  xsum = torch::stable::contiguous(xsum);
  Tensor out = new_tensor({N, p.h.M, p.h.n_groups}, kI32);
  const ulb_status st = ulb_int_dots(p.blob, p.nbytes, N, static_cast<const int8_t *>(xq.const_data_ptr()),
                                     static_cast<const int32_t *>(xsum.const_data_ptr()),
                                     static_cast<int32_t *>(out.mutable_data_ptr()));
  ULB_CHECK(st != ULB_ERR_SHAPE, "ulb.int_dots: xq must be zero past in_features and xsum the sums of xq over "
            "each group, as ulb.quantize_act gives them");
  check_ok(st, "int_dots");
  return out;
}

// bf16 x [..., K] through a plain bf16 weight [M, K] (bf16 out, as F.linear):
// one ulb_gemv_bf16 per row of x, so meant for decode (one token); the
// modules send longer inputs to F.linear.
Tensor linear_bf16(Tensor x, Tensor weight, std::optional<Tensor> bias) {
  const Meta mw(weight);
  check_cpu(mw, "linear_bf16", "weight");
  ULB_CHECK(mw.code == kBF16 && mw.dim == 2, "ulb.linear_bf16: weight must be a 2-D bfloat16 tensor, got ",
            mw.dtype_name, " with ", mw.dim, " dims");
  const int64_t M = mw.sizes[0], K = mw.sizes[1];
  ULB_CHECK(K > 0, "ulb.linear_bf16: weight has no input features");
  // The stride of a dimension of size 1 is never used (PyTorch calls such a
  // tensor contiguous whatever it says).
  const int64_t ldw = M == 1 ? K : mw.strides[0];
  ULB_CHECK((K == 1 || mw.strides[1] == 1) && ldw >= K,
            "ulb.linear_bf16: weight rows must be contiguous and not overlap (strides ", mw.strides[0], ", ",
            mw.strides[1], " for shape [", M, ", ", K, "]); pass weight.contiguous()");
  const Meta mx(x);
  check_cpu(mx, "linear_bf16", "input");
  ULB_CHECK(mx.code == kBF16, "ulb.linear_bf16: input must be bfloat16 like the weight, got ", mx.dtype_name);
  ULB_CHECK(mx.dim >= 1 && mx.last() == K, "ulb.linear_bf16: input has ", mx.last(),
            " features but the weight expects ", K);
  const Bias b = checked_bias(bias, M, "linear_bf16");
  Tensor y = new_output(mx, M);
  const Rows rows = as_rows(x, linear_args::rows(mx, K));
  const uint16_t *w = static_cast<const uint16_t *>(weight.const_data_ptr());
  uint16_t *out = static_cast<uint16_t *>(y.mutable_data_ptr());
  const int nthreads = static_cast<int>(torch::stable::get_num_threads());
  for (int64_t n = 0; n < rows.N; n++)
    check_ok(ulb_gemv_bf16(w, M, K, ldw, static_cast<const uint16_t *>(rows.data) + n * rows.ld, rows.inc,
                           b.ptr, b.dt, out + n * M, ULB_DT_BF16, nthreads),
             "linear_bf16");
  return y;
}

}  // namespace

STABLE_TORCH_LIBRARY(ulb, m) {
  m.def("pack(Tensor codes, Tensor scales, int format, int group_size, int tiles=-1) -> Tensor");
  m.def("unpack(Tensor packed) -> (Tensor, Tensor)");
  m.def("retile(Tensor packed, int tiles=-1) -> Tensor");
  m.def("packed_info(Tensor packed) -> Tensor");
  m.def("verify_packed(Tensor packed) -> Tensor");
  m.def("linear(Tensor x, Tensor packed, Tensor? bias, int out_features) -> Tensor");
  m.def("linear_many(Tensor[] x, Tensor[] packed, Tensor[] bias, int out_features) -> Tensor");
  m.def("quantize_act(Tensor x, Tensor packed) -> (Tensor, Tensor, Tensor)");
  m.def("int_dots(Tensor packed, Tensor xq, Tensor xsum) -> Tensor");
  m.def("linear_bf16(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
}

STABLE_TORCH_LIBRARY_IMPL(ulb, CPU, m) {
  m.impl("pack", TORCH_BOX(&pack));
  m.impl("retile", TORCH_BOX(&retile));
  m.impl("unpack", TORCH_BOX(&unpack));
  m.impl("packed_info", TORCH_BOX(&packed_info));
  m.impl("verify_packed", TORCH_BOX(&verify_packed));
  m.impl("linear", TORCH_BOX(&linear));
  m.impl("linear_many", TORCH_BOX(&linear_many));
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
    reinterpret_cast<const void *>(&ulb_lut1_set), reinterpret_cast<const void *>(&ulb_lut1_get),
    reinterpret_cast<const void *>(&ulb_lut1_serves),
    reinterpret_cast<const void *>(&ulb_lut1_available), reinterpret_cast<const void *>(&ulb_prefetch_get),
    reinterpret_cast<const void *>(&ulb_prefetch_set), reinterpret_cast<const void *>(&ulb_prefetch_resolve),
    reinterpret_cast<const void *>(&ulb_read_probe_streams),
    reinterpret_cast<const void *>(&ulb_spin_us), reinterpret_cast<const void *>(&ulb_format_count),
    reinterpret_cast<const void *>(&ulb_format_at), reinterpret_cast<const void *>(&ulb_format_get),
    reinterpret_cast<const void *>(&ulb_format_info_size), reinterpret_cast<const void *>(&ulb_tiles_name),
    reinterpret_cast<const void *>(&ulb_constants_get), reinterpret_cast<const void *>(&ulb_constants_size),
    reinterpret_cast<const void *>(&ulb_status_str), reinterpret_cast<const void *>(&ulb_gemv_bf16_native),
    reinterpret_cast<const void *>(&ulb_xxh64)};

// Importing ulbtorch._C registers the ops above; the module itself is empty.
extern "C" PyObject *PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module_def);
}
