"""Horovod's ``DistributedGradientTape`` and (TF1-style) ``DistributedOptimizer`` with grace.

Both are Horovod's own wrappers, built with no compression, whose gradient-combining function is then
replaced by grace's: everything else (persistent tapes, local sources, ``scale_local_gradients``,
``backward_passes_per_step`` of the legacy optimizer) is Horovod's behaviour, unchanged."""

from __future__ import annotations

import horovod.tensorflow as hvd

from frameworks import internals
from frameworks.process_set import announce, say_once
from frameworks.tensorflow import keras3
from frameworks.tensorflow.momentum import take_legacy_momentum
from frameworks.tensorflow.reduce import check_options, make_reduce_grads
from grace.pipeline import Pipeline


def DistributedGradientTape(gradtape, device_dense="", device_sparse="", compression=None,
                            sparse_as_dense=False, op=hvd.Average, gradient_predivide_factor=1.0,
                            num_groups=0, groups=None, process_set=hvd.global_process_set,
                            scale_local_gradients=True):
    """``hvd.DistributedGradientTape`` whose ``gradient()`` combines gradients through the grace
    pipeline ``compression`` (default ``grace.none()``); a Horovod compressor goes to Horovod's own.
    Either way its sources may be Keras 3 variables (``model.trainable_variables``: see
    ``frameworks.tensorflow.keras3``).

    Works eagerly and inside ``tf.function`` (traced once: per-tensor state lives in variables),
    with the compression built outside the step or inside it, as Horovod's examples build it."""
    if compression is None:
        import grace

        compression = grace.none()
    original = internals.original("horovod.tensorflow", "DistributedGradientTape")
    if not isinstance(compression, Pipeline):
        return keras3.horovods_tape(original, gradtape, device_dense, device_sparse, compression,
                                    sparse_as_dense, op, gradient_predivide_factor, num_groups,
                                    groups, process_set, scale_local_gradients)
    compression = keras3.shared_while_tracing(compression, process_set)
    reduce_grads = make_reduce_grads(compression, op, gradient_predivide_factor, sparse_as_dense,
                                     process_set)  # validates the options first
    # The heap, what else grace changes, and the momentum a compressor applies itself: the tape
    # sees no optimizer to take it from (said once on rank 0).
    announce(compression, process_set, optimizer_seen=False)
    tape = original(gradtape, device_dense, device_sparse, hvd.Compression.none, sparse_as_dense,
                    hvd.Average, 1.0, num_groups, groups, process_set, scale_local_gradients)
    internals.combine_gradients_with(tape, reduce_grads)
    tape._grace_pipeline = compression
    return keras3.mend_tape(tape)


def DistributedOptimizer(optimizer, name=None, use_locking=False, device_dense="", device_sparse="",
                         compression=None, sparse_as_dense=False, backward_passes_per_step=1,
                         op=hvd.Average, gradient_predivide_factor=1.0,
                         average_aggregated_gradients=False, num_groups=0, groups=None,
                         process_set=hvd.global_process_set, scale_local_gradients=True):
    """``horovod.tensorflow.DistributedOptimizer`` with grace: a TF1-style ``tf.compat.v1.train``
    optimizer is wrapped by Horovod's class with grace's gradient combination; a Keras optimizer goes
    to ``frameworks.tensorflow.keras.DistributedOptimizer``."""
    if compression is None:
        import grace

        compression = grace.none()
    original = internals.original("horovod.tensorflow", "DistributedOptimizer")
    args = (name, use_locking, device_dense, device_sparse)
    if not isinstance(compression, Pipeline):
        return original(optimizer, *args, compression, sparse_as_dense, backward_passes_per_step,
                        op, gradient_predivide_factor, average_aggregated_gradients, num_groups,
                        groups, process_set, scale_local_gradients)
    if not internals.is_tf1_optimizer(optimizer):
        from frameworks.tensorflow.keras import DistributedOptimizer as keras_optimizer

        return keras_optimizer(optimizer, name, device_dense, device_sparse, compression,
                               sparse_as_dense, gradient_predivide_factor, op,
                               backward_passes_per_step, average_aggregated_gradients, num_groups,
                               groups, process_set, scale_local_gradients)
    check_options(op, gradient_predivide_factor)  # before the optimizer's momentum is taken
    take_legacy_momentum(optimizer, compression, process_set)
    reduce_grads = make_reduce_grads(compression, op, gradient_predivide_factor, sparse_as_dense,
                                     process_set)
    announce(compression, process_set)
    rate = internals.tf1_setting(optimizer, "learning_rate")
    if isinstance(rate, (int, float)):  # a number (a tensor or a schedule is not judged)
        momentum = float(getattr(optimizer, "_momentum", 0.0))  # 0 where taken over
        say_once(compression.compressor.learning_rate_notice(float(rate), momentum), process_set)
    wrapped = original(optimizer, *args, hvd.Compression.none, sparse_as_dense,
                       backward_passes_per_step, hvd.Average, 1.0, average_aggregated_gradients,
                       num_groups, groups, process_set, scale_local_gradients)
    internals.combine_gradients_with(wrapped, reduce_grads)
    wrapped._grace_pipeline = compression
    return wrapped
