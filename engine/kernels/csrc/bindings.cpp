// Python bindings: check every tensor's dtype, shape and layout, then call the raw kernels.
// The binding files (bindings*.cpp) are the only ones that include torch; the kernels compile
// without it.
#include "binding_checks.h"
#include "decode_stack_binding.h"
#include "gguf_binding.h"
#include "gguf_linear.h"
#include "int8_linear_binding.h"
#include "moe_binding.h"

namespace meterserve {
namespace {

torch::Tensor small_batch_linear_op(const torch::Tensor& x, const torch::Tensor& weight,
                                    const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.size(0) >= 1 && x.size(0) <= kSmallBatchRows,
              "x must be [1..", kSmallBatchRows, ", K]");
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous(), "x and weight must be contiguous");
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16, "small_batch_linear is bfloat16 only");
  check_same_dtype(x, weight, "small_batch_linear");
  TORCH_CHECK(weight.dim() == 2 && weight.size(1) == x.size(1), "weight must be [N, K]");
  const bf16* bias_ptr = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->is_contiguous() && bias->numel() == weight.size(0), "bias must be [N]");
    check_same_dtype(x, *bias, "small_batch_linear bias");
    bias_ptr = data<bf16>(*bias);
  }
  auto out = torch::empty({x.size(0), weight.size(0)}, x.options());
  small_batch_linear(data<bf16>(x), data<bf16>(weight), bias_ptr, data<bf16>(out), x.size(0),
                     weight.size(0), x.size(1));
  return out;
}

torch::Tensor tile_small_linear_op(const torch::Tensor& x, const torch::Tensor& packed,
                                   const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.size(0) >= 1 && x.size(0) <= kSmallBatchRows &&
                  x.is_contiguous() && x.scalar_type() == torch::kBFloat16,
              "x must be contiguous bfloat16 [1..", kSmallBatchRows, ", K]");
  check_tiles(packed, x.size(1), "tile_small_linear");
  const int64_t M = x.size(0), K = x.size(1), N = packed.size(0) * 16;
  const bf16* bias_ptr = bias_data(bias, N, "tile_small_linear");
  auto out = torch::empty({M, N}, x.options());
  tile_small_linear(data<bf16>(x), data<bf16>(packed), bias_ptr, data<bf16>(out), M, N, K);
  return out;
}

torch::Tensor vector_linear_op(const torch::Tensor& x, const torch::Tensor& packed,
                               const c10::optional<torch::Tensor>& bias) {
  // M may be 0: a step whose rows all skip the LM head (prompt chunks that sample nothing).
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kBFloat16, "x must be bfloat16 [M, K]");
  check_tiles(packed, x.size(1), "vector_linear");
  const torch::Tensor rows = x.contiguous();
  const int64_t M = rows.size(0), K = rows.size(1), N = packed.size(0) * 16;
  const bf16* bias_ptr = bias_data(bias, N, "vector_linear");
  auto out = torch::empty({M, N}, x.options());
  vector_linear(data<bf16>(rows), data<bf16>(packed), bias_ptr, data<bf16>(out), M, N, K);
  return out;
}

// [N, K] bf16 -> the AMX tile layout amx_linear reads (N % 32 == 0, K % 32 == 0).
torch::Tensor amx_pack_weight_op(const torch::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == torch::kBFloat16,
              "weight must be bfloat16 [N, K]");
  const int64_t N = weight.size(0), K = weight.size(1);
  TORCH_CHECK(N % 32 == 0 && K % 32 == 0, "amx_pack_weight: N and K must be multiples of 32");
  // [n_tile, j, k_tile, r, p] -> [n_tile, k_tile, r, j, p]
  return weight.reshape({N / 16, 16, K / 32, 16, 2}).permute({0, 2, 3, 1, 4}).contiguous();
}

torch::Tensor amx_linear_op(const torch::Tensor& x, const torch::Tensor& packed,
                            const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(amx_available(), "AMX is not available to this process");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kBFloat16, "x must be bfloat16 [M, K]");
  check_tiles(packed, x.size(1), "amx_linear");
  const int64_t M = x.size(0), K = x.size(1), N = packed.size(0) * 16;
  const bf16* bias_ptr = bias_data(bias, N, "amx_linear");
  const int64_t padded_rows = (M + 31) / 32 * 32;
  torch::Tensor rows = x.contiguous();
  if (padded_rows != M) {
    rows = torch::zeros({padded_rows, K}, x.options());
    rows.narrow(0, 0, M).copy_(x);
  }
  auto out = torch::empty({M, N}, x.options());
  amx_linear(data<bf16>(rows), data<bf16>(packed), bias_ptr, data<bf16>(out), M, padded_rows, N,
             K);
  return out;
}

