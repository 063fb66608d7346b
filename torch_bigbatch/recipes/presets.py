"""The papers' setups, scaled to the world size: n samples per rank, LR by the linear rule
(mlperf_lars fixes its global batch instead: a world size must divide it)."""

from .recipe import Recipe

# Goyal et al. 2017: kn = 8k on 256 GPUs in one hour, 23.74% top-1 error (23.60% at 256);
# section 5.1: gamma 0 in each residual block's last BatchNorm, the fc layer from N(0, 0.01).
goyal2017 = Recipe(
    name="goyal2017", epochs=90, batch_per_rank=32, base_lr=0.1, base_batch=256,
    optimizer="sgd", momentum=0.9, nesterov=True, weight_decay=1e-4,
    warmup="gradual", warmup_epochs=5, decay="step", milestones=(30, 60, 80), gamma=0.1,
    label_smoothing=0.0, bn_group_size=32, zero_init_residual=True, fc_init_std=0.01)

# Mikami et al. 2018 (Sony): batch-size control 34K -> 68K, label smoothing 0.1, warmup; their
# 2D-torus allreduce is the "torus" backend. The epoch of the switch (30) and the decay
# (polynomial, power 2) are this preset's choices: the paper's schedule is not public in full.
mikami2018 = Recipe(
    name="mikami2018", epochs=90, batch_per_rank=32, batch_growth=((30, 2),), base_lr=0.1,
    base_batch=256, optimizer="sgd", momentum=0.9, nesterov=True, weight_decay=1e-4,
    warmup="gradual", warmup_epochs=5, decay="poly", power=2.0, label_smoothing=0.1,
    bn_group_size=32, zero_init_residual=True)

# MLPerf Training v2.0 ResNet-50 (LARS): global batch 3264, lr 10.5, warmup 2 epochs,
# polynomial decay power 2, weight decay 5e-5, label smoothing 0.1, 37 epochs (the global
# batch is fixed: the ranks share it).
mlperf_lars = Recipe(
    name="mlperf_lars", epochs=37, global_batch=3264, base_lr=10.5, base_batch=3264,
    optimizer="lars", momentum=0.9, nesterov=False, weight_decay=5e-5, trust_coefficient=0.001,
    warmup="gradual", warmup_epochs=2, warmup_from_base_lr=False, decay="poly", power=2.0,
    label_smoothing=0.1, bn_group_size=32, zero_init_residual=True)

RECIPES = {recipe.name: recipe for recipe in (goyal2017, mikami2018, mlperf_lars)}


def get_recipe(name):
    """The preset called `name`; a ValueError lists the known ones."""
    if name not in RECIPES:
        raise ValueError(f"unknown recipe {name!r}; known recipes: {', '.join(RECIPES)}")
    return RECIPES[name]
