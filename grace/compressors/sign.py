"""The sign family: signSGD, signum, error-feedback signSGD and 1-bit SGD. Each sends one bit per
element, packed eight to a byte, plus at most two scalars."""

from __future__ import annotations

import math

from grace import steps
from grace.blocks import DEFAULT_BLOCK_SIZE, Blocks
from grace.compressor import Compressor, Tabled, compute_dtype, numel_of, renamed
from grace.compressors.passes import Passes
from grace.momentum import OwnsMomentum
from grace.validation import check_int


def _signs(packed, ctx, ops, dtype, scale=None):
    """The +1 / -1 of ``steps.sign_bits``, times ``scale`` if given, in ``ctx.dtype``."""
    values = ops.constant([-1.0, 1.0], dtype, like=packed)
    if scale is not None:
        values = ops.mul(values, ops.cast(scale, dtype))
    return steps.unpack_values(ops, packed, ops.cast(values, ctx.dtype), bits=1, n=ctx.numel)


LEARNING_RATE = 1e-4
"""The step per element measured to train with signSGD and signum (mnist's MLP, docs/quality.md:
within 0.5 (signum) and 2 (signSGD) points of uncompressed training, where 3e-4 leaves signSGD 3-4
points short). Their update is ``±lr`` per element, as Adam's about is, so an Adam-sized rate fits;
SGD's usual 0.01-0.1, hundreds of times the gradients' own size per element, diverges."""


def learning_rate(momentum_in_optimizer: float = 0.0) -> float:
    """The learning rate for signSGD and signum: ``LEARNING_RATE``, divided down by the optimizer's
    momentum where it still applies to the votes (signSGD with SGD's momentum, whose steady state
    is ``lr / (1 - momentum)``; signum takes SGD's and Adam's momentum over, and Adam normalizes)."""
    return LEARNING_RATE * (1.0 - momentum_in_optimizer)


RATE_FAR_ABOVE = 2.0
"""How many times the rate that works (``learning_rate``) a sign compressor's optimizer may step
by before the wrapper says so: 3e-4 already leaves signSGD 3-4 points short (``LEARNING_RATE``)."""


OWNER_BITS = 2
"""Through the shards' owners (``communicator="alltoall"``), how many passes of 1-bit SGD an
owner sends its shard's sum in unless ``owner_bits`` is set: the first encodes the sum, the second
what the first left (``Passes``), 2 bits and 4 means per block. Gathering applies the mean of the
workers' n one-bit encodings; owners rounding the sum to one bit again ended 0.55 point below it
on mnist at 4 workers (6 real seeds; 0.51 over the last 3 epochs), two passes 0.19 (0.11), and an
owner sending the sum exactly matched it. The second stage doubles: a worker moves ``3 (n-1)/n``
of one payload where one pass moved ``2 (n-1)/n``, still flat in n (docs/results.md, "1-bit's
owners in two passes")."""


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
    # Measured by the quality benchmark (docs/quality.md, data/quality/safety.md).
    shortfalls = {
        "cnn-sgd": "3.0 points below in PyTorch (the quality benchmark's runs; 2.7-3 at every "
                   "learning rate and length tried; TensorFlow's run met its target): it sends each "
                   "element's sign and keeps nothing of what the sign leaves out (no error "
                   "feedback), a biased step (docs/quality.md, 'signSGD on the CNN'); efsignsgd "
                   "sends the same bits with error feedback and matched it",
        "lstm-sgd": "+16% perplexity at 1e-3 without clipping (+12.6% at three times the steps), "
                    "the same bias; efsignsgd ends within 1.2% there",
        "words-sgd": "+93% perplexity at 1e-4, rising at 3e-4 and 1e-3, the same bias; efsignsgd "
                     "ends 1.8% below uncompressed training there",
    }
    default_communicator = "allgather"

    def learning_rate_notice(self, lr: float | None, optimizer_momentum: float = 0.0) -> str | None:
        """Where ``lr`` (``None``: not known, as under ``DistributedGradientTape``) is more than
        ``RATE_FAR_ABOVE`` times the rate a sign method needs (``learning_rate``; signSGD's is
        divided down by a momentum the optimizer still applies to the votes), the sentence the
        wrapper logs once on rank 0 with the rate that works."""
        works = learning_rate(optimizer_momentum if self.name == "signsgd" else 0.0)
        if lr is not None and lr <= RATE_FAR_ABOVE * works:
            return None
        found = ("" if lr is None else
                 f"the optimizer's learning rate {lr:g} is {lr / works:,.0f} times what it needs; ")
        return (f"grace: {self.name} steps each element by +-lr whatever the gradient's size: "
                f"{found}use about {works:g} (docs/catalogue.md; SGD's usual 0.01-0.1 diverges), "
                f"and no gradient clipping after synchronize(), which would shrink the votes by the "
                f"square root of their count")

    def compress_flat(self, flat, name, ctx, ops):
        return [steps.sign_bits(ops, flat)]

    def decompress_flat(self, payload, ctx, ops):
        return _signs(payload[0], ctx, ops, compute_dtype(ctx.dtype))

    def aggregate(self, tensors, ops):
        votes = super().aggregate(tensors, ops)
        return ops.scale(ops.sign(votes), float(len(tensors)))

    def payload_nbytes(self, shape, itemsize):
        return _bits_nbytes(shape)

    def owner_codec(self):
        return Votes()


