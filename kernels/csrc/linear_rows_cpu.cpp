// x [M, K] @ w[N, K]^T for a few rows (decode at a small batch), float32: the weights stream from
// memory once, each row of w meeting every row of x while it is in registers. oneDNN and MKL block
// for large M and read a decode's weights well below this machine's bandwidth (BENCHMARKS.md, issue
// 23). Each output is one dot product in a fixed order whatever M is.
#include <torch/extension.h>

#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace {

#if defined(__AVX2__) && defined(__FMA__)
inline float hsum(__m256 v) {
  __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  return _mm_cvtss_f32(_mm_add_ss(lo, _mm_movehdup_ps(lo)));
}

// MR rows of x against NR rows of w (K a multiple of 8): MR * NR accumulators in registers
template <int MR, int NR>
inline void tile(const float* x, const float* w, int64_t K, float* out, int64_t ldo) {
  __m256 acc[MR][NR];
  for (int m = 0; m < MR; ++m)
    for (int n = 0; n < NR; ++n) acc[m][n] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 8) {
    __m256 wv[NR];
    for (int n = 0; n < NR; ++n) wv[n] = _mm256_loadu_ps(w + n * K + k);
    for (int m = 0; m < MR; ++m) {
      const __m256 xv = _mm256_loadu_ps(x + m * K + k);
      for (int n = 0; n < NR; ++n) acc[m][n] = _mm256_fmadd_ps(xv, wv[n], acc[m][n]);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int n = 0; n < NR; ++n) out[m * ldo + n] = hsum(acc[m][n]);
}
#else
template <int MR, int NR>
inline void tile(const float* x, const float* w, int64_t K, float* out, int64_t ldo) {
  for (int m = 0; m < MR; ++m)
    for (int n = 0; n < NR; ++n) {
      float s = 0.f;
#pragma omp simd reduction(+ : s)
      for (int64_t k = 0; k < K; ++k) s += x[m * K + k] * w[n * K + k];
      out[m * ldo + n] = s;
    }
}
#endif

// NR rows of w per tile: as many as the 16 vector registers hold beside MR rows of accumulators (one
// row of x is an FMA's memory operand). At one row, 8 streams of w read the weights 0.87x as long as 4.
template <int MR>
constexpr int nr() { return MR == 1 ? 8 : MR <= 2 ? 4 : MR <= 4 ? 3 : 1; }

// outputs [lo, hi) of MR rows of x against w's rows (out's rows ldo apart)
template <int MR>
void span(const float* x, const float* w, float* out, int64_t lo, int64_t hi, int64_t ldo, int64_t K) {
  constexpr int NR = nr<MR>();
  int64_t n = lo;
  for (; n + NR <= hi; n += NR) tile<MR, NR>(x, w + n * K, K, out + n, ldo);
  for (; n < hi; ++n) tile<MR, 1>(x, w + n * K, K, out + n, ldo);
}

using Span = void (*)(const float*, const float*, float*, int64_t, int64_t, int64_t, int64_t);
constexpr Span SPANS[8] = {span<1>, span<2>, span<3>, span<4>, span<5>, span<6>, span<7>, span<8>};

template <int MR>
void rows(const float* x, const float* w, float* out, int64_t N, int64_t K) {
  constexpr int NR = nr<MR>();
  // one contiguous share of w's rows per thread: each streams its part of the weights once. Its own
  // OpenMP region, on the calling thread's team (see paged_decode_cpu.cpp for why not at::parallel_for)
#pragma omp parallel if (N * K > 65536)
  {
    const int nth = omp_get_num_threads(), tid = omp_get_thread_num();
    const int64_t per = ((N + nth - 1) / nth + NR - 1) / NR * NR;
    const int64_t lo = std::min(N, tid * per);
    span<MR>(x, w, out, lo, std::min(N, lo + per), N, K);
  }
}

}  // namespace

// x [M, K] (1 <= M <= 8), w [N, K], both float32 and contiguous, K a multiple of 8 -> [M, N]
torch::Tensor linear_rows(torch::Tensor x, torch::Tensor w) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat, "linear_rows: float32 only");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.is_contiguous() && w.is_contiguous(), "linear_rows: contiguous 2-d tensors");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(w.size(1) == K && K % 8 == 0 && M >= 1 && M <= 8, "linear_rows: x [1..8, K], w [N, K], K % 8 == 0");
  auto out = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  switch (M) {
    case 1: rows<1>(xp, wp, op, N, K); break;
    case 2: rows<2>(xp, wp, op, N, K); break;
    case 3: rows<3>(xp, wp, op, N, K); break;
    case 4: rows<4>(xp, wp, op, N, K); break;
    case 5: rows<5>(xp, wp, op, N, K); break;
    case 6: rows<6>(xp, wp, op, N, K); break;
    case 7: rows<7>(xp, wp, op, N, K); break;
    default: rows<8>(xp, wp, op, N, K); break;
  }
  return out;
}

// A mixture of experts' grouped product: x [M, K] with its rows sorted by group, w [G, N, K], ends [G]
// int64 (where each group's rows end) -> [M, N], group g's rows times w[g].T. A group of at most
// `stream_rows` rows runs as chunks of up to 8 rows, each streaming w[g] once (decode: a few rows per
// expert), every group's chunks and column blocks shared among the threads in one parallel region; a
// larger group is one BLAS product (prefill). Float32, contiguous, K a multiple of 8.
torch::Tensor grouped_rows(torch::Tensor x, torch::Tensor w, torch::Tensor ends, int64_t stream_rows) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat, "grouped_rows: float32 only");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 3 && x.is_contiguous() && w.is_contiguous(), "grouped_rows: x [M, K], w [G, N, K]");
  const int64_t M = x.size(0), K = x.size(1), G = w.size(0), N = w.size(1);
  TORCH_CHECK(w.size(2) == K && K % 8 == 0, "grouped_rows: w [G, N, K] with x's K, a multiple of 8");
  TORCH_CHECK(ends.scalar_type() == at::kLong && ends.dim() == 1 && ends.size(0) == G, "grouped_rows: ends [G] int64");
  auto out = torch::empty({M, N}, x.options());
  const auto end = ends.contiguous();
  const int64_t* ep = end.data_ptr<int64_t>();
  TORCH_CHECK(G == 0 || ep[G - 1] == M, "grouped_rows: ends must finish at x's rows");
  struct Chunk { int64_t g, row, rows; };
  std::vector<Chunk> chunks;
  for (int64_t g = 0, start = 0; g < G; start = ep[g++]) {
    const int64_t n = ep[g] - start;
    TORCH_CHECK(n >= 0, "grouped_rows: ends must not decrease");
    if (n > stream_rows) {
      auto part = out.narrow(0, start, n);
      at::mm_out(part, x.narrow(0, start, n), w[g].t());
    } else {
      for (int64_t r = start; r < ep[g]; r += 8) chunks.push_back({g, r, std::min<int64_t>(8, ep[g] - r)});
    }
  }
  // each chunk's outputs in blocks of 48 (a multiple of every tile width): enough pieces to share
  constexpr int64_t NB = 48;
  const int64_t blocks = (N + NB - 1) / NB, items = static_cast<int64_t>(chunks.size()) * blocks;
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
#pragma omp parallel for schedule(static) if (items * NB * K > 65536)
  for (int64_t i = 0; i < items; ++i) {
    const Chunk& c = chunks[i / blocks];
    const int64_t lo = (i % blocks) * NB;
    SPANS[c.rows - 1](xp + c.row * K, wp + c.g * N * K, op + c.row * N, lo, std::min(N, lo + NB), N, K);
  }
  return out;
}
