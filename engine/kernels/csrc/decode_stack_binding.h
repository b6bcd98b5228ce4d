// The Python class over decode_stack (decode_stack_binding.cpp).
#pragma once

#include <torch/extension.h>

namespace meterserve {

void bind_decode_stack(pybind11::module_& m);

}  // namespace meterserve
