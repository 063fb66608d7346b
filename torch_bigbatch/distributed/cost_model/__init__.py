"""The alpha-beta cost model of allreduce algorithms (ring, NCCL's double binary tree, Goyal
et al.'s hierarchy, Mikami et al.'s torus and our pipelined torus), from one node to thousands
of GPUs.

  alpha_beta   the math: hardware presets, each algorithm's time, the projection; it imports
               only the standard library, nothing compiled;
  calibration  alpha and beta fitted to benchmarks/bench_allreduce.py's measurements;
  plot, cli    the figure and `python -m torch_bigbatch.distributed.cost_model`.
"""

from .alpha_beta import (ALGORITHMS, DEFAULT_SEGMENT_BYTES, PRESETS, RESNET50_GRADIENT_BYTES,
                         Hardware, allreduce_time, best_columns, best_segment_bytes, projection,
                         scaling_efficiency)
from .calibration import calibrate, fit_alpha_beta

__all__ = ["ALGORITHMS", "DEFAULT_SEGMENT_BYTES", "PRESETS", "RESNET50_GRADIENT_BYTES",
           "Hardware", "allreduce_time", "best_columns", "best_segment_bytes", "calibrate",
           "fit_alpha_beta", "projection", "scaling_efficiency"]
