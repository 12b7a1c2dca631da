"""Steps that several algorithms share, written once against the ``Ops`` primitives.

Each is the composite definition: several passes over a gradient with a full-size temporary for each.
``@accelerated`` lets ``grace.kernels`` run grace/native's single-pass loop of the same name instead
where one runs, which gives the same bits (tests/test_native.py holds them to that). Algorithms call
these as ``steps.sign_bits(ops, x)``; ``Ops`` itself keeps to general primitives.
"""

from __future__ import annotations

from grace.blocks import Blocks
from grace.kernels import accelerated
from grace.ops import Ops, Tensor


@accelerated("quantize_levels")
def quantize_levels(ops: Ops, x: Tensor, divisors: Tensor, *, seed: tuple, levels: int, bits: int,
                    block: int) -> Tensor:
    """Stochastic rounding of ``|x| / divisor * levels`` to an integer ``q`` (up with probability
    equal to the fraction, by ``Ops.random_uniform`` with ``seed`` = ``(seed_of, step)``), at most
    ``levels`` (elements beyond the divisor are clipped to it), sent as the sign-magnitude code
    ``2 q + (x < 0)`` of ``bits`` bits, packed. ``divisors``: positive, one per ``block``
    consecutive elements."""
    n = ops.numel(x)
    blocks = Blocks.of(n, block)
    dtype = ops.dtype(x)
    level = ops.scale(blocks.flat(ops.div(blocks.rows(ops.abs(x), ops),
                                           blocks.column(ops.cast(divisors, dtype), ops)),
                                   ops), float(levels))
    low = ops.floor(level)
    uniform = ops.random_uniform(n, seed[0], seed[1], like=x)
    up = ops.less(ops.cast(uniform, dtype), ops.sub(level, low))
    q = ops.minimum(ops.add(low, ops.cast(up, dtype)), float(levels))
    negative = ops.cast(ops.less(x, 0.0), dtype)
    return ops.pack_bits(ops.cast(ops.add(ops.scale(q, 2.0), negative), "int32"), bits)


@accelerated("block_sums")
def block_sums(ops: Ops, x: Tensor, *, block: int) -> Tensor:
    """Per block of ``block`` consecutive elements of the 1-d ``x``: the count of ``x >= 0``, the
    sum of those elements, the sum of the others, and the sum of squares, as a (4, blocks) float64
    tensor, accumulated in float64."""
    blocks = Blocks.of(ops.numel(x), block)
    rows = blocks.rows(ops.cast(x, "float64"), ops)
    nonnegative = ops.greater_equal(rows, 0.0)
    zero = ops.zeros(1, "float64", like=rows)
    # The four quantities' rows stacked, so that one row_sums adds them all: on the CPU that is one
    # host call (TensorFlow's tf.numpy_function) instead of four, each row summed as before.
    stacked = ops.reshape(ops.concat([ops.cast(nonnegative, "float64"),
                                      ops.where(nonnegative, rows, zero),
                                      ops.where(nonnegative, zero, rows),
                                      ops.mul(rows, rows)]), (4 * blocks.count, blocks.size))
    # The padding's zeros count as non-negative (and add nothing): take them out of the count.
    padding = ops.constant([0.0] * (blocks.count - 1) + [float(blocks.pad)] + [0.0] * (3 * blocks.count),
                           "float64", like=rows)
    return ops.reshape(ops.sub(ops.row_sums(stacked), padding), (4, blocks.count))


def block_parts(blocks: Blocks, x: Tensor, ops: Ops) -> list:
    """Per block of the 1-d ``x``, in float64: the count of ``x >= 0``, the sum of those, the sum
    of the others, the sum of squares (``block_sums``), as four 1-d tensors."""
    return ops.split(ops.flatten(block_sums(ops, x, block=blocks.size)), [blocks.count] * 4)


@accelerated("unpack_blocks")
def unpack_blocks(ops: Ops, packed: Tensor, tables: Tensor, *, bits: int, n: int, block: int) -> Tensor:
    """``tables[i // block, code]`` for each of the ``n`` codes ``pack_bits`` packed: decoding with
    one table of ``2**bits`` values per block of ``block`` elements (``tables``: (blocks, 2**bits),
    the output's dtype)."""
    blocks = Blocks.of(n, block)
    codes = blocks.rows(ops.cast(ops.unpack_bits(packed, bits, n), "int32"), ops)
    offsets = ops.mul(ops.arange(blocks.count, "int32", like=codes),
                      ops.constant([1 << bits], "int32", like=codes))
    index = blocks.flat(ops.add(codes, blocks.column(offsets, ops)), ops)
    return ops.gather(ops.flatten(tables), index)


@accelerated("unpack_blocks_onto")
def unpack_blocks_onto(ops: Ops, packed: Tensor, tables: Tensor, base: Tensor, *, bits: int, n: int,
                       block: int) -> Tensor:
    """``base`` (1-d, ``n`` elements) plus ``unpack_blocks``, in one pass where a loop runs."""
    return ops.add(base, unpack_blocks(ops, packed, tables, bits=bits, n=n, block=block))


@accelerated("sign_bits")
def sign_bits(ops: Ops, x: Tensor) -> Tensor:
    """One bit per element, 1 where ``x >= 0``, packed."""
    return ops.pack_bits(ops.greater_equal(x, 0.0), 1)


@accelerated("unpack_values")
def unpack_values(ops: Ops, packed: Tensor, values: Tensor, *, bits: int, n: int) -> Tensor:
    """``values[code]`` for each of the ``n`` codes ``pack_bits`` packed (``Ops.unpack_values``)."""
    return ops.unpack_values(packed, bits, n, values)


@accelerated("scaled_sum")
def scaled_sum(ops: Ops, a: Tensor | None, b: Tensor, *, alpha: float, beta: float) -> Tensor:
    """``a * alpha + b * beta`` (``b * beta`` where ``a`` is None), each product rounded to the
    dtype as ``Ops.scale`` does, then the sum; shaped as ``b``."""
    right = ops.scale(b, beta)
    return right if a is None else ops.add(ops.scale(a, alpha), right)


@accelerated("bf16_rows_sum")
def bf16_rows_sum(ops: Ops, rows: Tensor, *, workers: int, n: int) -> Tensor:
    """The sum of ``workers`` bfloat16 tensors of ``n`` elements that were gathered as their bits:
    ``rows``, int16, row after row in rank order (an adapter whose layer below cannot sum bfloat16,
    as Horovod 0.28.1 cannot, gathers the bits instead). Each row is widened to float32 and added in
    rank order, the same on every worker and in every framework, and the sum rounded once to
    bfloat16 (to nearest even); returned as its bits, int16, ``n`` elements. A NaN sum is a NaN
    whose bits may differ between the loop and a framework's cast; its step is rolled back as
    non-finite anyway."""
    values = ops.cast(ops.from_bytes(ops.to_bytes(rows), "bfloat16"), "float32")
    total = ops.slice(values, 0, n)
    for r in range(1, workers):
        total = ops.add(total, ops.slice(values, r * n, n))
    return ops.from_bytes(ops.to_bytes(ops.cast(total, "bfloat16")), "int16")
