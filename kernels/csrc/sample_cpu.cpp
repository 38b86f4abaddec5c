// An iteration's sampling step on the CPU, and its log probabilities: a row per thread and a few passes over each
// row while it is in cache. The step: the finiteness check, the grammar's bitmask, the argmax, and for a drawn row
// the tempered exponentials, min-p, top-k and top-p and the inverse CDF. In torch the same is about ten vocabulary-wide ops (unpack
// the bits, add the mask, amax, amin, argmax, divide, softmax, cumsum, searchsorted...), each a pass over a new
// tensor: at 17 x 49,152 on two cores 1.0-1.6 ms against 0.2-0.5 (tools/bench_sampler.py; issue 44).
// Built with -ffast-math: nothing here relies on IEEE infinities or NaN in arithmetic. Non-finite raw logits are
// found from their exponent bits, and a logit of -inf (a ban, or outside a mask) is left out by a test on its bits,
// never used in a subtraction or an exponential (the log probabilities' exp clamps its argument).
#include <torch/extension.h>

#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <algorithm>
#include <utility>
#include <vector>

namespace {

constexpr int64_t BLOCK = 256;         // the inverse CDF's partial sums: a block's total, then a scan inside one
constexpr float EXP_FLOOR = -87.f;     // below it float32's exp is a denormal or 0: taken as 0 (as softmax rounds)
constexpr uint32_t EXPONENT = 0x7f800000u;
constexpr uint32_t NEG_INF = 0xff800000u;

inline uint32_t bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  return u;
}

inline bool finite(float x) { return (bits(x) & EXPONENT) != EXPONENT; }
inline bool is_nan(float x) { return (bits(x) & 0x7fffffffu) > EXPONENT; }
// std::max's reference in a `best = std::max(best, x[v])` simd reduction keeps gcc from vectorizing it (15x slower)
inline float larger(float a, float b) { return b > a ? b : a; }

// each byte's 8 bits as 8 bytes of 0 or 1, least significant first (a little-endian word's bytes)
struct Unpacked {
  uint64_t of[256];
  Unpacked() {
    for (int b = 0; b < 256; ++b) {
      of[b] = 0;
      for (int i = 0; i < 8; ++i) of[b] |= static_cast<uint64_t>((b >> i) & 1) << (8 * i);
    }
  }
};
const Unpacked UNPACKED;

// the row's allowed logits, a byte each: its bitmask's (bit v of byte v / 8) and not -inf
void allowed(const uint8_t* mask, const float* x, int64_t V, uint8_t* a) {
  if (mask == nullptr) {
    std::memset(a, 1, V);
  } else {
    for (int64_t i = 0; i < V / 8; ++i) std::memcpy(a + 8 * i, &UNPACKED.of[mask[i]], 8);
    for (int64_t v = V / 8 * 8; v < V; ++v) a[v] = (mask[v >> 3] >> (v & 7)) & 1;
  }
#pragma omp simd
  for (int64_t v = 0; v < V; ++v) a[v] &= bits(x[v]) != NEG_INF;
}

