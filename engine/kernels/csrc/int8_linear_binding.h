// The Python functions over int8_linear (int8_linear_binding.cpp).
#pragma once

#include <torch/extension.h>

namespace meterserve {

void bind_int8_linear(pybind11::module_& m);

}  // namespace meterserve
