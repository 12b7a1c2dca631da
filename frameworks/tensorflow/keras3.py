"""Horovod 0.28.1's TensorFlow 2 entry points on Keras 3 variables, as TF2 users write their loops.

Horovod's own TF2 examples tape a Keras model (``hvd.DistributedGradientTape`` over
``model.trainable_variables``, inside ``tf.function``) and broadcast its variables with
``hvd.broadcast_variables``. Horovod 0.28.1 was written for ``tf.keras`` 2, whose variables were
``tf.Variable``s; Keras 3's are not, and three things break:

- the tape keys its sources by ``source.ref()``, which Keras 3 variables lack (``AttributeError``),
  whatever the compression;
- ``hvd.broadcast_variables`` called eagerly hands the variables to a ``tf.function``, which takes a
  Keras 3 variable for a tensor and cannot assign to it;
- ``horovod.tensorflow.keras.callbacks.BroadcastGlobalVariablesCallback`` calls ``ref()`` too, and
  ``optimizer.variables()``, a list on Keras 3; its ``MetricAverageCallback``,
  ``LearningRateScheduleCallback`` and ``LearningRateWarmupCallback`` call ``keras.backend``
  functions that Keras 3 removed and read ``optimizer.lr``, which Keras 3 calls ``learning_rate``.

``import grace`` mends them for every compression, Horovod's own included
(``frameworks/internals.py`` routes the functions here and wraps the callbacks' ``__init__``): a
Keras 3 variable is keyed and broadcast through the ``tf.Variable`` that holds its value, and the
callbacks stay Horovod's classes, reading and writing through Keras 3's API. A ``tf.Variable``
takes Horovod's own code path, unchanged; Horovod's reduction and compression are never touched.
One thing cannot be mended:
Keras 3 bakes SGD's momentum into the traced step, so the learning-rate callbacks' momentum
correction (Goyal et al. 2017) is not applied, and rank 0 says so once.
``GRACE_MEND_HOROVOD=0`` leaves Horovod as it is (docs/tensorflow.md, "TF2 loops over a Keras 3 model").

Horovod's examples also build the compression inside the traced step, so every trace builds a new
object; a grace pipeline keeps state (residuals, counters) in variables, which a later trace may not
create. So a pipeline built while TensorFlow traces a function is the one pipeline of its settings for
every trace: ``shared_while_tracing`` hands back the first one built with the same settings.
"""

from __future__ import annotations

import os
from typing import Any, Sequence

import keras
import tensorflow as tf

from frameworks import internals
from frameworks.process_set import say_once
from frameworks.tensorflow.broadcast import broadcast_model_and_optimizer

MEND_ENV = "GRACE_MEND_HOROVOD"


def mends_horovod() -> bool:
    """Whether ``import grace`` mends Horovod's TF2 entry points on Keras 3 (``GRACE_MEND_HOROVOD``,
    on unless ``0``)."""
    return os.environ.get(MEND_ENV, "1") != "0"


def held_variable(variable: Any) -> Any:
    """The ``tf.Variable`` that holds a Keras 3 variable's value; anything else as it is."""
    if hasattr(variable, "ref") or not hasattr(variable, "path"):
        return variable
    value = variable.value  # outside an autocast scope: the tf.Variable itself, not a cast of it
    return value if isinstance(value, tf.Variable) else variable


def source_key(source: Any) -> Any:
    """The key Horovod's tape gives a source (``ref()``), for a Keras 3 variable too."""
    return held_variable(source).ref()


def mend_tape(tape: Any) -> Any:
    """Horovod's ``_DistributedGradientTape`` ``tape`` (any compression) made to accept Keras 3
    variables as sources: ``gradient`` and ``register_local_source`` key them by ``source_key``,
    with Horovod's semantics (local sources not reduced, and divided by the workers' count when
    ``scale_local_gradients``). Sources that all have ``ref()`` go to Horovod's own ``gradient``."""
    horovods_gradient = tape.gradient
    local, process_set, size_of = internals.tf_tape_internals(tape)

    @tf.autograph.experimental.do_not_convert  # as Horovod's own, inside tf.function: plain Python
    def gradient(target, sources, output_gradients=None, use_generic_names=False):
        flat = tf.nest.flatten(sources)
        if all(hasattr(s, "ref") for s in flat):
            return horovods_gradient(target, sources, output_gradients, use_generic_names)
        say_once("grace: Horovod's DistributedGradientTape keys its sources by ref(), which Keras 3 "
                 "variables lack; grace keys each by the tf.Variable that holds its value "
                 f"(with Horovod's own compression too, unless {MEND_ENV}=0)", process_set)
        grads = list(tf.GradientTape.gradient(tape, target, flat, output_gradients))
        keys = [source_key(s) for s in flat]
        reduced = [i for i, key in enumerate(keys) if key not in local]
        combined = tape._allreduce_grads([grads[i] for i in reduced], [flat[i] for i in reduced],
                                         use_generic_names)
        for i, grad in zip(reduced, combined):
            grads[i] = grad
        if tape.scale_local_gradients and local:
            workers = size_of()
            for i, key in enumerate(keys):
                if key in local and grads[i] is not None:
                    grads[i] = _divided(grads[i], workers)
        return tf.nest.pack_sequence_as(sources, grads)

    def register_local_source(source):
        local.add(source_key(source))

    tape.gradient = gradient
    tape.register_local_source = register_local_source
    return tape


