// Bindings of the int8 linear kernels: check shapes and dtypes, quantize the activations into
// scratch, call int8_linear.
#include "int8_linear_binding.h"

#include "binding_checks.h"

namespace meterserve {
namespace {

// x bf16 [M, K] -> (x_q int8 [padded_rows, K], scales fp32 [M]); rows >= M are zero.
std::tuple<torch::Tensor, torch::Tensor> quantize(const torch::Tensor& x, int64_t padded_rows,
                                                  const c10::optional<torch::Tensor>& inv_smooth,
                                                  bool rotate) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kBFloat16, "x must be bfloat16 [M, K]");
  TORCH_CHECK(x.size(1) % (rotate ? 64 : 16) == 0,
              "int8: K must be a multiple of 16 (of 64 to rotate)");
  const float* smooth = nullptr;
  if (inv_smooth.has_value()) {
    TORCH_CHECK(inv_smooth->is_contiguous() && inv_smooth->scalar_type() == torch::kFloat32 &&
                    inv_smooth->numel() == x.size(1),
                "inv_smooth must be contiguous float32 [K]");
    smooth = data<float>(*inv_smooth);
  }
  const torch::Tensor rows = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1);
  auto x_q = torch::empty({padded_rows, K}, x.options().dtype(torch::kInt8));
  if (padded_rows > M) x_q.narrow(0, M, padded_rows - M).zero_();
  auto scales = torch::empty({M}, x.options().dtype(torch::kFloat32));
  quantize_rows(data<bf16>(rows), M, K, data<int8_t>(x_q), data<float>(scales), smooth, rotate);
  return {x_q, scales};
}

std::tuple<torch::Tensor, torch::Tensor> quantize_rows_op(
    const torch::Tensor& x, const c10::optional<torch::Tensor>& inv_smooth, bool rotate) {
  return quantize(x, x.size(0), inv_smooth, rotate);
}

torch::Tensor int8_linear_op(const torch::Tensor& x, const torch::Tensor& packed,
                             const torch::Tensor& scales, const torch::Tensor& row_sums,
                             const c10::optional<torch::Tensor>& bias, bool use_amx,
                             const c10::optional<torch::Tensor>& inv_smooth, bool rotate) {
  TORCH_CHECK(!use_amx || amx_int8_available(), "AMX-INT8 is not available to this process");
  TORCH_CHECK(packed.dim() == 5 && packed.scalar_type() == torch::kInt8 &&
                  packed.is_contiguous() && packed.size(2) == 16 && packed.size(3) == 16 &&
                  packed.size(4) == 4 && packed.size(0) % 2 == 0,
              "packed must be int8 [N / 16, K / 64, 16, 16, 4] with N % 32 == 0");
  TORCH_CHECK(x.dim() == 2, "x must be [M, K]");
  const int64_t M = x.size(0), K = x.size(1), N = packed.size(0) * 16;
  TORCH_CHECK(packed.size(1) * 64 == K, "int8_linear: K of x and weight differ");
  TORCH_CHECK(scales.is_contiguous() && scales.scalar_type() == torch::kFloat32 &&
                  scales.numel() == N,
              "scales must be contiguous float32 [N]");
  TORCH_CHECK(row_sums.is_contiguous() && row_sums.scalar_type() == torch::kInt32 &&
                  row_sums.numel() == N,
              "row_sums must be contiguous int32 [N]");
  const bf16* bias_ptr = bias_data(bias, N, "int8_linear");
  const bool tiles = use_amx && M > kSmallBatchRows;
  const int64_t padded_rows = tiles ? (M + 31) / 32 * 32 : M;
  auto [x_q, x_scales] = quantize(x, padded_rows, inv_smooth, rotate);
  auto out = torch::empty({M, N}, x.options());
  const Int8Weight weight{data<int8_t>(packed), data<float>(scales), data<int32_t>(row_sums)};
  int8_linear(data<int8_t>(x_q), data<float>(x_scales), weight, bias_ptr, data<bf16>(out), M,
              padded_rows, N, K, use_amx);
  return out;
}

}  // namespace

void bind_int8_linear(pybind11::module_& m) {
  const auto without_gil = py::call_guard<py::gil_scoped_release>();
  m.def("amx_int8_available", &amx_int8_available,
        "whether AMX-INT8 tiles are usable in this process");
  m.def("int8_quantize_rows", &quantize_rows_op,
        "bf16 [M, K] -> (int8 [M, K], fp32 scales [M]): symmetric per row, after the optional "
        "per-channel smoothing and 64-wide Hadamard rotation",
        py::arg("x"), py::arg("inv_smooth") = py::none(), py::arg("rotate") = false,
        without_gil);
  m.def("int8_linear", &int8_linear_op,
        "x[M, K] (bf16, quantized per row) @ int8 weight.T, dequantized (+ bias), bf16",
        py::arg("x"), py::arg("packed"), py::arg("scales"), py::arg("row_sums"),
        py::arg("bias"), py::arg("use_amx"), py::arg("inv_smooth") = py::none(),
        py::arg("rotate") = false, without_gil);
}

}  // namespace meterserve