class Votes(Compressor):
    """A majority vote, as a shard's owner sends it on (``communicator="alltoall"``): each element
    is ``-s``, ``0`` or ``+s`` (``s``: the vote in units of a sum over workers), sent exactly as a
    2-bit code and ``s``. One bit cannot carry the ties (0) that a vote of an even number of
    workers has."""

    name = "votes"
    sends_exactly = True

    def compress_flat(self, flat, name, ctx, ops):
        x = ops.cast(flat, compute_dtype(ctx.dtype))
        codes = ops.add(ops.sign(x), ops.full(ctx.numel, 1.0, ops.dtype(x), like=x))  # 0, 1, 2
        return [ops.cast(ops.max_abs(x), ctx.dtype), ops.pack_bits(ops.cast(codes, "uint8"), 2)]

    def decompress_flat(self, payload, ctx, ops):
        scale, packed = payload
        values = ops.mul(ops.constant([-1.0, 0.0, 1.0, 0.0], ctx.dtype, like=packed),
                         ops.cast(scale, ctx.dtype))
        return steps.unpack_values(ops, packed, values, bits=2, n=ctx.numel)

    def payload_nbytes(self, shape, itemsize):
        return itemsize + math.ceil(numel_of(shape) * 2 / 8)


class Signum(OwnsMomentum, SignSGD):
    """signum: signSGD applied to momentum. Each worker keeps, per tensor, ``m = beta * m + (1 -
    beta) * g`` and sends ``sign(m)`` (``sign(beta * m + (1 - beta) * g)`` with Nesterov); votes are
    combined by majority. ``beta`` is the wrapped optimizer's momentum, taken over so that it
    applies once (``grace.momentum``; Adam's ``beta_1`` too), else 0.9 (also over an optimizer
    without momentum). The update is ``±lr`` per
    element whatever the gradient's size: use ``learning_rate()`` (1e-4, ``LEARNING_RATE``).
    Bernstein et al., "signSGD: Compressed Optimisation for Non-Convex Problems", ICML 2018."""

    name = "signum"
    # Its own, not signSGD's; measured by the quality benchmark (docs/quality.md).
    shortfalls = {
        "words-sgd": "+28.5% perplexity at 1e-4 (+35% at 3e-4, +45% at 3e-5): it keeps a momentum "
                     "per tensor, so the embedding's sparse rows travel as they are and step by the "
                     "sign method's rate, 5,000 times below the model's; with the table sent dense "
                     "(sparse_as_dense=True) +15.9%, still short; efsignsgd ends 1.8% below "
                     "uncompressed training there",
    }
    default_momentum = 0.9
    keeps_default_momentum = True  # without a momentum, signum would be signSGD
    momentum_param = "beta"
    takes_adam_beta1 = True
    encodes_rows = False

    def __init__(self, beta: float | None = None, nesterov: bool = False):
        self._init_momentum(beta, nesterov)
        self.momentum_buffers: dict = {}

    @property
    def beta(self) -> float:
        return self.momentum

    def params(self):
        return {"beta": self.beta, "nesterov": self.nesterov}

    def compress_flat(self, flat, name, ctx, ops):
        # sign() ignores a positive scale, so the optimizer's dampening does not matter here.
        momentum = self.state_store.load(ops, self.momentum_buffers, name, like=flat)
        momentum = steps.scaled_sum(ops, momentum, flat, alpha=self.beta, beta=1.0 - self.beta)
        self.state_store.save(ops, self.momentum_buffers, name, momentum)
        if self.nesterov:
            momentum = steps.scaled_sum(ops, momentum, flat, alpha=self.beta, beta=1.0 - self.beta)
        return [steps.sign_bits(ops, momentum)]


