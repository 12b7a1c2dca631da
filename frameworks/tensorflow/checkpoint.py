"""grace's compression state in ``tf.train.Checkpoint``.

    ckpt = tf.train.Checkpoint(model=model, optimizer=optimizer,
                               compression=CompressionState(compression))
    ckpt.write(f"ckpt/rank{hvd.rank()}")     # each worker's own residuals
    ...
    ckpt.read(f"ckpt/rank{hvd.rank()}")      # before or after the first step

The state (residuals, momenta, warm starts, step counters) lives in variables that the pipeline
creates on its first step; this object saves them, as one serialized tensor, whenever the checkpoint
is written, and restores them, creating the variables if the first step has not run yet."""

from __future__ import annotations

import pickle

import numpy as np
import tensorflow as tf

from frameworks.tensorflow.ops import TensorFlowOps
from grace.pipeline import Pipeline


class CompressionState(tf.__internal__.tracking.Trackable):
    """A checkpointable view of a grace pipeline's per-worker state (for ``tf.train.Checkpoint``)."""

    def __init__(self, pipeline: Pipeline):
        if not isinstance(pipeline, Pipeline):
            raise ValueError(f"pipeline must be a grace Pipeline (grace.topk(...)), got {pipeline!r}")
        self.pipeline = pipeline

    def _serialize_to_tensors(self):
        state = self.pipeline.state_dict()
        return {"state": tf.constant(pickle.dumps(_to_numpy(state)))}

    def _restore_from_tensors(self, restored_tensors):
        state = pickle.loads(restored_tensors["state"].numpy())
        self.pipeline.load_state_dict(state, TensorFlowOps())
        return tf.no_op()


def _to_numpy(value):
    if isinstance(value, dict):
        return {k: _to_numpy(v) for k, v in value.items()}
    if hasattr(value, "numpy"):
        return np.asarray(value.numpy())
    return value
