#pragma once

#include <pybind11/pybind11.h>

namespace torch_bigbatch::torus {

void bind_torus(pybind11::module& m);

}  // namespace torch_bigbatch::torus
