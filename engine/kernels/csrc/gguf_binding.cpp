// gguf_linear: checks, then the path for the number of rows (gguf_linear.h).
#include "gguf_binding.h"

#include "binding_checks.h"
#include "gguf_linear.h"

namespace meterserve {
namespace {

// x [M, K] @ w.T (+ bias) with w the ggml blocks of type `kind`, out_features rows of
// row_bytes(kind, K) bytes (any contiguous uint8 tensor of that many bytes: [N, row_bytes] or
// the file's flat bytes). Up to small_rows rows (at most 8) take the small-batch kernel (on
// AMX tiles above 4 rows), more rows the AMX tile kernel up to 32, then the panels.
// use_amx=False takes the AVX512-BF16 paths even where AMX is available (so both are testable
// on one machine). The tile kernel and the AMX panels give a row the same sums, so with
// small_rows=0 a row's result does not depend on M. int8_activations: the small-batch rows
// quantize x to int8 (gguf_int8.cpp); larger batches are unchanged.
torch::Tensor gguf_linear_op(const torch::Tensor& x, const torch::Tensor& blocks, int64_t kind,
                             int64_t out_features, const c10::optional<torch::Tensor>& bias,
                             bool use_amx, int64_t small_rows,
                             bool int8_activations) {
  TORCH_CHECK(x.dim() == 2 && x.size(0) >= 1 && x.scalar_type() == torch::kBFloat16 &&
                  x.is_contiguous(),
              "gguf_linear: x must be contiguous bfloat16 [M >= 1, K]");
  const int64_t M = x.size(0), K = x.size(1), N = out_features;
  const int64_t row_bytes = gguf_row_bytes(static_cast<int>(kind), K);
  TORCH_CHECK(row_bytes > 0, "gguf_linear: ggml type ", kind,
              " is not supported, or K = ", K, " is not a whole number of its blocks");
  TORCH_CHECK(N >= 1 && blocks.device().is_cpu() && blocks.scalar_type() == torch::kUInt8 &&
                  blocks.is_contiguous() && blocks.numel() == N * row_bytes,
              "gguf_linear: blocks must be contiguous uint8 holding out_features x ", row_bytes,
              " bytes");
  const bf16* bias_ptr = bias_data(bias, N, "gguf_linear");
  const GgufWeight w{static_cast<int>(kind), data<uint8_t>(blocks), N, K, int8_activations};
  auto out = torch::empty({M, N}, x.options());
  gguf_linear_rows(data<bf16>(x), w, bias_ptr, data<bf16>(out), M, use_amx, small_rows);
  return out;
}

}  // namespace

void bind_gguf(pybind11::module_& m) {
  m.def("gguf_linear", &gguf_linear_op,
        "x[M, K] @ w.T (+ bias), w = ggml blocks as stored (exact weights up to 4 rows, "
        "bf16-rounded above)",
        py::arg("x"), py::arg("blocks"), py::arg("kind"), py::arg("out_features"),
        py::arg("bias") = py::none(), py::arg("use_amx") = true,
        py::arg("small_rows") = kSmallBatchRows, py::arg("int8_activations") = false,
        py::call_guard<py::gil_scoped_release>());
}

}  // namespace meterserve
