"""grace's compressors as a PyTorch DDP communication hook.

    ddp = torch.nn.parallel.DistributedDataParallel(model)
    ddp.register_comm_hook(grace.topk(0.01), grace.ddp_hook)

The compression object is the hook's state, as ``PowerSGDState`` is for PyTorch's ``powerSGD_hook``
(``DDPState`` adds a process group). Each DDP bucket (a ``GradBucket``) is one bucket of the same
``Pipeline`` the Horovod wrappers drive: its gradients compressed one by one with error feedback
(``granularity="layer"``), or joined into one vector (``"bucket"``, from the second step: see
``DDPState._plain_allreduce``), one collective per round over ``torch.distributed``; a sparse gradient
(DDP gives it a bucket of its own) travels as rows (``Pipeline.start_sparse``)
(``DistributedCollectives``), started as soon as DDP hands the bucket over, while backward goes on.
When DDP hands over its last bucket, the step is finished as one transaction, as under Horovod
(``Pipeline.finish_step``): every bucket's result averaged over the workers, and, if any worker's
gradient held an Inf or NaN, every tensor's compression state left as it was before the step and
every result NaN, so that a ``GradScaler`` skips the step.

State is keyed by each parameter: by its name where ``DDPState`` is given ``named_parameters``, else
``param.<k>`` in the order DDP's first buckets of the process hand the parameters over (the same in
every run of the same model with the same DDP options). DDP rebuilding its buckets after the first
iteration, and a resume, find each residual under its parameter. ``state_dict()`` of the compression
object saves it. One compression object serves one DDP model.

A DDP hook never sees the optimizer, so nothing of it is taken over (under Horovod, compressors that
apply momentum themselves take the optimizer's): a compressor that applies momentum is given it
(``grace.dgc(momentum=0.9)``), and rank 0 says so once (``Pipeline.notices``).
"""

# No ``from __future__ import annotations``: DDP checks the hook's annotations as objects
# (``dist.GradBucket``, ``torch.futures.Future[torch.Tensor]``).
import weakref
from typing import Any

import torch
import torch.distributed as dist

from frameworks.process_set import announce, say_once
from frameworks.torch.distributed import DistributedCollectives
from frameworks.torch.ops import TorchOps
from grace import agreement
from grace.pipeline import Pipeline
from grace.sparse import Rows

_OPS = TorchOps()
WRAPPER = "a DDP communication hook"
ATTRIBUTE = "_ddp_state"  # where a pipeline holds the DDPState that serves it


