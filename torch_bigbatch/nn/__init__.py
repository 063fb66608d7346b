"""Layers and model surgery for large-batch training: local (ghost) BatchNorm."""

from .conversion import convert_local_batchnorm, zero_init_last_bn
from .local_batchnorm import (LocalBatchNorm, LocalBatchNorm1d, LocalBatchNorm2d,
                              LocalBatchNorm3d, local_batch_norm)

__all__ = ["LocalBatchNorm", "LocalBatchNorm1d", "LocalBatchNorm2d", "LocalBatchNorm3d",
           "convert_local_batchnorm", "local_batch_norm", "zero_init_last_bn"]
