// Fused elementwise ops of the decoder block: one pass over memory instead of the
// five to seven PyTorch ops (each a full read and write of the activations) that
// the eager code runs. Rounding follows the Hugging Face modules step by step
// (fp32 math, a cast to the model dtype where they cast), so bf16 results equal
// the eager path's wherever fp32 evaluation order does not flip a rounding.
#include <ATen/Parallel.h>

#include "kernels.h"
#include "vec.h"

namespace tokenmill {
namespace {

template <typename T>
inline T round_to(float x) { return static_cast<T>(x); }

// out = weight * (x * rsqrt(mean(x^2) + eps)).to(dtype), as LlamaRMSNorm
template <typename T>
void rms_norm_kernel(T* out, const T* x, const T* weight, int64_t rows, int64_t hidden, double eps) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * hidden;
      T* outr = out + r * hidden;
      float sum = 0.f;
      int64_t i = 0;
#if defined(TOKENMILL_SIMD)
      if constexpr (kVectorized<T>) {
        vfloat acc = vzero();
        for (; i + kLanes <= hidden; i += kLanes) {
          const vfloat v = vload(xr + i);
          acc = vfmadd(v, v, acc);
        }
        sum = vsum(acc);
      }
#endif
      for (; i < hidden; ++i) sum += to_float(xr[i]) * to_float(xr[i]);
      const float inv = 1.f / std::sqrt(sum / static_cast<float>(hidden) + static_cast<float>(eps));
      int64_t j = 0;
#if defined(TOKENMILL_SIMD)
      if constexpr (kVectorized<T>) {
        const vfloat vinv = vset1(inv);
        for (; j + kLanes <= hidden; j += kLanes) {
          const vfloat normed = vround(vmul(vload(xr + j), vinv), xr);
          vstore(outr + j, vmul(vload(weight + j), normed));
        }
      }
#endif
      for (; j < hidden; ++j) {
        const T normed = round_to<T>(to_float(xr[j]) * inv);
        outr[j] = round_to<T>(to_float(weight[j]) * to_float(normed));
      }
    }
  });
}

// out = silu(gate).to(dtype) * up for x = [gate | up] per row, as LlamaMLP
template <typename T>
void silu_and_mul_kernel(T* out, const T* x, int64_t rows, int64_t d) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* gate = x + r * 2 * d;
      const T* up = gate + d;
      T* outr = out + r * d;
      int64_t j = 0;
#if defined(TOKENMILL_SIMD)
      if constexpr (kVectorized<T>) {
        const vfloat one = vset1(1.f);
        for (; j + kLanes <= d; j += kLanes) {
          const vfloat g = vload(gate + j);
          const vfloat act = vround(vdiv(g, vadd(one, vexp(vsub(vzero(), g)))), gate);
          vstore(outr + j, vmul(act, vload(up + j)));
        }
      }
#endif
      for (; j < d; ++j) {
        const float g = to_float(gate[j]);
        const T act = round_to<T>(g / (1.f + std::exp(-g)));
        outr[j] = round_to<T>(to_float(act) * to_float(up[j]));
      }
    }
  });
}

