// Paged decode attention for the CPU: every increment request's one query token attends to its
// K/V read in place through its block table: one pass, online softmax, no gather copy. The torch
// path copies every block (index_select) before SDPA reads it again; at batch 64 that copy
// and the second read were half of attention's time, which is all KV memory traffic.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

// HEAD_DIM > 0 fixes the head size at compile time (the common 64 and 128): the inner loops unroll and
// a head's accumulator stays in registers; HEAD_DIM = 0 takes it at run time.
template <int HEAD_DIM, typename index_t>
void decode(const float* q, const float* k_cache, const float* v_cache, const index_t* tables,
            const int32_t* lens, float* out, int64_t batch, int64_t n_heads, int64_t n_kv_heads,
            int64_t head_dim, int64_t block_size, int64_t max_blocks, float scale) {
  const int64_t d = HEAD_DIM > 0 ? HEAD_DIM : head_dim;
  const int64_t group = n_heads / n_kv_heads;
  const int64_t row = n_kv_heads * d;     // one token's K (or V) for all KV heads: contiguous
  const int64_t block_floats = block_size * row;
  // one task = one request: it streams each of its blocks once (a contiguous read the prefetcher
  // follows) and runs every head over the block while it sits in L1
  at::parallel_for(0, batch, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(n_heads * d), m(n_heads), l(n_heads), s(block_size);
    for (int64_t b = begin; b < end; ++b) {
      const int64_t len = lens[b];
      const index_t* table = tables + b * max_blocks;
      const float* qb = q + b * n_heads * d;
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(m.begin(), m.end(), -1e30f);  // finite: built with -ffast-math
      std::fill(l.begin(), l.end(), 0.f);
      for (int64_t j = 0, start = 0; start < len; ++j, start += block_size) {
        const int64_t n = std::min(block_size, len - start);
        const float* kb = k_cache + static_cast<int64_t>(table[j]) * block_floats;
        const float* vb = v_cache + static_cast<int64_t>(table[j]) * block_floats;
        if (start + block_size < len) {  // the next block is elsewhere in memory: ask for it now
          const int64_t next = static_cast<int64_t>(table[j + 1]) * block_floats;
          for (int64_t i = 0; i < block_floats; i += 16) {
            __builtin_prefetch(k_cache + next + i);
            __builtin_prefetch(v_cache + next + i);
          }
        }
        for (int64_t hq = 0; hq < n_heads; ++hq) {
          const int64_t kv_off = (hq / group) * d;
          const float* qh = qb + hq * d;
          float mx = m[hq];
          for (int64_t t = 0; t < n; ++t) {
            const float* kt = kb + t * row + kv_off;
            float dot = 0.f;
#pragma omp simd reduction(+ : dot)
            for (int64_t i = 0; i < d; ++i) dot += qh[i] * kt[i];
            s[t] = dot * scale;
            mx = std::max(mx, s[t]);
          }
          const float correction = std::exp(m[hq] - mx);  // 0 on the first block (m = -1e30)
          float sum = l[hq] * correction;
#pragma omp simd reduction(+ : sum)
          for (int64_t t = 0; t < n; ++t) {
            s[t] = std::exp(s[t] - mx);
            sum += s[t];
          }
          m[hq] = mx;
          l[hq] = sum;
          float a[HEAD_DIM > 0 ? HEAD_DIM : 1];  // register accumulator when the size is known
          float* ah = HEAD_DIM > 0 ? a : acc.data() + hq * d;
          const float* ah_in = acc.data() + hq * d;
#pragma omp simd
          for (int64_t i = 0; i < d; ++i) ah[i] = ah_in[i] * correction;
          for (int64_t t = 0; t < n; ++t) {
            const float p = s[t];
            const float* vt = vb + t * row + kv_off;
#pragma omp simd
            for (int64_t i = 0; i < d; ++i) ah[i] += p * vt[i];
          }
          if (HEAD_DIM > 0) std::copy(a, a + d, acc.data() + hq * d);
        }
      }
      float* ob = out + b * n_heads * d;
      for (int64_t hq = 0; hq < n_heads; ++hq) {
        const float inv = 1.f / l[hq];
        for (int64_t i = 0; i < d; ++i) ob[hq * d + i] = acc[hq * d + i] * inv;
      }
    }
  });
}

template <typename index_t>
void dispatch(const float* q, const float* k, const float* v, const index_t* tables, const int32_t* lens,
              float* out, int64_t batch, int64_t n_heads, int64_t n_kv_heads, int64_t d,
              int64_t block_size, int64_t max_blocks, float scale) {
  auto run = [&](auto kernel) {
    kernel(q, k, v, tables, lens, out, batch, n_heads, n_kv_heads, d, block_size, max_blocks, scale);
  };
  if (d == 64) run(decode<64, index_t>);
  else if (d == 128) run(decode<128, index_t>);
  else run(decode<0, index_t>);
}

}  // namespace

// q [B, H, d]; k_cache/v_cache [num_blocks, block_size, kvh, d]; block_tables [B, max_blocks];
// seq_lens [B] int32 (>= 1). Returns [B, H, d]. All float32, contiguous, on the CPU.
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor seq_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(), "bad shapes");
  TORCH_CHECK(q.scalar_type() == at::kFloat && k_cache.scalar_type() == at::kFloat &&
              v_cache.scalar_type() == at::kFloat, "float32 only");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous() &&
              block_tables.is_contiguous() && seq_lens.is_contiguous(), "contiguous tensors only");
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt, "seq_lens must be int32");
  const int64_t batch = q.size(0), n_heads = q.size(1), d = q.size(2);
  const int64_t block_size = k_cache.size(1), n_kv_heads = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == d && n_heads % n_kv_heads == 0 && block_tables.size(0) == batch &&
              seq_lens.size(0) == batch, "inconsistent sizes");
  auto out = torch::empty_like(q);
  const int64_t max_blocks = block_tables.size(1);
  const float s = static_cast<float>(scale);
  if (block_tables.scalar_type() == at::kLong) {
    dispatch(q.data_ptr<float>(), k_cache.data_ptr<float>(), v_cache.data_ptr<float>(),
             block_tables.data_ptr<int64_t>(), seq_lens.data_ptr<int32_t>(), out.data_ptr<float>(),
           batch, n_heads, n_kv_heads, d, block_size, max_blocks, s);
  } else {
    TORCH_CHECK(block_tables.scalar_type() == at::kInt, "block_tables must be int32 or int64");
    dispatch(q.data_ptr<float>(), k_cache.data_ptr<float>(), v_cache.data_ptr<float>(),
             block_tables.data_ptr<int32_t>(), seq_lens.data_ptr<int32_t>(), out.data_ptr<float>(),
           batch, n_heads, n_kv_heads, d, block_size, max_blocks, s);
  }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "paged decode attention (CPU, float32)");
}
