// DecodeStack: a model's decoder layers as decode_stack reads them, checked once at build time,
// and the per-step checks of the batch it runs. It keeps a reference to every tensor its raw
// pointers point into, so the weights and caches outlive it.
#include <algorithm>
#include <array>
#include <tuple>
#include <vector>

#include "binding_checks.h"
#include "decode_stack.h"
#include "decode_stack_binding.h"

namespace meterserve {
namespace {

constexpr int64_t kDense = -1;  // a linear's kind: -1 row-major bf16, -2 GGUF parts, -3 tiles
constexpr int64_t kGgufParts = -2;
constexpr int64_t kTiles = -3;
constexpr int64_t kExperts = -4;  // in a layer's down place: its MLP is a MoE's
constexpr int64_t kGgufExperts = -5;  // the same, its experts a GGUF's stacked blocks

// (kind, tensors): (-1, [weight]) row-major bf16 [out_features, in_features]
// | (-3, [packed]) bf16 in amx_pack_weight's layout [out / 16, in / 32, 16, 16, 2]
// | (-2, [parts, blocks_0, ..., blocks_P-1]): parts int64 [P, 3] = (ggml type, rows, int8
// activations 0 or 1) of each run of one format, blocks_i its bytes as stored in the file
// | (-4, [gate_up, down, routing]): a MoE layer's experts in tiles (moe_experts' layouts)
// and routing int64 [4] = (top_k, normalize, round_weights, bytes per expert); the layer's
// gate_up spec is then its router (hidden -> one logit per expert)
// | (-5, [gate, up, down, meta]): the same over a GGUF's stacked experts (moe_experts_gguf's
// blocks), meta int64 [11] = (gate, up, down ggml types, experts, expert size, top_k,
// normalize, round_weights, int8 activations, bytes per expert, the small-batch rows
// SparseMoE passes moe_experts_gguf).
using LinearSpec = std::tuple<int64_t, std::vector<torch::Tensor>>;

class DecodeStack {
 public:
  DecodeStack(const std::vector<torch::Tensor>& norms, const std::vector<LinearSpec>& linears,
              const std::vector<torch::Tensor>& key_caches,
              const std::vector<torch::Tensor>& value_caches, const torch::Tensor& cos,
              const torch::Tensor& sin, int64_t num_heads, int64_t num_kv_heads,
              int64_t block_size, double eps, double scale) {
    const int64_t num_layers = static_cast<int64_t>(key_caches.size());
    TORCH_CHECK(num_layers >= 1 && value_caches.size() == key_caches.size(),
                "DecodeStack: one key and one value cache per layer");
    // Two norms a layer (input, post-attention), four with Qwen3's q and k norms, then the
    // final norm.
    const int64_t per_layer = (static_cast<int64_t>(norms.size()) - 1) / num_layers;
    TORCH_CHECK((per_layer == 2 || per_layer == 4) &&
                    static_cast<int64_t>(norms.size()) == per_layer * num_layers + 1,
                "DecodeStack: two norms per layer (four with q/k norms) and the final norm");
    TORCH_CHECK(linears.size() == 4 * key_caches.size(),
                "DecodeStack: four linears per layer (qkv, o, gate_up, down; router, experts)");
    TORCH_CHECK(cos.dim() == 2 && cos.sizes() == sin.sizes() && cos.is_contiguous() &&
                    sin.is_contiguous() && cos.scalar_type() == torch::kBFloat16 &&
                    sin.scalar_type() == torch::kBFloat16,
                "DecodeStack: cos/sin must be contiguous bfloat16 [positions, head_dim]");
    const int64_t head_dim = cos.size(1), hidden = norms[0].numel();
    TORCH_CHECK(head_dim % 16 == 0 && head_dim <= 256 && num_kv_heads >= 1 &&
                    num_heads % num_kv_heads == 0 && block_size >= 1,
                "DecodeStack: head_dim a multiple of 16 up to 256, heads a multiple of kv heads");
    int64_t inter = 0, num_experts = 0, top_k = 0, expert_size = 0;
    for (int64_t i = 0; i < num_layers; ++i) {
      const auto& [kind, tensors] = linears[4 * i + 3];
      if (kind != kExperts && kind != kGgufExperts) {
        inter = std::max(inter, inputs_of(linears[4 * i + 3]));
        continue;
      }
      const auto [E, size, k] = kind == kExperts ? experts_shape(tensors, hidden)
                                                 : gguf_experts_shape(tensors);
      num_experts = std::max(num_experts, E);
      expert_size = std::max(expert_size, size);
      top_k = std::max(top_k, k);
    }
    shape_ = DecodeStackShape{hidden,      inter,     num_experts,  top_k,
                              expert_size, num_heads, num_kv_heads, head_dim,
                              block_size,  float(eps), float(scale), data<bf16>(cos),
                              data<bf16>(sin)};
    max_positions_ = cos.size(0);
    num_slots_ = key_caches[0].size(0);
    for (int64_t i = 0; i < num_layers; ++i)
      for (int64_t j = 0; j < per_layer; ++j)
        keep_vector(norms[per_layer * i + j], j < 2 ? hidden : head_dim, "norm weight");
    keep_vector(norms.back(), hidden, "final norm weight");
    keep(cos);
    keep(sin);
    final_norm_ = data<bf16>(norms.back());
    const int64_t q_size = num_heads * head_dim;
    for (int64_t i = 0; i < num_layers; ++i) {
      DecodeLayer layer{};
      layer.input_norm = data<bf16>(norms[per_layer * i]);
      layer.post_attention_norm = data<bf16>(norms[per_layer * i + 1]);
      if (per_layer == 4) {
        layer.q_norm = data<bf16>(norms[per_layer * i + 2]);
        layer.k_norm = data<bf16>(norms[per_layer * i + 3]);
      }
      layer.qkv = linear(linears[4 * i], shape_.qkv_width(), hidden);
      layer.o = linear(linears[4 * i + 1], hidden, q_size);
      const int64_t mlp_kind = std::get<0>(linears[4 * i + 3]);
      if (mlp_kind == kExperts || mlp_kind == kGgufExperts) {
        layer.moe = true;
        const auto& experts = std::get<1>(linears[4 * i + 3]);
        layer.routed = mlp_kind == kExperts ? routed_mlp(linears[4 * i + 2], experts, hidden)
                                            : gguf_routed_mlp(linears[4 * i + 2], experts, hidden);
      } else {
        layer.gate_up = linear(linears[4 * i + 2], 2 * inter, hidden);
        layer.down = linear(linears[4 * i + 3], hidden, inter);
      }
      layer.key_cache = cache(key_caches[i]);
      layer.value_cache = cache(value_caches[i]);
      layers_.push_back(layer);
    }
    bool all_gguf = true;
    for (const auto& spec : linears) all_gguf = all_gguf && std::get<0>(spec) == kGgufParts;
    max_rows_ = decode_stack_max_rows(all_gguf);
  }

