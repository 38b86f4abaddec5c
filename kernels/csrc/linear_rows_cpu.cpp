// x [M, K] @ w[N, K]^T for a few rows (decode at a small batch): the weights stream from memory once, a
// few rows of w at a time meeting every row of x while they are in registers or L1. oneDNN and MKL block
// for large M and read a decode's weights well below this machine's bandwidth (BENCHMARKS.md, issue 23).
// Each output is one dot product in a fixed order whatever M is. Weights in float32 or bfloat16 (half the
// bytes; x then bfloat16 too): AVX512-BF16's dot-product instruction where the CPU has it (bfloat16
// denormals read as zero), else each weight widened to float32 as it is loaded; either way every product
// and sum is float32's, rounded to bfloat16 once at the end.
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/extension.h>

#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace {

#if defined(__AVX2__) && defined(__FMA__)
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
// bfloat16 is float32's upper half: widen 8 to 32 bits and shift them into place
inline __m256 load8(const at::BFloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

inline float hsum(__m256 v) {
  __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  return _mm_cvtss_f32(_mm_add_ss(lo, _mm_movehdup_ps(lo)));
}

// MR rows of x against NR rows of w (K a multiple of 8): MR * NR accumulators in registers
template <int MR, int NR, typename W>
inline void tile(const float* x, const W* w, int64_t K, W* out, int64_t ldo) {
  __m256 acc[MR][NR];
  for (int m = 0; m < MR; ++m)
    for (int n = 0; n < NR; ++n) acc[m][n] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 8) {
    __m256 wv[NR];
    for (int n = 0; n < NR; ++n) wv[n] = load8(w + n * K + k);
    // two tiles ahead, the rows of w a later tile reads (each row its own 4 KB page at K = 1024, where
    // the hardware prefetcher stops), into L2: several rows of x are memory-bound otherwise (4-8 rows over
    // weights in memory, and the MoE's experts, took 0.75-0.9x the time with it); one row streams at the
    // bandwidth without it. One prefetch per 64-byte line.
    if (MR > 1 && (k * sizeof(W)) % 64 == 0)
      for (int n = 0; n < NR; ++n) _mm_prefetch(reinterpret_cast<const char*>(w + (2 * NR + n) * K + k), _MM_HINT_T1);
    for (int m = 0; m < MR; ++m) {
      const __m256 xv = _mm256_loadu_ps(x + m * K + k);
      for (int n = 0; n < NR; ++n) acc[m][n] = _mm256_fmadd_ps(xv, wv[n], acc[m][n]);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int n = 0; n < NR; ++n) out[m * ldo + n] = static_cast<W>(hsum(acc[m][n]));
}
#else
template <int MR, int NR, typename W>
inline void tile(const float* x, const W* w, int64_t K, W* out, int64_t ldo) {
  for (int m = 0; m < MR; ++m)
    for (int n = 0; n < NR; ++n) {
      float s = 0.f;
#pragma omp simd reduction(+ : s)
      for (int64_t k = 0; k < K; ++k) s += x[m * K + k] * static_cast<float>(w[n * K + k]);
      out[m * ldo + n] = static_cast<W>(s);
    }
}
#endif

#if defined(__AVX512BF16__)
// bfloat16 rows against bfloat16 weights on a CPU with AVX512-BF16: one instruction multiplies 16 pairs
// of each and adds both products to float32 accumulators (each product exact in float32), 32 values of K
// a step; the last step masked (K a multiple of 8). No widening: 4x fewer instructions than tile's
// bfloat16 path, whose conversions left a decode's experts compute-bound on one core.
template <int MR, int NR>
inline void tile(const at::BFloat16* x, const at::BFloat16* w, int64_t K, at::BFloat16* out, int64_t ldo) {
  __m512 acc[MR][NR];
  for (int m = 0; m < MR; ++m)
    for (int n = 0; n < NR; ++n) acc[m][n] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 32) {
    const __mmask32 mask = K - k >= 32 ? ~__mmask32(0) : (__mmask32(1) << (K - k)) - 1;
    __m512bh wv[NR];
    for (int n = 0; n < NR; ++n) wv[n] = (__m512bh)_mm512_maskz_loadu_epi16(mask, w + n * K + k);
    if (MR > 1)   // as tile's: two tiles ahead into L2, a 64-byte line a step
      for (int n = 0; n < NR; ++n) _mm_prefetch(reinterpret_cast<const char*>(w + (2 * NR + n) * K + k), _MM_HINT_T1);
    for (int m = 0; m < MR; ++m) {
      const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(mask, x + m * K + k);
      for (int n = 0; n < NR; ++n) acc[m][n] = _mm512_dpbf16_ps(acc[m][n], xv, wv[n]);
    }
  }
  // unrolled: a loop here keeps acc in memory, and gcc then stores every accumulator at every step (2.2x
  // the time at four rows)
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 8
    for (int n = 0; n < NR; ++n) out[m * ldo + n] = static_cast<at::BFloat16>(_mm512_reduce_add_ps(acc[m][n]));
}
// the rows' type a weight type's tiles take
template <typename W> struct RowsOf { using type = W; };
#else
template <typename W> struct RowsOf { using type = float; };
#endif
template <> struct RowsOf<float> { using type = float; };
template <typename W> using X = typename RowsOf<W>::type;