torch::Tensor amx_grouped_linear_op(const torch::Tensor& x, const torch::Tensor& packed,
                                    const torch::Tensor& groups) {
  TORCH_CHECK(amx_available(), "AMX is not available to this process");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kBFloat16 && x.is_contiguous(),
              "x must be contiguous bfloat16 [R, K]");
  check_expert_tiles(packed, x.size(1), "amx_grouped_linear");
  const int64_t K = x.size(1), N = packed.size(1) * 16;
  const int64_t rows = x.size(0) - 32;
  TORCH_CHECK(rows >= 0, "x needs 32 rows of padding after its last row");
  check_groups(groups, packed.size(0), rows);
  auto out = torch::empty({rows, N}, x.options());
  amx_grouped_linear(data<bf16>(x), data<bf16>(packed), data<int64_t>(groups), groups.size(0),
                     data<bf16>(out), N, K);
  return out;
}

torch::Tensor vector_grouped_linear_op(const torch::Tensor& x, const torch::Tensor& experts,
                                       const torch::Tensor& groups) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kBFloat16 && x.is_contiguous(),
              "x must be contiguous bfloat16 [R, K]");
  check_expert_tiles(experts, x.size(1), "vector_grouped_linear");
  check_groups(groups, experts.size(0), x.size(0));
  const int64_t N = experts.size(1) * 16;
  auto out = torch::empty({x.size(0), N}, x.options());
  vector_grouped_linear(data<bf16>(x), data<bf16>(experts), data<int64_t>(groups),
                        groups.size(0), data<bf16>(out), N, x.size(1));
  return out;
}

torch::Tensor argmax_rows_op(const torch::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.is_contiguous() && logits.size(1) > 0 &&
                  logits.size(1) < (int64_t(1) << 31),
              "logits must be contiguous [rows, vocab]");
  auto out = torch::empty({logits.size(0)}, logits.options().dtype(torch::kInt64));
  dispatch(logits, [&](auto tag) {
    using T = decltype(tag);
    argmax_rows<T>(data<T>(logits), logits.size(0), logits.size(1), data<int64_t>(out));
  });
  return out;
}

void check_sampling_rows(const torch::Tensor& logits, const torch::Tensor& rows,
                         const torch::Tensor& temperature) {
  TORCH_CHECK(logits.dim() == 2 && logits.is_contiguous() && logits.size(1) > 0 &&
                  logits.size(1) < (int64_t(1) << 31),
              "logits must be contiguous [rows, vocab]");
  TORCH_CHECK(rows.dim() == 1 && rows.scalar_type() == torch::kInt64 && rows.is_contiguous(),
              "rows must be int64 [R]");
  TORCH_CHECK(temperature.scalar_type() == torch::kFloat32 && temperature.is_contiguous() &&
                  temperature.numel() == rows.numel(),
              "temperature must be float32 [R]");
  check_indices(data<int64_t>(rows), rows.numel(), logits.size(0), "row index");
}

std::vector<torch::Tensor> top_candidates_op(const torch::Tensor& logits,
                                             const torch::Tensor& rows,
                                             const torch::Tensor& temperature, int64_t k) {
  check_sampling_rows(logits, rows, temperature);
  TORCH_CHECK(k >= 1 && k <= logits.size(1), "k must be in [1, vocab]");
  const int64_t n = rows.numel();
  auto f32 = logits.options().dtype(torch::kFloat32);
  auto max = torch::empty({n}, f32), sum = torch::empty({n}, f32);
  auto values = torch::empty({n, k}, f32);
  auto ids = torch::empty({n, k}, logits.options().dtype(torch::kInt64));
  dispatch(logits, [&](auto tag) {
    using T = decltype(tag);
    top_candidates<T>(data<T>(logits), logits.size(1), data<int64_t>(rows), n,
                      data<float>(temperature), k, data<float>(max), data<float>(sum),
                      data<float>(values), data<int64_t>(ids));
  });
  return {max, sum, values, ids};
}

