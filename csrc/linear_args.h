// The rules for the arguments of a linear call, in one place for both callers
// of ulb_linear: torch.ops.ulb.linear (ops.cpp) and the modules' fast path
// (eager.cpp), so that the fast path serves exactly the calls the op accepts.
// Plain C++ over TensorInfo, which each side fills from its own tensor API.
// A rule that fails calls fail(message parts...) and returns false: ops.cpp's
// fail throws the message, eager.cpp's ignores it and returns NotImplemented,
// so that the op runs and raises.
#ifndef ULB_LINEAR_ARGS_H
#define ULB_LINEAR_ARGS_H

#include <cstdint>
#include <iosfwd>

#include "ulb/ulb.h"

namespace linear_args {

enum class Device { None, Cpu, Other };  // None: None passed for a tensor
enum class Dtype { F32, BF16, U8, Other };

// What the rules read of a tensor. sizes and strides are borrowed from it.
struct TensorInfo {
  Device device = Device::None;
  Dtype dtype = Dtype::Other;
  const char *dtype_name = "";  // for messages
  int64_t dim = 0;
  const int64_t *sizes = nullptr, *strides = nullptr;

  int64_t last() const { return dim ? sizes[dim - 1] : 0; }
  int64_t numel() const {
    int64_t n = 1;
    for (int64_t i = 0; i < dim; i++) n *= sizes[i];
    return n;
  }
  // Row-major dense; the stride of a dimension of size 1 is never used.
  bool contiguous() const {
    int64_t expect = 1;
    for (int64_t i = dim; i-- > 0;) {
      if (sizes[i] == 1) continue;
      if (strides[i] != expect) return false;
      expect *= sizes[i];
    }
    return true;
  }
};

// A kernel status in a message: written by ulb_status_str where a message is
// made (ops.cpp defines the operator), so eager.cpp needs no kernel symbol.
struct StatusText {
  ulb_status st;
};
std::ostream &operator<<(std::ostream &os, StatusText s);

using HeaderFn = ulb_status (*)(const uint8_t *, int64_t, ulb_header *);

template <class Fail>
bool on_cpu(const TensorInfo &t, const char *op, const char *name, Fail &&fail) {
  if (t.device == Device::None) {
    fail("ulb.", op, ": ", name, " must be a tensor, got None");
    return false;
  }
  if (t.device != Device::Cpu) {
    fail("ulb.", op, ": ", name, " must be a CPU tensor (use the pure-PyTorch path for other devices)");
    return false;
  }
  return true;
}

// An activation or bias dtype: fp32 or bf16.
template <class Fail>
bool act_dtype(const TensorInfo &t, const char *op, const char *name, ulb_dtype *dt, Fail &&fail) {
  if (t.dtype != Dtype::F32 && t.dtype != Dtype::BF16) {
    fail("ulb.", op, ": ", name, " must be float32 or bfloat16, got ", t.dtype_name);
    return false;
  }
  *dt = t.dtype == Dtype::F32 ? ULB_DT_F32 : ULB_DT_BF16;
  return true;
}

// A packed weight: a 1-D contiguous uint8 CPU tensor whose bytes (blob) hold
// a valid header, read by `header` (ulb_blob_header) into *h.
template <class Fail>
bool packed(const TensorInfo &t, const uint8_t *blob, HeaderFn header, const char *op, ulb_header *h,
            Fail &&fail) {
  if (!on_cpu(t, op, "packed weight", fail)) return false;
  const bool contiguous = t.contiguous();
  if (t.dtype != Dtype::U8 || t.dim != 1 || !contiguous) {
    fail("ulb.", op, ": packed weight must be a 1-D contiguous uint8 tensor made by ulb.pack, got dtype ",
         t.dtype_name, " with ", t.dim, " dims", contiguous ? "" : ", not contiguous");
    return false;
  }
  const ulb_status st = header(blob, t.sizes[0], h);
  if (st != ULB_OK) {
    fail("ulb.", op, ": ", StatusText{st});
    return false;
  }
  return true;
}

// An optional bias (nullptr: none) of M elements, fp32 or bf16, into *dt.
template <class Fail>
bool bias(const TensorInfo *b, int64_t M, const char *op, ulb_dtype *dt, Fail &&fail) {
  *dt = ULB_DT_F32;
  if (!b) return true;
  if (!on_cpu(*b, op, "bias", fail) || !act_dtype(*b, op, "bias", dt, fail)) return false;
  if (b->dim != 1 || b->sizes[0] != M) {
    fail("ulb.", op, ": bias must have shape [", M, "]");
    return false;
  }
  return true;
}

// How the kernel reads the rows of x [..., K], leading dims flattened: N rows
// of stride ld, elements of stride inc. 2-D and contiguous inputs are read in
// place; any other layout needs x reshaped to [N, K] first (reshape).
struct Rows {
  int64_t N, ld, inc;
  bool reshape;
};

inline Rows rows(const TensorInfo &x, int64_t K) {
  const int64_t N = K > 0 ? x.numel() / K : 0;
  if (x.dim == 2) return {N, x.strides[0], x.strides[1], false};
  return {N, K, 1, !x.contiguous()};
}

// One layer of a linear call: linear(x, packed, bias, out_features).
struct Layer {
  ulb_header h;
  ulb_dtype xdt, bdt;
  Rows rows;
};

template <class Fail>
bool layer(const TensorInfo &x, const TensorInfo &w, const uint8_t *blob, HeaderFn header, const TensorInfo *b,
           int64_t out_features, const char *op, Layer *out, Fail &&fail) {
  if (!packed(w, blob, header, op, &out->h, fail)) return false;
  if (!on_cpu(x, op, "input", fail) || !act_dtype(x, op, "input", &out->xdt, fail)) return false;
  if (x.dim < 1) {
    fail("ulb.", op, ": input must have at least 1 dim");
    return false;
  }
  if (x.last() != out->h.K) {
    fail("ulb.", op, ": input has ", x.last(), " features but the packed weight expects ", out->h.K);
    return false;
  }
  if (out_features != out->h.M) {
    fail("ulb.", op, ": out_features=", out_features, " but the packed weight has ", out->h.M, " rows");
    return false;
  }
  if (!bias(b, out->h.M, op, &out->bdt, fail)) return false;
  out->rows = rows(x, out->h.K);
  return true;
}

}  // namespace linear_args

#endif
