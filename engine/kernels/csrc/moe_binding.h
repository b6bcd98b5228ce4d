// The Python function over moe_experts (moe_binding.cpp).
#pragma once

#include <torch/extension.h>

namespace meterserve {

void bind_moe(pybind11::module_& m);

}  // namespace meterserve
