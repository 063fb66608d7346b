"""Fused large-batch optimizers: SGD (drop-in for torch.optim.SGD), LARS, and the parameter
groups of Goyal et al. 2017."""

from .lars import LARS
from .param_groups import param_groups
from .sgd import SGD

__all__ = ["SGD", "LARS", "param_groups"]
