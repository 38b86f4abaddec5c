// The CPU extension's Python functions (kernels/cpu_kernels.py builds every source of csrc/ into one module).
#include <torch/extension.h>

torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor seq_lens, double scale,
                                     int64_t window, double softcap, c10::optional<torch::Tensor> sinks);
torch::Tensor rms_norm(torch::Tensor x, c10::optional<torch::Tensor> delta, torch::Tensor w, double eps);
void rotary_(torch::Tensor x, torch::Tensor positions, torch::Tensor cos, torch::Tensor sin, int64_t n_heads);
torch::Tensor silu_mul(torch::Tensor gate_up);
torch::Tensor linear_rows(torch::Tensor x, torch::Tensor w);
torch::Tensor grouped_rows(torch::Tensor x, torch::Tensor w, torch::Tensor ends, int64_t stream_rows);
torch::Tensor sample_rows(torch::Tensor raw, torch::Tensor x, torch::Tensor masks, torch::Tensor mask_index,
                          torch::Tensor temperature, torch::Tensor min_p, torch::Tensor top_k, torch::Tensor top_p,
                          torch::Tensor u);
void process_rows(torch::Tensor x, torch::Tensor bias_rows, torch::Tensor bias_ids, torch::Tensor bias_vals,
                  torch::Tensor pen_rows, torch::Tensor slots, torch::Tensor counts, torch::Tensor seen,
                  torch::Tensor params);
std::vector<torch::Tensor> log_probs_rows(torch::Tensor x, torch::Tensor rows, torch::Tensor targets, int64_t k);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "paged decode attention (float32 or bfloat16 KV)",
        py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("block_tables"), py::arg("seq_lens"),
        py::arg("scale"), py::arg("window") = 0, py::arg("softcap") = 0.0, py::arg("sinks") = py::none());
  m.def("rms_norm", &rms_norm, "RMSNorm of rows, after an optional in-place residual add");
  m.def("rotary_", &rotary_, "rotary embedding of the first heads of every row, in place");
  m.def("silu_mul", &silu_mul, "silu(gate) * up of [gate | up] rows");
  m.def("linear_rows", &linear_rows, "x [M, K] @ w.T for a few rows, float32 or bfloat16, the weights streamed once");
  m.def("sample_rows", &sample_rows, "each row's token (argmax, or a draw by inverse CDF) over whether it is usable, float32");
  m.def("process_rows", &process_rows, "logit biases, bans and penalties into [S, V] float32 logits, in place");
  m.def("log_probs_rows", &log_probs_rows, "some rows' log-softmax at a target each and their k largest, float32");
  m.def("grouped_rows", &grouped_rows, "each group of x's rows times its own w[g].T (a mixture of experts), float32 or bfloat16");
}
