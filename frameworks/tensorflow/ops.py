"""``grace.ops.Ops`` over TensorFlow tensors, eager or inside ``tf.function``.

Under ``tf.function`` the algorithm code runs once, at tracing; what must change from call to call
(residuals, step counters, byte counts) lives in ``tf.Variable``s created on first use, and random-k's
index draw runs when the graph executes (``tf.numpy_function``)."""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from frameworks.tensorflow.rows import HostRows
from grace import kernels, native
from grace.ops import THIN_COLUMNS, HostAccess, Ops, host_row_sums, index_dtype, unpack_table
from grace.rng import draw_indices, draw_uniform
from grace.sparse import RowStore

HOST_GATHER_MIN = 1 << 16
"""From this many indices into a tensor the loops take, ``gather`` runs numpy's ``take`` (1.5-3 times
faster than ``tf.gather`` on the CPU: 250 K of 25 M, about 2.5-5 ms against 7.5 ms); for fewer, the
``tf.numpy_function``'s fixed cost outweighs it."""

# Build (or load) grace/native now: a first use inside a traced function would have AutoGraph try
# to convert the build's file-system calls.
native.available()


def _ascending(positions, n):
    """The ``k`` distinct ``positions`` in ``[0, n)`` in ascending order, by a mask: linear, where
    a sort is not. Its shape stays static ``[k]``, as ``positions``' was."""
    mask = tf.scatter_nd(tf.reshape(positions, [-1, 1]), tf.ones(tf.shape(positions), tf.bool),
                         tf.reshape(tf.cast(n, positions.dtype), [1]))
    return tf.cast(tf.reshape(tf.where(mask), tf.shape(positions)), positions.dtype)


def _top_k(x, k: int, n, index_type: str):
    """The indices of the ``k`` largest magnitudes of ``x``, ascending."""
    chosen = tf.math.top_k(tf.abs(x), k, sorted=False, index_type=index_type).indices
    return _ascending(chosen, tf.size(x) if n is None else n)


def _host(fn, inputs, dtypes, shapes, stateful=False):
    """``fn`` over the inputs as numpy arrays, in the graph (``tf.numpy_function``): one output for
    one dtype, a list of them for a list of dtypes."""
    outputs = tf.numpy_function(fn, inputs, dtypes, stateful=stateful)
    single = not isinstance(dtypes, (list, tuple))
    # Run eagerly, a list of one dtype gives back one tensor, not a list of one.
    outputs = list(outputs) if isinstance(outputs, (list, tuple)) else [outputs]
    for out, shape in zip(outputs, [shapes] if single else shapes):
        out.set_shape(shape)
    return outputs[0] if single else outputs


def _own_sum(x) -> bool:
    """Whether ``x`` is, through reshapes, the output of an addition in a traced graph: a buffer
    of its own (TensorFlow gives an addition an input's buffer only where nothing else reads that
    input), unlike an eager tensor the caller may hold, or an ``Identity``, which shares its
    input's. Error feedback's compensated tensor (``ResidualMemory.compensate``) is one."""
    if tf.executing_eagerly() or not hasattr(x, "op"):
        return False
    while x.op.type == "Reshape":
        x = x.op.inputs[0]
    return x.op.type in ("AddV2", "Add")


