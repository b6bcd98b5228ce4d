// The AVX2 module's Python names (engine/kernels load_avx2_kernels); all release the GIL.
#include <torch/extension.h>

#include "avx2_kernels.h"

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
  m.def("paged_decode_attention_f32", &avx2::paged_decode_attention_f32,
        "out[decodes, heads, dim]: each decode row's attention over its own paged float32 K/V "
        "(sliding_window 0 and softcap 0: none)",
        py::arg("query"), py::arg("key_cache"), py::arg("value_cache"), py::arg("block_tables"),
        py::arg("context_lens"), py::arg("block_size"), py::arg("scale"),
        py::arg("sliding_window") = 0, py::arg("softcap") = 0.0,
        py::call_guard<py::gil_scoped_release>());
  const auto without_gil = py::call_guard<py::gil_scoped_release>();
  m.def("rms_norm", &avx2::rms_norm, "RMSNorm per row (float32)", without_gil);
  m.def("rms_norm_heads_", &avx2::rms_norm_heads_,
        "RMSNorm in place over num_heads heads of each row from first_column (Qwen3 q/k norms)",
        without_gil);
  m.def("add_rms_norm_", &avx2::add_rms_norm_, "residual += x; x = rms_norm(residual), in place",
        without_gil);
  m.def("silu_and_mul", &avx2::silu_and_mul, "silu(gate) * up over [..., 2 * inter]",
        without_gil);
  m.def("rotary_", &avx2::rotary_, "rotate-half RoPE in place on the first heads of each row",
        without_gil);
  m.attr("max_rows") = avx2::kMaxRows;
}