// a finite float's bits as an integer in the float's order (-0 as +0): a radix select's key
inline uint32_t order_key(float x) {
  uint32_t u = bits(x);
  u = (u & 0x7fffffffu) == 0 ? 0 : u;
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// a row's scratch beside its bytes and exponentials: the tokens still in a select (logit key, exponential), and a
// radix level's histogram
struct Radix {
  struct Bucket {
    double mass;
    int64_t count;
  };
  std::vector<std::pair<uint32_t, float>> left;
  std::vector<int32_t> near;   // the ids of the tokens near the largest logit (near_tokens)
  Bucket at[2048];
};

// the bucket of a histogram (w wide) the walk down from its top stops in: the first holding a token where those at or
// above it number `count` or sum to `mass`; -1 where none does. `above`: what the buckets above it hold, moved past it.
int64_t walk(const Radix& r, uint32_t w, int64_t count, double mass, int64_t& above_n, double& above_m) {
  for (int64_t b = w - 1; b >= 0; --b) {
    if (r.at[b].count == 0) continue;
    if (above_n + r.at[b].count >= count || above_m + r.at[b].mass >= mass) return b;
    above_n += r.at[b].count;
    above_m += r.at[b].mass;
  }
  return -1;
}

// A select's tokens: the row's with an exponential and a logit's key at least `least`, each given to `f` as (key,
// exponential) in token order; a token below `least` costs a compare.
struct Whole {
  const float* x;
  const float* e;
  int64_t V;
  uint32_t least;
  template <class F> void each(F f) const {
    const float *xs = x, *es = e;   // locals: f's stores could alias the fields, reloaded every token otherwise
    const uint32_t floor = least;
    for (int64_t v = 0, n = V; v < n; ++v) {
      const uint32_t k = order_key(xs[v]);
      if (es[v] > 0.f && k >= floor) f(k, es[v]);
    }
  }
};

// ...or those of a list of ids (near_tokens'), in its order
struct Listed {
  const float* x;
  const float* e;
  const std::vector<int32_t>& ids;
  uint32_t least;
  template <class F> void each(F f) const {
    const float *xs = x, *es = e;
    const uint32_t floor = least;
    for (const int32_t v : ids) {
      const uint32_t k = order_key(xs[v]);
      if (k >= floor) f(k, es[v]);
    }
  }
};

// Of `tokens`: the least key at which those at or above it first number `count` or sum to `p` of `total` (< 0: of
// their own exponentials' sum), walking down from the largest; 0 where all of them do not. A radix select: a
// histogram by key bits 31-21, then of the bucket the walk stops in by bits 20-10, then 9-0: a few passes over the
// row where sorting it took 4 ms at 49,152 tokens (issue 44), or over a list of a few dozen.
template <class Tokens>
uint32_t select_key(const Tokens& tokens, int64_t count, double p, double total, Radix& r) {
  constexpr int SHIFT[3] = {21, 10, 0};
  constexpr uint32_t WIDTH[3] = {2048, 2048, 1024};
  std::fill(r.at, r.at + WIDTH[0], Radix::Bucket{0.0, 0});
  tokens.each([&](uint32_t k, float ek) {
    Radix::Bucket& h = r.at[k >> SHIFT[0]];
    h.mass += ek;
    ++h.count;
  });
  if (total < 0) {
    total = 0;
    for (uint32_t b = 0; b < WIDTH[0]; ++b) total += r.at[b].mass;
  }
  int64_t above_n = 0;
  double above_m = 0;
  const double mass = p * total;
  int64_t b = walk(r, WIDTH[0], count, mass, above_n, above_m);
  if (b < 0) return 0;
  r.left.clear();
  tokens.each([&](uint32_t k, float ek) {
    if ((k >> SHIFT[0]) == static_cast<uint32_t>(b)) r.left.emplace_back(k, ek);
  });
  for (int level = 1; level < 3; ++level) {
    const int s = SHIFT[level];
    const uint32_t w = WIDTH[level];
    std::fill(r.at, r.at + w, Radix::Bucket{0.0, 0});
    for (const auto& [k, ek] : r.left) {
      Radix::Bucket& h = r.at[(k >> s) & (w - 1)];
      h.mass += ek;
      ++h.count;
    }
    const int64_t n = above_n;
    const double m = above_m;
    b = walk(r, w, count, mass, above_n, above_m);
    if (b < 0) {  // a finer grouping's sums fell a rounding short of the coarser one's: all of its bucket stays
      above_n = n;
      above_m = m;
      b = 0;
      while (b + 1 < static_cast<int64_t>(w) && r.at[b].count == 0) ++b;
    }
    const uint32_t at = static_cast<uint32_t>(b);
    r.left.erase(std::remove_if(r.left.begin(), r.left.end(), [&](const auto& t) { return ((t.first >> s) & (w - 1)) != at; }),
                 r.left.end());
  }
  return r.left.empty() ? 0 : r.left.front().first;  // every token left has this key (none: no cut)
}

// The tokens whose logit is within NEAR temperatures of the largest (a probability e^-12 of its or more), where they
// are few (a model's row: a few dozen): wherever they number top_k, or hold top_p of the row's mass, the cuts fall
// among them, and a select then reads their list instead of the row. A block of 64 without one is a vector compare.
constexpr float NEAR = 12.f;

// r.near: the near tokens' ids; returns their exponentials' sum, or -1 where there are none to use (many: more
// than a sixteenth of the row; a logit that is not finite)
double near_tokens(const float* x, const float* e, int64_t V, float logit, Radix& r) {
  r.near.clear();
  if (!finite(logit)) return -1.0;
  int64_t count = 0;   // a vector count first: a flat row's many are not gathered
#pragma omp simd reduction(+ : count)
  for (int64_t v = 0; v < V; ++v) count += (e[v] > 0.f) & (x[v] >= logit);
  if (count > V / 16) return -1.0;
  double mass = 0;
  for (int64_t lo = 0; lo < V; lo += 64) {   // a block's near tokens as the bits of a word, then its set bits
    const int64_t n = std::min<int64_t>(64, V - lo);
    uint64_t hit = 0;
#pragma omp simd reduction(| : hit)
    for (int64_t i = 0; i < n; ++i) hit |= static_cast<uint64_t>((e[lo + i] > 0.f) & (x[lo + i] >= logit)) << i;
    for (; hit; hit &= hit - 1) {
      const int64_t v = lo + __builtin_ctzll(hit);
      r.near.push_back(static_cast<int32_t>(v));
      mass += e[v];
    }
  }
  return mass;
}

// top-k, then top-p over what top-k kept (vLLM's and transformers' order and renormalization), as cuts on the logits
// so that equal logits share a fate (their exponentials may differ in the last bit: a vector lane's exp and a
// scalar's): the k largest and any equal to the k-th; then the largest whose exponentials reach top_p of theirs,
// and any equal to the last. `total`: the row's exponentials' sum; `near`: NEAR's logit. The least logit's key
// kept (0: no cut).
uint32_t cut(const float* x, const float* e, int64_t V, int64_t top_k, float top_p, double total, float near, Radix& r) {
  const double near_mass = near_tokens(x, e, V, near, r);
  // the near tokens' list where `listed`, else the row: tokens with a logit's key at least `least`
  const auto select = [&](bool listed, uint32_t least, int64_t count, double p, double of) {
    return listed ? select_key(Listed{x, e, r.near, least}, count, p, of, r) : select_key(Whole{x, e, V, least}, count, p, of, r);
  };
  const bool listed_k = near_mass >= 0 && static_cast<int64_t>(r.near.size()) >= top_k;   // top-k's cut among them
  const uint32_t least = top_k > 0 ? select(listed_k, 0, top_k, 2.0, -1.0) : 0;
  if (top_p >= 1.f) return least;
  if (least > 0)   // over what top-k kept: all near tokens where its cut was among them
    return std::max(least, select(listed_k, least, INT64_MAX, top_p, -1.0));
  // of the row's total either way; a margin against two sums' roundings: a near mass a hair short reads the row
  return select(near_mass >= top_p * total * (1 + 1e-9), 0, INT64_MAX, top_p, total);
}

// e's blocks' sums after zeroing the tokens whose logit's key is below `least`; their total. A compare of the
// logits with the key's own value (key order is value order for finite floats; a token with an exponential has a
// finite logit), which vectorizes where the keys did not.
double zero_below(const float* x, float* e, int64_t V, uint32_t least, double* block) {
  const uint32_t u = (least & 0x80000000u) ? least ^ 0x80000000u : ~least;   // order_key's inverse
  float cut;
  std::memcpy(&cut, &u, sizeof cut);
  double total = 0;
  for (int64_t lo = 0, b = 0; lo < V; lo += BLOCK, ++b) {
    const int64_t hi = std::min(V, lo + BLOCK);
    double s = 0;
#pragma omp simd reduction(+ : s)
    for (int64_t v = lo; v < hi; ++v) {
      e[v] = x[v] < cut ? 0.f : e[v];
      s += e[v];
    }
    block[b] = s;
    total += s;
  }
  return total;
}

// one row: (token, ok); ok false where the raw logits are not all finite, the processed ones hold NaN or +inf (a
// malformed plan's bias or penalty), nothing is allowed, or a drawn row's parameters are not numbers or leave it
// nothing
std::pair<int64_t, bool> sample_row(const float* raw, const float* x, const uint8_t* mask, int64_t V, float temperature,
                                    float min_p, int64_t top_k, float top_p, double u, uint8_t* a, float* e,
                                    double* block, Radix& r) {
  uint32_t worst = 0;  // any exponent all ones: inf or NaN (in x, -inf is a ban)
#pragma omp simd reduction(| : worst)
  for (int64_t v = 0; v < V; ++v)
    worst |= ((bits(raw[v]) & EXPONENT) == EXPONENT) | (((bits(x[v]) & EXPONENT) == EXPONENT) & (bits(x[v]) != NEG_INF));
  allowed(mask, x, V, a);
  float best = -FLT_MAX;
  uint32_t any = 0;
#pragma omp simd reduction(max : best) reduction(| : any)
  for (int64_t v = 0; v < V; ++v) {  // -inf and masked logits are selected out, never compared as values
    const bool in = a[v];
    any |= in;
    best = std::max(best, in ? x[v] : -FLT_MAX);
  }
  if (worst || !any) return {0, false};
  int64_t arg = V;  // the first allowed token at the maximum, as torch's argmax: a vector test a block of 64, then
  for (int64_t lo = 0; lo < V && arg == V; lo += 64) {   // the block it is in (no short circuit: a grammar's mask
    const int64_t hi = std::min(V, lo + 64);              // is a coin toss to a branch predictor)
    uint32_t hit = 0;
#pragma omp simd reduction(| : hit)
    for (int64_t v = lo; v < hi; ++v) hit |= (a[v] != 0) & (x[v] == best);
    for (int64_t v = lo; hit && v < hi; ++v)
      if ((a[v] != 0) & (x[v] == best)) {
        arg = v;
        break;
      }
  }
  if (arg == V) return {0, false};
  if (u < 0) return {arg, true};
  // a temperature that is not a number, not positive or too small to divide by (the API takes 1e-3 and up) fails
  // the row, as softmax's NaN does on a device, and so do a min-p and a top-p that are not numbers (a top-p of 0, as
  // float32 rounds the API's least: the most likely token)
  const float inv_t = 1.f / temperature;
  if (is_nan(temperature) || temperature <= 0.f || !finite(inv_t) || !finite(min_p) || is_nan(top_p))
    return {arg, false};
  const int64_t n_blocks = (V + BLOCK - 1) / BLOCK;
  double total = 0;
  for (int64_t b = 0; b < n_blocks; ++b) {
    const int64_t lo = b * BLOCK, hi = std::min(V, lo + BLOCK);
    double s = 0;
#pragma omp simd reduction(+ : s)
    for (int64_t v = lo; v < hi; ++v) {
      const bool in = a[v];
      const float d = in ? (x[v] - best) * inv_t : EXP_FLOOR - 1.f;
      const float p = std::exp(std::max(d, EXP_FLOOR));
      const float kept = d < EXP_FLOOR || p < min_p ? 0.f : p;  // min-p: p / sum below min_p * max / sum, max = 1
      e[v] = kept;
      s += kept;
    }
    block[b] = s;
    total += s;
  }
  if (!(total > 0.0)) return {arg, false};  // a min-p past 1 (a malformed plan) left nothing, as on a device
  if (top_k > 0 || top_p < 1.f) {
    const uint32_t least = cut(x, e, V, top_k, top_p, total, best - NEAR * temperature, r);
    if (least > 0) total = zero_below(x, e, V, least, block);
  }
  // the first token whose cumulative probability exceeds u * total (< total, as the argmax's term is 1): a block's
  // sum first, then the tokens of the block it falls in; a token of probability 0 never crosses
  const double target = u * total;
  double acc = 0;
  int64_t b = 0;
  while (b + 1 < n_blocks && acc + block[b] <= target) acc += block[b++];
  const int64_t lo = b * BLOCK, hi = std::min(V, lo + BLOCK);
  int64_t last = -1;
  for (int64_t v = lo; v < hi; ++v) {
    acc += e[v];
    last = e[v] > 0.f ? v : last;
    if ((e[v] > 0.f) & (acc > target)) return {v, true};
  }
  return {last >= 0 ? last : arg, true};  // rounding left the block's own sum a little above its scan
}

// one row's log-softmax at its target and its k largest, most likely first (equal values: the lower id first)
void log_probs_row(const float* x, int64_t V, int64_t target, int64_t k, float* chosen, float* top_v, int64_t* top_i) {
  float best = -FLT_MAX;
#pragma omp simd reduction(max : best)
  for (int64_t v = 0; v < V; ++v) best = larger(best, x[v]);
  double sum = 0;  // float lanes within a block (as torch's), blocks summed in double
  for (int64_t lo = 0; lo < V; lo += BLOCK) {
    const int64_t hi = std::min(V, lo + BLOCK);
    float s = 0.f;
#pragma omp simd reduction(+ : s)
    for (int64_t v = lo; v < hi; ++v) s += std::exp(std::max(x[v] - best, EXP_FLOOR));
    sum += s;
  }
  const float log_sum = static_cast<float>(std::log(sum));  // log_softmax(x) = x - max - log(sum): torch's order
  constexpr int64_t LANES = 64;
  for (int64_t lo = 0; k > 0 && lo < V; lo += LANES) {
    const int64_t hi = std::min(V, lo + LANES);
    float block = -FLT_MAX;  // a block joins the scan only where it beats the k-th so far: rarely, after the start
#pragma omp simd reduction(max : block)
    for (int64_t v = lo; v < hi; ++v) block = larger(block, x[v]);
    if (lo >= k && block <= top_v[k - 1]) continue;
    for (int64_t v = lo; v < hi; ++v) {
      if (v >= k && x[v] <= top_v[k - 1]) continue;
      int64_t j = std::min(v, k - 1);  // insert, keeping the lower id first among equal values
      while (j > 0 && top_v[j - 1] < x[v]) {
        top_v[j] = top_v[j - 1];
        top_i[j] = top_i[j - 1];
        --j;
      }
      top_v[j] = x[v];
      top_i[j] = v;
    }
  }
  for (int64_t j = 0; j < k; ++j) top_v[j] = top_v[j] - best - log_sum;
  *chosen = x[target] - best - log_sum;
}

}  // namespace

