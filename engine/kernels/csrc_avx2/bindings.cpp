// The AVX2 module's Python names (engine/kernels load_avx2_kernels); all release the GIL.
#include <torch/extension.h>

#include "gguf_avx2.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("gguf_matvec_f32", &avx2::gguf_matvec_f32,
        "x[M <= 8, K] float32 @ w.T (+ bias), w = ggml blocks as stored (exact weights)",
        py::arg("x"), py::arg("blocks"), py::arg("kind"), py::arg("out_features"),
        py::arg("bias") = py::none(), py::call_guard<py::gil_scoped_release>());
  m.def("gguf_panel_f32", &avx2::gguf_panel_f32,
        "x[M, K] float32 @ w.T (+ bias) for any M: weight panels dequantized once per call",
        py::arg("x"), py::arg("blocks"), py::arg("kind"), py::arg("out_features"),
        py::arg("bias") = py::none(), py::call_guard<py::gil_scoped_release>());
  m.def("gguf_dequantize_f32", &avx2::gguf_dequantize_f32,
        "float32 [N, K] from ggml blocks, equal to gguf-py's dequantize", py::arg("blocks"),
        py::arg("kind"), py::arg("rows"), py::arg("cols"),
        py::call_guard<py::gil_scoped_release>());
  m.def("gguf_matvec_int8", &avx2::gguf_matvec_int8,
        "x[M <= 8, K] float32 rounded to int8 per block @ w.T (+ bias), the stored codes in "
        "integers (EngineConfig.gguf_activations 'int8')",
        py::arg("x"), py::arg("blocks"), py::arg("kind"), py::arg("out_features"),
        py::arg("bias") = py::none(), py::call_guard<py::gil_scoped_release>());
  m.attr("max_rows") = avx2::kMaxRows;
}
