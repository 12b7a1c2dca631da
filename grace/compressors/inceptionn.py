from __future__ import annotations

import numpy as np

from grace import native
from grace.compressor import LENGTH_BYTES, Compressor, at_least_bytes, compute_dtype
from grace.kernels import accelerated
from grace.validation import check_positive


class Inceptionn(Compressor):
    """INCEPTIONN's error-bounded float compression: with ``e = error_bound``, each element is sent
    in 0, 8, 16 or 32 bits by its magnitude: elements that round to 0 in steps of ``e`` are dropped
    (0 bits), the others are sent as a signed multiple of ``e`` in 8 bits when it fits in 7 bits,
    else in 16 bits when it fits in 15, else as the float itself (32 bits). A 2-bit tag per element
    says which. Every element is reproduced within ``e / 2`` (exactly in the 32-bit class). Should
    the encoded form (its lengths included) not be smaller than the tensor on some worker, every
    worker sends the tensor dense that step (``agrees_on_form``). The rounding error (the dropped
    elements whole) stays in a residual (error feedback) by default: a layer whose gradients are all
    below ``e / 2`` would otherwise never move (a word model's perplexity: +8.7% without, fp32's
    with, docs/quality.md). Li et al.,
    "A Network-Centric Hardware/Algorithm Co-Design to Accelerate Distributed Training of Deep Neural
    Networks", MICRO 2018."""

    name = "inceptionn"
    default_memory = "residual"
    default_communicator = "allgather"
    fixed_size = False
    agrees_on_form = True

    def __init__(self, error_bound: float = 2.0**-10):
        self.error_bound = check_positive("error_bound", error_bound)

    def params(self):
        return {"error_bound": self.error_bound}

    def compress_flat(self, flat, name, ctx, ops):
        x = ops.cast(flat, compute_dtype(ctx.dtype))
        inverse = ops.constant([1.0 / self.error_bound], ops.dtype(x), like=flat)
        tags, small, medium, large = encode(ops, x, inverse)
        # The largest class travels in the gradient's own dtype (x holds it exactly).
        return [tags, small, medium, ops.cast(large, ctx.dtype)]

    def not_smaller(self, flat, ctx, ops):
        # How many elements reach each class, counted against thresholds a little below the
        # classes' own (rounding half to even at |x| / e = 0.5, 127.5, 32767.5): an upper bound of
        # the encoded size, from three counting passes instead of an encoding.
        x = ops.cast(flat, compute_dtype(ctx.dtype))
        below = self.error_bound * (1.0 - 2.0**-20)
        beyond = [ops.count_at_least(x, c * below) for c in (0.5, 127.5, 32767.5)]
        itemsize = ops.itemsize(ctx.dtype)
        encoded = (-(-ctx.numel // 4) + beyond[0] + beyond[1] + (itemsize - 2) * beyond[2]
                   + 4 * LENGTH_BYTES)
        return at_least_bytes(encoded, ctx.numel * itemsize, ops, like=flat)

    def decompress_flat(self, payload, ctx, ops):
        packed, small, medium, large = payload
        dtype = compute_dtype(ctx.dtype)
        bound = ops.constant([self.error_bound], dtype, like=packed)
        return ops.cast(decode(ops, packed, small, medium, ops.cast(large, dtype), bound, n=ctx.numel),
                        ctx.dtype)


# The loops of inceptionn.c beside this file: the tags and the classes' members in one pass
# (counted, then written), the count of a range's tags, and the decoding.
ENCODE_LOOP = native.Loop("grace_inceptionn_encode", (
    native.In(0), native.START, native.COUNT, native.Param("inverse"), native.Out(0),
    native.Placed(1, 0), native.Placed(2, 1), native.Placed(3, 2), native.Row(4)))
COUNT_TAGS_LOOP = native.Loop("grace_count_tags", (native.In(0), native.START, native.COUNT,
                                                   native.Row(0)))
DECODE_LOOP = native.Loop("grace_inceptionn_decode", (
    native.In(0), native.START, native.COUNT, native.In(1), native.In(2), native.In(3), native.Offset(0),
    native.Offset(1), native.Offset(2), native.Param("bound"), native.Out(0)))


def _encode_loop(x: np.ndarray, inverse: np.ndarray):
    """The tags (2 bits, packed) and class members (int8 and int16 steps, float32 values) for
    float32 ``x`` with ``steps = rint(x * inverse)``."""
    tags = native.empty((x.size + 3) // 4, np.uint8)
    (tags, small, medium, large), _ = native.select(
        ENCODE_LOOP, x.size, [x], [tags], [np.int8, np.int16, np.float32],
        {"inverse": native.scalar(inverse)})
    return tags, small, medium, large


def _decode_loop(tags: np.ndarray, small: np.ndarray, medium: np.ndarray, large: np.ndarray,
                 error_bound: np.ndarray, n: int) -> np.ndarray:
    counts = np.zeros((native.parts(n), 3), np.int64)
    native.run(COUNT_TAGS_LOOP, n, [tags], [counts])
    offsets, totals = native.placement(counts)
    tagged, members = tuple(int(c) for c in totals), (small.size, medium.size, large.size)
    if tagged != members:
        raise ValueError(f"inceptionn payload: its tags count {tagged} members of classes 1, 2, 3, "
                         f"but it holds {members}")
    out = native.empty(n, np.float32)
    native.run(DECODE_LOOP, n, [tags, small, medium, large], [out],
               {"bound": native.scalar(error_bound)}, offsets=offsets)
    return out


native.register("inceptionn_encode", native.Kernel(_encode_loop, lambda x, inverse: [
    ("uint8", ((x[0] + 3) // 4,)), ("int8", (None,)), ("int16", (None,)), ("float32", (None,))],
    native.float32_at(0)))
native.register("inceptionn_decode", native.Kernel(_decode_loop, lambda *shapes, n: [("float32", (n,))],
                                                   native.float32_at(3, 4)))


@accelerated("inceptionn_encode")
def encode(ops, x, inverse):
    """The 2-bit tags (packed) and the three classes (int8 and int16 steps of ``1 / inverse``, and
    the values of ``x`` themselves) of the 1-d ``x``; ``inverse``: ``[1 / error_bound]``."""
    steps = ops.round(ops.mul(x, inverse))
    size = ops.abs(steps)
    tag = ops.add(ops.add(ops.cast(ops.greater_equal(size, 1.0), "int32"),
                          ops.cast(ops.greater_equal(size, 128.0), "int32")),
                  ops.cast(ops.greater_equal(size, 32768.0), "int32"))
    in_class = [ops.nonzero(ops.equal(tag, c)) for c in (1, 2, 3)]
    return (ops.pack_bits(tag, 2),
            ops.cast(ops.gather(steps, in_class[0]), "int8"),
            ops.cast(ops.gather(steps, in_class[1]), "int16"),
            ops.gather(x, in_class[2]))


@accelerated("inceptionn_decode")
def decode(ops, packed, small, medium, large, bound, n):
    """The ``n`` values that ``encode`` sent, in ``large``'s dtype; ``bound``: ``[error_bound]``."""
    dtype = ops.dtype(large)
    tag = ops.unpack_bits(packed, 2, n)
    out = ops.scatter_add(n, ops.nonzero(ops.equal(tag, 1)), ops.mul(ops.cast(small, dtype), bound))
    out = ops.add(out, ops.scatter_add(n, ops.nonzero(ops.equal(tag, 2)),
                                       ops.mul(ops.cast(medium, dtype), bound)))
    return ops.add(out, ops.scatter_add(n, ops.nonzero(ops.equal(tag, 3)), large))