// AVX512-BF16's tiles, with 32 vector registers, hold twice AVX2's rows of w beside the accumulators
template <typename W>
constexpr bool wide() { return !std::is_same_v<X<W>, float>; }

// NR rows of w per tile for one or two rows of x: as many as the vector registers hold beside the
// accumulators. At one row, 8 streams of w read the weights 0.87x as long as 4.
template <int MR, typename W>
constexpr int nr() { return MR == 1 || wide<W>() ? 8 : 4; }

// outputs [lo, hi) of MR rows of x against w's rows (out's rows ldo apart)
template <int MR, typename W>
void span(const X<W>* x, const W* w, W* out, int64_t lo, int64_t hi, int64_t ldo, int64_t K) {
  constexpr int NR = nr<MR, W>();
  int64_t n = lo;
  for (; n + NR <= hi; n += NR) tile<MR, NR>(x, w + n * K, K, out + n, ldo);
  for (; n < hi; ++n) tile<MR, 1>(x, w + n * K, K, out + n, ldo);
}

// every row of x in tiles of up to 4 against NR rows of w
template <int NR, typename W>
void rows(const X<W>* x, int64_t M, const W* w, W* out, int64_t ldo, int64_t K) {
  for (int64_t m = 0; m < M; m += 4) {
    const X<W>* xm = x + m * K;
    W* om = out + m * ldo;
    switch (std::min<int64_t>(4, M - m)) {
      case 1: tile<1, NR>(xm, w, K, om, ldo); break;
      case 2: tile<2, NR>(xm, w, K, om, ldo); break;
      case 3: tile<3, NR>(xm, w, K, om, ldo); break;
      default: tile<4, NR>(xm, w, K, om, ldo);
    }
  }
}

// outputs [lo, hi) of M rows of x (any M >= 1): one or two rows stream many rows of w at once; more rows
// take w three rows at a time (six with AVX512-BF16), every four rows of x meeting them while they are in
// L1, so the weights are read from memory once whatever M is (a tile of more than 4 rows would hold too
// few rows of w in registers and wait on loading x)
template <typename W>
void block(const X<W>* x, int64_t M, const W* w, W* out, int64_t lo, int64_t hi, int64_t ldo, int64_t K) {
  if (M == 1) return span<1>(x, w, out, lo, hi, ldo, K);
  if (M == 2) return span<2>(x, w, out, lo, hi, ldo, K);
  constexpr int NW = wide<W>() ? 6 : 3;
  int64_t n = lo;
  for (; n + NW <= hi; n += NW) rows<NW>(x, M, w + n * K, out + n, ldo, K);
  for (; n < hi; ++n) rows<1>(x, M, w + n * K, out + n, ldo, K);
}

// out = x @ w.T for many rows. Float32 by oneDNN's linear on the plain weight, as the dense layers run
// (engine/gemm.py), where torch has it: MKL's sgemm, at::mm's choice, took 2.1x its time for an expert of
// 64 rows on an AVX-512 host (MKL runs its AVX2 code on AMD CPUs) and 1.15x with oneDNN held to AVX2.
// bfloat16 by at::mm, which is oneDNN's already.
void product(torch::Tensor& out, const torch::Tensor& x, const torch::Tensor& w) {
  static const auto linear = c10::Dispatcher::singleton().findSchema({"mkldnn::_linear_pointwise", ""});
  if (x.scalar_type() != at::kFloat || !linear) {
    at::mm_out(out, x, w.t());
    return;
  }
  torch::jit::Stack stack{x, w, c10::IValue(), c10::IValue("none"), c10::IValue(c10::List<std::optional<at::Scalar>>()),
                          c10::IValue()};
  linear->callBoxed(&stack);
  out.copy_(stack[0].toTensor());
}