def _unpack_table(bits: int):
    """``grace.ops.unpack_table`` as a constant of the graph."""
    return tf.constant(unpack_table(bits))


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
        if x.dtype.name == dtype:
            return x
        if {x.dtype.name, dtype} == {"float32", "bfloat16"} and kernels.applies(self, [x], dtypes=[]):
            # TensorFlow's own bfloat16 casts run element by element on the CPU: grace/native's
            # loops, the same bits (bf16's encoding and decoding of 25 M elements 2.6 times
            # faster: docs/performance.md, "16-bit casts and sums").
            if dtype == "bfloat16":
                return tf.bitcast(self.on_host(native.bf16_round, [x], ["int16"], [x.shape],
                                               pure=True)[0], tf.bfloat16)
            return self._widened(x, 1.0)
        return tf.cast(x, dtype)

    def _widened(self, x, factor: float):
        """16-bit ``x`` widened to float32 and multiplied by ``factor``, in one pass of
        grace/native's loop (``kernels.applies`` has said yes)."""
        brain = x.dtype == tf.bfloat16
        return self.on_host(lambda bits: native.widen_scaled(bits, brain, factor),
                            [tf.bitcast(x, tf.int16)], ["float32"], [x.shape], pure=True)[0]

    def scale_into(self, x, factor, out):
        if (x.dtype in (tf.float16, tf.bfloat16) and out.dtype == tf.float32
                and kernels.applies(self, [x], dtypes=[])):
            # fp16's and bf16's sums decoded and scaled in one pass, not a cast and a product;
            # IEEE float32's product, which is TensorFlow's but where its flush-to-zero makes a
            # subnormal product 0 (torch's and the loop's keep it).
            return tf.reshape(self._widened(x, factor), out.shape)
        return super().scale_into(x, factor, out)

    def copy(self, x):
        return tf.identity(x)

    def concat(self, xs):
        return tf.concat([tf.reshape(x, [-1]) for x in xs], 0)

    def split(self, x, sizes):
        return tf.split(x, sizes if isinstance(sizes, tf.Tensor) else list(sizes))

    def strided(self, x, stride):
        return x[::stride]

    def slice(self, x, start, length):
        def at(v):
            return tf.reshape(tf.cast(v, tf.int64), [1])
        return tf.slice(x, at(start), at(length))

    def to_bytes(self, x):
        return tf.reshape(tf.bitcast(x, tf.uint8), [-1])

    def from_bytes(self, b, dtype):
        size = tf.as_dtype(dtype).size
        return tf.bitcast(b if size == 1 else tf.reshape(b, [-1, size]), tf.as_dtype(dtype))

    def lengths(self, tensors):
        return tf.stack([tf.size(t, out_type=tf.int32) for t in tensors])

    def add(self, a, b):
        return tf.add(a, b)

    def sub(self, a, b):
        return tf.subtract(a, b)

    def scale(self, x, factor):
        if x.dtype in (tf.float16, tf.bfloat16):
            return tf.cast(tf.cast(x, tf.float32) * tf.constant(factor, tf.float32), x.dtype)
        return x * tf.constant(factor, dtype=x.dtype)

    def abs(self, x):
        return tf.abs(x)

    def static_shape(self, x):
        return tuple(x.shape.as_list())

    def static_numel(self, x):
        return x.shape.num_elements()  # None for a selection whose size is known only at run time

    def full_topk_indices(self, x, k):
        n = x.shape.num_elements()
        return _top_k(x, k, n, index_dtype(n) if n is not None else "int32")

    def gather(self, x, indices):
        taken = indices.shape.num_elements()
        if kernels.applies(self, [x]) and taken is not None and taken >= HOST_GATHER_MIN:
            return _host(np.take, [x, indices], x.dtype, indices.shape)
        return tf.gather(x, indices)

    def scatter_add(self, n, indices, values):
        if kernels.applies(self, [values], numel=n):
            return _host(lambda i, v: native.scatter_add(n, i, v), [indices, values], tf.float32, [n])
        return tf.math.unsorted_segment_sum(values, indices, n)

    def rows_on_host(self, codec, name, rank):
        return HostRows(codec, name, rank)

    def on_host(self, fn, inputs, dtypes, shapes, pure=False):
        return _host(fn, list(inputs), [tf.as_dtype(d) for d in dtypes], list(shapes), stateful=not pure)

    def unique(self, x):
        # tf.unique keeps the order of first appearance: sort the distinct values, and map each
        # element's position through the sorting permutation's inverse.
        values, first = tf.unique(x, out_idx=tf.int64)
        order = tf.argsort(values)
        rank = tf.math.invert_permutation(order)
        return tf.gather(values, order), tf.gather(tf.cast(rank, tf.int64), first)

    def divmod(self, x, divisor):
        divisor = tf.constant(divisor, x.dtype)
        return tf.math.floordiv(x, divisor), tf.math.floormod(x, divisor)

    def add_rows(self, count, positions, rows):
        return tf.math.unsorted_segment_sum(rows, positions, tf.cast(count, tf.int64))

    def zero_at(self, x, indices, overwrite=False, after=()):
        if kernels.applies(self, [x]):
            if overwrite and _own_sum(x):
                # No copy: the sum's buffer becomes the residual, once what reads it has read it
                # (docs/performance.md, "TensorFlow's residual in place").
                return _host(native.zero_in_place, [x, indices, *after], x.dtype, x.shape)
            # One copy on the host: TensorFlow's scatter copies x and then writes k entries at
            # twice a copy's cost (docs/performance.md, "TensorFlow's residual").
            return _host(native.zeroed_copy, [x, indices], x.dtype, x.shape)
        return tf.tensor_scatter_nd_update(x, tf.reshape(indices, [-1, 1]),
                                           tf.zeros(tf.shape(indices), x.dtype))

    def size(self, x):
        return x.shape.num_elements() if x.shape.is_fully_defined() else tf.size(x)

    def full(self, n, value, dtype, like):
        return tf.fill([n], tf.constant(value, dtype=dtype))

    def arange(self, n, dtype, like):
        return tf.range(n, dtype=dtype)

    def constant(self, values, dtype, like):
        return tf.reshape(tf.constant(values, dtype=dtype), [-1])

    def mul(self, a, b):
        return a * b

    def div(self, a, b):
        return a / b

    def sign(self, x):
        return tf.sign(x)

    def where(self, cond, a, b):
        return tf.where(cond, a, b)

    def greater_equal(self, a, b):
        return tf.greater_equal(a, b)

    def less(self, a, b):
        return tf.less(a, b)

    def equal(self, a, b):
        return tf.equal(a, b)

    def floor(self, x):
        return tf.floor(x)

    def round(self, x):
        return tf.round(x)

    def exponent_bits(self, x):
        bits = tf.bitcast(tf.cast(x, tf.float32), tf.int32)
        return tf.bitwise.bitwise_and(tf.bitwise.right_shift(bits, 23), 0xFF)

    def power_of_two(self, exponent):
        return tf.bitcast(tf.bitwise.left_shift(tf.cast(exponent, tf.int32), 23), tf.float32)

    def bucketize(self, x, boundaries):
        return tf.searchsorted(boundaries, x, side="right", out_type=tf.int32)

    def sqrt(self, x):
        return tf.sqrt(x)

    def maximum(self, a, b):
        return tf.maximum(a, _like(b, a))

    def minimum(self, a, b):
        return tf.minimum(a, _like(b, a))

    def _composite_sum(self, x):
        if x.dtype.is_floating:
            return tf.reshape(tf.cast(tf.reduce_sum(tf.cast(x, tf.float64)), x.dtype), [1])
        return tf.reshape(tf.reduce_sum(x), [1])

    def max(self, x):
        return tf.reshape(tf.cond(tf.size(x) > 0, lambda: tf.reduce_max(x),
                                  lambda: tf.zeros([], x.dtype)), [1])

    def nonfinite_flag(self, x):
        finite = tf.reduce_all(tf.math.is_finite(tf.cast(x, tf.float32)))
        return tf.reshape(1.0 - tf.cast(finite, tf.float32), [1])

    def nonzero(self, mask):
        n = mask.shape.num_elements() or 0
        return tf.cast(tf.reshape(tf.where(mask), [-1]), index_dtype(n))

    def sort(self, x):
        return tf.sort(x)

    def cond(self, pred, true_fn, false_fn):
        if isinstance(pred, bool):
            return true_fn() if pred else false_fn()
        return tf.cond(tf.reshape(pred, []), true_fn, false_fn)

    def pack_bits(self, codes, bits):
        if 8 % bits == 0:  # whole codes per byte: shifted ORs of columns of codes
            per = 8 // bits
            c = tf.cast(codes, tf.uint8)
            c = tf.reshape(tf.pad(tf.reshape(c, [-1]), [[0, (-self.numel(codes)) % per]]), [-1, per])
            out = c[:, 0]
            for j in range(1, per):
                out = tf.bitwise.bitwise_or(out, tf.bitwise.left_shift(c[:, j], tf.constant(bits * j,
                                                                                           tf.uint8)))
            return out
        planes = tf.bitwise.bitwise_and(
            tf.bitwise.right_shift(tf.reshape(tf.cast(codes, tf.int32), [-1, 1]), tf.range(bits)), 1)
        planes = tf.reshape(planes, [-1])
        planes = tf.pad(planes, [[0, (-(self.numel(codes) * bits)) % 8]])
        weights = tf.bitwise.left_shift(1, tf.range(8))
        return tf.cast(tf.reduce_sum(tf.reshape(planes, [-1, 8]) * weights, axis=1), tf.uint8)

    def unpack_bits(self, packed, bits, n):
        if 8 % bits == 0:  # a table from each byte value to its codes
            return tf.reshape(tf.gather(_unpack_table(bits), tf.cast(packed, tf.int32)), [-1])[:n]
        planes = tf.bitwise.bitwise_and(
            tf.bitwise.right_shift(tf.reshape(tf.cast(packed, tf.int32), [-1, 1]), tf.range(8)), 1)
        planes = tf.reshape(planes, [-1])[: n * bits]
        weights = tf.bitwise.left_shift(1, tf.range(bits))
        return tf.reduce_sum(tf.reshape(planes, [n, bits]) * weights, axis=1)

    def unpack_values(self, packed, bits, n, values):
        if 8 % bits != 0:
            return super().unpack_values(packed, bits, n, values)
        table = tf.gather(values, tf.cast(_unpack_table(bits), tf.int32))
        return tf.reshape(tf.gather(table, tf.cast(packed, tf.int32)), [-1])[:n]

    # --- grace/native's fused loops, on the host ---------------------------------------------------
    def _sums(self, x):
        return _host(lambda a: np.array(native.sums(a), np.float64), [x], tf.float64, [3])

    def row_sums(self, x):
        sums = _host(host_row_sums, [x], tf.float64, [x.shape[0]])
        return tf.cast(sums, x.dtype)

    def sum(self, x):
        if kernels.applies(self, [x]):
            return tf.reshape(tf.cast(self._sums(x)[0], x.dtype), [1])
        return self._composite_sum(x)

    def norm(self, x):
        if kernels.applies(self, [x]):
            return tf.reshape(tf.cast(tf.sqrt(self._sums(x)[1]), x.dtype), [1])
        return super().norm(x)

    def max_abs(self, x):
        if kernels.applies(self, [x]):
            return tf.reshape(tf.cast(self._sums(x)[2], x.dtype), [1])
        return super().max_abs(x)

    def order_statistics(self, x, ranks):
        m = x.shape.num_elements()
        if m is None or len(ranks) > 4:
            return super().order_statistics(x, ranks)
        # Each from the shorter end with top_k (sorted), instead of sorting everything.
        picked = []
        for r in ranks:
            r = int(r)
            if r >= m // 2:
                picked.append(tf.math.top_k(x, m - r, sorted=True).values[m - r - 1])
            else:
                picked.append(-tf.math.top_k(-x, r + 1, sorted=True).values[r])
        return tf.stack(picked)

    def count_at_least(self, x, threshold):
        if not kernels.applies(self, [x]):
            return tf.math.count_nonzero(tf.abs(x) >= tf.cast(threshold, x.dtype), dtype=tf.int64)

        def run(a, t):
            return np.int64(native.count_at_least(np.ascontiguousarray(a), float(np.reshape(t, -1)[0])))

        return _host(run, [x, tf.cast(threshold, x.dtype)], tf.int64, [])

    def indices_at_least(self, x, threshold):
        if not kernels.applies(self, [x]):
            return super().indices_at_least(x, threshold)
        dtype = index_dtype(x.shape.num_elements())

        def run(a, t):
            return native.indices_at_least(np.ascontiguousarray(a), float(np.reshape(t, -1)[0]), dtype)

        return _host(run, [x, tf.cast(threshold, x.dtype)], tf.as_dtype(dtype), [None])

    def host_access(self, tensors):
        return HostAccess(on_host=True, contiguous=True, crossing=True)  # copied in and out

    def matmul(self, a, b, transpose_a=False, transpose_b=False, subtract_from=None):
        if (transpose_a and not transpose_b and a.shape.rank == b.shape.rank == 2
                and b.shape[1] is not None and b.shape[1] <= THIN_COLUMNS):
            # Mᵀ P with a thin P (PowerSGD's second product) as (Pᵀ M)ᵀ, reading M as it lies: 2-2.5
            # times faster on the CPU (docs/performance.md, "PowerSGD's products").
            product = tf.transpose(tf.matmul(b, a, transpose_a=True))
        else:
            product = tf.matmul(a, b, transpose_a=transpose_a, transpose_b=transpose_b)
        return product if subtract_from is None else subtract_from - product

    def orthogonalize(self, x):
        return tf.linalg.qr(x)[0]

    def random_uniform(self, n, seed_of, step, like):
        values = tf.numpy_function(lambda s: draw_uniform(n, seed_of(int(s))), [step], tf.float32,
                                   stateful=False)
        values.set_shape([n])
        return values

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

    def read_state(self, store, key, like, initial=None):
        if key not in store:
            value = tf.zeros_like(like) if initial is None else tf.constant(initial, like.dtype)
            store[key] = tf.Variable(value, trainable=False, name=_variable_name(key))
        return store[key].read_value()

    def _variable(self, store, key, like):
        if key not in store:
            if isinstance(store, RowStore):  # rows whose number changes: a variable first dimension
                store[key] = tf.Variable(like, trainable=False, name=_variable_name(key),
                                         shape=tf.TensorShape([None, *like.shape[1:]]))
            else:
                store[key] = tf.Variable(tf.zeros_like(like), trainable=False,
                                         name=_variable_name(key))
        return store[key]

    def prepare_rows(self, index_store, value_store, key, like_indices, like):
        # State must exist from the first traced call: no rows at first.
        if key not in index_store:
            self._variable(index_store, key, tf.zeros([0], like_indices.dtype))
            self._variable(value_store, key, tf.zeros([0, *like.shape[1:]], like.dtype))

    def write_state(self, store, key, value, unless=False):
        variable = self._variable(store, key, value)
        if unless is False:
            variable.assign(value)
            return
        # In a traced graph the flag is only known when it runs: keep the old value where it is set.
        # A cond picks one of the two whole tensors; tf.where would broadcast the scalar flag over
        # every element (about 11 ms for 2.4 M elements on one core: 135 ms a step on ResNet-50).
        value = tf.cast(value, variable.dtype)
        variable.assign(tf.cond(unless, variable.read_value, lambda: value))

    def count_of(self, store, key):
        return self._variable(store, key, tf.constant(0, tf.int64)).read_value()

    def add_to_count(self, store, key, increment):
        return self._variable(store, key, tf.constant(0, tf.int64)).assign_add(increment) - increment

    def as_count(self, increment):
        return tf.cast(increment, tf.int64)

    def is_set(self, flag):
        return tf.reshape(tf.cast(flag, tf.float32), [-1])[0] > 0

    def snapshot(self, value):
        return value.numpy() if isinstance(value, tf.Variable) else tf.identity(value)

    def nan_if(self, dropped, x):
        # A cond, not an element-wise tf.where over a broadcast scalar (write_state says why).
        return tf.cond(dropped, lambda: tf.fill(tf.shape(x), tf.constant(float("nan"), x.dtype)),
                       lambda: tf.identity(x))


def _like(value, tensor):
    """``value`` in ``tensor``'s dtype; a Python number is made in that dtype directly (casting goes
    through float32 first, where float64's extremes do not fit)."""
    if isinstance(value, tf.Tensor):
        return tf.cast(value, tensor.dtype)
    return tf.constant(value, dtype=tensor.dtype)


def _variable_name(key: str) -> str:
    return "grace_" + "".join(c if c.isalnum() or c in "_." else "_" for c in key)
