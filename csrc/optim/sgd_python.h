#pragma once
// torch_bigbatch._C.sgd_step_: the op's kernel called from Python without torch's dispatcher.

#include <pybind11/pybind11.h>

namespace torch_bigbatch::optim {

void bind_sgd(pybind11::module& m);

}  // namespace torch_bigbatch::optim
