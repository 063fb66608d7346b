"""Fused SGD with momentum: torch.optim.SGD's update, in one kernel launch per device and dtype.

The kernel (torch.ops.torch_bigbatch.sgd_step_) takes the tensors of every parameter group at
once, so ResNet-50's 161 parameters are stepped by a single launch (torch's fused SGD packs at
most 48 tensors per launch with momentum). The same kernel serves LARS (see lars.py).
"""

import operator
import re

import torch
from torch.optim import Optimizer

from .. import _C

_SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_MOMENTUM_FORMS = ("torch", "goyal")
_NO_BUFFER, _FIRST_STEP, _UPDATE_BUFFER = range(3)  # how a launch treats momentum buffers
# State of buffers whose first step GradScaler may have skipped: a one-element float32 tensor,
# non-zero while every step of theirs was skipped, which the kernel reads on the device (so
# their next real step initialises them, as torch.optim.SGD's would, without a host sync).
# Under GradScaler the key stays in `state` once 0 (telling would take a sync); state_dict()
# and loading leave it out.
_PENDING = "first_step_pending"
_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)  # no __torch_function__ of their own


def _dispatcher_needed():
    """Whether the step must reach its kernel through torch's dispatcher (torch.ops) rather than
    directly (torch_bigbatch._C.sgd_step_, half the op's host cost for ResNet-50's 161 tensors,
    csrc/optim/sgd_python.cpp): while torch.compile traces it, and under the modes that see every
    op (FakeTensorMode, FlopCounterMode, __torch_function__ modes)."""
    return (torch.compiler.is_compiling() or torch._C._is_torch_function_mode_enabled()
            or torch._C._len_torch_dispatch_stack() > 0)


def _check_group(group):
    """torch.optim.SGD's checks (and messages), applied to every group, plus ours."""
    lr = group["lr"]
    if isinstance(lr, torch.Tensor) and lr.numel() != 1:
        raise ValueError("Tensor lr must be 1-element")
    if lr < 0.0:
        raise ValueError(f"Invalid learning rate: {lr}")
    if group["momentum"] < 0.0:
        raise ValueError(f"Invalid momentum value: {group['momentum']}")
    if group["weight_decay"] < 0.0:
        raise ValueError(f"Invalid weight_decay value: {group['weight_decay']}")
    if group["nesterov"] and (group["momentum"] <= 0 or group["dampening"] != 0):
        raise ValueError("Nesterov momentum requires a momentum and zero dampening")
    if group["differentiable"]:
        raise ValueError("torch_bigbatch's SGD and LARS do not support differentiable=True: "
                         "their fused kernel is not differentiable; use torch.optim.SGD for that")
    if group["momentum_form"] not in _MOMENTUM_FORMS:
        raise ValueError(
            f"Invalid momentum_form: {group['momentum_form']!r} (expected 'torch' or 'goyal')"
        )
    if _uncorrected_goyal(group) and isinstance(lr, torch.Tensor):
        raise ValueError(
            "momentum_form='goyal' with lr_correction=False needs a float lr, not a Tensor"
        )


def _uncorrected_goyal(group):
    return group["momentum_form"] == "goyal" and not group["lr_correction"]


def _momentum_scale(group):
    """The buffer-decay factor that makes torch's update follow Goyal et al.'s eq. (10).

    Eq. (10), as Caffe2 implements it, keeps v = lr * b and updates v <- mu * c * v + lr * g,
    p <- p - v, with the momentum correction c = lr_t / lr_{t-1}. In torch's buffer b = v / lr
    that is b <- mu * c * (lr_{t-1} / lr_t) * b + g: with the correction (the default) exactly
    torch's form, without it the factor lr_{t-1} / lr_t that the paper warns about. Keeping b
    in torch's meaning lets state dicts move between both forms and torch.optim.SGD.
    """
    if not _uncorrected_goyal(group):
        return 1.0
    lr, previous = float(group["lr"]), group.get("prev_lr")
    # A step at lr 0 has no velocity to rescale; keep the buffer as it is.
    return previous / lr if previous is not None and lr > 0 else 1.0