torch::Tensor draw_whole_op(const torch::Tensor& logits, const torch::Tensor& rows,
                            const torch::Tensor& temperature, const torch::Tensor& min_p,
                            const torch::Tensor& uniforms) {
  check_sampling_rows(logits, rows, temperature);
  TORCH_CHECK(min_p.scalar_type() == torch::kFloat32 && min_p.is_contiguous() &&
                  min_p.numel() == rows.numel(),
              "min_p must be float32 [R]");
  TORCH_CHECK(uniforms.scalar_type() == torch::kFloat64 && uniforms.is_contiguous() &&
                  uniforms.numel() == rows.numel(),
              "uniforms must be float64 [R]");
  auto out = torch::empty({rows.numel()}, logits.options().dtype(torch::kInt64));
  dispatch(logits, [&](auto tag) {
    using T = decltype(tag);
    draw_whole<T>(data<T>(logits), logits.size(1), data<int64_t>(rows), rows.numel(),
                  data<float>(temperature), data<float>(min_p), data<double>(uniforms),
                  data<int64_t>(out));
  });
  return out;
}

torch::Tensor rms_norm_op(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous(), "rms_norm: contiguous inputs only");
  check_same_dtype(x, weight, "rms_norm");
  auto out = torch::empty_like(x);
  const int64_t hidden = x.size(-1);
  dispatch(x, [&](auto tag) {
    using T = decltype(tag);
    rms_norm<T>(data<T>(x), data<T>(weight), data<T>(out), x.numel() / hidden, hidden, eps);
  });
  return out;
}

// Heads [first_column / head_dim, + num_heads) of every row of x [rows, width], in place.
void rms_norm_heads_op(torch::Tensor& x, int64_t first_column, const torch::Tensor& weight,
                       int64_t num_heads, double eps) {
  check_row_major(x, "x");
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 1 && weight.is_contiguous(),
              "rms_norm_heads_: x must be [rows, width], weight [head_dim]");
  check_same_dtype(x, weight, "rms_norm_heads_");
  const int64_t head_dim = weight.numel();
  TORCH_CHECK(first_column >= 0 && num_heads >= 0 &&
                  first_column + num_heads * head_dim <= x.size(1),
              "rms_norm_heads_: heads past the end of the row");
  dispatch(x, [&](auto tag) {
    using T = decltype(tag);
    rms_norm_heads<T>(data<T>(x) + first_column, x.stride(0), data<T>(weight), x.size(0),
                      num_heads, head_dim, eps);
  });
}

void add_rms_norm_op(torch::Tensor& x, torch::Tensor& residual, const torch::Tensor& weight,
                     double eps) {
  TORCH_CHECK(x.is_contiguous() && residual.is_contiguous() && weight.is_contiguous(),
              "add_rms_norm: contiguous inputs only");
  TORCH_CHECK(x.sizes() == residual.sizes(), "add_rms_norm: x and residual shapes differ");
  check_same_dtype(x, residual, "add_rms_norm");
  check_same_dtype(x, weight, "add_rms_norm");
  const int64_t hidden = x.size(-1);
  dispatch(x, [&](auto tag) {
    using T = decltype(tag);
    add_rms_norm<T>(data<T>(x), data<T>(residual), data<T>(weight), x.numel() / hidden, hidden,
                    eps);
  });
}

torch::Tensor silu_and_mul_op(const torch::Tensor& gate_up) {
  TORCH_CHECK(gate_up.is_contiguous() && gate_up.size(-1) % 2 == 0,
              "silu_and_mul: contiguous [..., 2 * intermediate] input");
  const int64_t inter = gate_up.size(-1) / 2;
  auto sizes = gate_up.sizes().vec();
  sizes.back() = inter;
  auto out = torch::empty(sizes, gate_up.options());
  dispatch(gate_up, [&](auto tag) {
    using T = decltype(tag);
    silu_and_mul<T>(data<T>(gate_up), data<T>(out), gate_up.numel() / (2 * inter), inter);
  });
  return out;
}

