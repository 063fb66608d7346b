"""Large-batch schedules: linear LR scaling, warmup and decay per iteration (LargeBatchLR),
and batch-size control with its distributed sampler. Label smoothing is torch's own:
torch.nn.CrossEntropyLoss(label_smoothing=0.1)."""

from .batch_size import BatchSizeSchedule, DistributedBatchSampler
from .large_batch_lr import LargeBatchLR
from .scaling import linear_scaling

__all__ = ["BatchSizeSchedule", "DistributedBatchSampler", "LargeBatchLR", "linear_scaling"]