def _divided(grad: Any, workers: Any) -> Any:
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(grad.values / workers, grad.indices, grad.dense_shape)
    return grad / workers


def horovods_tape(original: Any, *args: Any, **kwargs: Any) -> Any:
    """``hvd.DistributedGradientTape`` with a compression that is not grace's (Horovod's own, or
    none given): Horovod's own tape, with Horovod's own arguments and defaults, its sources keyed
    for Keras 3 variables (``mend_tape``) unless ``GRACE_MEND_HOROVOD=0``."""
    tape = original(*args, **kwargs)
    return mend_tape(tape) if mends_horovod() else tape


def horovods_broadcast_variables(original: Any, variables: Sequence, *args: Any, **kwargs: Any) -> Any:
    """``hvd.broadcast_variables`` for Keras 3 variables too: each goes as the ``tf.Variable`` that
    holds its value, through Horovod's own broadcast (eagerly or inside ``tf.function``), unless
    ``GRACE_MEND_HOROVOD=0``."""
    if mends_horovod():
        variables = [held_variable(v) for v in variables]
    return original(variables, *args, **kwargs)


class _Keras3Backend:
    """The ``keras.backend`` functions Horovod's Keras callbacks call eagerly, on Keras 3."""

    @staticmethod
    def constant(value: Any, name: str | None = None) -> Any:
        """``keras.backend.constant``: a TF constant."""
        return tf.constant(value, name=name)

    @staticmethod
    def get_value(value: Any) -> Any:
        """``keras.backend.get_value``: the value as numpy."""
        return keras.ops.convert_to_numpy(value)


def learning_rate_of(optimizer: Any) -> float:
    """A Keras 3 optimizer's learning rate now (a schedule's value at this step), as a float, read
    eagerly (also from inside a traced step)."""
    with tf.init_scope():
        return float(keras.ops.convert_to_numpy(optimizer.learning_rate))


def variable_list(variables: Any) -> list:
    """``None``, one variable or several, as a list (Horovod's ``local_variables`` takes each)."""
    if variables is None:
        return []
    if hasattr(variables, "shape") and hasattr(variables, "assign"):  # one variable
        return [variables]
    return list(variables)


def mend_broadcast_callback(callback: Any, init: Any, root_rank: int, device: str = "",
                            local_variables: Any = None) -> None:
    """``hvd.callbacks.BroadcastGlobalVariablesCallback(root_rank, device, local_variables)`` on
    Keras 3: Horovod's, which refuses Keras 3 variables as ``local_variables``, so they are keyed
    here (``source_key``); its methods are mended on the class (``_mend_methods``)."""
    _mend_methods()
    if not mends_horovod():
        return init(callback, root_rank, device, local_variables)
    init(callback, root_rank, device)
    internals.horovod_attribute(callback, "_local_vars").update(
        source_key(v) for v in variable_list(local_variables))


def mend_metric_average(callback: Any, init: Any, *args: Any, **kwargs: Any) -> None:
    """``hvd.callbacks.MetricAverageCallback`` on Keras 3: Horovod's, averaging every metric over
    the workers at each epoch's end, with ``tf.constant`` for ``keras.backend.constant``."""
    init(callback, *args, **kwargs)
    if mends_horovod():
        callback.backend = _Keras3Backend()


def mend_schedule(callback: Any, init: Any, *args: Any, **kwargs: Any) -> None:
    """``hvd.callbacks.LearningRateScheduleCallback`` and ``LearningRateWarmupCallback`` (from
    ``initial_lr / size`` to ``initial_lr`` over ``warmup_epochs``, Goyal et al. 2017) on Keras 3:
    Horovod's, their methods mended on the class (``_mend_methods``)."""
    _mend_methods()
    init(callback, *args, **kwargs)
    if mends_horovod():
        callback.backend = _Keras3Backend()


_MENDED_METHODS: list = []


