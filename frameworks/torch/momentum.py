"""The PyTorch optimizers' settings, handed to the pipeline's takeover (``grace.takeover``):
``torch.optim.SGD``'s momentum, Adam's and AdamW's ``betas[0]``, and, for random-k, Adam's
second moment. ``OptimizerTakeover`` is what ``DistributedOptimizer`` keeps of it: which setting
was taken, the parameters whose update the compression gives, and how the optimizer then steps
(its momentum set aside for its step, those parameters stepped by their updates). A DDP hook
never sees the optimizer: there the compressor's own arguments apply."""

from __future__ import annotations

import warnings
from contextlib import contextmanager
from typing import Callable, Iterable

import torch

from frameworks.process_set import log_once
from frameworks.torch.ops import TorchOps
from grace.momentum import OptimizerMomentum
from grace.pipeline import Pipeline

_OPS = TorchOps()


def _one_value(optimizer, key: str):
    """A param-group setting that must be the same in every group for grace to take it over."""
    values = {repr(group[key]) for group in optimizer.param_groups}
    if len(values) > 1:
        raise ValueError(f"{type(optimizer).__name__}'s {key} differs between param groups "
                         f"({', '.join(sorted(values))}); the compression applies one momentum to "
                         f"every tensor: use one value")
    return optimizer.param_groups[0][key]


def optimizer_momentum(optimizer) -> tuple[OptimizerMomentum, bool] | None:
    """The momentum ``torch.optim.SGD`` (or Adam's ``betas[0]``) would apply, as its settings say
    now, and whether it is Adam's."""
    if isinstance(optimizer, torch.optim.SGD):
        return OptimizerMomentum(float(_one_value(optimizer, "momentum")),
                                 bool(_one_value(optimizer, "nesterov")),
                                 float(_one_value(optimizer, "dampening")),
                                 "torch.optim.SGD's momentum"), False
    if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        beta1 = float(_one_value(optimizer, "betas")[0])
        return OptimizerMomentum(beta1, dampening=beta1,
                                 source=f"torch.optim.{type(optimizer).__name__}'s betas[0]"), True
    return None


def adam_settings(optimizer) -> tuple[float, float]:
    """Adam's ``betas[1]`` and ``eps``, one value each for every param group."""
    return float(_one_value(optimizer, "betas")[1]), float(_one_value(optimizer, "eps"))


