// The Python module torch_bigbatch._C. Importing it also runs the op registrations of ops.cpp
// and the kernels; the module itself holds the classes of the torus backend.

#include <torch/extension.h>

#include "torus/torus_python.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { torch_bigbatch::torus::bind_torus(m); }
