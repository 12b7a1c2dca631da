"""Keras 3 with grace: a ``DistributedOptimizer`` that really combines gradients, and broadcasts of
initial weights and optimizer state that work on Keras 3 variables.

Horovod 0.28.1's own Keras wrappers predate Keras 3: its ``DistributedOptimizer`` hooks methods that
Keras 3 never calls, so training runs but each worker applies only its own gradients (the workers
silently diverge), and ``BroadcastGlobalVariablesCallback`` fails because Keras 3 variables have no
``ref()``. The optimizer below wraps ``apply()``, which every Keras 3 update goes through
(``model.fit``, ``apply_gradients``), and ``BroadcastGlobalVariablesCallback`` / ``broadcast_variables``
below replace Horovod's."""

from __future__ import annotations

import horovod.tensorflow as hvd
import keras
import tensorflow as tf

from frameworks import internals
from frameworks.process_set import announce, say_once
from frameworks.tensorflow.broadcast import broadcast_model_and_optimizer
from frameworks.tensorflow.broadcast import broadcast_variables as broadcast_variables  # its old path
from frameworks.tensorflow.keras3 import learning_rate_of, variable_list
from frameworks.tensorflow.momentum import take_keras_adam_moments, take_keras_momentum
from frameworks.tensorflow.ops import TensorFlowOps
from frameworks.tensorflow.reduce import make_reduce_grads
from grace.pipeline import Pipeline


def _in_xla_context() -> bool:
    from tensorflow.python.ops import control_flow_util

    return control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph())


def _apply(self, grads, trainable_variables=None):
    if _in_xla_context():
        raise ValueError(
            "grace (Horovod's collectives) cannot run inside an XLA-compiled step: compile the model "
            "with jit_compile=False (jit_compile='auto' does this for you)")
    variables = self._trainable_variables if trainable_variables is None else list(trainable_variables)
    if not getattr(self, "_grace_rate_checked", False):  # the rate as it is, traced or not
        self._grace_rate_checked = True
        say_once(self._grace_pipeline.compressor.learning_rate_notice(
            learning_rate_of(self), float(getattr(self, "momentum", 0.0) or 0.0)),
            self._grace_process_set)
    steps = self.gradient_accumulation_steps
    if steps:
        grads = _accumulated(self, list(grads), variables, steps)
    else:
        grads = self._grace_reduce(list(grads), variables)
    if getattr(self, "_grace_adam", False):
        return _apply_updates(self, grads, variables)
    return super(self.__class__, self).apply(grads, trainable_variables)


def _apply_updates(self, grads, variables):
    """Adam's moments taken over (``Pipeline.take_adam_moments``): the tensors the compression
    compressed came back as their updates, stepped here by the learning rate (after Keras's
    decoupled weight decay, before the variable's constraint, as Keras steps); the optimizer
    applies the others."""
    pipeline, ops = self._grace_pipeline, TensorFlowOps()
    own = {i for i, (g, v) in enumerate(zip(grads, variables))
           if isinstance(g, tf.Tensor) and pipeline.steps_itself(tuple(v.shape), str(v.dtype), ops)}
    if not self.built:  # built on every variable, as without the takeover
        self.build(variables)
        self.built = True
    rate = tf.identity(self.learning_rate)  # this step's, before apply() counts the step
    rest = [i for i in range(len(grads)) if i not in own]
    if rest:
        super(self.__class__, self).apply([grads[i] for i in rest], [variables[i] for i in rest])
    else:
        self._iterations.assign_add(1)
    for i in sorted(own):
        variable = variables[i]
        lr = tf.cast(rate, variable.dtype)
        if self.weight_decay is not None and self._use_weight_decay(variable):
            variable.assign(variable - variable * tf.cast(self.weight_decay, variable.dtype) * lr)
        variable.assign_sub(tf.cast(grads[i], variable.dtype) * lr)
        if variable.constraint is not None:
            variable.assign(variable.constraint(variable))


