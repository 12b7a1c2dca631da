"""``grace.ops.Ops`` over TensorFlow tensors, eager or inside ``tf.function``.

Under ``tf.function`` the algorithm code runs once, at tracing; what must change from call to call
(residuals, step counters, byte counts) lives in ``tf.Variable``s created on first use, and random-k's
index draw runs when the graph executes (``tf.numpy_function``)."""

from __future__ import annotations

import tensorflow as tf

from grace.ops import Ops, draw_indices, index_dtype


class TensorFlowOps(Ops):
    name = "tensorflow"

    def shape(self, x):
        shape = x.shape
        if not shape.is_fully_defined():
            raise ValueError(f"grace needs gradients of a static shape, got {shape}")
        return tuple(shape.as_list())

    def dtype(self, x):
        return x.dtype.name

    def itemsize(self, dtype):
        return tf.as_dtype(dtype).size

    def zeros(self, n, dtype, like):
        return tf.zeros([n], dtype=dtype)

    def flatten(self, x):
        return tf.reshape(x, [-1])

    def reshape(self, x, shape):
        return tf.reshape(x, list(shape))

    def cast(self, x, dtype):
        return x if x.dtype.name == dtype else tf.cast(x, dtype)

    def copy(self, x):
        return tf.identity(x)

    def concat(self, xs):
        return tf.concat([tf.reshape(x, [-1]) for x in xs], 0)

    def split(self, x, sizes):
        return tf.split(x, list(sizes))

    def add(self, a, b):
        return tf.add(a, b)

    def sub(self, a, b):
        return tf.subtract(a, b)

    def scale(self, x, factor):
        return x * tf.constant(factor, dtype=x.dtype)

    def abs(self, x):
        return tf.abs(x)

    def topk_indices(self, x, k):
        n = self.numel(x)
        return tf.math.top_k(tf.abs(x), k, sorted=False, index_type=index_dtype(n)).indices

    def gather(self, x, indices):
        return tf.gather(x, indices)

    def scatter_add(self, n, indices, values):
        return tf.math.unsorted_segment_sum(values, indices, n)

    def from_numpy(self, array, like):
        return tf.convert_to_tensor(array)

    def to_numpy(self, x):
        if x.dtype == tf.bfloat16:
            x = tf.cast(x, tf.float32)
        return x.numpy()

    def random_indices(self, n, k, seed_of, step, like):
        dtype = index_dtype(n)
        indices = tf.numpy_function(lambda s: draw_indices(n, k, seed_of(int(s))), [step], dtype,
                                    stateful=False)
        indices.set_shape([k])
        return indices

    def load(self, store, key, like):
        if key not in store:
            store[key] = tf.Variable(tf.zeros_like(like), trainable=False,
                                     name=_variable_name(key))
        return store[key].read_value()

    def save(self, store, key, value):
        if key not in store:
            store[key] = tf.Variable(tf.zeros_like(value), trainable=False,
                                     name=_variable_name(key))
        store[key].assign(value)

    def counter(self, store, key, increment=1):
        if key not in store:
            store[key] = tf.Variable(0, dtype=tf.int64, trainable=False, name=_variable_name(key))
        return store[key].assign_add(increment) - increment


def _variable_name(key: str) -> str:
    return "grace_" + "".join(c if c.isalnum() or c in "_." else "_" for c in key)
