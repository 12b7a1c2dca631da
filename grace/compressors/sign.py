"""The sign family: signSGD, signum, error-feedback signSGD and 1-bit SGD. Each sends one bit per
element, packed eight to a byte, plus at most two scalars."""

from __future__ import annotations

import math

from grace.compressor import Compressor, compute_dtype, numel_of
from grace.validation import check_fraction


def _split(bits_and_sums, ops):
    """``sign_bits_with_sums``' result as the bits and the three sums, each a 1-element tensor."""
    bits, sums = bits_and_sums
    return bits, ops.split(sums, [1, 1, 1])


def _signs(packed, ctx, ops, dtype, scale=None):
    """The +1 / -1 of ``Ops.sign_bits``, times ``scale`` if given, in ``ctx.dtype``."""
    values = ops.constant([-1.0, 1.0], dtype, like=packed)
    if scale is not None:
        values = ops.mul(values, ops.cast(scale, dtype))
    return ops.unpack_values(packed, 1, ctx.numel, ops.cast(values, ctx.dtype))


def _bits_nbytes(shape):
    return math.ceil(numel_of(shape) / 8)


class SignSGD(Compressor):
    """signSGD with majority vote: each worker sends the sign of each element (1 bit); the workers'
    signs are combined by majority vote, so every worker applies ``sign(sum of signs)`` (0 on a tie).
    Bernstein et al., "signSGD: Compressed Optimisation for Non-Convex Problems", ICML 2018, and
    "signSGD with Majority Vote is Communication Efficient and Fault Tolerant", ICLR 2019.

    The vote is returned in the units of a sum over workers (``n_workers * vote``), so that
    ``op=Average`` applies the vote itself and ``op=Sum`` that many times."""

    name = "signsgd"
    default_communicator = "allgather"

    def encode(self, flat, name, ctx, ops):
        return [ops.sign_bits(flat)]

    def decode(self, payload, ctx, ops):
        return _signs(payload[0], ctx, ops, compute_dtype(ctx.dtype))

    def aggregate(self, tensors, ops):
        votes = super().aggregate(tensors, ops)
        return ops.scale(ops.sign(votes), float(len(tensors)))

    def payload_nbytes(self, shape, itemsize):
        return _bits_nbytes(shape)


class Signum(SignSGD):
    """signum: signSGD applied to momentum. Each worker keeps, per tensor, ``m = beta * m + (1 -
    beta) * g`` and sends ``sign(m)``; votes are combined by majority. Bernstein et al., "signSGD:
    Compressed Optimisation for Non-Convex Problems", ICML 2018."""

    name = "signum"

    def __init__(self, beta: float = 0.9):
        self.beta = check_fraction("beta", beta)
        self.momentum: dict = {}

    def params(self):
        return {"beta": self.beta}

    def encode(self, flat, name, ctx, ops):
        momentum = ops.load(self.momentum, name, like=flat)
        momentum = ops.scaled_sum(momentum, self.beta, flat, 1.0 - self.beta)
        ops.save(self.momentum, name, momentum)
        return [ops.sign_bits(momentum)]


class EFSignSGD(Compressor):
    """Scaled sign for error-feedback signSGD: send ``sign(p)`` (1 bit each) and the scale
    ``||p||_1 / d``, so the estimate is ``(||p||_1 / d) sign(p)``; its default ``efsignsgd`` memory
    feeds back the error ``p - estimate``. Karimireddy et al., "Error Feedback Fixes SignSGD and
    other Gradient Compression Schemes", ICML 2019."""

    name = "efsignsgd"
    default_memory = "efsignsgd"
    default_communicator = "allgather"

    def encode(self, flat, name, ctx, ops):
        x = ops.cast(flat, compute_dtype(ctx.dtype))
        bits, (_, positive, negative) = _split(ops.sign_bits_with_sums(x), ops)
        scale = ops.scale(ops.sub(positive, negative), 1.0 / ctx.numel)
        return [ops.cast(scale, ctx.dtype), bits]

    def decode(self, payload, ctx, ops):
        scale, packed = payload
        return _signs(packed, ctx, ops, compute_dtype(ctx.dtype), scale)

    def payload_nbytes(self, shape, itemsize):
        return itemsize + _bits_nbytes(shape)


class OneBit(Compressor):
    """1-bit SGD: each element is sent as one bit, whether it is >= 0, and the receiver replaces it
    by the mean of the non-negative or of the negative elements (both sent); error feedback keeps
    the quantization error. Seide et al., "1-Bit Stochastic Gradient Descent and its Application to
    Data-Parallel Distributed Training of Speech DNNs", Interspeech 2014."""

    name = "onebit"
    default_memory = "residual"
    default_communicator = "allgather"

    def encode(self, flat, name, ctx, ops):
        x = ops.cast(flat, compute_dtype(ctx.dtype))
        bits, (count, positive, negative) = _split(ops.sign_bits_with_sums(x), ops)
        mean_pos = ops.div(positive, ops.maximum(count, 1.0))
        rest = ops.sub(ops.full(1, float(ctx.numel), ops.dtype(x), like=x), count)
        mean_neg = ops.div(negative, ops.maximum(rest, 1.0))
        means = ops.cast(ops.concat([mean_pos, mean_neg]), ctx.dtype)
        return [means, bits]

    def decode(self, payload, ctx, ops):
        means, packed = payload
        mean_pos, mean_neg = ops.split(means, [1, 1])
        return ops.unpack_values(packed, 1, ctx.numel, ops.concat([mean_neg, mean_pos]))

    def payload_nbytes(self, shape, itemsize):
        return 2 * itemsize + _bits_nbytes(shape)