// NeoX rotary in place on the first `rot` features of each head:
// x = x * cos + rotate_half(x) * sin, each product and the sum rounded to T as the
// eager code (and HF's apply_rotary_pos_emb) rounds them. cos/sin: [tokens, rot], already in T.
template <typename T>
void rotary_kernel(T* x, int64_t tokens, int64_t heads, int64_t token_stride, int64_t head_stride,
                   const T* cos, const T* sin, int64_t rot) {
  const int64_t half = rot / 2;
  at::parallel_for(0, tokens, 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* c = cos + t * rot;
      const T* s = sin + t * rot;
      for (int64_t h = 0; h < heads; ++h) {
        T* v = x + t * token_stride + h * head_stride;
        int64_t i = 0;
#if defined(TOKENMILL_SIMD)
        // the same roundings a vector at a time (scalar, each bf16 rounding was a call: 19x fp32's time)
        if constexpr (kVectorized<T>) {
          for (; i + kLanes <= half; i += kLanes) {
            const vfloat x1 = vload(v + i), x2 = vload(v + i + half);
            const vfloat a1 = vround(vmul(x1, vload(c + i)), v), b1 = vround(vmul(vmul(x2, vset1(-1.f)), vload(s + i)), v);
            const vfloat a2 = vround(vmul(x2, vload(c + i + half)), v), b2 = vround(vmul(x1, vload(s + i + half)), v);
            vstore(v + i, vadd(a1, b1));
            vstore(v + i + half, vadd(a2, b2));
          }
        }
#endif
        for (; i < half; ++i) {
          const float x1 = to_float(v[i]), x2 = to_float(v[i + half]);
          const T a1 = round_to<T>(x1 * to_float(c[i])), b1 = round_to<T>(-x2 * to_float(s[i]));
          const T a2 = round_to<T>(x2 * to_float(c[i + half])), b2 = round_to<T>(x1 * to_float(s[i + half]));
          v[i] = round_to<T>(to_float(a1) + to_float(b1));
          v[i + half] = round_to<T>(to_float(a2) + to_float(b2));
        }
      }
    }
  });
}

template <typename F>
void dispatch(const at::Tensor& t, const char* name, F&& run) {
  switch (t.scalar_type()) {
    case at::kFloat: run(static_cast<float*>(nullptr)); break;
    case at::kBFloat16: run(static_cast<c10::BFloat16*>(nullptr)); break;
    default: TORCH_CHECK(false, name, ": float32 or bfloat16 only");
  }
}

}  // namespace

void rms_norm(at::Tensor out, at::Tensor x, at::Tensor weight, double eps) {
  TORCH_CHECK(x.is_contiguous() && out.is_contiguous() && weight.is_contiguous(), "rms_norm: contiguous tensors");
  TORCH_CHECK(x.scalar_type() == weight.scalar_type() && out.scalar_type() == x.scalar_type(), "rms_norm: one dtype");
  const int64_t hidden = x.size(-1);
  dispatch(x, "rms_norm", [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    rms_norm_kernel<T>(out.data_ptr<T>(), x.data_ptr<T>(), weight.data_ptr<T>(), x.numel() / hidden, hidden, eps);
  });
}

void silu_and_mul(at::Tensor out, at::Tensor x) {
  TORCH_CHECK(x.is_contiguous() && out.is_contiguous(), "silu_and_mul: contiguous tensors");
  TORCH_CHECK(out.scalar_type() == x.scalar_type(), "silu_and_mul: one dtype");
  const int64_t d = x.size(-1) / 2;
  dispatch(x, "silu_and_mul", [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    silu_and_mul_kernel<T>(out.data_ptr<T>(), x.data_ptr<T>(), x.numel() / (2 * d), d);
  });
}

void rotary_embedding(at::Tensor query, at::Tensor key, at::Tensor cos, at::Tensor sin) {
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.sizes() == sin.sizes(), "rotary: cos/sin [tokens, rot]");
  const int64_t rot = cos.size(1);
  for (const at::Tensor& x : {query, key}) {
    TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.size(0) == cos.size(0) && x.size(2) >= rot,
                "rotary: [tokens, heads, head_dim] with contiguous heads");
    TORCH_CHECK(x.scalar_type() == cos.scalar_type(), "rotary: one dtype");
    dispatch(x, "rotary_embedding", [&](auto* tag) {
      using T = std::remove_pointer_t<decltype(tag)>;
      rotary_kernel<T>(x.data_ptr<T>(), x.size(0), x.size(1), x.stride(0), x.stride(1), cos.data_ptr<T>(),
                       sin.data_ptr<T>(), rot);
    });
  }
}

}  // namespace tokenmill
