"""LARS (You et al. 2017): SGD whose step for each tensor is scaled by a trust ratio.

lr_local = lr * trust_coefficient * |p| / (|g| + weight_decay * |p| + eps), with the ratio 1
where either norm is 0, optionally clipped at 1, and groups marked lars_exclude=True (biases
and normalization parameters, see param_groups) left unadapted. The norms come from a fused
multi-tensor kernel on the parameters' device: no host synchronization.
"""

from .sgd import _FusedSGD


class LARS(_FusedSGD):
    """torch.optim.SGD's arguments, plus trust_coefficient (default 0.001), eps (default 1e-8)
    and clip (clip the trust ratio at 1, default False). A group with lars_exclude=True is
    stepped as plain SGD."""

    def __init__(self, params, lr=1e-3, momentum=0, dampening=0, weight_decay=0,
                 nesterov=False, *, trust_coefficient=0.001, eps=1e-8, clip=False,
                 maximize=False, foreach=None, differentiable=False, fused=None,
                 momentum_form="torch", lr_correction=True):
        super().__init__(params, {
            "lr": lr, "momentum": momentum, "dampening": dampening,
            "weight_decay": weight_decay, "nesterov": nesterov, "maximize": maximize,
            "momentum_form": momentum_form, "lr_correction": lr_correction,
            "foreach": foreach, "fused": fused, "differentiable": differentiable,
            "trust_coefficient": trust_coefficient, "eps": eps, "clip": clip,
            "lars_exclude": False,
        })

    def add_param_group(self, param_group):
        group = {**self.defaults, **param_group}
        if not group["trust_coefficient"] > 0.0:  # 0 reads "not adapted" in the kernel; NaN too
            raise ValueError(f"Invalid trust_coefficient value: {group['trust_coefficient']} "
                             "(it must be positive; lars_exclude=True steps a group as plain SGD)")
        if not group["eps"] >= 0.0:  # NaN too
            raise ValueError(f"Invalid eps value: {group['eps']}")
        super().add_param_group(param_group)

    def _trust_coefficient(self, group):
        return 0.0 if group["lars_exclude"] else group["trust_coefficient"]