def _mend_methods() -> None:
    """Mend, once, the methods of Horovod's Keras callbacks that fail on Keras 3, on the classes
    themselves, so that a user's subclass still overrides them; each runs Horovod's own where
    ``GRACE_MEND_HOROVOD=0``. The broadcast is grace's own callback's
    (``frameworks.tensorflow.broadcast.broadcast_model_and_optimizer``); the schedules read and set
    ``optimizer.learning_rate``. Keras 3 compiles SGD's momentum into the traced step as a
    constant, so the schedules' momentum correction cannot be applied: said once on rank 0."""
    if _MENDED_METHODS:
        return
    import horovod.tensorflow as hvd
    from horovod.tensorflow.keras import callbacks

    def mended(cls: type, name: str, method: Any) -> None:
        horovods = getattr(cls, name)

        def choose(self, *args, **kwargs):
            return (method if mends_horovod() else horovods)(self, *args, **kwargs)

        choose.__name__, choose.__doc__ = name, method.__doc__
        setattr(cls, name, choose)
        _MENDED_METHODS.append((cls, name, horovods))

    def on_batch_end(self, batch: int, logs: dict | None = None) -> None:
        """After the first batch, rank ``root_rank``'s model and optimizer variables for all."""
        if self.broadcast_done:
            return
        local = internals.horovod_attribute(self, "_local_vars")
        broadcast_model_and_optimizer(self.model, self.root_rank, hvd.global_process_set,
                                      lambda v: source_key(v) not in local)
        self.broadcast_done = True

    def register_local_var(self, variable: Any) -> None:
        """``variable`` (a Keras 3 one too) is left out of the broadcast."""
        internals.horovod_attribute(self, "_local_vars").add(source_key(variable))

    def adjust(self, epoch: float) -> None:
        """The schedule's rate for ``epoch``, set as Keras 3's ``optimizer.learning_rate``."""
        optimizer = self.model.optimizer
        optimizer.learning_rate = self.initial_lr * self.multiplier(epoch)
        if self.momentum_correction and getattr(optimizer, "momentum", 0.0):
            say_once(f"grace: {type(self).__name__}'s momentum correction is not applied on "
                     "Keras 3, which compiles the optimizer's momentum into the traced step; the "
                     "learning rate follows the schedule (momentum_correction=False silences "
                     "this)", hvd.global_process_set)

    def no_momentum_to_restore(self) -> None:
        """Nothing: the momentum was never changed (``adjust``)."""

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        """The rate in the epoch's logs (and, ending a warm-up, said on rank 0)."""
        rate = learning_rate_of(self.model.optimizer)
        if logs is not None:
            logs["lr"] = rate
        if (hasattr(self, "verbose") and self.end_epoch is not None
                and epoch == self.end_epoch - 1 and self.verbose > 0 and hvd.rank() == 0):
            print(f"\nEpoch {epoch + 1}: finished gradual learning rate warmup to {rate:g}.")

    mended(callbacks.BroadcastGlobalVariablesCallback, "on_batch_end", on_batch_end)
    mended(callbacks.BroadcastGlobalVariablesCallback, "register_local_var", register_local_var)
    for cls in (callbacks.LearningRateScheduleCallback, callbacks.LearningRateWarmupCallback):
        mended(cls, "_adjust_learning_rate", adjust)
        mended(cls, "_restore_momentum_if_needed", no_momentum_to_restore)
        mended(cls, "on_epoch_end", on_epoch_end)


_SHARED: dict = {}


def shared_while_tracing(pipeline: Any, process_set: Any) -> Any:
    """``pipeline``, or, when it was built while TensorFlow traced a function (as Horovod's examples
    build their compression inside the step), the first pipeline that the same line of the same
    ``tf.function`` built with the same settings for the same process set: its state lives in
    variables, which only the first trace may create. Another function, or a new one made at the
    same line (another model's run), builds its own; the entry of a function that is gone is
    dropped with it."""
    site = getattr(pipeline, "built_while_tracing", None)
    if site is None:
        return pipeline
    filename, line, function = site
    if function is not None and function() is None:
        return pipeline
    key = (filename, line, None if function is None else id(function()), repr(pipeline),
           getattr(process_set, "process_set_id", None))
    for stale in [k for k, (ref, _) in _SHARED.items() if ref is not None and ref() is None]:
        del _SHARED[stale]  # a function that is gone: its id may be another's now
    if key not in _SHARED:
        _SHARED[key] = (function, pipeline)
    shared = _SHARED[key][1]
    if shared is not pipeline:
        say_once("grace: the compression built inside a traced function is built again at each "
                 "trace; every trace uses the first one (its state lives in variables, which only "
                 "the first trace may create). Build it once outside the function to read its "
                 "stats()", process_set, key=key)
    return shared
