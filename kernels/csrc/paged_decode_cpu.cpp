// Paged decode attention for the CPU: every increment request's one query token attends to its
// K/V read in place through its block table: one pass, online softmax, no gather copy. The torch
// path copies every block (index_select) before SDPA reads it again; at batch 64 that copy
// and the second read were half of attention's time, which is all KV memory traffic.
// The KV cache is float32 or bfloat16 (half the bytes to stream); queries, scores and accumulators
// are float32 either way.
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

// one K/V element as float: bfloat16 is the high half of a float32, so widening is a shift the
// compiler vectorizes (c10::BFloat16's conversion goes through a function it does not)
inline float widen(float x) { return x; }
inline float widen(uint16_t x) {
  const uint32_t u = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// HEAD_DIM > 0 fixes the head size at compile time (the common 64 and 128): the inner loops unroll and
// a head's accumulator stays in registers; HEAD_DIM = 0 takes it at run time.
// A layer's options: `window` > 0 reads only the keys at positions > the query's - window (whole
// blocks before them are skipped, never read); `softcap` > 0 caps the scaled scores at softcap * tanh(s /
// softcap); `sinks` (one logit per head, or null) joins each head's softmax denominator.
struct Options {
  int64_t window;
  float softcap;
  const float* sinks;
};

template <int HEAD_DIM, typename kv_t, typename index_t>
void decode(const float* q, const kv_t* k_cache, const kv_t* v_cache, const index_t* tables,
            const int32_t* lens, float* out, int64_t batch, int64_t n_heads, int64_t n_kv_heads,
            int64_t head_dim, int64_t block_size, int64_t max_blocks, float scale, Options opt) {
  const int64_t d = HEAD_DIM > 0 ? HEAD_DIM : head_dim;
  const int64_t group = n_heads / n_kv_heads;
  const int64_t row = n_kv_heads * d;     // one token's K (or V) for all KV heads: contiguous
  const int64_t block_floats = block_size * row;
  // one task = one request: it streams each of its blocks once (a contiguous read the prefetcher
  // follows) and runs every head over the block while it sits in L1
  // a plain OpenMP region on the calling thread's team, not at::parallel_for: that would run this
  // extension's own copy of ATen's lazy per-thread init, which adopts the thread count any thread
  // set last (a FastServe worker's copy thread sets 1), and the compute thread ran single-threaded.
  // Requests differ in length: hand them out one at a time.
#pragma omp parallel if (batch > 1)
  {
    std::vector<float> acc(n_heads * d), m(n_heads), l(n_heads), s(block_size);
#pragma omp for schedule(dynamic, 1)
    for (int64_t b = 0; b < batch; ++b) {
      const int64_t len = lens[b];
      const index_t* table = tables + b * max_blocks;
      const float* qb = q + b * n_heads * d;
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t hq = 0; hq < n_heads; ++hq) {  // a sink is a key of value 0 scoring sinks[hq]: exp(0) in l
        m[hq] = opt.sinks ? opt.sinks[hq] : -1e30f;  // finite: built with -ffast-math
        l[hq] = opt.sinks ? 1.f : 0.f;
      }
      const int64_t first = opt.window > 0 ? std::max<int64_t>(0, len - opt.window) : 0;  // first visible key
      for (int64_t j = first / block_size, start = j * block_size; start < len; ++j, start += block_size) {
        const int64_t lo = std::max<int64_t>(first - start, 0);   // keys of this block before the window
        const int64_t n = std::min(block_size, len - start);
        const kv_t* kb = k_cache + static_cast<int64_t>(table[j]) * block_floats;
        const kv_t* vb = v_cache + static_cast<int64_t>(table[j]) * block_floats;
        if (start + block_size < len) {  // the next block is elsewhere in memory: ask for it now
          const int64_t next = static_cast<int64_t>(table[j + 1]) * block_floats;
          for (int64_t i = 0; i < block_floats; i += 64 / static_cast<int64_t>(sizeof(kv_t))) {
            __builtin_prefetch(k_cache + next + i);
            __builtin_prefetch(v_cache + next + i);
          }
        }
        for (int64_t hq = 0; hq < n_heads; ++hq) {
          const int64_t kv_off = (hq / group) * d;
          const float* qh = qb + hq * d;
          float mx = m[hq];
          for (int64_t t = lo; t < n; ++t) {
            const kv_t* kt = kb + t * row + kv_off;
            float dot = 0.f;
#pragma omp simd reduction(+ : dot)
            for (int64_t i = 0; i < d; ++i) dot += qh[i] * widen(kt[i]);
            s[t] = opt.softcap > 0.f ? opt.softcap * std::tanh(dot * scale / opt.softcap) : dot * scale;
            mx = std::max(mx, s[t]);
          }
          const float correction = std::exp(m[hq] - mx);  // 0 on the first block (m = -1e30)
          float sum = l[hq] * correction;
#pragma omp simd reduction(+ : sum)
          for (int64_t t = lo; t < n; ++t) {
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
          for (int64_t t = lo; t < n; ++t) {
            const float p = s[t];
            const kv_t* vt = vb + t * row + kv_off;
#pragma omp simd
            for (int64_t i = 0; i < d; ++i) ah[i] += p * widen(vt[i]);
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
  }
}

template <typename kv_t, typename index_t>
void dispatch(const float* q, const kv_t* k, const kv_t* v, const index_t* tables, const int32_t* lens,
              float* out, int64_t batch, int64_t n_heads, int64_t n_kv_heads, int64_t d,
              int64_t block_size, int64_t max_blocks, float scale, Options opt) {
  auto run = [&](auto kernel) {
    kernel(q, k, v, tables, lens, out, batch, n_heads, n_kv_heads, d, block_size, max_blocks, scale, opt);
  };
  if (d == 64) run(decode<64, kv_t, index_t>);
  else if (d == 128) run(decode<128, kv_t, index_t>);
  else run(decode<0, kv_t, index_t>);
}

template <typename kv_t>
void dispatch_tables(const float* q, const kv_t* k, const kv_t* v, const torch::Tensor& tables, const int32_t* lens,
                     float* out, int64_t batch, int64_t n_heads, int64_t n_kv_heads, int64_t d,
                     int64_t block_size, float scale, Options opt) {
  const int64_t max_blocks = tables.size(1);
  if (tables.scalar_type() == at::kLong) {
    dispatch(q, k, v, tables.data_ptr<int64_t>(), lens, out, batch, n_heads, n_kv_heads, d, block_size, max_blocks, scale, opt);
  } else {
    TORCH_CHECK(tables.scalar_type() == at::kInt, "block_tables must be int32 or int64");
    dispatch(q, k, v, tables.data_ptr<int32_t>(), lens, out, batch, n_heads, n_kv_heads, d, block_size, max_blocks, scale, opt);
  }
}

}  // namespace

// q [B, H, d]; k_cache/v_cache [num_blocks, block_size, kvh, d]; block_tables [B, max_blocks];
// seq_lens [B] int32 (>= 1). Returns [B, H, d] in q's dtype. q, k_cache and v_cache all float32 or
// all bfloat16, contiguous, on the CPU. window, softcap, sinks ([H] float32 or None): Options above.
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor seq_lens, double scale,
                                     int64_t window, double softcap, c10::optional<torch::Tensor> sinks) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(), "bad shapes");
  const auto dtype = k_cache.scalar_type();
  TORCH_CHECK((dtype == at::kFloat || dtype == at::kBFloat16) && q.scalar_type() == dtype &&
              v_cache.scalar_type() == dtype, "float32 or bfloat16 only, the same for q, k_cache and v_cache");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous() &&
              block_tables.is_contiguous() && seq_lens.is_contiguous(), "contiguous tensors only");
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt, "seq_lens must be int32");
  const int64_t batch = q.size(0), n_heads = q.size(1), d = q.size(2);
  const int64_t block_size = k_cache.size(1), n_kv_heads = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == d && n_heads % n_kv_heads == 0 && block_tables.size(0) == batch &&
              seq_lens.size(0) == batch, "inconsistent sizes");
  const auto qf = q.to(at::kFloat);   // a few KB: queries and accumulators stay float32
  auto out = torch::empty_like(qf);
  const float s = static_cast<float>(scale);
  torch::Tensor sink_f;
  if (sinks.has_value()) {
    sink_f = sinks->to(at::kFloat).contiguous();
    TORCH_CHECK(sink_f.dim() == 1 && sink_f.size(0) == n_heads, "sinks must be [n_heads]");
  }
  const Options opt{window, static_cast<float>(softcap), sinks.has_value() ? sink_f.data_ptr<float>() : nullptr};
  if (dtype == at::kFloat) {
    dispatch_tables(qf.data_ptr<float>(), k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), block_tables,
                    seq_lens.data_ptr<int32_t>(), out.data_ptr<float>(), batch, n_heads, n_kv_heads, d, block_size, s, opt);
  } else {
    auto bits = [](const torch::Tensor& t) { return reinterpret_cast<const uint16_t*>(t.data_ptr<at::BFloat16>()); };
    dispatch_tables(qf.data_ptr<float>(), bits(k_cache), bits(v_cache), block_tables, seq_lens.data_ptr<int32_t>(),
                    out.data_ptr<float>(), batch, n_heads, n_kv_heads, d, block_size, s, opt);
  }
  return out.to(q.scalar_type());
}