  int64_t max_rows() const { return max_rows_; }

  // hidden: [rows, hidden_size] embeddings, one decode per row -> (the final-normed hidden,
  // the (layer, expert) pairs run).
  std::tuple<torch::Tensor, int64_t, int64_t> run(const torch::Tensor& hidden,
                                         const torch::Tensor& positions,
                                         const torch::Tensor& slots,
                                         const torch::Tensor& block_tables,
                                         const torch::Tensor& context_lens) const {
    TORCH_CHECK(hidden.dim() == 2 && hidden.size(0) >= 1 && hidden.size(0) <= max_rows_ &&
                    hidden.size(1) == shape_.hidden_size &&
                    hidden.scalar_type() == torch::kBFloat16,
                "DecodeStack.run: hidden must be bfloat16 [1..", max_rows_, ", hidden_size]");
    const int64_t rows = hidden.size(0);
    check_rows(positions, rows, "positions");
    check_rows(slots, rows, "slots");
    check_rows(context_lens, rows, "context_lens");
    TORCH_CHECK(block_tables.scalar_type() == torch::kInt64 && block_tables.is_contiguous() &&
                    block_tables.dim() == 2 && block_tables.size(0) == rows,
                "DecodeStack.run: block_tables must be int64 [rows, max_blocks]");
    const int64_t max_blocks = block_tables.size(1);
    check_indices(data<int64_t>(positions), rows, max_positions_, "position");
    check_indices(data<int64_t>(slots), rows, num_slots_, "slot");
    check_indices(data<int64_t>(block_tables), block_tables.numel(),
                  num_slots_ / shape_.block_size, "block id");
    check_indices(data<int64_t>(context_lens), rows, max_blocks * shape_.block_size + 1,
                  "context length");
    auto out = hidden.contiguous().clone();
    auto residual = torch::empty_like(out);
    const DecodeStep step{rows, data<int64_t>(positions), data<int64_t>(slots),
                          data<int64_t>(block_tables), max_blocks, data<int64_t>(context_lens)};
    int64_t experts_run, expert_bytes;
    {
      pybind11::gil_scoped_release no_gil;  // as the single kernels: see bindings.cpp
      experts_run = decode_stack(layers_, shape_, step, final_norm_, data<bf16>(out),
                                 data<bf16>(residual), &expert_bytes);
    }
    return {out, experts_run, expert_bytes};
  }

