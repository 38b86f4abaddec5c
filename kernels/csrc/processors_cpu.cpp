// The logits processors on the CPU (orca_mq/engine/history.py's Processors.apply): logit_bias, min_tokens' bans and
// the penalties in one call, the penalties one pass over each penalized row, where torch's ops made about ten passes
// over [rows, vocab] tensors (16 penalized rows at 49,152 tokens: 3.6 ms an iteration, which every other client's
// iteration waited on; issue 44). The arithmetic is torch's, operation by operation and rounded as its ops round:
// fast-math is off here (no contraction into fused multiply-adds, no reciprocal for a division), so that the
// logits a row draws from are the ops' to the bit (the draw's own arithmetic is sample_cpu.cpp's).
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <vector>

#pragma GCC push_options
#pragma GCC optimize("no-fast-math", "fp-contract=off")

namespace {

inline bool neg_inf(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  return u == 0xff800000u;
}

// transformers' repetition penalty where a token was seen, then OpenAI's presence and frequency penalties
void penalize_row(float* x, const int32_t* count, const bool* seen, int64_t V, float presence, float frequency,
                  float repetition) {
  for (int64_t v = 0; v < V; ++v) {
    float y = x[v];
    if (seen[v]) y = y > 0.f ? y / repetition : y * repetition;
    const float c = static_cast<float>(count[v]);
    const float fc = frequency * c;
    y = y - fc;
    x[v] = y - presence * static_cast<float>(c > 0.f);
  }
}

}  // namespace

// x [S, V] float32, changed in place: the biases (bias_rows, bias_ids [B] int64, bias_vals [B] float32) added, a
// -inf one a ban, after the others, and undone for a row it would leave with no token; then for pen_rows [P] int64
// the penalties, of history rows slots [P] int64 of counts [N, V] int32 and seen [N, V] bool, params [P, 3] float32
// (presence, frequency, repetition)
void process_rows(torch::Tensor x, torch::Tensor bias_rows, torch::Tensor bias_ids, torch::Tensor bias_vals,
                  torch::Tensor pen_rows, torch::Tensor slots, torch::Tensor counts, torch::Tensor seen,
                  torch::Tensor params) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2 && x.is_contiguous(), "x: contiguous [S, V] float32");
  const int64_t S = x.size(0), V = x.size(1), B = bias_rows.numel(), P = pen_rows.numel();
  bias_rows = bias_rows.contiguous();
  bias_ids = bias_ids.contiguous();
  bias_vals = bias_vals.contiguous();
  pen_rows = pen_rows.contiguous();
  slots = slots.contiguous();
  counts = counts.contiguous();
  seen = seen.contiguous();
  params = params.contiguous();
  TORCH_CHECK(bias_rows.dtype() == torch::kInt64 && bias_ids.dtype() == torch::kInt64 && bias_vals.dtype() == torch::kFloat32 &&
              bias_ids.numel() == B && bias_vals.numel() == B, "biases: rows, ids int64, values float32, B each");
  TORCH_CHECK(pen_rows.dtype() == torch::kInt64 && slots.dtype() == torch::kInt64 && slots.numel() == P &&
              params.dtype() == torch::kFloat32 && params.numel() == 3 * P, "penalties: rows, slots int64, params [P, 3] float32");
  TORCH_CHECK(P == 0 || (counts.dtype() == torch::kInt32 && seen.dtype() == torch::kBool && counts.dim() == 2 &&
                         counts.size(1) == V && seen.sizes() == counts.sizes()), "history: counts int32, seen bool, [N, V]");
  float* xp = x.data_ptr<float>();
  const int64_t* br = bias_rows.data_ptr<int64_t>();
  const int64_t* bi = bias_ids.data_ptr<int64_t>();
  const float* bv = bias_vals.data_ptr<float>();
  for (int64_t j = 0; j < B; ++j)
    TORCH_CHECK(br[j] >= 0 && br[j] < S && bi[j] >= 0 && bi[j] < V, "a bias outside the logits");
  for (int64_t j = 0; j < B; ++j)
    if (!neg_inf(bv[j])) xp[br[j] * V + bi[j]] += bv[j];
  std::vector<std::tuple<int64_t, int64_t, float>> banned;  // (row, id, the logit before), in order
  for (int64_t j = 0; j < B; ++j) {
    if (neg_inf(bv[j])) {
      banned.emplace_back(br[j], bi[j], xp[br[j] * V + bi[j]]);
      xp[br[j] * V + bi[j]] = bv[j];
    }
  }
  std::vector<int64_t> checked, undo;  // a row the bans leave nothing gets its logits back, the last ban undone first
  for (const auto& [r, id, before] : banned) {
    if (std::find(checked.begin(), checked.end(), r) != checked.end()) continue;
    checked.push_back(r);
    bool none = true;
    for (int64_t v = 0; v < V && none; ++v) none = neg_inf(xp[r * V + v]);
    if (none) undo.push_back(r);
  }
  for (auto it = banned.rbegin(); it != banned.rend(); ++it)
    if (std::find(undo.begin(), undo.end(), std::get<0>(*it)) != undo.end()) xp[std::get<0>(*it) * V + std::get<1>(*it)] = std::get<2>(*it);
  if (P == 0) return;
  const int64_t* pr = pen_rows.data_ptr<int64_t>();
  const int64_t* sl = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < P; ++i)  // ascending: one thread a row
    TORCH_CHECK(pr[i] >= 0 && pr[i] < S && (i == 0 || pr[i] > pr[i - 1]) && sl[i] >= 0 && sl[i] < counts.size(0),
                "penalized rows not ascending, or a row or slot out of range");
  const int32_t* cp = counts.data_ptr<int32_t>();
  const bool* sp = seen.data_ptr<bool>();
  const float* pp = params.data_ptr<float>();
#pragma omp parallel for schedule(static) if (P > 1 && P * V > 65536)
  for (int64_t i = 0; i < P; ++i)
    penalize_row(xp + pr[i] * V, cp + sl[i] * V, sp + sl[i] * V, V, pp[3 * i], pp[3 * i + 1], pp[3 * i + 2]);
}

#pragma GCC pop_options
