// Raw-pointer CPU kernels. No torch headers here: bindings.cpp checks shapes and dtypes, then
// calls these. Row-major throughout; `*_stride` arguments are in elements.
#pragma once

#include <cstdint>
#include <type_traits>

#include "gguf_linear.h"
#include "numeric.h"

namespace meterserve {

// The most rows the small-batch products take (MAX_SMALL_BATCH_ROWS in Python, the decode stack's
// limit for a GGUF model): up to here they are bound by streaming the weight, which they read
// once for all rows.
constexpr int64_t kSmallBatchRows = 8;

// fn(std::integral_constant<int, M>{}) with M = rows (1..kSmallBatchRows; more take 8): picks
// the instance of a kernel templated on its number of rows at run time.
template <class Fn>
void with_small_rows(int64_t rows, Fn&& fn) {
  switch (rows) {
    case 1: return fn(std::integral_constant<int, 1>{});
    case 2: return fn(std::integral_constant<int, 2>{});
    case 3: return fn(std::integral_constant<int, 3>{});
    case 4: return fn(std::integral_constant<int, 4>{});
    case 5: return fn(std::integral_constant<int, 5>{});
    case 6: return fn(std::integral_constant<int, 6>{});
    case 7: return fn(std::integral_constant<int, 7>{});
    default: return fn(std::integral_constant<int, 8>{});
  }
}

// out[m, n] = x[m, :] . weight[n, :] (+ bias[n]), m < M <= 8, K % 32 == 0; fp32 accumulate.
// Streams the weight once for all M rows: the decode-time matrix-vector product.
void small_batch_linear(const bf16* x, const bf16* weight, const bf16* bias, bf16* out,
                        int64_t M, int64_t N, int64_t K);

// small_batch_linear over a weight in amx_linear's tile layout (`packed`, below): the same sums
// up to fp32 summation order, so no CPU needs a row-major copy. N % 32 == 0, K % 32 == 0.
// Without AMX, 3-8 rows are vector_linear's.
void tile_small_linear(const bf16* x, const bf16* packed, const bf16* bias, bf16* out,
                       int64_t M, int64_t N, int64_t K);

// out[m, n] = x[m, :] . weight[n, :] (+ bias[n]), m < M (any M >= 0), over the same tile layout
// (`packed`, below) with AVX512-BF16 vector products: the large-batch path of a CPU without
// AMX. Each element is one fp32 sum over k in order, so a row's result does not depend on M.
void vector_linear(const bf16* x, const bf16* packed, const bf16* bias, bf16* out, int64_t M,
                   int64_t N, int64_t K);

// True once this process may use AMX tiles (Linux grants them on request).
bool amx_available();

// out[m, n] = x[m, :] . weight[n, :] (+ bias[n]) on AMX, m < M. x is [padded_rows, K] with
// padded_rows a multiple of 32 (rows >= M are zeros), N % 32 == 0, K % 32 == 0; `packed` is the
// weight in tiles: packed[n / 16][k / 32][(k % 32) / 2][n % 16][k % 2] = weight[n][k].
void amx_linear(const bf16* x, const bf16* packed, const bf16* bias, bf16* out, int64_t M,
                int64_t padded_rows, int64_t N, int64_t K);

// A mixture-of-experts layer's products in one call: group g = (expert, first_row, num_rows)
// multiplies rows [first_row, first_row + num_rows) of x by expert `expert`'s weight,
// out[r, n] = x[r, :] . weight_expert[n, :]: a group of more than 2 rows exactly as amx_linear
// computes them, of 1-2 rows by the vector product (which may differ in the last bit). x is
// [R + 32, K] (32 rows of padding after the last group's rows); packed is [E, ...] with each
// expert in amx_linear's tile layout; the groups' rows are disjoint. All groups share one
// parallel region, so the threads stream every expert's tiles back to back.
void amx_grouped_linear(const bf16* x, const bf16* packed, const int64_t* groups,
                        int64_t num_groups, bf16* out, int64_t N, int64_t K);

// amx_grouped_linear without AMX, over the same tile layout (N % 16 == 0, K % 32 == 0), x
// [R, K] with no padding: a group of more than 2 rows exactly as vector_linear computes them,
// of 1-2 rows as tile_small_linear does (vector_grouped_linear.cpp).
void vector_grouped_linear(const bf16* x, const bf16* weights, const int64_t* groups,
                           int64_t num_groups, bf16* out, int64_t N, int64_t K);

// One mixture-of-experts layer's experts: gate_up [E] of [2 inter, hidden] (gate rows, then up
// rows), down [E] of [hidden, inter], each in amx_linear's tile layout.
struct MoeExperts {
  const bf16* gate_up;
  const bf16* down;
  int64_t num_experts, hidden, inter;
};

// moe_experts' working memory for P = tokens * k pairs: rows [P + 32, hidden] and hidden
// [P + 32, inter] (32 rows of padding each, as amx_grouped_linear reads), gate_up_out
// [P, 2 inter], expert_out [P, hidden], order and position [P].
struct MoeScratch {
  bf16 *rows, *gate_up_out, *hidden, *expert_out;
  int64_t *order, *position;
};

// A router's picks: for each of `tokens` rows of logits [tokens, E], the k experts of largest
// softmax probability in descending order (the lower id first among equal ones) into picks
// [tokens, k], their probabilities into weights [tokens, k] (fp32), divided by their sum where
// `normalize`, rounded to bf16 precision where `round_weights` (moe_route.cpp).
void moe_route(const bf16* logits, int64_t tokens, int64_t E, int64_t k, bool normalize,
               bool round_weights, int64_t* picks, float* weights);

// out[t] = sum over j < k, in order, of weights[t, j] * expert picks[t, j] applied to x[t]
// (down(silu(gate(x)) * up(x)), each expert's rows as the grouped products compute them), fp32
// sum rounded once to bf16; round_products: each weighted product is first rounded to bf16.
// picks [tokens, k] in [0, num_experts); weights fp32 [tokens, k]. Returns how many distinct
// experts ran (the meter's bytes). See moe_experts.cpp.
int64_t moe_experts(const bf16* x, const int64_t* picks, const float* weights,
                    bool round_products, const MoeExperts& experts, int64_t tokens, int64_t k,
                    const MoeScratch& scratch, bf16* out);

// A GGUF file's experts as stored: gate and up [E * inter] rows of `hidden` weights, down
// [E * hidden] rows of `inter`, each one tensor of one ggml block type (expert e's rows are
// the e-th run of inter, or hidden, rows). small_rows, use_amx, int8_activations: as
// gguf_linear takes them.
struct MoeGgufExperts {
  GgufWeight gate, up, down;  // N = E * rows: all experts
  int64_t num_experts, hidden, inter;
  int64_t small_rows;
  bool use_amx;
};

// moe_experts over GGUF experts: the same sort, gather, silu_and_mul and weighted sum; each
// picked expert's rows through gguf_linear_rows (the path GGUFLinear takes for that many
// rows), gate and up as two products whose outputs are laid side by side as gate_up. scratch
// as moe_experts' (no padding rows needed); gate_up_out doubles as gate and up's outputs.
int64_t moe_experts_gguf(const bf16* x, const int64_t* picks, const float* weights,
                         bool round_products, const MoeGgufExperts& experts, int64_t tokens,
                         int64_t k, const MoeScratch& scratch, bf16* out);

// An int8 [N, K] weight (N % 32 == 0, K % 64 == 0) quantized per output channel, in the one
// layout both int8 paths read: packed[n / 16][k / 64][(k % 64) / 4][n % 16][k % 4] =
// weight[n][k] (AMX-INT8 B tiles, vpdpbusd operands); scales fp32 [N] (weight = packed *
// scale); row_sums int32 [N] = sum_k weight[n][k] (the vpdpbusd path's u8 offset correction).
struct Int8Weight {
  const int8_t* packed;
  const float* scales;
  const int32_t* row_sums;
};

// True once this process may use AMX-INT8 tiles (built with them, Linux granted them).
bool amx_int8_available();

// Per row m < M, the row's values v (fp32): x[m, k] * inv_smooth[k] when inv_smooth is given
// (SmoothQuant's per-channel division, fp32 multiply), then, when rotate, each 64-wide block
// transformed by the orthonormal Hadamard matrix (six butterfly stages a + b, a - b with
// strides 1, 2, 4, ..., 32, then * 0.125, the order of int8_linear.py's hadamard_blocks);
// scales[m] = max_k |v[k]| / 127, x_q[m, k] = round(v[k] * (127 / max)) clamped to
// [-127, 127], nearest even (0 and scale 0 for a zero row). K % 16 == 0 (K % 64 to rotate).
void quantize_rows(const bf16* x, int64_t M, int64_t K, int8_t* x_q, float* scales,
                   const float* inv_smooth = nullptr, bool rotate = false);

// out[m, n] = fma(float(sum_k x_q[m, k] weight[n, k]), x_scales[m] * scales[n], bias[n]) in
// bf16, m < M. use_amx: rows > kSmallBatchRows on AMX-INT8 tiles (x_q then [padded_rows, K],
// padded_rows a multiple of 32, padding rows zero); otherwise, and for any M without it,
// vpdpbusd. Both add the same exact int32 sums: the result is the same bits either way.
void int8_linear(const int8_t* x_q, const float* x_scales, const Int8Weight& weight,
                 const bf16* bias, bf16* out, int64_t M, int64_t padded_rows, int64_t N,
                 int64_t K, bool use_amx);

// out[r] = index of the first maximum of logits[r, 0:n] (n < 2^31).
template <typename T>
void argmax_rows(const T* logits, int64_t rows, int64_t n, int64_t* out);

// Sampling over rows `rows` of logits [*, vocab] after x = logit / temperature[r]; see
// sampling.cpp. top_candidates: max_out[r], sum_out[r] = sum of e^(x - max), and the k largest
// x (values_out [num_rows, k], ids_out) by descending x, ties by ascending id, -inf padded.
template <typename T>
void top_candidates(const T* logits, int64_t vocab, const int64_t* rows, int64_t num_rows,
                    const float* temperature, int64_t k, float* max_out, float* sum_out,
                    float* values_out, int64_t* ids_out);

// out[r] = an inverse-CDF draw with uniforms[r] over e^(x - max), weights below min_p[r] zeroed.
template <typename T>
void draw_whole(const T* logits, int64_t vocab, const int64_t* rows, int64_t num_rows,
                const float* temperature, const float* min_p, const double* uniforms,
                int64_t* out);

// x <- rms_norm(x) * weight per row of `hidden` elements (HF Llama rounding for bfloat16).
template <typename T>
void rms_norm(const T* x, const T* weight, T* out, int64_t rows, int64_t hidden, float eps);

// In place, each of the num_heads heads of head_dim elements from each row's start
// (row_stride apart): head <- rms_norm(head) * weight (Qwen3's q and k norms).
template <typename T>
void rms_norm_heads(T* x, int64_t row_stride, const T* weight, int64_t rows, int64_t num_heads,
                    int64_t head_dim, float eps);

// residual <- residual + x; x <- rms_norm(residual) * weight. Both in place, per row.
template <typename T>
void add_rms_norm(T* x, T* residual, const T* weight, int64_t rows, int64_t hidden, float eps);

// out[r, :] = silu(gate_up[r, :inter]) * gate_up[r, inter:], rounding after silu as torch does.
template <typename T>
void silu_and_mul(const T* gate_up, T* out, int64_t rows, int64_t inter);

// Rotate-half RoPE in place on `num_heads` heads of each row (HF convention, cos/sin tables
// [max_positions, head_dim] whose halves repeat).
template <typename T>
void rotary_inplace(T* x, int64_t row_stride, const int64_t* positions, const T* cos,
                    const T* sin, int64_t rows, int64_t num_heads, int64_t head_dim);

// cache[slots[i], :] = src[i, :] for `width` elements per row, for keys and values.
template <typename T>
void store_kv(const T* key, const T* value, int64_t src_stride, T* key_cache, T* value_cache,
              const int64_t* slots, int64_t rows, int64_t width);

// One query token per request over its paged context; see paged_attention.cpp.
// sliding_window W > 0: it sees the last W positions only; softcap c > 0: scores become
// c * tanh(scale * score / c). 0 turns either off.
template <typename T>
void paged_decode_attention(const T* query, int64_t query_stride, const T* key_cache,
                            const T* value_cache, const int64_t* block_tables,
                            int64_t max_blocks, const int64_t* context_lens, T* out,
                            int64_t num_decodes, int64_t num_heads, int64_t num_kv_heads,
                            int64_t head_dim, int64_t block_size, float scale,
                            int64_t sliding_window, float softcap);

// Causal attention of prefill chunks over the paged cache (their own keys already stored);
// spans [num_chunks, 3] = (query_start, query_len, start_position); out [sum query_len,
// num_heads, head_dim], chunks' rows in order. bf16, head_dim 64 or 128; sliding_window and
// softcap as in paged_decode_attention; see prefill_attention.cpp.
void paged_prefill_attention(const bf16* query, int64_t query_stride, const bf16* key_cache,
                             const bf16* value_cache, const int64_t* block_tables,
                             int64_t max_blocks, const int64_t* spans, int64_t num_chunks,
                             bf16* out, int64_t num_heads, int64_t num_kv_heads,
                             int64_t head_dim, int64_t block_size, float scale,
                             int64_t sliding_window, float softcap);

}  // namespace meterserve