void rotary_op(torch::Tensor& x, const torch::Tensor& positions, const torch::Tensor& cos,
               const torch::Tensor& sin, int64_t num_heads, int64_t head_dim) {
  check_row_major(x, "rotary x");
  TORCH_CHECK(x.dim() == 2 && x.size(1) >= num_heads * head_dim, "rotary: x must be [rows, >= heads * dim]");
  TORCH_CHECK(positions.scalar_type() == torch::kInt64 && positions.is_contiguous() &&
                  positions.numel() == x.size(0),
              "rotary: positions must be int64 [rows]");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.size(-1) == head_dim,
              "rotary: cos/sin must be contiguous [positions, head_dim]");
  check_same_dtype(x, cos, "rotary");
  check_same_dtype(x, sin, "rotary");
  dispatch(x, [&](auto tag) {
    using T = decltype(tag);
    rotary_inplace<T>(data<T>(x), x.stride(0), data<int64_t>(positions), data<T>(cos),
                      data<T>(sin), x.size(0), num_heads, head_dim);
  });
}

void store_kv_op(const torch::Tensor& key, const torch::Tensor& value, torch::Tensor& key_cache,
                 torch::Tensor& value_cache, const torch::Tensor& slots) {
  check_row_major(key, "key");
  check_row_major(value, "value");
  TORCH_CHECK(key.dim() == 2 && value.sizes() == key.sizes() && key.stride(0) == value.stride(0),
              "store_kv: key and value must be [rows, width] with equal strides");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(key_cache.numel() / key_cache.size(0) == key.size(1), "store_kv: width mismatch");
  TORCH_CHECK(slots.scalar_type() == torch::kInt64 && slots.numel() == key.size(0),
              "store_kv: slots must be int64 [rows]");
  TORCH_CHECK(slots.is_contiguous(), "store_kv: slots must be contiguous");
  check_indices(data<int64_t>(slots), slots.numel(), key_cache.size(0), "store_kv slot");
  check_same_dtype(key, key_cache, "store_kv");
  dispatch(key, [&](auto tag) {
    using T = decltype(tag);
    store_kv<T>(data<T>(key), data<T>(value), key.stride(0), data<T>(key_cache),
                data<T>(value_cache), data<int64_t>(slots), key.size(0), key.size(1));
  });
}

// sliding_window and softcap: 0 turns either off.
void check_scoring(int64_t sliding_window, double softcap, const char* op) {
  TORCH_CHECK(sliding_window >= 0, op, ": sliding_window must be >= 0 (0: none)");
  TORCH_CHECK(std::isfinite(softcap) && softcap >= 0, op, ": softcap must be >= 0 (0: none)");
}

torch::Tensor paged_decode_attention_op(const torch::Tensor& query, const torch::Tensor& key_cache,
                                        const torch::Tensor& value_cache,
                                        const torch::Tensor& block_tables,
                                        const torch::Tensor& context_lens, int64_t block_size,
                                        double scale, int64_t sliding_window, double softcap) {
  check_scoring(sliding_window, softcap, "paged_decode_attention");
  TORCH_CHECK(query.dim() == 3 && query.stride(2) == 1 && query.stride(1) == query.size(2),
              "query must be [decodes, heads, dim] with contiguous heads");
  TORCH_CHECK(key_cache.dim() == 3 && key_cache.is_contiguous() && value_cache.is_contiguous(),
              "caches must be contiguous [slots, kv_heads, dim]");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt64 && block_tables.is_contiguous() &&
                  block_tables.dim() == 2 && block_tables.size(0) == query.size(0),
              "block_tables must be int64 [decodes, max_blocks]");
  TORCH_CHECK(context_lens.scalar_type() == torch::kInt64 && context_lens.is_contiguous() &&
                  context_lens.numel() == query.size(0),
              "context_lens must be int64 [decodes]");
  const int64_t num_heads = query.size(1), num_kv_heads = key_cache.size(1);
  TORCH_CHECK(num_heads % num_kv_heads == 0, "heads must be a multiple of kv heads");
  TORCH_CHECK(query.size(2) % 16 == 0 && query.size(2) <= 256,
              "paged_decode_attention needs head_dim a multiple of 16, at most 256");
  check_same_dtype(query, key_cache, "paged_decode_attention");
  check_same_dtype(query, value_cache, "paged_decode_attention");
  const int64_t num_blocks = key_cache.size(0) / block_size;
  check_indices(data<int64_t>(block_tables), block_tables.numel(), num_blocks, "block id");
  check_indices(data<int64_t>(context_lens), context_lens.numel(),
                block_tables.size(1) * block_size + 1, "context length");
  auto out = torch::empty({query.size(0), num_heads, query.size(2)}, query.options());
  dispatch(query, [&](auto tag) {
    using T = decltype(tag);
    paged_decode_attention<T>(data<T>(query), query.stride(0), data<T>(key_cache),
                              data<T>(value_cache), data<int64_t>(block_tables),
                              block_tables.size(1), data<int64_t>(context_lens), data<T>(out),
                              query.size(0), num_heads, num_kv_heads, query.size(2), block_size,
                              scale, sliding_window, static_cast<float>(softcap));
  });
  return out;
}