 private:
  // A linear's in_features.
  static int64_t inputs_of(const LinearSpec& spec) {
    const auto& [kind, tensors] = spec;
    if (kind == kGgufParts) {  // row bytes are linear in K: K = row bytes * 256 / row_bytes(256)
      const auto parts = gguf_parts_of(tensors);
      const int64_t row_bytes = tensors[1].numel() / parts[0][1];
      return row_bytes * 256 / gguf_row_bytes(static_cast<int>(parts[0][0]), 256);
    }
    if (kind == kTiles) {
      TORCH_CHECK(tensors.size() == 1 && tensors[0].dim() == 5,
                  "DecodeStack: a tiled linear is one amx_pack_weight tensor");
      return tensors[0].size(1) * 32;
    }
    TORCH_CHECK(!tensors.empty() && tensors[0].dim() == 2,
                "DecodeStack: a linear needs a 2-D weight");
    return tensors[0].size(1);
  }

  // (experts, expert size, top_k) of a MoE layer's (-4) tensors, checked.
  static std::array<int64_t, 3> experts_shape(const std::vector<torch::Tensor>& t,
                                              int64_t hidden) {
    TORCH_CHECK(t.size() == 3, "DecodeStack: experts are (gate_up, down, routing)");
    check_expert_tiles(t[0], hidden, "DecodeStack experts gate_up");
    const int64_t E = t[0].size(0), size = t[0].size(1) * 16 / 2;
    check_expert_tiles(t[1], size, "DecodeStack experts down");
    TORCH_CHECK(t[1].size(0) == E && t[1].size(1) * 16 == hidden,
                "DecodeStack: experts' down must be [", E, "] of [", hidden, ", ", size, "]");
    const torch::Tensor& routing = t[2];
    TORCH_CHECK(routing.scalar_type() == torch::kInt64 && routing.numel() == 4 &&
                    routing.is_contiguous(),
                "DecodeStack: routing must be int64 (top_k, normalize, round_weights, bytes per "
                "expert)");
    const int64_t k = data<int64_t>(routing)[0];
    TORCH_CHECK(k >= 1 && k <= E, "DecodeStack: top_k must be in [1, experts]");
    return {E, size, k};
  }

  RoutedMlp routed_mlp(const LinearSpec& router, const std::vector<torch::Tensor>& experts,
                       int64_t hidden) {
    const auto [E, size, k] = experts_shape(experts, hidden);
    RoutedMlp moe;
    moe.router = linear(router, E, hidden);
    moe.experts = MoeExperts{data<bf16>(experts[0]), data<bf16>(experts[1]), E, hidden, size};
    const int64_t* routing = data<int64_t>(experts[2]);
    moe.top_k = k;
    moe.normalize = routing[1] != 0;
    moe.round_weights = routing[2] != 0;
    moe.bytes_per_expert = routing[3];
    for (const auto& t : experts) keep(t);
    return moe;
  }