class DDPState:
    """The state of ``ddp_hook``: a grace ``Pipeline``, the process group DDP reduces over
    (``None``: the default group) and, optionally, the model's ``named_parameters()``, which name
    the compression state as Horovod's ``named_parameters=`` does (the seeds of the stochastic
    compressors are drawn per name, so that a run under Horovod and one under DDP then compute the
    same bits). ``ddp_hook`` makes one for a pipeline given on its own.

    It holds what lasts over one step (the buckets started, their futures) and the names of the
    parameters. ``state_dict()`` and ``load_state_dict()`` are the pipeline's."""

    def __init__(self, compression: Pipeline, process_group: Any = None,
                 named_parameters: Any = None) -> None:
        if not isinstance(compression, Pipeline):
            raise TypeError(f"compression must be a grace pipeline such as grace.topk(0.01), got "
                            f"{type(compression).__name__}")
        if compression.hierarchical and process_group is not None:
            raise ValueError("hierarchical=True groups the job's workers by host: use it with the "
                             "default process group (process_group=None)")
        if getattr(compression, ATTRIBUTE, None) is not None:
            raise ValueError("this compression object already serves a DDP model: its state is "
                             "per parameter, so build one per model (grace.topk(0.01) again)")
        setattr(compression, ATTRIBUTE, self)
        self.pipeline = compression
        self.process_group = process_group
        self.collectives = DistributedCollectives(process_group)
        self._names: dict[int, str] = {}  # id(parameter) -> its name, while the parameter lives
        self._count = 0  # names given as param.<k>
        for name, parameter in named_parameters or ():
            if not isinstance(name, str) or not isinstance(parameter, torch.Tensor):
                raise TypeError("named_parameters must give (name, parameter) pairs, as "
                                "model.named_parameters() does")
            self._remember(parameter, name)
        self._named = bool(self._names)
        self._seen_all = False  # the first step is over: every parameter has been handed over
        self._checked: set = set()  # bucket layouts the workers agreed on
        self._pending: list = []  # this step's buckets so far: (buffer, Exchange, Future) each
        self._announced = False
        self._steps = 0  # steps finished by this process

    def state_dict(self) -> "dict[str, Any]":
        """This worker's compression state (``Pipeline.state_dict``): save it per worker."""
        return self.pipeline.state_dict()

    def load_state_dict(self, state: "dict[str, Any]") -> None:
        self.pipeline.load_state_dict(state)

    def _remember(self, parameter: torch.Tensor, name: str) -> None:
        key = id(parameter)
        self._names[key] = name
        # Forgotten when the parameter goes, so that a new tensor at the same address is not
        # taken for it; the model holds its parameters, this state does not.
        weakref.finalize(parameter, self._names.pop, key, None)

    def name_of(self, parameter: torch.Tensor) -> str:
        """The parameter's name: the model's (``named_parameters``), else ``param.<k>`` in the
        order DDP's first buckets hand the parameters over. That order is the same in every run
        with the same model and DDP options (``bucket_cap_mb``, ``find_unused_parameters``):
        give ``named_parameters`` to resume under other options."""
        key = id(parameter)
        if key not in self._names:
            if self._named:
                raise ValueError("a parameter DDP reduces is not in named_parameters: give "
                                 "DDPState the named_parameters() of the model DDP wraps")
            if self._seen_all:
                raise ValueError("a parameter this compression object has not seen before reached "
                                 "it after its first step: it serves another model, and its state "
                                 "is per parameter; build one compression object per DDP model")
            self._remember(parameter, f"param.{self._count}")
            self._count += 1
        return self._names[key]

    # --- one bucket ------------------------------------------------------------------------------
    def on_bucket(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        try:
            return self._on_bucket(bucket)
        except BaseException as error:
            # The step is abandoned: its started buckets' futures fail, and their state writes,
            # never committed, are dropped with them (a later step must not finish them).
            self._abandon(error)
            raise

    def _abandon(self, error: BaseException) -> None:
        pending, self._pending = self._pending, []
        for _, _, future in pending:
            if not future.done():
                future.set_exception(error)

    def _on_bucket(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        if bucket.index() == 0 and self._pending:  # a step DDP abandoned (an error elsewhere)
            self._abandon(RuntimeError("grace: DDP started a new step before the last one ended"))
        buffer = bucket.buffer()
        group = self.collectives
        if not self._announced:
            self._announce()
        names = [self.name_of(p) for p in bucket.parameters()]
        if self._steps == 0 and self._dense_first():
            return self._plain_allreduce(bucket, buffer)
        gradients = [buffer] if buffer.is_sparse else bucket.gradients()
        if group.size > 1 and tuple(names) not in self._checked:
            self._check_agreement(names, gradients)
        if buffer.is_sparse:  # DDP gives a sparse gradient a bucket of its own: its rows travel
            if self.pipeline.hierarchical:
                raise ValueError(f"hierarchical=True sums each host's gradients dense before "
                                 f"compressing, which a sparse gradient ({names[0]!r}) cannot be: "
                                 f"build the embedding with sparse=False")
            grad = buffer.coalesce()
            rows = Rows(grad.indices()[0], grad.values().reshape(grad.values().shape[0], -1),
                        tuple(grad.shape))
            exchange = self.pipeline.start_sparse(rows, names[0], group, _OPS)
        else:
            # DDP fills the bucket anew each step: it is the exchange's within the step only.
            exchange = self.pipeline.start_bucket(gradients, names, group, _OPS, overwrite=True,
                                                  lent=True)
        future: torch.futures.Future = torch.futures.Future()
        self._pending.append((buffer, exchange, future))
        if bucket.is_last():
            self._finish()
        return future

    def _dense_first(self) -> bool:
        """Whether state made in the first step would belong to DDP's first buckets rather than to
        parameters: ``granularity="bucket"`` keeps one residual per bucket (its tensors joined),
        and under ``hierarchical=True`` the worker of a host that compresses a bucket (and keeps
        its residual) is chosen by the bucket."""
        return self.pipeline.hierarchical or self.pipeline.granularity == "bucket"

    def _plain_allreduce(self, bucket: dist.GradBucket, buffer: torch.Tensor
                         ) -> torch.futures.Future[torch.Tensor]:
        """DDP's own averaging of a bucket, for the first step where state is per bucket
        (``_dense_first``).

        DDP regroups its buckets after the first iteration: a residual made in the first step
        would then be joined with other tensors, or stay with a worker that no longer compresses
        its tensor. So that step travels dense, leaving no state, and compression starts once the
        buckets are final (each process's first step, a resumed one too, whose loaded state
        waits for the second)."""
        if bucket.is_last():
            self._steps += 1
            self._seen_all = True
        buffer.div_(self.collectives.size)
        work = dist.all_reduce(buffer, group=self.process_group, async_op=True)
        return work.get_future().then(lambda done: done.value()[0])

    def _finish(self) -> None:
        results = self.pipeline.finish_step([e for _, e, _ in self._pending], self.collectives,
                                            1.0 / self.collectives.size)
        self._steps += 1
        self._seen_all = True
        pending, self._pending = self._pending, []
        for (buffer, _, future), tensors in zip(pending, results):
            if isinstance(tensors, Rows):  # a sparse gradient: its rows, one per index
                future.set_result(torch.sparse_coo_tensor(
                    tensors.indices.to(torch.int64).reshape(1, -1),
                    tensors.values.reshape(-1, *tensors.dense_shape[1:]), tensors.dense_shape,
                    dtype=buffer.dtype, device=buffer.device).coalesce())
                continue
            _write_into(buffer, tensors)
            future.set_result(buffer)

    def _check_agreement(self, names: "list[str]", gradients: "list[torch.Tensor]") -> None:
        """Fail at once, on every worker, if the workers differ in compression or in this bucket's
        parameters (a mismatch would otherwise hang a collective or combine unlike payloads)."""
        mine = agreement.describe(self.pipeline, [(n, g.shape, g.dtype) for n, g in
                                                  zip(names, gradients)],
                                  bucket=names, process_group_size=self.collectives.size)
        everyone: list = [None] * self.collectives.size
        dist.all_gather_object(everyone, mine, group=self.process_group)
        agreement.check(everyone)
        self._checked.add(tuple(names))

    def _announce(self) -> None:
        """Set glibc's heap for the steps, and say once on rank 0 each way grace departs from what
        the user set, as the Horovod wrappers do when they are built (``announce``)."""
        self._announced = True
        group = _AsProcessSet(self.collectives)
        announce(self.pipeline, group, optimizer_seen=False, wrapper=WRAPPER)
        if self.pipeline.hierarchical:
            say_once("grace: hierarchical=True under DDP: the first step of this process travels "
                     "dense, through DDP's own allreduce, and compression starts at the second: "
                     "DDP regroups its buckets after the first step, and each host's worker that "
                     "compresses a bucket, keeping its residual, is chosen by the bucket", group)
        elif self.pipeline.granularity == "bucket":
            say_once("grace: granularity='bucket' under DDP: the first step of this process travels "
                     "dense, through DDP's own allreduce, and compression starts at the second: "
                     "DDP regroups its buckets after the first step, and a bucket's tensors share "
                     "one residual; granularity='layer' (the default) compresses from the first",
                     group)


def _write_into(buffer: torch.Tensor, tensors: "list[torch.Tensor]") -> None:
    """The bucket's results written into its flat buffer, in one pass. A result may already be
    in its place (a gradient the pipeline summed in place, ``allreduce_given_async``): it is not
    copied onto itself."""
    storage = buffer.untyped_storage().data_ptr()
    if not any(t.untyped_storage().data_ptr() == storage for t in tensors):
        if len(tensors) == 1:
            buffer.copy_(tensors[0].reshape(-1))
        else:  # written into the bucket in one pass, not joined apart and copied in after
            torch.cat([t.reshape(-1) for t in tensors], out=buffer)
        return
    writes, offset = [], 0
    for tensor in tensors:
        place = buffer[offset:offset + tensor.numel()]
        offset += tensor.numel()
        if tensor.untyped_storage().data_ptr() == storage:
            if tensor.data_ptr() == place.data_ptr() and tensor.is_contiguous():
                continue  # in its place already
            tensor = tensor.clone()  # elsewhere in the bucket: read before anything is written
        writes.append((place, tensor))
    for place, tensor in writes:
        place.copy_(tensor.reshape(-1))


class _AsProcessSet:
    """A ``torch.distributed`` group as the rank-0 logging of ``frameworks.process_set`` reads a
    Horovod process set."""

    def __init__(self, collectives: DistributedCollectives) -> None:
        self.collectives = collectives

    def included(self) -> bool:
        return True

    def rank(self) -> int:
        return self.collectives.rank

    def size(self) -> int:
        return self.collectives.size


def state_for(state: "Pipeline | DDPState") -> "DDPState":
    """The ``DDPState`` of a hook's state: itself, or the one made for a pipeline (once; it lives
    on the pipeline, as ``_ddp_state``)."""
    if isinstance(state, DDPState):
        return state
    if not isinstance(state, Pipeline):
        raise TypeError(f"ddp_hook's state must be a grace pipeline (grace.topk(0.01)) or a "
                        f"grace.DDPState, got {type(state).__name__}")
    made = getattr(state, ATTRIBUTE, None)
    return made if made is not None else DDPState(state)


def ddp_hook(state: "Pipeline | DDPState", bucket: dist.GradBucket
             ) -> torch.futures.Future[torch.Tensor]:
    """A DDP communication hook: ``ddp.register_comm_hook(grace.topk(0.01), grace.ddp_hook)``.

    Compresses the bucket's gradients with the pipeline given as ``state`` (or a ``DDPState``) and
    starts their exchange; the future carries the bucket averaged over the workers, complete once
    DDP has handed over the step's last bucket (the step is one transaction: see the module)."""
    return state_for(state).on_bucket(bucket)
