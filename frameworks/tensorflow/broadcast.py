"""Rank 0's values of Keras 3 variables for every worker: a model's and its optimizer's (what
Horovod's ``broadcast_variables`` and its Keras callback do, which fail on Keras 3 variables)."""

from __future__ import annotations

import horovod.tensorflow as hvd
import keras
import tensorflow as tf


def broadcast_variables(variables, root_rank: int = 0, process_set=hvd.global_process_set,
                        name: str = "grace.broadcast") -> None:
    """Give every worker ``root_rank``'s values of ``variables`` (Keras 3 or tf variables), in
    place. Every worker must call it with the same variables in the same order."""
    for i, variable in enumerate(variables):
        value = hvd.broadcast(tf.convert_to_tensor(variable), root_rank, name=f"{name}.{i}",
                              ignore_name_scope=True, process_set=process_set)
        variable.assign(value)


def broadcast_model_and_optimizer(model, root_rank: int, process_set, broadcast) -> None:
    """Give every worker ``root_rank``'s values of ``model``'s variables for which ``broadcast``
    is true, and of its optimizer's (Keras's own ``Optimizer.variables``: Horovod's Keras wrapper
    overrides it with a method that fails): grace's callback and Horovod's, mended."""
    broadcast_variables([v for v in model.variables if broadcast(v)], root_rank, process_set,
                        "grace.model")
    if model.optimizer is not None:
        broadcast_variables(keras.optimizers.Optimizer.variables.fget(model.optimizer), root_rank,
                            process_set, "grace.optimizer")
