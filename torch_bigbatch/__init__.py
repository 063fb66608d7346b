"""torch_bigbatch: accurate, fast large-minibatch data-parallel training for PyTorch.

Goyal et al. 2017 and Mikami et al. 2018 as a PyTorch extension: a fused SGD/LARS optimizer
with the large-batch fixes, the "torus" c10d backend (a 2D-torus allreduce, registered on
import), local (ghost) BatchNorm with fused kernels, large-batch schedules, and, as they land, the
ResNet models, paper recipes and the torchrun job.
"""

import torch  # noqa: F401  (loads libtorch before the extension)

from . import _C  # noqa: F401  (importing it registers the torch_bigbatch ops)
from . import ops  # noqa: F401  (fake kernels for torch.compile)
from . import data, distributed, models, nn, optim, recipes, schedules

__version__ = "0.1.0"
__all__ = ["data", "distributed", "models", "nn", "optim", "recipes", "schedules"]