  // (experts, expert size, top_k) of a GGUF MoE layer's (-5) tensors, checked.
  static std::array<int64_t, 3> gguf_experts_shape(const std::vector<torch::Tensor>& t) {
    TORCH_CHECK(t.size() == 4, "DecodeStack: GGUF experts are (gate, up, down, meta)");
    const torch::Tensor& meta = t[3];
    TORCH_CHECK(meta.scalar_type() == torch::kInt64 && meta.numel() == 11 && meta.is_contiguous(),
                "DecodeStack: GGUF experts' meta must be int64 [11]");
    const int64_t* m = data<int64_t>(meta);
    TORCH_CHECK(m[3] >= 1 && m[4] >= 1 && m[5] >= 1 && m[5] <= m[3],
                "DecodeStack: GGUF experts need experts >= 1, a size >= 1, top_k in [1, experts]");
    return {m[3], m[4], m[5]};
  }

  // Stacked expert blocks, checked as moe_experts_gguf checks them, kept alive.
  GgufWeight stacked(const torch::Tensor& blocks, int64_t kind, int64_t E, int64_t rows,
                     int64_t cols, bool int8_activations, const char* what) {
    keep(blocks);
    return stacked_gguf_experts(blocks, kind, E, rows, cols, int8_activations, what);
  }

  RoutedMlp gguf_routed_mlp(const LinearSpec& router, const std::vector<torch::Tensor>& t,
                            int64_t hidden) {
    const auto [E, size, k] = gguf_experts_shape(t);
    keep(t[3]);
    const int64_t* m = data<int64_t>(t[3]);
    const bool int8 = m[8] != 0;
    RoutedMlp moe;
    moe.router = linear(router, E, hidden);
    moe.gguf = true;
    // As SparseMoE._gguf_experts_native calls moe_experts_gguf (use_amx at its default, its
    // small_rows), so both paths take the same kernels at every row count.
    const GgufWeight gate = stacked(t[0], m[0], E, size, hidden, int8, "DecodeStack experts gate");
    const GgufWeight up = stacked(t[1], m[1], E, size, hidden, int8, "DecodeStack experts up");
    const GgufWeight down = stacked(t[2], m[2], E, hidden, size, int8, "DecodeStack experts down");
    moe.gguf_experts = MoeGgufExperts{gate, up, down, E, hidden, size, m[10], true};
    moe.top_k = k;
    moe.normalize = m[6] != 0;
    moe.round_weights = m[7] != 0;
    moe.bytes_per_expert = m[9];
    return moe;
  }

  void keep(const torch::Tensor& t) { kept_.push_back(t); }

  void keep_vector(const torch::Tensor& t, int64_t size, const char* what) {
    TORCH_CHECK(t.is_contiguous() && t.numel() == size && t.scalar_type() == torch::kBFloat16,
                "DecodeStack: ", what, " must be contiguous bfloat16 [", size, "]");
    keep(t);
  }

  bf16* cache(const torch::Tensor& t) {
    TORCH_CHECK(t.dim() == 3 && t.is_contiguous() && t.scalar_type() == torch::kBFloat16 &&
                    t.size(0) == num_slots_ && t.size(0) % shape_.block_size == 0 &&
                    t.size(1) == shape_.num_kv_heads && t.size(2) == shape_.head_dim,
                "DecodeStack: caches must be contiguous bfloat16 [slots, kv_heads, head_dim]");
    keep(t);
    return data<bf16>(t);
  }

  SmallLinear linear(const LinearSpec& spec, int64_t out_features, int64_t in_features) {
    const auto& [kind, tensors] = spec;
    SmallLinear w;
    w.out_features = out_features;
    w.in_features = in_features;
    for (const auto& t : tensors) keep(t);
    if (kind == kGgufParts) return gguf_linear_of(tensors, w);
    if (kind == kTiles) return tiled_linear_of(tensors, w);
    TORCH_CHECK(kind == kDense, "DecodeStack: a linear's kind is -1 (dense), -2 (GGUF parts) or "
                "-3 (tiles), got ", kind);
    TORCH_CHECK(tensors.size() == 1, "DecodeStack: a dense linear is one weight tensor");
    const auto& weight = tensors[0];
    TORCH_CHECK(weight.is_contiguous() && weight.scalar_type() == torch::kBFloat16 &&
                    weight.dim() == 2 && weight.size(0) == out_features &&
                    weight.size(1) == in_features,
                "DecodeStack: dense weight must be contiguous bfloat16 [", out_features, ", ",
                in_features, "]");
    w.dense = data<bf16>(weight);
    return w;
  }