class EFSignSGD(Tabled, Compressor):
    """Scaled sign for error-feedback signSGD, in blocks of ``block_size`` elements: send
    ``sign(p)`` (1 bit each) and, per block ``b``, the scale ``||p_b||_1 / |b|``, so the estimate
    is ``(||p_b||_1 / |b|) sign(p)``; its default ``efsignsgd`` memory feeds back the error ``p -
    estimate``, on the velocity where the optimizer has momentum (taken over). One scale per 512
    elements (1/16 bit each) follows the gradient's magnitude across a layer, which one scale per
    tensor cannot (``block_size=0``). Karimireddy et al., "Error Feedback Fixes SignSGD and other
    Gradient Compression Schemes", ICML 2019; Zheng et al., "Communication-Efficient Distributed
    Blockwise Momentum SGD with Error-Feedback", NeurIPS 2019 (blockwise scales)."""

    name = "efsignsgd"
    # Measured by the quality benchmark (docs/quality.md, data/quality/safety.md).
    shortfalls = {
        "lstm-sgd": "+2.9% perplexity in TensorFlow at 4,000 steps, where PyTorch's run ends within "
                    "1.2%: from Keras's initial weights it learns more slowly (PyTorch from the "
                    "same weights: +5.6%); topk ends within 1.5% there",
    }
    layout_sensitive = True  # blocks of consecutive elements
    default_memory = "efsignsgd"
    default_communicator = "allgather"

    def __init__(self, block_size: int = DEFAULT_BLOCK_SIZE, bucket_size: int | None = None):
        block_size = renamed("block_size", block_size, bucket_size, DEFAULT_BLOCK_SIZE)
        self.block_size = check_int("block_size", block_size, minimum=0)

    def params(self):
        return {"block_size": self.block_size}

    def compress_flat(self, flat, name, ctx, ops):
        x = ops.cast(flat, compute_dtype(ctx.dtype))
        blocks = Blocks.of(ctx.numel, self.block_size)
        _, positive, negative, _ = steps.block_parts(blocks, x, ops)
        lengths = blocks.lengths("float64", ops, like=positive)
        scales = ops.div(ops.sub(positive, negative), lengths)  # the mean magnitude per block
        return [ops.cast(scales, ctx.dtype), steps.sign_bits(ops, x)]

    def tables(self, payload, ctx, ops):
        scales, packed = payload
        blocks = Blocks.of(ctx.numel, self.block_size)
        # Each block's two values, -scale and +scale, for the bits 0 (x < 0) and 1.
        signs = ops.reshape(ops.constant([-1.0, 1.0], ctx.dtype, like=packed), (1, 2))
        return packed, 1, ops.mul(blocks.column(scales, ops), signs), blocks.size

    def payload_nbytes(self, shape, itemsize):
        return Blocks.of(numel_of(shape), self.block_size).count * itemsize + _bits_nbytes(shape)