torch::Tensor paged_prefill_attention_op(const torch::Tensor& query,
                                         const torch::Tensor& key_cache,
                                         const torch::Tensor& value_cache,
                                         const torch::Tensor& block_tables,
                                         const torch::Tensor& spans, int64_t block_size,
                                         double scale, int64_t sliding_window, double softcap) {
  check_scoring(sliding_window, softcap, "paged_prefill_attention");
  TORCH_CHECK(query.scalar_type() == torch::kBFloat16, "paged_prefill_attention is bfloat16 only");
  TORCH_CHECK(query.dim() == 3 && query.stride(2) == 1 && query.stride(1) == query.size(2),
              "query must be [tokens, heads, dim] with contiguous heads");
  TORCH_CHECK(query.size(2) == 64 || query.size(2) == 128,
              "paged_prefill_attention needs head_dim 64 or 128");
  TORCH_CHECK(key_cache.dim() == 3 && key_cache.is_contiguous() && value_cache.is_contiguous() &&
                  value_cache.sizes() == key_cache.sizes() && key_cache.size(2) == query.size(2),
              "caches must be contiguous [slots, kv_heads, dim]");
  check_same_dtype(query, key_cache, "paged_prefill_attention");
  check_same_dtype(query, value_cache, "paged_prefill_attention");
  const int64_t num_heads = query.size(1), num_kv_heads = key_cache.size(1);
  TORCH_CHECK(num_heads % num_kv_heads == 0, "heads must be a multiple of kv heads");
  TORCH_CHECK(spans.scalar_type() == torch::kInt64 && spans.is_contiguous() && spans.dim() == 2 &&
                  spans.size(1) == 3,
              "spans must be int64 [chunks, 3]");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt64 && block_tables.is_contiguous() &&
                  block_tables.dim() == 2 && block_tables.size(0) == spans.size(0),
              "block_tables must be int64 [chunks, max_blocks]");
  const int64_t num_blocks = key_cache.size(0) / block_size;
  check_indices(data<int64_t>(block_tables), block_tables.numel(), num_blocks, "block id");
  const int64_t* span = data<int64_t>(spans);
  int64_t rows = 0;
  for (int64_t i = 0; i < spans.size(0); ++i, span += 3) {
    TORCH_CHECK(span[0] >= 0 && span[1] >= 1 && span[2] >= 0 && span[0] + span[1] <= query.size(0),
                "chunk ", i, " lies outside the query rows");
    TORCH_CHECK(span[2] + span[1] <= block_tables.size(1) * block_size,
                "chunk ", i, "'s context exceeds its block table");
    rows += span[1];
  }
  auto out = torch::empty({rows, num_heads, query.size(2)}, query.options());
  paged_prefill_attention(data<bf16>(query), query.stride(0), data<bf16>(key_cache),
                          data<bf16>(value_cache), data<int64_t>(block_tables),
                          block_tables.size(1), data<int64_t>(spans), spans.size(0),
                          data<bf16>(out), num_heads, num_kv_heads, query.size(2), block_size,
                          static_cast<float>(scale), sliding_window, static_cast<float>(softcap));
  return out;
}

}  // namespace
}  // namespace meterserve

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace meterserve;
  // Every op but amx_available runs without the GIL, so the HTTP thread can parse, tokenize and
  // answer /health while a step computes. pybind11 converts the arguments with the GIL held,
  // releases it around the C++ call, and retakes it before wrapping the returned tensor (or
  // raising a TORCH_CHECK error). Safe because the ops read and write tensor memory only: no
  // Python objects, no callbacks; ATen allocation and torch ops need no GIL. The ops keep no
  // shared state (AMX permission is a thread-safe static, scratch space is thread_local), so
  // two threads may call them at once. amx_available keeps the GIL: it returns a cached bool.
  const auto without_gil = py::call_guard<py::gil_scoped_release>();
  m.def("small_batch_linear", &small_batch_linear_op, "x[M<=8,K] @ weight[N,K].T (+ bias), bf16",
        without_gil);
  m.def("amx_available", &amx_available, "whether AMX tiles are usable in this process");
  m.def("tile_small_linear", &tile_small_linear_op,
        "x[M<=8,K] @ weight.T (+ bias) over the amx_pack_weight layout, bf16", without_gil);
  m.def("vector_linear", &vector_linear_op,
        "x[M,K] @ weight.T (+ bias) over the amx_pack_weight layout, AVX512-BF16, bf16",
        without_gil);
  m.def("amx_pack_weight", &amx_pack_weight_op, "bf16 [N, K] -> AMX tile layout", without_gil);
  m.def("amx_linear", &amx_linear_op, "x[M, K] @ weight.T (+ bias) on AMX tiles, bf16",
        without_gil);
  m.def("amx_grouped_linear", &amx_grouped_linear_op,
        "groups of rows of x @ their expert's weight.T on AMX tiles (a MoE layer's experts)",
        without_gil);
  m.def("vector_grouped_linear", &vector_grouped_linear_op,
        "groups of rows of x @ their expert's weight.T (tile layout), AVX512-BF16 (no AMX)",
        without_gil);
  m.def("argmax_rows", &argmax_rows_op, "first-maximum argmax of each row", without_gil);
  m.def("top_candidates", &top_candidates_op,
        "per row after temperature: max, sum of e^(x - max), the k largest x and ids",
        without_gil);
  m.def("draw_whole", &draw_whole_op, "inverse-CDF draw over the whole vocabulary, min_p",
        without_gil);
  m.def("rms_norm", &rms_norm_op, "RMSNorm per row, HF rounding", without_gil);
  m.def("rms_norm_heads_", &rms_norm_heads_op,
        "RMSNorm in place over num_heads heads of each row from first_column (Qwen3 q/k norms)",
        without_gil);
  m.def("add_rms_norm_", &add_rms_norm_op, "residual += x; x = rms_norm(residual), in place",
        without_gil);
  m.def("silu_and_mul", &silu_and_mul_op, "silu(gate) * up over [..., 2 * inter]", without_gil);
  m.def("rotary_", &rotary_op, "rotate-half RoPE in place on the first heads of each row",
        without_gil);
  m.def("store_kv_", &store_kv_op, "write key/value rows into cache slots", without_gil);
  m.def("paged_decode_attention", &paged_decode_attention_op,
        "decode attention over the paged cache (sliding_window, softcap: 0 = none)",
        py::arg("query"), py::arg("key_cache"), py::arg("value_cache"), py::arg("block_tables"),
        py::arg("context_lens"), py::arg("block_size"), py::arg("scale"),
        py::arg("sliding_window") = 0, py::arg("softcap") = 0.0, without_gil);
  m.def("paged_prefill_attention", &paged_prefill_attention_op,
        "causal prefill attention of chunks over the paged cache, bf16 (sliding_window, "
        "softcap: 0 = none)",
        py::arg("query"), py::arg("key_cache"), py::arg("value_cache"), py::arg("block_tables"),
        py::arg("spans"), py::arg("block_size"), py::arg("scale"),
        py::arg("sliding_window") = 0, py::arg("softcap") = 0.0, without_gil);
  m.attr("MAX_SMALL_BATCH_ROWS") = kSmallBatchRows;  // the decode stack of a GGUF model
  m.attr("GGUF_TILE_ROWS") = kGgufTileRows;  // the decode stack's limit on the GGUF tiles
  m.attr("GGUF_WIDE_TILE_ROWS") = kGgufWideTileRows;  // gguf_linear's AMX tiles take this many
  bind_decode_stack(m);  // DecodeStack.run releases the GIL itself, after its checks
  bind_gguf(m);          // gguf_linear (gguf_binding.cpp)
  bind_int8_linear(m);
  bind_moe(m);  // moe_experts (moe_binding.cpp)
}
