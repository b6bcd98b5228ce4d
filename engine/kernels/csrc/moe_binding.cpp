// Binding of moe_experts: check the picks, weights and experts (tiles [E, ...]), allocate the
// scratch.
#include "moe_binding.h"

#include "binding_checks.h"

namespace meterserve {
namespace {

// (out [T, H], experts run). weights float32 or bfloat16 [T, k]: bfloat16 weights round each
// weighted product to bfloat16 (see kernels.h).
std::tuple<torch::Tensor, int64_t> moe_experts_op(const torch::Tensor& x,
                                                   const torch::Tensor& picks,
                                                   const torch::Tensor& weights,
                                                   const torch::Tensor& gate_up,
                                                   const torch::Tensor& down) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kBFloat16 && x.is_contiguous(),
              "x must be contiguous bfloat16 [T, H]");
  const int64_t tokens = x.size(0), hidden = x.size(1);
  TORCH_CHECK(picks.dim() == 2 && picks.size(0) == tokens && picks.scalar_type() == torch::kInt64,
              "picks must be int64 [T, k]");
  TORCH_CHECK(weights.sizes() == picks.sizes(), "weights must be [T, k] like picks");
  check_expert_tiles(gate_up, hidden, "moe_experts gate_up");  // [E] of [2 inter, hidden]
  const int64_t E = gate_up.size(0), inter = gate_up.size(1) * 16 / 2, k = picks.size(1);
  check_expert_tiles(down, inter, "moe_experts down");
  const int64_t down_rows = down.size(1) * 16;
  TORCH_CHECK(down.size(0) == E && down_rows == hidden,
              "moe_experts: down must be [", E, "] experts of [", hidden, ", ", inter, "]");
  const torch::Tensor pick_ids = picks.contiguous();
  const int64_t pairs = tokens * k;
  check_indices(data<int64_t>(pick_ids), pairs, E, "expert");
  const bool round_products = weights.scalar_type() == torch::kBFloat16;
  const torch::Tensor weights32 = weights.to(torch::kFloat32).contiguous();
  auto bf16_rows = [&](int64_t rows, int64_t cols) {
    return torch::empty({rows, cols}, x.options());
  };
  // Padding rows: read by tile loads, never written out; zero so they hold numbers.
  torch::Tensor rows = bf16_rows(pairs + 32, hidden), hidden_rows = bf16_rows(pairs + 32, inter);
  rows.narrow(0, pairs, 32).zero_();
  hidden_rows.narrow(0, pairs, 32).zero_();
  torch::Tensor gate_up_out = bf16_rows(pairs, 2 * inter), expert_out = bf16_rows(pairs, hidden);
  torch::Tensor index = torch::empty({2, pairs}, picks.options());
  const MoeScratch scratch{data<bf16>(rows),        data<bf16>(gate_up_out),
                           data<bf16>(hidden_rows), data<bf16>(expert_out),
                           data<int64_t>(index),    data<int64_t>(index) + pairs};
  const MoeExperts experts{data<bf16>(gate_up), data<bf16>(down), E, hidden, inter};
  torch::Tensor out = bf16_rows(tokens, hidden);
  const int64_t run = moe_experts(data<bf16>(x), data<int64_t>(pick_ids), data<float>(weights32),
                                  round_products, experts, tokens, k, scratch, data<bf16>(out));
  return {out, run};
}