def _accumulated(self, grads, variables, steps):
    """With ``gradient_accumulation_steps``: the micro-steps' gradients are summed locally, and the
    sum is combined over the workers once, on the update step. Keras accumulates whatever apply()
    receives and applies ``(g + accumulated) / steps`` on the update step; it gets zeros before and
    the combined sum then, so it applies the workers' average of the accumulated gradients, and
    grace communicates once per update, not once per micro-step."""
    if not hasattr(self, "_grace_sums"):
        self._grace_sums = [None if g is None else tf.Variable(tf.zeros_like(v), trainable=False)
                            for g, v in zip(grads, variables)]
        self._grace_micro = tf.Variable(0, dtype=tf.int64, trainable=False)
    sums = [None if g is None else total.assign_add(tf.convert_to_tensor(g))
            for g, total in zip(grads, self._grace_sums)]
    micro = self._grace_micro.assign_add(1)

    def combine():
        combined = self._grace_reduce([None if t is None else tf.identity(t) for t in sums], variables)
        for total in self._grace_sums:
            if total is not None:
                total.assign(tf.zeros_like(total))
        return [tf.zeros_like(v) if c is None else c for c, v in zip(combined, variables)]

    def wait():
        return [tf.zeros_like(v) for v in variables]

    out = tf.cond(micro % steps == 0, combine, wait)
    return [None if g is None else o for g, o in zip(grads, out)]


def DistributedOptimizer(optimizer, name=None, device_dense="", device_sparse="", compression=None,
                         sparse_as_dense=False, gradient_predivide_factor=1.0, op=hvd.Average,
                         backward_passes_per_step=1, average_aggregated_gradients=False,
                         num_groups=0, groups=None, process_set=hvd.global_process_set,
                         scale_local_gradients=True):
    """``horovod.tensorflow.keras.DistributedOptimizer`` for Keras 3 with a grace pipeline
    (default ``grace.none()``, which also makes plain averaging work on Keras 3).

    Returns a new optimizer of a subclass of ``optimizer``'s class, built from its config, whose
    ``apply()`` first combines the gradients over the workers. ``model.compile(optimizer=...)`` with
    its defaults and ``model.fit`` work: ``jit_compile='auto'`` resolves to ``False`` for a model with
    this optimizer (Horovod's collectives have no XLA kernels)."""
    if compression is None:
        import grace

        compression = grace.none()
    if not isinstance(compression, Pipeline):
        original = internals.original("horovod.tensorflow.keras", "DistributedOptimizer")
        return original(optimizer, name, device_dense, device_sparse, compression, sparse_as_dense,
                        gradient_predivide_factor, op, backward_passes_per_step,
                        average_aggregated_gradients, num_groups, groups, process_set,
                        scale_local_gradients)
    if backward_passes_per_step != 1:
        raise ValueError(
            "backward_passes_per_step must be 1 with Keras 3: use the optimizer's own "
            "gradient_accumulation_steps=N, whose accumulated update grace then combines")
    reduce_grads = make_reduce_grads(compression, op, gradient_predivide_factor, sparse_as_dense,
                                     process_set)
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,), {"apply": _apply})
    averaged = op == hvd.Average and gradient_predivide_factor == 1.0
    adam = take_keras_adam_moments(optimizer.__class__, optimizer.get_config(), compression,
                                   process_set, averaged)
    config = take_keras_momentum(optimizer.__class__, optimizer.get_config(), compression, process_set)
    announce(compression, process_set)  # the heap, and what else grace changes (said on rank 0)
    if name is not None:
        config["name"] = name
    wrapped = cls.from_config(config)
    wrapped._grace_reduce = reduce_grads
    wrapped._grace_pipeline = compression
    wrapped._grace_process_set = process_set
    wrapped._grace_adam = adam
    return wrapped


def is_grace_optimizer(optimizer) -> bool:
    inner = getattr(optimizer, "inner_optimizer", None)  # LossScaleOptimizer
    return hasattr(optimizer, "_grace_reduce") or (inner is not None and hasattr(inner, "_grace_reduce"))


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
    """At the start of training, give every worker ``root_rank``'s model weights and optimizer state
    (Horovod's callback of the same name fails on Keras 3 unless ``import grace`` mends it). The
    optimizer is built first if needed, so that its state exists to be broadcast.
    ``local_variables``: model variables left as each worker has them (Horovod's option)."""

    def __init__(self, root_rank: int = 0, process_set=hvd.global_process_set,
                 local_variables=None):
        super().__init__()
        self.root_rank = root_rank
        self.process_set = process_set
        self._local = {id(v) for v in variable_list(local_variables)}

    def on_train_begin(self, logs=None):
        optimizer = self.model.optimizer
        if optimizer is not None and not optimizer.built:
            optimizer.build(self.model.trainable_variables)
        broadcast_model_and_optimizer(self.model, self.root_rank, self.process_set,
                                      lambda v: id(v) not in self._local)


# Keras 3 resolves jit_compile='auto' to XLA on CPU too, and Horovod's ops have no XLA kernels.
internals.keras_auto_jit_off_for(is_grace_optimizer)
