"""Paper presets for large-batch ResNet training: goyal2017, mikami2018, mlperf_lars."""

from .presets import RECIPES, get_recipe, goyal2017, mikami2018, mlperf_lars
from .recipe import Recipe

__all__ = ["RECIPES", "Recipe", "get_recipe", "goyal2017", "mikami2018", "mlperf_lars"]
