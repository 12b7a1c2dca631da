"""The one function every TensorFlow wrapper uses to combine gradients through a grace pipeline."""

from __future__ import annotations

from typing import Callable, Sequence

import horovod.tensorflow as hvd
import tensorflow as tf

from frameworks.process_set import compares_at_construction, gather_objects
from frameworks.tensorflow import layout
from frameworks.tensorflow.collectives import HorovodCollectives
from frameworks.tensorflow.ops import TensorFlowOps
from grace import agreement
from grace.pipeline import Pipeline
from grace.sparse import Rows

_OPS = TensorFlowOps()


def check_options(op, gradient_predivide_factor: float) -> None:
    """The options grace refuses, checked where the user builds the wrapper."""
    if op not in (hvd.Average, hvd.Sum):
        raise ValueError("op must be hvd.Average or hvd.Sum with grace compression "
                         "(Adasum combines uncompressed model deltas)")
    if gradient_predivide_factor != 1.0 and op != hvd.Average:
        raise ValueError("gradient_predivide_factor not supported with op != Average")


def variable_name(variable, index: int) -> str:
    """A name that is the same on every worker and in every call: Keras 3's path, else the TF name
    without its ``:0`` suffix, else the position."""
    if variable is None:
        return f"grad_{index}"
    path = getattr(variable, "path", None)
    return path if isinstance(path, str) else variable.name.split(":")[0]


def _check_agreement(pipeline, collectives, **options) -> None:
    """Where the wrapper is built eagerly (Keras and TF1 optimizers, a tape outside tf.function),
    fail at once on every worker if the workers compress differently. (Variables are not known
    yet here; Horovod itself rejects tensors whose shapes differ across workers.)"""
    if collectives.size == 1 or not tf.executing_eagerly() or \
            not compares_at_construction(collectives.process_set):
        return
    mine = agreement.describe(pipeline, [], **options)
    agreement.check(gather_objects(hvd, mine, collectives.process_set, "grace.agreement"))


def _rows(grad: tf.IndexedSlices, variable) -> Rows:
    """A ``tf.IndexedSlices`` gradient as rows of its table, whose shape must be known when the
    graph is traced (the variable's, else the gradient's static ``dense_shape``)."""
    shape = None if variable is None else tf.TensorShape(variable.shape)  # Keras 3's: a tuple
    if shape is None or not shape.is_fully_defined():
        static = None if grad.dense_shape is None else tf.get_static_value(grad.dense_shape)
        if static is None:
            raise ValueError("a sparse gradient (tf.IndexedSlices) travels as rows of its table, "
                             "whose shape must be known: pass the variables with the gradients, "
                             "or sparse_as_dense=True")
        shape = static
    return Rows(grad.indices, grad.values, tuple(int(d) for d in shape))


def make_reduce_grads(pipeline: Pipeline, op=hvd.Average, gradient_predivide_factor: float = 1.0,
                      sparse_as_dense: bool = False, process_set=None) -> Callable:
    """``reduce(grads, vars=None, use_generic_names=False) -> grads``: Horovod's signature for the
    function its wrappers call to combine gradients; ``None`` gradients stay ``None``."""
    check_options(op, gradient_predivide_factor)
    collectives = HorovodCollectives(process_set)
    _check_agreement(pipeline, collectives, op=op, gradient_predivide_factor=gradient_predivide_factor,
                     sparse_as_dense=sparse_as_dense)
    if pipeline.hierarchical:  # the hosts' process sets, made now (eagerly) on every worker
        collectives.hosts()
    reorders = pipeline.compressor.layout_sensitive

    def reduce_grads(grads: Sequence, variables: Sequence | None = None, use_generic_names=False):
        grads = list(grads)
        variables = list(variables) if variables is not None else [None] * len(grads)
        names = [variable_name(v, i) for i, v in enumerate(variables)]
        # Keras's kernels in PyTorch's order for a compressor whose blocks depend on it (layout.py).
        turned = {i for i, (g, n) in enumerate(zip(grads, names))
                  if reorders and isinstance(g, tf.Tensor) and g.shape.rank is not None
                  and layout.is_output_last(n, g.shape.rank)}
        if len(set(names)) != len(names):
            names = [f"{n}.{i}" for i, n in enumerate(names)]
        present, sparse = [], []
        for position, (grad, name) in enumerate(zip(grads, names)):
            if grad is None:
                continue
            if isinstance(grad, tf.IndexedSlices) and sparse_as_dense:
                grad = tf.convert_to_tensor(grad)
            if op == hvd.Average and gradient_predivide_factor != 1.0:
                grad = grad / gradient_predivide_factor  # IndexedSlices: its values
            if isinstance(grad, tf.IndexedSlices):  # travels as rows (grace.sparse)
                sparse.append((position, _rows(grad, variables[position]), name))
            else:
                present.append((position, layout.output_major(grad) if position in turned else grad,
                                name))
        # Buckets in reverse variable order, as backward makes the gradients (as in PyTorch).
        present.reverse()
        buckets = pipeline.buckets([(_OPS.shape(g), _OPS.dtype(g)) for _, g, _ in present], _OPS)
        exchanges = [pipeline.start_sparse(rows, name, collectives, _OPS) for _, rows, name in sparse]
        exchanges += [pipeline.start_bucket([present[i][1] for i in bucket],
                                            [present[i][2] for i in bucket], collectives, _OPS)
                      for bucket in buckets]
        scale = gradient_predivide_factor / collectives.size if op == hvd.Average else 1.0
        # One verdict for the step: an Inf or NaN anywhere drops every tensor's state writes.
        finished = pipeline.finish_step(exchanges, collectives, scale)
        combined: list = [None] * len(grads)
        for (position, _, _), rows in zip(sparse, finished):
            combined[position] = tf.IndexedSlices(rows.values, rows.indices,
                                                  tf.constant(rows.dense_shape, tf.int64))
        for bucket, results in zip(buckets, finished[len(sparse):]):
            for i, result in zip(bucket, results):
                position = present[i][0]
                combined[position] = layout.output_last(result) if position in turned else result
        return combined

    return reduce_grads
