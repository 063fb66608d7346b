// The Python module torch_bigbatch._C. Importing it also runs the op registrations of ops.cpp
// and the kernels; the module itself holds the classes of the torus backend and the SGD step's
// undispatched entry.

#include <torch/extension.h>

#include "optim/sgd_python.h"
#include "torus/torus_python.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // Whether the CUDA half (kernels and their glue) is linked in: setup.py builds it whenever
  // torch is a CUDA build, and the tests of that build check it is.
#ifdef TORCH_BIGBATCH_WITH_CUDA
  m.attr("WITH_CUDA") = true;
#else
  m.attr("WITH_CUDA") = false;
#endif
  torch_bigbatch::optim::bind_sgd(m);
  torch_bigbatch::torus::bind_torus(m);
}