  static SmallLinear tiled_linear_of(const std::vector<torch::Tensor>& tensors, SmallLinear w) {
    const auto& packed = tensors[0];
    TORCH_CHECK(packed.is_contiguous() && packed.scalar_type() == torch::kBFloat16 &&
                    packed.size(0) * 16 == w.out_features && packed.size(1) * 32 == w.in_features &&
                    packed.size(2) == 16 && packed.size(3) == 16 && packed.size(4) == 2,
                "DecodeStack: tiled weight must be amx_pack_weight's layout of [", w.out_features,
                ", ", w.in_features, "]");
    w.tiles = data<bf16>(packed);
    return w;
  }

  static std::vector<std::array<int64_t, 3>> gguf_parts_of(const std::vector<torch::Tensor>& t) {
    TORCH_CHECK(!t.empty() && t[0].scalar_type() == torch::kInt64 && t[0].dim() == 2 &&
                    t[0].size(1) == 3 && t[0].is_contiguous() &&
                    t.size() == static_cast<size_t>(t[0].size(0)) + 1 && t[0].size(0) >= 1,
                "DecodeStack: GGUF parts are (int64 [P, 3] of (ggml type, rows, int8 "
                "activations), P blocks)");
    std::vector<std::array<int64_t, 3>> parts(t[0].size(0));
    const int64_t* p = data<int64_t>(t[0]);
    for (size_t i = 0; i < parts.size(); ++i) parts[i] = {p[3 * i], p[3 * i + 1], p[3 * i + 2]};
    return parts;
  }

  static SmallLinear gguf_linear_of(const std::vector<torch::Tensor>& tensors, SmallLinear w) {
    int64_t column = 0;
    const auto parts = gguf_parts_of(tensors);
    for (size_t i = 0; i < parts.size(); ++i) {
      const auto& [kind, rows, int8_activations] = parts[i];
      const torch::Tensor& blocks = tensors[i + 1];
      const int64_t row_bytes = gguf_row_bytes(static_cast<int>(kind), w.in_features);
      TORCH_CHECK(row_bytes > 0 && blocks.scalar_type() == torch::kUInt8 &&
                      blocks.is_contiguous() && blocks.numel() == rows * row_bytes,
                  "DecodeStack: GGUF part ", i, " must hold ", rows, " rows of ggml type ", kind,
                  " with ", w.in_features, " inputs");
      w.gguf.push_back({GgufWeight{static_cast<int>(kind), data<uint8_t>(blocks), rows,
                                   w.in_features, int8_activations != 0},
                        column});
      column += rows;
    }
    TORCH_CHECK(column == w.out_features, "DecodeStack: GGUF parts have ", column,
                " rows, expected ", w.out_features);
    return w;
  }

  static void check_rows(const torch::Tensor& t, int64_t rows, const char* what) {
    TORCH_CHECK(t.scalar_type() == torch::kInt64 && t.is_contiguous() && t.numel() == rows,
                "DecodeStack.run: ", what, " must be int64 [rows]");
  }

  std::vector<torch::Tensor> kept_;
  std::vector<DecodeLayer> layers_;
  DecodeStackShape shape_{};
  const bf16* final_norm_ = nullptr;
  int64_t max_positions_ = 0, num_slots_ = 0, max_rows_ = kSmallBatchRows;
};

}  // namespace

void bind_decode_stack(pybind11::module_& m) {
  pybind11::class_<DecodeStack>(m, "DecodeStack",
                                "a model's decoder layers for decode-only steps of 1 to max_rows rows")
      .def(pybind11::init<const std::vector<torch::Tensor>&, const std::vector<LinearSpec>&,
                          const std::vector<torch::Tensor>&, const std::vector<torch::Tensor>&,
                          const torch::Tensor&, const torch::Tensor&, int64_t, int64_t, int64_t,
                          double, double>())
      .def_property_readonly("max_rows", &DecodeStack::max_rows,
                             "8, or 16 when every linear is GGUF blocks and AMX is usable")
      .def("run", &DecodeStack::run,
           "embeddings [rows, hidden] of decode rows -> (final-normed hidden states, "
           "(layer, expert) pairs run, their experts' bytes)");
}

}  // namespace meterserve
