// x [M, K] @ w[N, K]^T for a few rows (decode at a small batch), float32: the weights stream from
// memory once, a few rows of w at a time meeting every row of x while they are in registers or L1.
// oneDNN and MKL block for large M and read a decode's weights well below this machine's bandwidth
// (BENCHMARKS.md, issue 23). Each output is one dot product in a fixed order whatever M is.
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
    // two tiles ahead, the rows of w a later tile reads (each row its own 4 KB page at K = 1024, where
    // the hardware prefetcher stops), into L2: several rows of x are memory-bound otherwise (4-8 rows over
    // weights in memory, and the MoE's experts, took 0.75-0.9x the time with it); one row streams at the
    // bandwidth without it
    if (MR > 1 && (k & 8) == 0)
      for (int n = 0; n < NR; ++n) _mm_prefetch(reinterpret_cast<const char*>(w + (2 * NR + n) * K + k), _MM_HINT_T1);
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

// NR rows of w per tile for one or two rows of x: as many as the 16 vector registers hold beside the
// accumulators. At one row, 8 streams of w read the weights 0.87x as long as 4.
template <int MR>
constexpr int nr() { return MR == 1 ? 8 : 4; }

// outputs [lo, hi) of MR rows of x against w's rows (out's rows ldo apart)
template <int MR>
void span(const float* x, const float* w, float* out, int64_t lo, int64_t hi, int64_t ldo, int64_t K) {
  constexpr int NR = nr<MR>();
  int64_t n = lo;
  for (; n + NR <= hi; n += NR) tile<MR, NR>(x, w + n * K, K, out + n, ldo);
  for (; n < hi; ++n) tile<MR, 1>(x, w + n * K, K, out + n, ldo);
}

using Tile = void (*)(const float*, const float*, int64_t, float*, int64_t);
constexpr Tile TILES3[4] = {tile<1, 3>, tile<2, 3>, tile<3, 3>, tile<4, 3>};
constexpr Tile TILES1[4] = {tile<1, 1>, tile<2, 1>, tile<3, 1>, tile<4, 1>};

// outputs [lo, hi) of M rows of x (any M >= 1): one or two rows stream many rows of w at once; more rows
// take w three rows at a time, every four rows of x meeting them while they are in L1, so the weights
// are read from memory once whatever M is (a tile of more than 4 rows would hold too few rows of w in
// registers and wait on loading x)
void block(const float* x, int64_t M, const float* w, float* out, int64_t lo, int64_t hi, int64_t ldo, int64_t K) {
  if (M == 1) return span<1>(x, w, out, lo, hi, ldo, K);
  if (M == 2) return span<2>(x, w, out, lo, hi, ldo, K);
  const auto rows = [&](const Tile* tiles, int64_t n) {
    for (int64_t m = 0; m < M; m += 4) tiles[std::min<int64_t>(4, M - m) - 1](x + m * K, w + n * K, K, out + m * ldo + n, ldo);
  };
  int64_t n = lo;
  for (; n + 3 <= hi; n += 3) rows(TILES3, n);
  for (; n < hi; ++n) rows(TILES1, n);
}

}  // namespace

// x [M, K] (M >= 1: past a few dozen rows a blocked GEMM wins), w [N, K], both float32 and contiguous, K a
// multiple of 8 -> [M, N]
torch::Tensor linear_rows(torch::Tensor x, torch::Tensor w) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat, "linear_rows: float32 only");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.is_contiguous() && w.is_contiguous(), "linear_rows: contiguous 2-d tensors");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(w.size(1) == K && K % 8 == 0 && M >= 1, "linear_rows: x [M >= 1, K], w [N, K], K % 8 == 0");
  auto out = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
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
  return out;
}

// A mixture of experts' grouped product: x [M, K] with its rows sorted by group, w [G, N, K], ends [G]
// int64 (where each group's rows end) -> [M, N], group g's rows times w[g].T. A group of at most
// `stream_rows` rows streams w[g] from memory once (decode: a few rows per expert), every group's
// column blocks shared among the threads in one parallel region; a larger group is one BLAS product
// (prefill). Float32, contiguous, K a multiple of 8.
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
  struct Group { int64_t g, row, rows; };
  std::vector<Group> groups;
  for (int64_t g = 0, start = 0; g < G; start = ep[g++]) {
    const int64_t n = ep[g] - start;
    TORCH_CHECK(n >= 0, "grouped_rows: ends must not decrease");
    if (n > stream_rows) {
      auto part = out.narrow(0, start, n);
      at::mm_out(part, x.narrow(0, start, n), w[g].t());
    } else if (n > 0) {
      groups.push_back({g, start, n});
    }
  }
  // each group's outputs in blocks of 48 (a multiple of every tile width): enough pieces to share
  constexpr int64_t NB = 48;
  const int64_t blocks = (N + NB - 1) / NB, items = static_cast<int64_t>(groups.size()) * blocks;
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
#pragma omp parallel for schedule(static) if (items * NB * K > 65536)
  for (int64_t i = 0; i < items; ++i) {
    const Group& c = groups[i / blocks];
    const int64_t lo = (i % blocks) * NB;
    block(xp + c.row * K, c.rows, wp + c.g * N * K, op + c.row * N, lo, std::min(N, lo + NB), N, K);
  }
  return out;
}