class OneBit(Tabled, Compressor):
    """1-bit SGD, in blocks of ``block_size`` elements: each element is sent as one bit, whether
    it is >= 0, and the receiver replaces it by the mean of its block's non-negative or negative
    elements (both sent, per block); error feedback keeps the quantization error, on the velocity
    where the optimizer has momentum (its default ``momentum`` memory takes it over). The paper
    quantizes per column of each matrix; blocks of 512 do the same for any shape, at 1/8 bit per
    element, where two means for a whole layer lose 1-2.5 points of accuracy on mnist's MLP
    (``block_size=0``). Through the shards' owners an owner sends its shard's sum in
    ``owner_bits`` passes (``OWNER_BITS``). Seide et al., "1-Bit Stochastic Gradient Descent and
    its Application to Data-Parallel Distributed Training of Speech DNNs", Interspeech 2014."""

    name = "onebit"
    # Measured by the quality benchmark (docs/quality.md, data/quality/safety.md).
    shortfalls = {
        "lstm-sgd": "+4.5% perplexity in TensorFlow at 4,000 steps, where PyTorch's run ends within "
                    "0.3%: from Keras's initial weights it learns more slowly (PyTorch from the "
                    "same weights: +6.8%); topk ends within 1.5% there",
    }
    layout_sensitive = True  # blocks of consecutive elements
    default_memory = "momentum"
    default_communicator = "allgather"

    owner_bits: int | None = None

    def __init__(self, block_size: int = DEFAULT_BLOCK_SIZE, owner_bits: int | None = None,
                 bucket_size: int | None = None):
        block_size = renamed("block_size", block_size, bucket_size, DEFAULT_BLOCK_SIZE)
        self.block_size = check_int("block_size", block_size, minimum=0)
        self.owner_bits = None if owner_bits is None else check_int("owner_bits", owner_bits, minimum=1)

    def params(self):
        # owner_bits only where set: a default 1-bit reads (and checkpoints) as it always has.
        return {"block_size": self.block_size} | (
            {} if self.owner_bits is None else {"owner_bits": self.owner_bits})

    def owner_codec(self):
        """Through the shards' owners an owner sends its shard's sum in ``owner_bits`` passes of
        1-bit SGD (``OWNER_BITS`` by default), each encoding what the ones before it left."""
        bits = OWNER_BITS if self.owner_bits is None else self.owner_bits
        return self if bits == 1 else Passes(self, bits)

    def compress_flat(self, flat, name, ctx, ops):
        x = ops.cast(flat, compute_dtype(ctx.dtype))
        blocks = Blocks.of(ctx.numel, self.block_size)
        count, positive, negative, _ = steps.block_parts(blocks, x, ops)
        rest = ops.sub(blocks.lengths("float64", ops, like=count), count)
        mean_pos = ops.div(positive, ops.maximum(count, 1.0))
        mean_neg = ops.div(negative, ops.maximum(rest, 1.0))
        return [ops.cast(ops.concat([mean_pos, mean_neg]), ctx.dtype), steps.sign_bits(ops, x)]

    def tables(self, payload, ctx, ops):
        means, packed = payload
        blocks = Blocks.of(ctx.numel, self.block_size)
        mean_pos, mean_neg = ops.split(means, [blocks.count, blocks.count])
        # Each block's two values: its negative mean for the bit 0, its non-negative one for 1.
        bit = ops.reshape(ops.greater_equal(ops.constant([0.0, 1.0], "float32", like=packed), 0.5), (1, 2))
        tables = ops.where(bit, blocks.column(mean_pos, ops), blocks.column(mean_neg, ops))
        return packed, 1, tables, blocks.size

    def payload_nbytes(self, shape, itemsize):
        return 2 * Blocks.of(numel_of(shape), self.block_size).count * itemsize + _bits_nbytes(shape)
