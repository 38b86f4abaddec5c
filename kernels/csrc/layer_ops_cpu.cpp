// A Llama layer's elementwise work on the CPU, one pass per op instead of torch's chain of kernels:
// in torch a norm is 7 ops, rotary 9, the MLP's activation 3, each a dispatch and a pass over memory,
// and at decode (a few rows) their Python and dispatch cost more than their arithmetic.
// float32 or bfloat16 storage; arithmetic in float32 either way (as the torch path: x.float() ...).
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

inline float load(float x) { return x; }
inline float load(at::BFloat16 x) {
  uint32_t u = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
inline void store(float* p, float v) { *p = v; }
inline void store(at::BFloat16* p, float v) { *p = at::BFloat16(v); }  // round to nearest even, as .to()

// rows are independent: worth a team only when there is enough of them
inline bool parallel_rows(int64_t rows, int64_t width) { return rows > 1 && rows * width > 16384; }

template <typename T>
void rms_norm_rows(T* h, const T* delta, const T* w, T* out, int64_t rows, int64_t n, float eps) {
#pragma omp parallel for if (parallel_rows(rows, n))
  for (int64_t r = 0; r < rows; ++r) {
    T* x = h + r * n;
    float ss = 0.f;
    if (delta != nullptr) {  // the residual add first: h += delta, in the storage dtype (as torch's add)
      const T* d = delta + r * n;
      for (int64_t i = 0; i < n; ++i) {
        store(x + i, load(x[i]) + load(d[i]));
      }
    }
#pragma omp simd reduction(+ : ss)
    for (int64_t i = 0; i < n; ++i) ss += load(x[i]) * load(x[i]);
    const float inv = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
    T* o = out + r * n;
    for (int64_t i = 0; i < n; ++i) {
      T normed;
      store(&normed, load(x[i]) * inv);  // (x * rsqrt(...)).to(dtype), then * w in the dtype
      store(o + i, load(w[i]) * load(normed));
    }
  }
}

template <typename T>
void rotary_rows(T* x, int64_t row_stride, const int64_t* pos, const T* cos, const T* sin, int64_t rows,
                 int64_t n_heads, int64_t d) {
  const int64_t half = d / 2;
#pragma omp parallel for if (parallel_rows(rows, n_heads * d))
  for (int64_t r = 0; r < rows; ++r) {
    const T* c = cos + pos[r] * d;  // the tables' halves are equal (rotate-half layout)
    const T* s = sin + pos[r] * d;
    for (int64_t h = 0; h < n_heads; ++h) {
      T* x1 = x + r * row_stride + h * d;
      T* x2 = x1 + half;
      for (int64_t i = 0; i < half; ++i) {
        const float a = load(x1[i]), b = load(x2[i]), ci = load(c[i]), si = load(s[i]);
        T ac, bs, bc, as;  // each product rounded to the dtype, as torch's separate ops do
        store(&ac, a * ci);
        store(&bs, b * si);
        store(&bc, b * ci);
        store(&as, a * si);
        store(x1 + i, load(ac) - load(bs));
        store(x2 + i, load(bc) + load(as));
      }
    }
  }
}

template <typename T>
void silu_mul_rows(const T* gate_up, T* out, int64_t rows, int64_t n) {
#pragma omp parallel for if (parallel_rows(rows, n))
  for (int64_t r = 0; r < rows; ++r) {
    const T* g = gate_up + r * 2 * n;
    const T* u = g + n;
    T* o = out + r * n;
    for (int64_t i = 0; i < n; ++i) {
      const float x = load(g[i]);
      T act;
      store(&act, x / (1.f + std::exp(std::min(-x, 88.f))));  // finite under -ffast-math: exp(88) < FLT_MAX
      store(o + i, load(act) * load(u[i]));
    }
  }
}

void check(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.is_contiguous(), name, " must be a contiguous CPU tensor");
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, name, " must be float32 or bfloat16");
}

template <typename F>
void by_dtype(const torch::Tensor& t, F&& f) {
  if (t.scalar_type() == at::kFloat) {
    f(float{});
  } else {
    f(at::BFloat16{});
  }
}

}  // namespace

// x [T, n], w [n] -> w * (x * rsqrt(mean(x^2) + eps)); with `delta`, x += delta (in place) first
torch::Tensor rms_norm(torch::Tensor x, c10::optional<torch::Tensor> delta, torch::Tensor w, double eps) {
  check(x, "x");
  check(w, "w");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 1 && w.size(0) == x.size(1) && w.scalar_type() == x.scalar_type(), "bad shapes");
  if (delta) {
    check(*delta, "delta");
    TORCH_CHECK(delta->sizes() == x.sizes() && delta->scalar_type() == x.scalar_type(), "delta must match x");
  }
  auto out = torch::empty_like(x);
  by_dtype(x, [&](auto tag) {
    using T = decltype(tag);
    rms_norm_rows<T>(x.data_ptr<T>(), delta ? delta->data_ptr<T>() : nullptr, w.data_ptr<T>(), out.data_ptr<T>(),
                     x.size(0), x.size(1), static_cast<float>(eps));
  });
  return out;
}

// in place: the first n_heads heads of every row of x [T, >= n_heads * d] (rows may be wider: a fused
// QKV output whose Q and K heads rotate, V left alone), at positions [T], tables cos/sin [max_pos, d]
void rotary_(torch::Tensor x, torch::Tensor positions, torch::Tensor cos, torch::Tensor sin, int64_t n_heads) {
  check(cos, "cos");
  check(sin, "sin");
  const int64_t d = cos.size(1);
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(1) >= n_heads * d && d % 2 == 0, "bad x");
  TORCH_CHECK(x.scalar_type() == cos.scalar_type() && sin.sizes() == cos.sizes(), "x, cos and sin: one dtype");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() && positions.size(0) == x.size(0),
              "positions must be [T] int64");
  const int64_t max_pos = cos.size(0);
  const int64_t* p = positions.data_ptr<int64_t>();
  for (int64_t r = 0; r < x.size(0); ++r) TORCH_CHECK(p[r] >= 0 && p[r] < max_pos, "position out of range");
  by_dtype(x, [&](auto tag) {
    using T = decltype(tag);
    rotary_rows<T>(x.data_ptr<T>(), x.stride(0), p, cos.data_ptr<T>(), sin.data_ptr<T>(), x.size(0), n_heads, d);
  });
}

// gate_up [T, 2n] = [gate | up] -> silu(gate) * up [T, n]
torch::Tensor silu_mul(torch::Tensor gate_up) {
  check(gate_up, "gate_up");
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0, "gate_up must be [T, 2n]");
  const int64_t n = gate_up.size(1) / 2;
  auto out = torch::empty({gate_up.size(0), n}, gate_up.options());
  by_dtype(gate_up, [&](auto tag) {
    using T = decltype(tag);
    silu_mul_rows<T>(gate_up.data_ptr<T>(), out.data_ptr<T>(), gate_up.size(0), n);
  });
  return out;
}