// raw, x [S, V] float32 (x: after the logits processors; may be raw itself); masks [M, >= V / 8 bytes] uint8 and
// mask_index [S] int64 (-1: no mask); temperature, min_p, top_p [S] float32; top_k [S] int64 (0: none); u [S] float64
// (< 0: greedy) -> [2, S] int64: each row's token over whether it is usable
torch::Tensor sample_rows(torch::Tensor raw, torch::Tensor x, torch::Tensor masks, torch::Tensor mask_index,
                          torch::Tensor temperature, torch::Tensor min_p, torch::Tensor top_k, torch::Tensor top_p,
                          torch::Tensor u) {
  TORCH_CHECK(raw.dtype() == torch::kFloat32 && x.dtype() == torch::kFloat32 && raw.sizes() == x.sizes() && raw.dim() == 2,
              "raw and x: [S, V] float32");
  raw = raw.contiguous();
  x = x.contiguous();
  masks = masks.contiguous();
  mask_index = mask_index.contiguous();
  temperature = temperature.contiguous();
  min_p = min_p.contiguous();
  top_k = top_k.contiguous();
  top_p = top_p.contiguous();
  u = u.contiguous();
  const int64_t S = raw.size(0), V = raw.size(1), W = masks.size(1);
  TORCH_CHECK(masks.dtype() == torch::kUInt8 && masks.dim() == 2 && W >= (V + 7) / 8, "masks: [M, >= V / 8] uint8");
  TORCH_CHECK(mask_index.numel() == S && temperature.numel() == S && min_p.numel() == S && top_k.numel() == S &&
              top_p.numel() == S && u.numel() == S, "a value per row");
  TORCH_CHECK(temperature.dtype() == torch::kFloat32 && min_p.dtype() == torch::kFloat32 && top_p.dtype() == torch::kFloat32 &&
              top_k.dtype() == torch::kInt64 && mask_index.dtype() == torch::kInt64 && u.dtype() == torch::kFloat64,
              "temperature, min_p, top_p float32; top_k, mask_index int64; u float64");
  const int64_t* mi = mask_index.data_ptr<int64_t>();
  for (int64_t r = 0; r < S; ++r) TORCH_CHECK(mi[r] >= -1 && mi[r] < masks.size(0), "mask_index past the masks");
  const float* t = temperature.data_ptr<float>();
  const float* mp = min_p.data_ptr<float>();
  const int64_t* tk = top_k.data_ptr<int64_t>();
  const float* tp = top_p.data_ptr<float>();
  const double* uu = u.data_ptr<double>();
  const float* rp = raw.data_ptr<float>();
  const float* xp = x.data_ptr<float>();
  const uint8_t* mk = masks.data_ptr<uint8_t>();
  auto out = torch::empty({2, S}, torch::kInt64);
  int64_t* o = out.data_ptr<int64_t>();
#pragma omp parallel if (S > 1 && S * V > 65536)
  {
    std::vector<uint8_t> a(V);
    std::vector<float> e(V);
    std::vector<double> block((V + BLOCK - 1) / BLOCK);
    Radix radix;
#pragma omp for schedule(static)
    for (int64_t r = 0; r < S; ++r) {
      const auto [token, ok] = sample_row(rp + r * V, xp + r * V, mi[r] >= 0 ? mk + mi[r] * W : nullptr, V, t[r], mp[r],
                                          tk[r], tp[r], uu[r], a.data(), e.data(), block.data(), radix);
      o[r] = token;
      o[S + r] = ok;
    }
  }
  return out;
}