class _Launch:
    """The tensors of one kernel launch: one device, one dtype, one buffer mode."""

    def __init__(self, name, dtype, device, mode, pending):
        self.name = name  # the optimizer's class, for errors
        self.dtype, self.device = dtype, device  # of every parameter, when the launch was made
        self.device_index = -1 if device.index is None else device.index  # as get_device()
        self.mode = mode
        self.first_step = mode == _FIRST_STEP
        self.pending = pending  # the buffers' shared _PENDING flag, or None
        self.params, self.group_of_tensor = [], []
        # The kernel may be called directly (see _dispatcher_needed): a device of ours, and
        # every parameter and gradient a plain tensor (or nn.Parameter). Meta tensors, for
        # one, go to the op's fake kernel.
        self.direct = device.type in ("cpu", "cuda")
        self.indices = []  # of its parameters in the optimizer's, to pick a step's tensors
        self.grads, self.buffers = None, []  # a step's
        self.states = []  # a first step's: the parameters' state, where its buffers go

    def run(self, param_groups, **arguments):
        """The launch's kernel; an error names the parameter as param_groups does, not by its
        place in this launch (found only then: nothing extra on the step's path)."""
        step = (_C.sgd_step_ if self.direct and not _dispatcher_needed()
                else torch.ops.torch_bigbatch.sgd_step_)
        try:
            step(self.params, self.grads, self.buffers, self.group_of_tensor, **arguments)
        except (RuntimeError, ValueError, TypeError) as error:
            # A plan reused from a step with dense gradients does not look at their layout
            # again (one more attribute per gradient on every step): the op refuses it, in
            # the dispatcher's words.
            _refuse_sparse(self.name, self.grads)
            if any(p.dtype != self.dtype or p.device != self.device for p in self.params):
                raise _StalePlan from error
            def place(match):
                tensor = int(match.group(2))
                group = self.group_of_tensor[tensor]
                index = next(i for i, p in enumerate(param_groups[group]["params"])
                             if p is self.params[tensor])
                return f"{match.group(0)} (param_groups[{group}]['params'][{index}])"
            error.args = (re.sub(r"\b(params|grads|momentum_buffers)\[(\d+)\]", place,
                                 str(error), count=1),) + error.args[1:]
            raise


class _StalePlan(Exception):
    """A reused launch met a parameter converted in place (module.to(), p.data = ...) since
    its plan was made; the op refused the launch before touching any of its tensors."""


def _refuse_sparse(name, grads):
    if any(grad is not None and grad.is_sparse for grad in grads):
        raise RuntimeError(f"{name} does not support sparse gradients")


def _state_entries(states, key):
    return [None if state is None else state.get(key) for state in states]


class _LaunchPlan:
    """How a step's parameters go into launches, and what deciding that read: the parameters
    and their groups, the gradients' types (None where there is none), momentum on or off,
    which have a momentum buffer, and the state's flags of skipped first steps. A later step that reads the same (parameters
    and flags by identity) takes these launches, with its own gradients and buffers: the plan
    holds neither, so what the state drops is freed."""

    def __init__(self, optimizer, params, grads, buffers, pendings):
        groups = optimizer.param_groups
        self.params = params
        self.group_sizes = [len(group["params"]) for group in groups]
        self.momentum_on = [group["momentum"] != 0 for group in groups]
        self.grad_types = list(map(type, grads))
        self.has_buffer = [buffer is not None for buffer in buffers]
        self.pendings = pendings
        name = type(optimizer).__name__
        launches = {}
        group_of_param = (index for index, size in enumerate(self.group_sizes)
                          for _ in range(size))
        _refuse_sparse(name, grads)
        for i, (p, grad, group) in enumerate(zip(params, grads, group_of_param)):
            if grad is None:
                continue
            mode, pending = _NO_BUFFER, None
            if self.momentum_on[group]:
                mode = _UPDATE_BUFFER if self.has_buffer[i] else _FIRST_STEP
                pending = pendings[i]
            key = (p.dtype, p.device, mode, id(pending))
            launch = launches.get(key)
            if launch is None:
                if p.dtype not in _SUPPORTED_DTYPES:
                    raise TypeError(f"{name} supports float32, float16 and bfloat16 "
                                    f"parameters, got {p.dtype}")
                launch = launches[key] = _Launch(name, p.dtype, p.device, mode, pending)
            launch.params.append(p)
            launch.indices.append(i)
            launch.direct = launch.direct and type(p) in _PLAIN_TYPES and type(grad) is torch.Tensor
            launch.group_of_tensor.append(group)
        self.launches = list(launches.values())
        # A first step makes buffers: the next step reads another state. Flags of skipped
        # first steps are updated in place (_track_pending), so a plan that holds them fits on.
        self.reusable = not any(launch.first_step for launch in self.launches)

    def fits(self, groups, params, grads, buffers, pendings):
        """Whether a step that reads these would sort its parameters into the same launches."""
        return (len(params) == len(self.params)
                and all(map(operator.is_, params, self.params))
                and [len(group["params"]) for group in groups] == self.group_sizes
                and [group["momentum"] != 0 for group in groups] == self.momentum_on
                and list(map(type, grads)) == self.grad_types
                and [buffer is not None for buffer in buffers] == self.has_buffer
                and all(map(operator.is_, pendings, self.pendings))
                # A converted parameter would join another launch. With one launch the op
                # refuses the stale one before it steps anything (_StalePlan), so the common
                # single-dtype step reads no dtype or device here.
                and (len(self.launches) == 1 or all(
                    p.dtype is launch.dtype and p.get_device() == launch.device_index
                    for launch in self.launches for p in launch.params)))