// out [x's rows, n] in x's dtype, filled by fn(x's data as the tiles take it, w's data, out, out's data) by
// the weights' dtype: float32 or bfloat16, x's too (computed in float32, rounded once)
template <typename Fn>
torch::Tensor by_weight(const char* what, const torch::Tensor& x, const torch::Tensor& w, int64_t n, Fn fn) {
  TORCH_CHECK(x.scalar_type() == w.scalar_type() && (w.scalar_type() == at::kFloat || w.scalar_type() == at::kBFloat16),
              what, ": x and w both float32 or both bfloat16");
  auto out = torch::empty({x.size(0), n}, x.options());
  if (w.scalar_type() == at::kFloat) {
    fn(x.data_ptr<float>(), w.data_ptr<float>(), out, out.data_ptr<float>());
  } else {
    using XB = X<at::BFloat16>;
    const torch::Tensor rows = std::is_same_v<XB, float> ? x.to(at::kFloat) : x;
    fn(rows.data_ptr<XB>(), w.data_ptr<at::BFloat16>(), out, out.data_ptr<at::BFloat16>());
  }
  return out;
}

}  // namespace

// x [M, K] (M >= 1: past a few dozen rows a blocked GEMM wins), w [N, K], both contiguous float32 or both
// bfloat16, K a multiple of 8 -> [M, N]
torch::Tensor linear_rows(torch::Tensor x, torch::Tensor w) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.is_contiguous() && w.is_contiguous(), "linear_rows: contiguous 2-d tensors");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(w.size(1) == K && K % 8 == 0 && M >= 1, "linear_rows: x [M >= 1, K], w [N, K], K % 8 == 0");
  return by_weight("linear_rows", x, w, N, [&](const auto* xp, const auto* wp, torch::Tensor&, auto* op) {
    // one contiguous share of w's rows per thread (a multiple of 24: every tile width): each streams its
    // part of the weights once. Its own OpenMP region, on the calling thread's team (see
    // paged_decode_cpu.cpp for why not at::parallel_for)
#pragma omp parallel if (N * K > 65536)
    {
      const int nth = omp_get_num_threads(), tid = omp_get_thread_num();
      const int64_t per = ((N + nth - 1) / nth + 23) / 24 * 24;
      const int64_t lo = std::min(N, tid * per);
      block(xp, M, wp, op, lo, std::min(N, lo + per), N, K);
    }
  });
}

// A mixture of experts' grouped product: x [M, K] with its rows sorted by group, w [G, N, K], ends [G]
// int64 (where each group's rows end) -> [M, N], group g's rows times w[g].T. A group of at most
// `stream_rows` rows streams w[g] from memory once (decode: a few rows per expert), every group's
// column blocks shared among the threads in one parallel region; a larger group is one product (`product`)
// (prefill). Both float32 or both bfloat16, contiguous, K a multiple of 8.
torch::Tensor grouped_rows(torch::Tensor x, torch::Tensor w, torch::Tensor ends, int64_t stream_rows) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 3 && x.is_contiguous() && w.is_contiguous(), "grouped_rows: x [M, K], w [G, N, K]");
  const int64_t M = x.size(0), K = x.size(1), G = w.size(0), N = w.size(1);
  TORCH_CHECK(w.size(2) == K && K % 8 == 0, "grouped_rows: w [G, N, K] with x's K, a multiple of 8");
  TORCH_CHECK(ends.scalar_type() == at::kLong && ends.dim() == 1 && ends.size(0) == G, "grouped_rows: ends [G] int64");
  const auto end = ends.contiguous();
  const int64_t* ep = end.data_ptr<int64_t>();
  TORCH_CHECK(G == 0 || ep[G - 1] == M, "grouped_rows: ends must finish at x's rows");
  return by_weight("grouped_rows", x, w, N, [&](const auto* xp, const auto* wp, torch::Tensor& out, auto* op) {
    struct Group { int64_t g, row, rows; };
    std::vector<Group> groups;
    for (int64_t g = 0, start = 0; g < G; start = ep[g++]) {
      const int64_t n = ep[g] - start;
      TORCH_CHECK(n >= 0, "grouped_rows: ends must not decrease");
      if (n > stream_rows) {
        auto part = out.narrow(0, start, n);
        product(part, x.narrow(0, start, n), w[g]);
      } else if (n > 0) {
        groups.push_back({g, start, n});
      }
    }
    // each group's outputs in blocks of 48 (a multiple of every tile width): enough pieces to share
    constexpr int64_t NB = 48;
    const int64_t blocks = (N + NB - 1) / NB, items = static_cast<int64_t>(groups.size()) * blocks;
#pragma omp parallel for schedule(static) if (items * NB * K > 65536)
    for (int64_t i = 0; i < items; ++i) {
      const Group& c = groups[i / blocks];
      const int64_t lo = (i % blocks) * NB;
      block(xp + c.row * K, c.rows, wp + c.g * N * K, op + c.row * N, lo, std::min(N, lo + NB), N, K);
    }
  });
}