// x [S, V] float32, rows [R] int64 (the rows asking), targets [R] int64, 0 <= k <= V -> (the targets' log-softmax [R],
// the k largest [R, k], their ids [R, k]): torch's log_softmax, gather and topk in one pass and a scan per row
std::vector<torch::Tensor> log_probs_rows(torch::Tensor x, torch::Tensor rows, torch::Tensor targets, int64_t k) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2, "x: [S, V] float32");
  x = x.contiguous();
  rows = rows.contiguous();
  targets = targets.contiguous();
  const int64_t V = x.size(1), R = rows.numel();
  TORCH_CHECK(k >= 0 && k <= V && targets.numel() == R, "0 <= k <= V and a target per row");
  const int64_t* r = rows.data_ptr<int64_t>();
  const int64_t* t = targets.data_ptr<int64_t>();
  for (int64_t i = 0; i < R; ++i)
    TORCH_CHECK(r[i] >= 0 && r[i] < x.size(0) && t[i] >= 0 && t[i] < V, "a row or target out of range");
  auto chosen = torch::empty({R}, torch::kFloat32);
  auto top_v = torch::empty({R, k}, torch::kFloat32);
  auto top_i = torch::empty({R, k}, torch::kInt64);
  const float* xp = x.data_ptr<float>();
  float* c = chosen.data_ptr<float>();
  float* tv = top_v.data_ptr<float>();
  int64_t* ti = top_i.data_ptr<int64_t>();
#pragma omp parallel for schedule(static) if (R > 1 && R * V > 65536)
  for (int64_t i = 0; i < R; ++i) log_probs_row(xp + r[i] * V, V, t[i], k, c + i, tv + i * k, ti + i * k);
  return {chosen, top_v, top_i};
}
