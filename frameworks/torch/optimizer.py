"""Horovod's ``DistributedOptimizer`` for PyTorch, with a grace pipeline in place of allreduce.

Everything a Horovod user relies on behaves as in ``horovod.torch``: communication starts from each
parameter's gradient hook while the backward pass goes on, ``step()`` waits for it, ``op`` is
``hvd.Average`` or ``hvd.Sum``, ``backward_passes_per_step`` accumulates locally, ``synchronize()`` with
``skip_synchronize()`` allows gradient clipping, ``groups`` starts a group's tensors together, and
``hvd.broadcast_parameters`` / ``hvd.broadcast_optimizer_state`` work on the returned optimizer.
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager
from typing import Iterable

import horovod.torch as hvd
import torch

from frameworks import internals
from frameworks.process_set import (
    announce,
    compares_at_construction,
    elastic,
    gather_objects,
    say_once,
)
from frameworks.torch.collectives import HorovodCollectives
from frameworks.torch.momentum import OptimizerTakeover, momentum_aside_class
from frameworks.torch.ops import TorchOps
from grace import agreement
from grace.pipeline import Pipeline
from grace.sparse import Rows

_OPS = TorchOps()


class _GraceDistributedOptimizer(torch.optim.Optimizer):
    # Methods are copied into a class derived from the user's optimizer class (as Horovod does), so
    # they call the wrapped optimizer through ``super(self.__class__, self)``.

    def __init__(self, params, named_parameters, compression: Pipeline, backward_passes_per_step=1,
                 op=hvd.Average, gradient_predivide_factor=1.0, groups=None, sparse_as_dense=False,
                 process_set=hvd.global_process_set):
        super(self.__class__, self).__init__(params)
        self._pipeline = compression
        self._collectives = HorovodCollectives(process_set)
        self._parameter_names = _parameter_names(self.param_groups, named_parameters)
        self.backward_passes_per_step = backward_passes_per_step
        self._allreduce_delay = {p: backward_passes_per_step for p in self._parameter_names}
        self.op = op
        self.gradient_predivide_factor = gradient_predivide_factor
        self.sparse_as_dense = sparse_as_dense
        self.process_set = process_set
        self._touched: set = set()  # parameters whose hook fired since the last synchronize
        self._done: set = set()  # ... and whose gradient is final for this step
        self._started: dict = {}  # bucket index -> its exchanges: (positions, Exchange) each
        self._sparse: dict = {}  # parameter -> whether its gradient is sparse, as the workers agreed
        # Horovod elastic: a worker that joins has not voted, so every worker votes at every step.
        self._vote_every_step = elastic()
        self._synchronized = False
        self._should_synchronize = True
        self._groups = groups
        # What the optimizer handed the compression (taken after the agreement check).
        self._takeover = OptimizerTakeover(self, compression)
        self._handed: list = []  # (parameter, its p.grad when its bucket started, its version then)
        self._warned_written = False
        self._rate_checked = False
        self._buckets: list[tuple] = []
        self._bucket_of: dict = {}
        self._bucket_ready: list[int] = []
        if self.process_set.included():
            self._register_hooks()
            self._check_agreement()
            if compression.hierarchical:  # the hosts' process sets, made now on every worker
                self._collectives.hosts()

    # --- set-up --------------------------------------------------------------------------------
    def _register_hooks(self):
        params = [p for group in self.param_groups for p in group["params"] if p.requires_grad]
        # Reverse registration order, roughly the order in which backward makes the gradients (as
        # PyTorch DDP assumes): the first bucket fills, and starts, while backward goes on. Every
        # worker builds the same model, so it forms the same buckets (the agreement check makes
        # sure).
        self._requires_update = list(reversed(params))
        if self._groups is not None:  # Horovod's groups: tensors that travel together
            self._buckets = _form_groups(self._requires_update, self._groups)
        else:
            positions = self._pipeline.buckets(
                [(tuple(p.shape), _OPS.dtype(p)) for p in self._requires_update], _OPS)
            self._buckets = [tuple(self._requires_update[i] for i in bucket) for bucket in positions]
        for index, bucket in enumerate(self._buckets):
            for p in bucket:
                self._bucket_of[p] = index
        self._bucket_ready = [0] * len(self._buckets)
        for p in self._requires_update:
            p.register_post_accumulate_grad_hook(self._make_hook(p))

    def _check_agreement(self):
        """Fail at once, on every worker, if the workers differ in compression, options,
        parameters or buckets (a mismatch would otherwise hang a collective or combine unlike
        payloads)."""
        if self.process_set.size() == 1 or not compares_at_construction(self.process_set):
            return
        mine = agreement.describe(
            self._pipeline,
            [(self._parameter_names[p], p.shape, p.dtype) for p in self._requires_update],
            op=self.op, backward_passes_per_step=self.backward_passes_per_step,
            gradient_predivide_factor=self.gradient_predivide_factor,
            buckets=[[self._parameter_names[p] for p in bucket] for bucket in self._buckets])
        agreement.check(gather_objects(hvd, mine, self.process_set, "grace.agreement"))

    def set_backward_passes_per_step(self, passes: int) -> None:
        self.backward_passes_per_step = passes
        for p in self._allreduce_delay:
            self._allreduce_delay[p] = passes

    def state_dict(self):
        """The wrapped optimizer's state, and under ``"grace"`` this worker's compression state
        (residuals, momenta, warm starts, step counters): save it per worker."""
        state = super(self.__class__, self).state_dict()
        state["grace"] = self._pipeline.state_dict()
        return state

    def load_state_dict(self, state_dict):
        self._reset_step()
        self._synchronized = False
        self._should_synchronize = True
        for p in self._allreduce_delay:
            self._allreduce_delay[p] = self.backward_passes_per_step
        state_dict = dict(state_dict)
        compression = state_dict.pop("grace", None)
        super(self.__class__, self).load_state_dict(state_dict)
        if compression is not None:
            self._pipeline.load_state_dict(compression)

    # --- communication -------------------------------------------------------------------------
    def _gradient(self, p):
        """p's gradient as it travels: dense, or (sparse, unless ``sparse_as_dense``) its rows, in
        the form the workers agreed for p (a worker without a gradient, or with the other form,
        converts: exactly, as zeros are no rows)."""
        sparse = self._sparse.get(p, False) and not self.sparse_as_dense
        if p.grad is None:
            # Another worker may have a gradient for p in this step: every worker must take part.
            p.grad = torch.zeros_like(p).to_sparse() if sparse else torch.zeros_like(p)
        grad = p.grad
        if grad.is_sparse != sparse:
            grad = grad.to_sparse() if sparse else grad.to_dense()
        if self.op == hvd.Average and self.gradient_predivide_factor != 1.0:
            grad = grad / self.gradient_predivide_factor
        if not sparse:
            grad = self._takeover.gradient(p, grad)
        if sparse:  # as backward made it, a row per lookup: the pipeline adds up repeats
            return Rows(grad._indices()[0], grad._values(), tuple(grad.shape))
        return grad

    def _agree_on_sparse(self) -> None:
        """Once, in the first step's ``synchronize``: whether each parameter's gradient travels
        sparse, so that every worker exchanges it alike even where its own gradient is missing.
        One allreduce of two counts per parameter: sparse where some worker's gradient is sparse
        and none is dense (a dense one may have started already, in a hook)."""
        params = self._requires_update
        mine = ([float(p.grad is not None and p.grad.is_sparse) for p in params]
                + [float(p.grad is not None and not p.grad.is_sparse) for p in params])
        if self._collectives.size > 1:
            mine = self._collectives.synchronize(self._collectives.allreduce_async(
                torch.tensor(mine, dtype=torch.float32), "grace.sparse_gradients")).tolist()
            self._pipeline.count_control(4 * len(mine), _OPS)
        n = len(params)
        self._sparse = {p: mine[i] > 0 and mine[n + i] == 0 for i, p in enumerate(params)}

    def _may_start(self, bucket) -> bool:
        """Whether a bucket may start from a hook: always once the workers agreed which
        gradients are sparse; before (the first step), if all its gradients are dense. Never
        where starting waits for the other workers (``Pipeline.starts_waiting``): then every
        bucket starts in ``synchronize``, in the same order on every worker. From a hook, a worker
        whose backward skips a parameter (Horovod's forced allreduce of a missing gradient) would
        wait in one bucket's vote while another waits in a different collective, each for the
        other (Horovod's own test_force_allreduce hung so with threshold)."""
        if self._pipeline.starts_waiting:
            return False
        return bool(self._sparse) or all(p.grad is not None and not p.grad.is_sparse for p in bucket)

    def _start_bucket(self, index: int) -> None:
        if not self._started:  # the step's first bucket: the momentum as the settings say now
            self._takeover.retake()
        bucket = self._buckets[index]
        grads = [self._gradient(p) for p in bucket]
        names = [self._parameter_names[p] for p in bucket]
        dense = [i for i, g in enumerate(grads) if not isinstance(g, Rows)]
        started = [([i], self._pipeline.start_sparse(grads[i], names[i], self._collectives, _OPS))
                   for i, g in enumerate(grads) if isinstance(g, Rows)]
        if dense:
            # The gradients are the exchange's to write over, as Horovod's in-place allreduce
            # does: synchronize() replaces each p.grad's storage with its result. Each goes in as
            # an alias (detach()), so that set_ on p.grad leaves what error feedback kept alone;
            # one autograd tracks (backward(create_graph=True)) as it is, never written into.
            handed = [grads[i] if grads[i].requires_grad else grads[i].detach() for i in dense]
            started.append((dense, self._pipeline.start_bucket(
                handed, [names[i] for i in dense], self._collectives, _OPS, overwrite=True)))
            # The gradients' versions now, to tell in synchronize() whether the script wrote into
            # them in between (what error feedback keeps for the next step may be there).
            self._handed.extend((bucket[i], bucket[i].grad, bucket[i].grad._version) for i in dense)
        self._started[index] = started

    def _make_hook(self, p):
        def hook(*_):
            if p in self._done and self._allreduce_delay[p] <= 0:
                raise AssertionError(
                    "Gradients were computed more than backward_passes_per_step times before call "
                    "to step(). Increase backward_passes_per_step to accumulate gradients locally.")
            self._touched.add(p)
            self._allreduce_delay[p] -= 1
            if self._allreduce_delay[p] > 0:
                return
            self._done.add(p)
            index = self._bucket_of[p]
            self._bucket_ready[index] += 1
            bucket = self._buckets[index]
            if self._bucket_ready[index] == len(bucket) and self._may_start(bucket):
                # The bucket's last gradient is ready: it travels while backward goes on.
                self._start_bucket(index)
        return hook

    def _scale(self) -> float:
        if self.op == hvd.Average:
            return self.gradient_predivide_factor / self._collectives.size
        return 1.0

    def _reset_step(self) -> None:
        self._handed.clear()
        self._touched.clear()
        self._done.clear()
        self._started.clear()
        self._bucket_ready = [0] * len(self._buckets)

    def synchronize(self):
        if not self.process_set.included():
            self._synchronized = True
            return
        if not self._sparse and self._buckets:
            self._agree_on_sparse()
        for index in range(len(self._buckets)):
            if index not in self._started:  # some gradient did not come from backward's hooks
                self._start_bucket(index)
        written = [self._parameter_names[p] for p, t, version in self._handed if t._version != version]
        if written and not self._warned_written:
            self._warned_written = True  # once per wrapper, on every worker, as Horovod warns
            warnings.warn(
                f"grace: the gradients of {', '.join(written[:3])}{' ...' if len(written) > 3 else ''} "
                f"were written between backward and synchronize() (clipped, unscaled or changed "
                f"in place) while their exchange was under way: the change reaches what error "
                f"feedback keeps for the next step, or this step's result, or nothing, depending "
                f"on the compressor and on timing. Call optimizer.synchronize() first, then "
                f"change the gradients, then step under optimizer.skip_synchronize(), as with "
                f"Horovod", stacklevel=2)
        # One verdict for the step: an Inf or NaN anywhere drops every tensor's state writes.
        started = [(index, positions, exchange) for index in range(len(self._buckets))
                   for positions, exchange in self._started[index]]
        finished = self._pipeline.finish_step([exchange for _, _, exchange in started],
                                              self._collectives, self._scale())
        for (index, positions, exchange), results in zip(started, finished):
            if exchange.single:
                results = [results]
            for i, result in zip(positions, results):
                p = self._buckets[index][i]
                self._allreduce_delay[p] = self.backward_passes_per_step
                if isinstance(result, Rows):
                    # Distinct indices in ascending order, within the table: coalesced by
                    # construction, so torch need not check it again.
                    p.grad = torch.sparse_coo_tensor(
                        result.indices.reshape(1, -1), result.values.to(p.dtype), result.dense_shape,
                        is_coalesced=True, check_invariants=False)
                elif p.grad.is_sparse:  # sparse_as_dense: dense on the wire, sparse for the
                    p.grad = result.to(p.dtype).to_sparse()  # optimizer (SparseAdam needs it)
                else:
                    p.grad.set_(result.to(p.grad.dtype))
        self._takeover.remember_updates()
        self._reset_step()
        if self._vote_every_step:
            self._sparse = {}
        self._synchronized = True

    @contextmanager
    def skip_synchronize(self):
        """Let ``step()`` skip synchronization, after an explicit ``synchronize()``."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure=None):
        if self._should_synchronize:
            if self._synchronized:
                warnings.warn(
                    "optimizer.step() called without optimizer.skip_synchronize() context after "
                    "optimizer.synchronize(). This can cause training slowdown. You may want to "
                    "consider using optimizer.skip_synchronize() context if you use "
                    "optimizer.synchronize() in your code.")
            self.synchronize()
        self._synchronized = False
        if not self._rate_checked:  # the first step's rate, against what the compressor needs
            self._rate_checked = True
            momentum = 0.0 if self._takeover.taken else max(
                (float(g.get("momentum", 0.0)) for g in self.param_groups), default=0.0)
            say_once(self._pipeline.compressor.learning_rate_notice(
                max(float(g["lr"]) for g in self.param_groups), momentum), self.process_set)
        # Adam's moments taken over: the compression gave some parameters their update.
        return self._takeover.step(closure, super(self.__class__, self).step)

    def zero_grad(self, *args, **kwargs):
        if self._touched:
            raise AssertionError(
                "optimizer.zero_grad() was called after loss.backward() but before optimizer.step() "
                "or optimizer.synchronize(). This is prohibited as it can cause a race condition.")
        return super(self.__class__, self).zero_grad(*args, **kwargs)

    def compression_stats(self) -> dict:
        """This worker's ``stats()`` of the pipeline: bytes sent against dense bytes."""
        return self._pipeline.stats()


def _parameter_names(param_groups, named_parameters) -> dict:
    if named_parameters is not None:
        named_parameters = list(named_parameters)
    else:
        named_parameters = [(f"allreduce.noname.{i}.{j}", v)
                            for i, group in enumerate(param_groups)
                            for j, v in enumerate(group["params"])]
    if any(not isinstance(p, tuple) for p in named_parameters):
        raise ValueError("named_parameters should be a sequence of tuples (name, parameter), "
                         "usually produced by model.named_parameters().")
    names = [k for k, _ in named_parameters]
    dups = sorted({k for k in names if names.count(k) > 1})
    if dups:
        raise ValueError(f"Parameter names in named_parameters must be unique. "
                         f"Found duplicates: {', '.join(dups)}")
    all_ids = {id(v) for group in param_groups for v in group["params"]}
    unnamed = all_ids - {id(v) for _, v in named_parameters}
    if unnamed:
        raise ValueError("named_parameters was specified, but one or more model parameters were "
                         f"not named. Python object ids: {', '.join(str(i) for i in unnamed)}")
    return {v: k for k, v in named_parameters if id(v) in all_ids}


def _form_groups(params: list, groups) -> list[tuple]:
    if isinstance(groups, list):
        formed, seen = [], set()
        for group in groups:
            members = tuple(p for p in group if any(p is q for q in params))
            if members:
                formed.append(members)
                seen.update(id(p) for p in members)
        return formed + [(p,) for p in params if id(p) not in seen]
    count = min(groups, len(params))
    return [tuple(params[i::count]) for i in range(count)] if count else []


def _check_groups(groups) -> None:
    if groups is None:
        return
    if isinstance(groups, list):
        seen = set()
        for group in groups:
            for p in group:
                if not isinstance(p, torch.Tensor):
                    raise ValueError("groups must consist of torch.Tensor.")
                if id(p) in seen:
                    raise ValueError("A parameter can only appear once in groups.")
                seen.add(id(p))
    elif isinstance(groups, bool) or not isinstance(groups, int) or groups <= 0:
        raise ValueError("groups should be a non-negative integer or a list of list of torch.Tensor.")


def DistributedOptimizer(optimizer: torch.optim.Optimizer,
                         named_parameters: Iterable[tuple[str, torch.nn.Parameter]] | None = None,
                         compression: Pipeline | None = None,
                         backward_passes_per_step: int = 1,
                         op=hvd.Average,
                         gradient_predivide_factor: float = 1.0,
                         num_groups: int = 0,
                         groups=None,
                         sparse_as_dense: bool = False,
                         process_set=hvd.global_process_set) -> torch.optim.Optimizer:
    """Wrap ``optimizer`` so that gradients are compressed by the grace pipeline ``compression``
    (``grace.topk(0.01)``, ...) and combined over the workers before each step.

    Same signature and behaviour as ``horovod.torch.DistributedOptimizer``; ``compression`` defaults
    to ``grace.none()``. A Horovod compressor (``hvd.Compression.fp16``) is handed to Horovod's own
    optimizer unchanged. The returned object is an instance of a subclass of ``optimizer``'s class.
    """
    if compression is None:
        import grace

        compression = grace.none()
    if not isinstance(compression, Pipeline):
        return internals.original("horovod.torch", "DistributedOptimizer")(
            optimizer, named_parameters, compression, backward_passes_per_step, op,
            gradient_predivide_factor, num_groups, groups, sparse_as_dense, process_set)
    if op not in (hvd.Average, hvd.Sum):
        raise ValueError("op must be hvd.Average or hvd.Sum with grace compression "
                         "(Adasum combines uncompressed model deltas)")
    if gradient_predivide_factor != 1.0 and op != hvd.Average:
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    if isinstance(backward_passes_per_step, bool) or not isinstance(backward_passes_per_step, int) \
            or backward_passes_per_step <= 0:
        raise ValueError(f"backward_passes_per_step must be an int > 0, got {backward_passes_per_step!r}")
    if num_groups != 0:
        warnings.warn("Parameter `num_groups` has been replaced by `groups` and will be removed.",
                      DeprecationWarning)
        if groups is None:
            groups = num_groups
    _check_groups(groups)
    cls = type(optimizer.__class__.__name__, (momentum_aside_class(optimizer.__class__),),
               dict(_GraceDistributedOptimizer.__dict__))
    # hvd.broadcast_optimizer_state must treat it as Horovod's (it steps without communicating).
    internals.treated_as_horovods_optimizer(cls)
    wrapped = cls(optimizer.param_groups, named_parameters, compression, backward_passes_per_step,
                  op, gradient_predivide_factor, groups, sparse_as_dense, process_set)
    # After the agreement check (which the constructor makes): the workers' optimizers may differ
    # in momentum until hvd.broadcast_optimizer_state gives them rank 0's, as in Horovod.
    wrapped._takeover.take(getattr(wrapped, "_requires_update", ()),
                           op == hvd.Average and gradient_predivide_factor == 1.0, process_set)
    announce(compression, process_set)  # the heap, and what else grace changes (said on rank 0)
    return wrapped