def _skipped(found_inf, device):
    """A new float32 flag on `device`: 1 where GradScaler skips this step, else 0. GradScaler's
    found_inf sums its devices' flags (2 where two found infs); a pending flag kept at 0 or 1
    (_track_pending clamps it) cannot grow to inf over skipped steps, whose product with 0 was
    NaN: pending for ever."""
    return found_inf.ne(0).to(device=device, dtype=torch.float32)


class _FusedSGD(Optimizer):
    """The fused step shared by SGD and LARS; subclasses give the public constructor."""

    def __init__(self, params, defaults):
        # torch.optim.SGD's groups carry it, and torch's __setstate__ adds it to the defaults
        # of a copy: without it here a deepcopy's groups had a key the original's lacked.
        super().__init__(params, {"differentiable": False, **defaults})
        self._launch_plan = None  # the last step's, reused while it fits (_gather_launches)
        # torch.amp.GradScaler then hands grad_scale and found_inf to step() instead of
        # unscaling: the kernel unscales and skips the step on the device, without a sync.
        self._step_supports_amp_scaling = True

    def add_param_group(self, param_group):
        _check_group({**self.defaults, **param_group})
        super().add_param_group(param_group)  # torch's checks; its group's params are tensors
        params = self.param_groups[-1]["params"]
        # torch.optim warns and steps such a parameter twice; one launch would update it from
        # two threads (or blocks) at once, a race with no defined result.
        if len({id(p) for p in params}) != len(params):
            self.param_groups.pop()
            raise ValueError(f"{type(self).__name__}: a parameter group lists a parameter more "
                             "than once; list each parameter once")

    def load_state_dict(self, state_dict):
        """torch.optim's load; a saved group that lacks keys of ours (one of torch.optim.SGD's,
        or of SGD where this is LARS) keeps this group's values of them, not the defaults: LARS
        groups built by param_groups() keep their lars_exclude, SGD's their momentum_form."""
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) == len(self.param_groups):  # else torch's load names the mismatch
            state_dict = {**state_dict, "param_groups": [
                {**{key: group[key] for key in self.defaults if key in group}, **saved}
                for group, saved in zip(self.param_groups, saved_groups)]}
        super().load_state_dict(state_dict)

    def __setstate__(self, state):
        super().__setstate__(state)
        self._launch_plan = None
        # Not in torch's pickled state: a copy (copy.deepcopy, pickle) would otherwise leave
        # GradScaler to unscale on its own, with a host sync per step.
        self._step_supports_amp_scaling = True
        # Groups loaded from torch.optim.SGD (or an older version) lack our keys; one saved by
        # torch.optim.SGD(differentiable=True) steps here as the fused kernel steps, untracked.
        for group in self.param_groups:
            for key, value in self.defaults.items():
                group.setdefault(key, value)
            group["differentiable"] = False
        # Loading moved each pending flag to its parameter's dtype, one copy per parameter: keep
        # the ones still set as one float32 flag per device and dtype (a sync here, not in
        # step()). Per dtype too: a launch updates its flag in place once it ran, and another
        # launch reading the same flag after it would take its zero buffers for started ones.
        flags = {}
        for param_state in self.state.values():
            pending = param_state.pop(_PENDING, None)
            if pending is not None and pending.item() != 0:
                buffer = param_state.get("momentum_buffer", pending)  # the parameter's dtype
                param_state[_PENDING] = flags.setdefault(
                    (pending.device, buffer.dtype),
                    torch.ones((), dtype=torch.float32, device=pending.device))

    def _trust_coefficient(self, group):
        """LARS's coefficient for a group; 0 leaves its update unadapted."""
        return 0.0

    def _gather_launches(self, found_inf):
        # Runs at every step, so it reads as few tensor attributes as it can (the kernel's glue
        # checks every tensor's shape, dtype, strides and device in C++, at every step) and
        # sorts the parameters into launches again only when what the sorting read has changed:
        # for ResNet-50's 161 parameters sorting took about 135 of a step's 234 us on the host
        # (a 2-core Xeon), and a step on a GPU waits for its host (bench_optimizer.py).
        params = [p for group in self.param_groups for p in group["params"]]
        grads = [p.grad for p in params]
        states = list(map(self.state.get, params))
        buffers = _state_entries(states, "momentum_buffer")
        pendings = _state_entries(states, _PENDING)
        plan = self._launch_plan
        if plan is None or not plan.fits(self.param_groups, params, grads, buffers, pendings):
            self._buffers_follow_their_parameters(params, buffers)
            plan = _LaunchPlan(self, params, grads, buffers, pendings)
        # New momentum buffers only once every tensor has passed the plan's checks; they join
        # the state once their launch has run (see step). Such a plan, or one tracking skipped
        # first steps, serves one step: the state it read changes with it.
        self._launch_plan = plan if plan.reusable else None
        for launch in plan.launches:
            launch.grads = [grads[i] for i in launch.indices]
            if launch.mode == _UPDATE_BUFFER:
                launch.buffers = [buffers[i] for i in launch.indices]
            elif launch.first_step:
                # Their state before any launch runs: a state that is no defaultdict (as
                # torch.optim's) raises here, where no parameter has moved yet.
                launch.states = [self.state[p] for p in launch.params]
                launch.buffers = [torch.zeros_like(p) for p in launch.params]
                if found_inf is not None:  # this first step may be skipped on the device
                    launch.pending = _skipped(found_inf, launch.device)
        return plan.launches

    def _buffers_follow_their_parameters(self, params, buffers):
        """A parameter converted in place (module.to(), p.data = ...) leaves its momentum buffer
        in the old dtype or device, which the kernel refuses: converted as torch's
        load_state_dict converts state (torch.optim.SGD would step on with the old buffer).
        Only where the launches are sorted again, off the reused plan's path."""
        for i, (p, buffer) in enumerate(zip(params, buffers)):
            if buffer is not None and (buffer.dtype != p.dtype or buffer.device != p.device):
                buffers[i] = self.state[p]["momentum_buffer"] = buffer.to(p)

    def _group_lists(self, device, momentum_scales):
        lists = {key: [] for key in ("lr", "lr_tensor", "momentum", "momentum_scale",
                                     "dampening", "weight_decay", "nesterov", "maximize",
                                     "trust_coefficient", "trust_eps", "trust_clip")}
        for group, momentum_scale in zip(self.param_groups, momentum_scales):
            lr = group["lr"]
            if isinstance(lr, torch.Tensor) and lr.device == device:
                lists["lr"].append(0.0)
                lists["lr_tensor"].append(lr.to(torch.float32))
            else:
                lists["lr"].append(float(lr))
                lists["lr_tensor"].append(None)
            lists["momentum"].append(float(group["momentum"]))
            lists["momentum_scale"].append(momentum_scale)
            lists["dampening"].append(float(group["dampening"]))
            lists["weight_decay"].append(float(group["weight_decay"]))
            lists["nesterov"].append(bool(group["nesterov"]))
            lists["maximize"].append(bool(group["maximize"]))
            lists["trust_coefficient"].append(float(self._trust_coefficient(group)))
            lists["trust_eps"].append(float(group.get("eps", 0.0)))
            lists["trust_clip"].append(bool(group.get("clip", False)))
        return lists

    @torch.no_grad()
    def step(self, closure=None):
        """Perform a single optimization step.

        Args:
            closure (Callable, optional): A closure that reevaluates the model
                and returns the loss.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grad_scale = getattr(self, "grad_scale", None)
        found_inf = getattr(self, "found_inf", None)
        launches = self._gather_launches(found_inf)
        stepped = {index for launch in launches for index in launch.group_of_tensor}
        # A group without gradients takes no step: its previous LR stays (see _momentum_scale).
        momentum_scales = [_momentum_scale(group) if index in stepped else 1.0
                           for index, group in enumerate(self.param_groups)]
        try:
            self._run_launches(launches, momentum_scales, grad_scale, found_inf)
        except _StalePlan:  # nothing has stepped: sort the parameters again
            self._launch_plan = None
            self._run_launches(self._gather_launches(found_inf), momentum_scales, grad_scale,
                               found_inf)
        for index in stepped:  # once every launch ran: a step that raises leaves it as it was
            group = self.param_groups[index]
            if _uncorrected_goyal(group):
                group["prev_lr"] = float(group["lr"])
        return loss

    def _run_launches(self, launches, momentum_scales, grad_scale, found_inf):
        # The op checks a launch's tensors before it touches any: a launch that raises leaves
        # its parameters and their state as they were (launches of other dtypes or devices
        # that ran before it have stepped).
        try:
            for launch in launches:
                device = launch.device
                device_found_inf = None if found_inf is None else found_inf.to(device)
                launch.run(
                    self.param_groups,
                    **self._group_lists(device, momentum_scales),
                    grad_scale=None if grad_scale is None else grad_scale.to(device),
                    found_inf=device_found_inf,
                    first_step=launch.first_step,
                    first_step_pending=None if launch.first_step else launch.pending,
                )
                for param_state, buffer in zip(launch.states, launch.buffers):
                    param_state["momentum_buffer"] = buffer
                self._track_pending(launch, device_found_inf)
        finally:  # the launches kept for the next step keep no gradient or buffer alive
            for launch in launches:
                launch.grads, launch.buffers, launch.states = None, [], []

    def state_dict(self):
        """torch.optim's state dict, without the buffers whose every step GradScaler skipped so
        far (and their flags): torch.optim.SGD would take such a zero buffer for one that has
        started, and under dampening scale its first real step by (1 - dampening). Without
        them, either optimizer starts those buffers at their first real step."""
        state_dict = super().state_dict()
        still_pending = {}  # per flag (a launch's buffers share one): read once, a host sync
        for key, param_state in state_dict["state"].items():
            pending = param_state.get(_PENDING)
            if pending is None:
                continue
            param_state = {k: v for k, v in param_state.items() if k != _PENDING}  # a copy
            if id(pending) not in still_pending:
                still_pending[id(pending)] = pending.item() != 0
            if still_pending[id(pending)]:
                del param_state["momentum_buffer"]
            state_dict["state"][key] = param_state
        return state_dict

    def _track_pending(self, launch, found_inf):
        """After a launch: its buffers stay pending while every step of theirs is skipped."""
        if launch.pending is None:
            return
        if launch.first_step:  # the new buffers' flag: set while this step may be skipped
            for p in launch.params:
                self.state[p][_PENDING] = launch.pending
        elif found_inf is None:  # this step ran: no longer pending
            for p in launch.params:
                del self.state[p][_PENDING]
        else:  # pending only if this step was skipped too; in place: a kept plan holds it
            launch.pending.clamp_(max=found_inf)  # 0 or 1 stays 0 or 1; one op per step


class SGD(_FusedSGD):
    r"""Drop-in for torch.optim.SGD: the same arguments, groups, state dicts and update.

    Args:
        params: iterable of parameters or dicts defining parameter groups.
        lr (float or Tensor): learning rate (default: 1e-3); a one-element tensor on the
            parameters' device is read by the kernel, so a step can be captured in a CUDA graph.
        momentum, dampening, weight_decay, nesterov, maximize: as in torch.optim.SGD. Weight
            decay is always lr * wd * p inside the update, never a scale of the loss.
        momentum_form: "torch" (Goyal et al. eq. 9, torch.optim.SGD) or "goyal" (eq. 10 as
            Caffe2 implements it, v <- mu * c * v + lr * g, p <- p - v).
        lr_correction: apply the momentum correction c = lr_t / lr_{t-1} in the "goyal" form
            (default True), which makes both forms follow the same trajectory under any LR
            schedule; without it the "goyal" form drifts whenever the LR changes. (Without it,
            the previous LR is that of the group's previous step with gradients, also one that
            GradScaler skipped on the device: telling would take a host sync.)
        foreach, fused: accepted as torch.optim.SGD accepts them, and without effect: the step
            is always one fused kernel launch per device and dtype.
        differentiable: only False; the fused kernel is not differentiable by autograd (use
            torch.optim.SGD(differentiable=True) to differentiate through a step).
    """

    def __init__(self, params, lr=1e-3, momentum=0, dampening=0, weight_decay=0,
                 nesterov=False, *, maximize=False, foreach=None, differentiable=False,
                 fused=None, momentum_form="torch", lr_correction=True):
        super().__init__(params, {
            "lr": lr, "momentum": momentum, "dampening": dampening,
            "weight_decay": weight_decay, "nesterov": nesterov, "maximize": maximize,
            "momentum_form": momentum_form, "lr_correction": lr_correction,
            "foreach": foreach, "fused": fused, "differentiable": differentiable,
        })
