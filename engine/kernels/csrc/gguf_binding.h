// The Python op over GGUF blocks (gguf_binding.cpp).
#pragma once

#include <torch/extension.h>

namespace meterserve {

void bind_gguf(pybind11::module_& m);

}  // namespace meterserve