// moe_experts over a GGUF's stacked experts: gate, up [E * inter, row bytes] and down
// [E * hidden, row bytes] uint8 blocks of ggml types gate_kind, up_kind, down_kind.
std::tuple<torch::Tensor, int64_t> moe_experts_gguf_op(
    const torch::Tensor& x, const torch::Tensor& picks, const torch::Tensor& weights,
    const torch::Tensor& gate, int64_t gate_kind, const torch::Tensor& up, int64_t up_kind,
    const torch::Tensor& down, int64_t down_kind, int64_t num_experts, int64_t inter,
    bool use_amx, int64_t small_rows, bool int8_activations) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kBFloat16 && x.is_contiguous(),
              "x must be contiguous bfloat16 [T, H]");
  const int64_t tokens = x.size(0), hidden = x.size(1), E = num_experts;
  TORCH_CHECK(picks.dim() == 2 && picks.size(0) == tokens && picks.scalar_type() == torch::kInt64,
              "picks must be int64 [T, k]");
  TORCH_CHECK(weights.sizes() == picks.sizes(), "weights must be [T, k] like picks");
  auto stacked = [&](const torch::Tensor& blocks, int64_t kind, int64_t rows, int64_t cols,
                     const char* what) {
    return stacked_gguf_experts(blocks, kind, E, rows, cols, int8_activations, what);
  };
  const MoeGgufExperts experts{stacked(gate, gate_kind, inter, hidden, "moe_experts_gguf gate"),
                               stacked(up, up_kind, inter, hidden, "moe_experts_gguf up"),
                               stacked(down, down_kind, hidden, inter, "moe_experts_gguf down"),
                               E, hidden, inter, small_rows, use_amx};
  const int64_t k = picks.size(1), pairs = tokens * k;
  const torch::Tensor pick_ids = picks.contiguous();
  check_indices(data<int64_t>(pick_ids), pairs, E, "expert");
  const bool round_products = weights.scalar_type() == torch::kBFloat16;
  const torch::Tensor weights32 = weights.to(torch::kFloat32).contiguous();
  auto bf16_rows = [&](int64_t rows, int64_t cols) {
    return torch::empty({rows, cols}, x.options());
  };
  torch::Tensor rows = bf16_rows(pairs, hidden), hidden_rows = bf16_rows(pairs, inter);
  torch::Tensor gate_up_out = bf16_rows(pairs, 2 * inter), expert_out = bf16_rows(pairs, hidden);
  torch::Tensor index = torch::empty({2, pairs}, picks.options());
  const MoeScratch scratch{data<bf16>(rows),        data<bf16>(gate_up_out),
                           data<bf16>(hidden_rows), data<bf16>(expert_out),
                           data<int64_t>(index),    data<int64_t>(index) + pairs};
  torch::Tensor out = bf16_rows(tokens, hidden);
  const int64_t run =
      moe_experts_gguf(data<bf16>(x), data<int64_t>(pick_ids), data<float>(weights32),
                       round_products, experts, tokens, k, scratch, data<bf16>(out));
  return {out, run};
}

// (weights [T, k], picks [T, k]) of logits bf16 [T, E]: weights bf16 where round_weights (as
// moe_experts then rounds each weighted product), else float32.
std::tuple<torch::Tensor, torch::Tensor> moe_route_op(const torch::Tensor& logits, int64_t k,
                                                      bool normalize, bool round_weights) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == torch::kBFloat16 &&
                  logits.is_contiguous(),
              "logits must be contiguous bfloat16 [T, E]");
  const int64_t tokens = logits.size(0), E = logits.size(1);
  TORCH_CHECK(k >= 1 && k <= E, "k must be in [1, E]");
  auto picks = torch::empty({tokens, k}, logits.options().dtype(torch::kInt64));
  auto weights = torch::empty({tokens, k}, logits.options().dtype(torch::kFloat32));
  moe_route(data<bf16>(logits), tokens, E, k, normalize, round_weights, data<int64_t>(picks),
            data<float>(weights));
  return {round_weights ? weights.to(torch::kBFloat16) : weights, picks};
}

}  // namespace

void bind_moe(pybind11::module_& m) {
  m.def("moe_route", &moe_route_op,
        "a router's top-k picks from its logits: (weights, picks), as SparseMoE._route states",
        py::call_guard<py::gil_scoped_release>());
  m.def("moe_experts", &moe_experts_op,
        "a MoE layer's picked experts (tile layout), weighted and summed per token: "
        "(out, run)",
        py::call_guard<py::gil_scoped_release>());
  m.def("moe_experts_gguf", &moe_experts_gguf_op,
        "a MoE layer's picked experts as a GGUF stores them (stacked blocks), weighted and "
        "summed per token: (out, run)",
        py::arg("x"), py::arg("picks"), py::arg("weights"), py::arg("gate"),
        py::arg("gate_kind"), py::arg("up"), py::arg("up_kind"), py::arg("down"),
        py::arg("down_kind"), py::arg("num_experts"), py::arg("inter"),
        py::arg("use_amx") = true, py::arg("small_rows") = kSmallBatchRows,
        py::arg("int8_activations") = false, py::call_guard<py::gil_scoped_release>());
}

}  // namespace meterserve
