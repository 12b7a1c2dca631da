"""The TensorFlow optimizers' momentum, handed to a compressor that applies it itself (see
``grace.momentum``): Keras 3's ``SGD(momentum=, nesterov=)`` and ``Adam(beta_1=)``, and TF1's
``MomentumOptimizer`` and ``AdamOptimizer``. ``DistributedGradientTape`` never sees the optimizer:
with it, give the momentum to the compression (``grace.dgc(momentum=0.9)``) and none to the
optimizer."""

from __future__ import annotations

import keras
import tensorflow as tf

from frameworks import internals
from frameworks.process_set import log_once
from grace.momentum import OptimizerMomentum
from grace.pipeline import Pipeline

KEEP_ADAM = ("amsgrad", "clipnorm", "clipvalue", "global_clipnorm", "loss_scale_factor", "use_ema",
             "gradient_accumulation_steps")
"""A Keras Adam's settings that keep its moments with it: AMSGrad's running maximum is Adam's to
keep, and the others change the updates on their way (clipping, a loss scale, a moving average
of the weights, accumulation over micro-steps)."""


def keras_adam_kept(config: dict) -> list[str]:
    """The settings of ``KEEP_ADAM`` this Keras Adam's ``config`` sets."""
    return [key for key in KEEP_ADAM if config.get(key)]


def take_keras_adam_moments(optimizer_class, config: dict, compression: Pipeline, process_set,
                            averaged: bool) -> bool:
    """Whether ``compression`` takes a Keras ``Adam``'s or ``AdamW``'s moments over
    (``Pipeline.take_adam_moments``: random-k), so that the wrapper steps the tensors it compresses
    by their updates. Not with AMSGrad (its running maximum is Adam's to keep), nor where Keras
    would change the updates on their way (clipping, a loss scale, a moving average of the weights,
    accumulation over micro-steps): the optimizer then steps everything, as it is."""
    if not issubclass(optimizer_class, keras.optimizers.Adam) or keras_adam_kept(config):
        return False
    line = compression.take_adam_moments(float(config.get("beta_2", 0.999)),
                                         float(config.get("epsilon", 1e-7)), averaged=averaged)
    log_once(line, process_set)
    return compression.adam_moments_taken


def take_keras_momentum(optimizer_class, config: dict, compression: Pipeline, process_set) -> dict:
    """The config of a Keras optimizer to build, with its momentum set to 0 where ``compression``
    took it over."""
    if issubclass(optimizer_class, keras.optimizers.SGD):
        found = OptimizerMomentum(float(config.get("momentum", 0.0)), bool(config.get("nesterov", False)),
                                  source="keras SGD's momentum")
        line = compression.take_momentum(found)
        if line is not None:
            config = {**config, "momentum": 0.0, "nesterov": False}
    elif issubclass(optimizer_class, (keras.optimizers.Adam, keras.optimizers.AdamW)):
        beta1 = float(config.get("beta_1", 0.0))
        kept = keras_adam_kept(config)
        log_once(compression.adam_caution(f"keras {optimizer_class.__name__}" + (
            f" ({', '.join(kept)} set: Adam keeps its moments)" if kept else "")), process_set)
        line = compression.take_momentum(OptimizerMomentum(beta1, dampening=beta1,
                                                        source="keras Adam's beta_1"), adam=True)
        if line is not None:
            config = {**config, "beta_1": 0.0}
    else:
        return config
    log_once(line, process_set)
    return config


def take_legacy_momentum(optimizer, compression: Pipeline, process_set) -> None:
    """The same for a TF1 ``tf.compat.v1.train`` optimizer, whose settings are private attributes
    read when it first applies gradients."""
    if isinstance(optimizer, tf.compat.v1.train.MomentumOptimizer):
        found = OptimizerMomentum(float(internals.tf1_setting(optimizer, "momentum")),
                                  bool(internals.tf1_setting(optimizer, "nesterov")),
                                  source="MomentumOptimizer's momentum")
        line = compression.take_momentum(found)
        if line is not None:
            internals.set_tf1_setting(optimizer, "momentum", 0.0)
            internals.set_tf1_setting(optimizer, "nesterov", False)
    elif isinstance(optimizer, tf.compat.v1.train.AdamOptimizer):
        beta1 = float(internals.tf1_setting(optimizer, "beta1"))
        log_once(compression.adam_caution("AdamOptimizer"), process_set)
        line = compression.take_momentum(OptimizerMomentum(beta1, dampening=beta1,
                                                        source="AdamOptimizer's beta1"), adam=True)
        if line is not None:
            internals.set_tf1_setting(optimizer, "beta1", 0.0)
    else:
        return
    log_once(line, process_set)