class OptimizerTakeover:
    """What ``optimizer`` (the wrapped one) handed ``pipeline``: ``taken`` ("sgd", "adam" or
    ``None``), and, where random-k took Adam's moments over, ``steps_itself``, the parameters whose
    update comes out of the exchange, which ``step`` steps by the learning rate while the optimizer
    steps the others."""

    def __init__(self, optimizer, pipeline: Pipeline):
        self.optimizer = optimizer
        self.pipeline = pipeline
        self.taken: str | None = None
        self.steps_itself: set = set()
        self._group_of: dict = {}  # parameter -> its param group, as the groups are this step
        self._updates_given: dict = {}  # parameter -> its update and version after synchronize()
        self._warned_updates_changed = False

    def take(self, params: Iterable[torch.Tensor], averaged: bool, process_set) -> None:
        """Hand ``torch.optim.SGD``'s momentum (or Adam's ``betas[0]``, and for random-k Adam's
        moments) to a compression that applies it itself (see ``grace.momentum``), each change
        logged once on rank 0. ``params``: the parameters the wrapper exchanges; ``averaged``:
        whether their gradients are averaged as they are (``hvd.Average``, no predivide factor)."""
        momentum = optimizer_momentum(self.optimizer)
        if momentum is None:
            return
        found, adam = momentum
        optimizer = self.optimizer
        if adam:
            self._take_adam_moments(params, averaged, process_set)
            log_once(self.pipeline.adam_caution(f"torch.optim.{type(optimizer).__name__}"),
                     process_set)
        line = self.pipeline.take_momentum(found, adam=adam)
        log_once(line, process_set)
        self.taken = None if line is None else "adam" if adam else "sgd"

    def _take_adam_moments(self, params, averaged: bool, process_set) -> None:
        """AMSGrad keeps its own moments (its running maximum is Adam's to keep)."""
        optimizer = self.optimizer
        if not isinstance(optimizer, torch.optim.Adam) or any(
                group.get("amsgrad", False) for group in optimizer.param_groups):
            return
        log_once(self.pipeline.take_adam_moments(*adam_settings(optimizer), averaged=averaged),
                 process_set)
        self.steps_itself = {p for p in params
                             if self.pipeline.steps_itself(tuple(p.shape), _OPS.dtype(p), _OPS)}

    def retake(self) -> None:
        """The momentum taken over, as the optimizer's settings say now (rank 0's after
        hvd.broadcast_optimizer_state, the saved ones after load_state_dict, a scheduler's)."""
        if self.taken is not None:
            self.pipeline.retake_momentum(optimizer_momentum(self.optimizer)[0])
        if self.steps_itself:
            self.pipeline.take_adam_moments(*adam_settings(self.optimizer))
            self._group_of = {p: group for group in self.optimizer.param_groups
                              for p in group["params"]}

    def gradient(self, p: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        """What Adam would take for ``p``'s moments, where the compression steps ``p``: the
        gradient negated with ``maximize``, and with Adam's own (not decoupled) weight decay added,
        as ``torch.optim.Adam`` adds it."""
        if p not in self.steps_itself:
            return grad
        group = self._group_of[p]
        if group.get("maximize", False):
            grad = -grad
        decay = group.get("weight_decay", 0.0)
        if decay and not group.get("decoupled_weight_decay", False):
            grad = grad + decay * p.detach()
        return grad

    def remember_updates(self) -> None:
        """The updates as the exchange gave them (after ``synchronize``), to tell in ``step``
        whether the script changed them in between (clipping, a loss scaler's unscale_: meant for
        gradients)."""
        self._updates_given = {p: _fingerprint(p.grad) for p in self.steps_itself
                               if p.grad is not None and not p.grad.is_sparse}

    def step(self, closure, optimizer_step: Callable):
        """The optimizer's step (``optimizer_step(closure)``), with the parameters whose update
        the compression gave stepped by it instead."""
        if not self.steps_itself:
            return optimizer_step(closure)
        updates = {p: p.grad for p in self.steps_itself
                   if p.grad is not None and not p.grad.is_sparse}
        if not self._warned_updates_changed and any(
                not _same(self._updates_given.get(p), _fingerprint(u)) for p, u in updates.items()):
            self._warned_updates_changed = True  # once per wrapper, on every worker, as Horovod warns
            warnings.warn("grace: the gradients of the tensors random-k compresses were changed "
                          "between synchronize() and step() (clipped, unscaled or replaced), but "
                          "with Adam's moments taken over they hold their updates, burst / "
                          "(sqrt(v) + eps), not gradients: for a script that does this, build the "
                          "compression with take_adam_moments=False (docs/quality.md, 'With Adam')",
                          stacklevel=3)
        for p in updates:
            p.grad = None
        try:
            loss = optimizer_step(closure)
        finally:
            for p, update in updates.items():
                p.grad = update
        self._step_updates(updates)
        return loss

    def _step_updates(self, updates: dict) -> None:
        """Step each parameter by its update from the compression, times its group's learning
        rate, after AdamW's decoupled weight decay (``p -= lr * weight_decay * p``), as Adam
        steps."""
        with torch.no_grad():
            for p, update in updates.items():
                group = self._group_of[p]
                lr, decay = group["lr"], group.get("weight_decay", 0.0)
                if decay and group.get("decoupled_weight_decay", False):
                    p.mul_(1.0 - lr * decay)
                p.sub_(update * lr)


FINGERPRINT_ELEMENTS = 1 << 14
"""How many evenly spaced elements of an update ``_fingerprint`` reads: random-k's update is
non-zero at its drawn entries only (a ``ratio`` of them), so a uniform scaling (``unscale_``,
clipping) leaves a sample of this many unchanged only where it holds no drawn entry, which at
ratio 0.001 happens with probability e^-16."""


def _fingerprint(update: torch.Tensor) -> tuple:
    """The update tensor, its version counter and evenly spaced elements of it. The version alone
    misses a ``GradScaler``'s ``unscale_``, whose fused kernel writes without counting; reading
    every element would cost a pass over the model's largest tensors each step."""
    flat = update.reshape(-1)
    return update, update._version, flat[::max(1, flat.numel() // FINGERPRINT_ELEMENTS)].clone()


def _same(given: tuple | None, now: tuple) -> bool:
    return (given is not None and given[0] is now[0] and given[1] == now[1]
            and torch.equal(given[2], now[2]))


@contextmanager
def momentum_set_aside(optimizer, taken: str | None):
    """The optimizer's momentum at 0 for its step (the compression applied it), and its settings as
    they were afterwards: what a user, ``state_dict`` or ``hvd.broadcast_optimizer_state`` reads is
    what the user set. SGD keeps a (zero, unused) momentum buffer per parameter as it would with
    its momentum: hvd.broadcast_optimizer_state takes an optimizer without state for a fresh one
    and then broadcasts no settings."""
    if taken is None:
        yield
        return
    keys = ("betas",) if taken == "adam" else ("momentum", "nesterov", "dampening")
    kept = [{key: group[key] for key in keys} for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        if taken == "adam":
            group["betas"] = (0.0, group["betas"][1])
        else:
            group["momentum"], group["nesterov"], group["dampening"] = 0.0, False, 0.0
    try:
        yield
    finally:
        for group, settings in zip(optimizer.param_groups, kept):
            group.update(settings)
    if taken == "sgd":
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None and "momentum_buffer" not in optimizer.state[p]:
                    optimizer.state[p]["momentum_buffer"] = torch.zeros_like(p)


def momentum_aside_class(optimizer_class: type) -> type:
    """``optimizer_class`` whose ``step`` sets the momentum aside where the compression took it
    over: between the wrapper and the user's class, so that every way to the optimizer's own step
    passes there, hvd.broadcast_optimizer_state's state-initialising one included."""
    def step(self, *args, **kwargs):
        takeover = getattr(self, "_takeover", None)
        with momentum_set_aside(self, None if takeover is None else takeover.taken):
            return super(aside, self).step(*args, **kwargs)

    aside = type(optimizer_class.__name__, (optimizer_class,), {"step": step})
    return aside
