"""Independent numpy models of the algorithms, written straight from their definitions (float64), to
check what the framework wrappers compute on real workers."""

from __future__ import annotations

import numpy as np

from tests.workers.common import LR, batch, gradients, init_weights

MIN_NUMEL = 1024  # grace's default: b (8 elements) travels dense, W (1280) is compressed


def at(setting, step: int) -> float:
    """A setting's value at ``step``: a number, or a sequence of one per step (a scheduler's)."""
    return float(setting) if np.isscalar(setting) else float(setting[step])


def with_residual(choose):
    """Error feedback around a sparsifier: ``choose(name, step, flat)`` picks the indices sent from
    gradient + residual; the rest becomes the new residual."""
    residuals = {}

    def compress(name, rank, step, g):
        c = g + residuals.get((name, rank), 0.0)
        flat = c.reshape(-1)
        keep = choose(name, step, flat)
        sent = np.zeros_like(flat)
        sent[keep] = flat[keep]
        sent = sent.reshape(c.shape)
        residuals[(name, rank)] = c - sent
        return sent
    return compress


def with_velocity(choose, momentum, nesterov=False, mask=False, dense_steps=0, dense_momentum=True,
                  dampening=0.0):
    """Error feedback on the velocity (the ``momentum`` memory; with ``mask``, DGC's): each worker
    keeps ``u = momentum * u + g`` and compresses ``e + u`` (``e + g + momentum * u`` with
    Nesterov); ``e`` keeps what was not sent; DGC's masking zeroes ``u`` where entries were sent.
    ``momentum``: a number, or one per step (a scheduler's).
    The first ``dense_steps`` exchanges are a warm-up, sent dense: the velocity (which compression
    then continues) where the momentum was taken over (``dense_momentum``), else the gradient.
    ``dampening``: ``u = momentum * u + (1 - dampening) * g`` (Adam's ``beta_1`` taken over)."""
    residuals, velocities = {}, {}

    def compress(name, rank, step, g):
        key = (name, rank)
        if step < dense_steps and not dense_momentum:
            return g
        beta = at(momentum, step)
        u = beta * velocities.get(key, 0.0) + (1.0 - dampening) * g
        velocities[key] = u
        if step < dense_steps:
            return u
        c = residuals.get(key, 0.0) + (g + beta * u if nesterov else u)
        flat = c.reshape(-1)
        keep = choose(name, step, flat)
        sent = np.zeros_like(flat)
        sent[keep] = flat[keep]
        sent = sent.reshape(c.shape)
        residuals[key] = c - sent
        if mask:
            velocities[key] = np.where(sent != 0, 0.0, u)
        return sent
    return compress


def largest(ratio):
    """Top-k's choice: the ``ratio`` of entries of largest magnitude."""
    def choose(name, step, flat):
        return np.argsort(-np.abs(flat), kind="stable")[:max(1, int(ratio * flat.size))]
    return choose


def topk_with_residual(ratio):
    """Top-k of (gradient + residual) by magnitude."""
    return with_residual(largest(ratio))


def bucket_means(bucket):
    """1-bit SGD of a shard: in buckets of ``bucket`` consecutive elements, each element becomes
    its bucket's mean of the non-negative elements or of the negative ones, as its sign says."""
    def encode(x):
        sent = np.empty_like(x)
        for start in range(0, x.size, bucket):
            part = x[start:start + bucket]
            up = part >= 0
            sent[start:start + bucket] = np.where(up, part[up].mean() if up.any() else 0.0,
                                                  part[~up].mean() if (~up).any() else 0.0)
        return sent
    return encode


def onebit_with_residual(bucket=512):
    """1-bit SGD with error feedback, in buckets of ``bucket`` consecutive elements of the
    flattened (gradient + residual) (``bucket_means``); the rest is the new residual."""
    encode = bucket_means(bucket)
    residuals = {}

    def compress(name, rank, step, g):
        c = g + residuals.get((name, rank), 0.0)
        sent = encode(c.reshape(-1)).reshape(c.shape)
        residuals[(name, rank)] = c - sent
        return sent
    return compress


def twobit_quantize(threshold=1.0, relative=True, block_size=None):
    """Two-bit quantization of a flat float32 array (MXNet's 2bit, Strom 2015): each element
    becomes +t at or above t, -t at or below -t, else 0; ``t`` is ``threshold``, times the root mean
    square of the element's block of ``block_size`` consecutive elements (0: the whole array; by
    default 512) where ``relative``. In float32, as the compressor quantizes (root mean squares in
    float64)."""
    if block_size is None:  # the compressor's default: blocks of 512 where the threshold is relative
        block_size = 512 if relative else 0

    def quantize(c):
        t = np.float32(threshold)
        if relative:
            t = np.float32(np.float32(np.sqrt(np.sum(c.astype(np.float64) ** 2)))
                           * np.float32(threshold / np.sqrt(c.size)))
        return np.where(c >= t, t, np.where(-c >= t, -t, np.float32(0.0))).astype(np.float32)

    def encode(flat):
        flat = flat.astype(np.float32)
        size = flat.size if block_size == 0 else block_size
        return np.concatenate([quantize(flat[i:i + size]) for i in range(0, flat.size, size)])
    return encode


def twobit_with_residual(threshold=1.0, relative=True, block_size=None):
    """Two-bit quantization (``twobit_quantize``) with error feedback: the rest of (gradient +
    residual) is the new residual."""
    residuals = {}
    encode = twobit_quantize(threshold, relative, block_size)

    def compress(name, rank, step, g):
        c = (g + residuals.get((name, rank), 0.0)).astype(np.float32)
        sent = encode(c.reshape(-1)).reshape(c.shape)
        residuals[(name, rank)] = c - sent
        return sent
    return compress


def randomk_with_residual(ratio, seed):
    """Random-k with indices from the seed every worker derives from (seed, name, step), as the
    workers build it with ``min_kept=1``: ``ratio`` of every tensor, at least one entry."""
    from grace.compressors.randomk import RandomK
    from grace.rng import reference_indices  # the draw's definition, in numpy

    seeds = RandomK(ratio, seed=seed)

    def choose(name, step, flat):
        k = max(1, int(ratio * flat.size))
        return reference_indices(flat.size, k, seeds.step_seed(name, step))
    return with_residual(choose)


def randomk_adam(ratio, seed, lr, eps, name="weight", transposed=False, workers=2, steps=10,
                 decay=0.0, adam_start=0):
    """Final (W, b) of random-k with Adam's moments taken over (grace.second_moment), written from
    its definition: each worker keeps ``v = 0.999 v + 0.001 g²`` of its own W gradient and error
    feedback's residual; random-k (``min_kept=1``, the draw of ``randomk_with_residual``) sends the
    drawn entries of gradient + residual and of ``v / (1 - 0.999^t)``; the averaged ``v`` replaces
    the shared estimate there, and W steps by ``lr * burst / (sqrt(v) + eps)``, no first moment.
    b (dense) steps by Adam (0.9, 0.999) as the optimizer computes it. ``name`` and ``transposed``:
    the tensor as a framework names and lays it out (Keras's ``kernel`` is W transposed).
    ``decay``: AdamW's decoupled weight decay, ``p -= lr * decay * p`` before each update. ``lr``: a
    number or one per step. ``adam_start``: the steps Adam counted for b before the first
    (``hvd.broadcast_optimizer_state`` initialises it with one step of zero gradients)."""
    from grace.compressors.randomk import RandomK
    from grace.rng import reference_indices

    seeds = RandomK(ratio, seed=seed)
    w, b = (a.astype(np.float64) for a in init_weights(0))
    n = w.size
    residual = [np.zeros(n) for _ in range(workers)]
    local = [np.zeros(n) for _ in range(workers)]
    shared = np.zeros(n)
    m_b, v_b = 0.0, 0.0
    for step in range(steps):
        t = step + 1
        keep = reference_indices(n, max(1, int(ratio * n)), seeds.step_seed(name, step))
        burst, drawn, gb = np.zeros(n), np.zeros(n), 0.0
        for rank in range(workers):
            x, y = batch(rank, step)
            dw, db = gradients(w.astype(np.float32), b.astype(np.float32), x, y)
            g = (dw.T if transposed else dw).reshape(-1)
            local[rank] = 0.999 * local[rank] + 0.001 * g * g
            c = g + residual[rank]
            burst[keep] += c[keep] / workers
            drawn[keep] += local[rank][keep] / (1 - 0.999**t) / workers
            residual[rank] = c.copy()
            residual[rank][keep] = 0.0
            gb = gb + db / workers
        shared[keep] = drawn[keep]
        rate = at(lr, step)
        update = rate * burst / (np.sqrt(shared) + eps)
        w, b = w * (1 - rate * decay), b * (1 - rate * decay)
        w = w - (update.reshape(w.shape[::-1]).T if transposed else update.reshape(w.shape))
        m_b = 0.9 * m_b + 0.1 * gb
        v_b = 0.999 * v_b + 0.001 * gb * gb
        t_b = t + adam_start
        b = b - rate / (1 - 0.9**t_b) * m_b / (np.sqrt(v_b / (1 - 0.999**t_b)) + eps)
    return w, b


def fp16_sum(values):
    """Half-precision payloads summed in half precision, as an fp16 allreduce does."""
    total = np.float16(0) * values[0].astype(np.float16)
    for v in values:
        total = (total + v.astype(np.float32).astype(np.float16)).astype(np.float16)
    return total.astype(np.float64)


def keep_top(fraction):
    """Top-k of a shard: its ``k = max(16, int(fraction * size))`` entries of largest magnitude,
    the rest zero."""
    def encode(x):
        k = min(x.size, max(16, int(fraction * x.size)))
        keep = np.argsort(-np.abs(x), kind="stable")[:k]
        sent = np.zeros_like(x)
        sent[keep] = x[keep]
        return sent
    return encode


class ResidualMemory:
    """Error feedback on a worker's whole tensor: it compensates with what it kept and keeps what
    was not sent."""

    def __init__(self):
        self.residuals = {}

    def compensate(self, key, g):
        return g + self.residuals.get(key, 0.0)

    def update(self, key, compensated, sent):
        self.residuals[key] = compensated - sent


class DGCMemory(ResidualMemory):
    """DGC's memory: momentum correction (velocity ``u = momentum * u + g``, residual ``v = v + u``,
    ``v`` sent) and momentum factor masking (``u`` zeroed where entries were sent)."""

    def __init__(self, momentum):
        super().__init__()
        self.momentum, self.velocities = momentum, {}

    def compensate(self, key, g):
        self.velocities[key] = self.momentum * self.velocities.get(key, 0.0) + g
        return self.residuals.get(key, 0.0) + self.velocities[key]

    def update(self, key, compensated, sent):
        super().update(key, compensated, sent)
        self.velocities[key] = np.where(sent != 0, 0.0, self.velocities[key])


def two_stage(workers, encode, owner_encode, residuals_kept=True, memory=None, seeded=False,
              float32=False):
    """``communicator="alltoall"`` from its definition: each worker cuts (gradient + its residual)
    into ``workers`` shards (sizes differing by at most one, the larger first) and encodes each
    (``encode(shard) -> what it decodes to``), its residual the rest; each shard's owner adds up
    the workers' decoded shards and its own residual, encodes that (``owner_encode``), its residual
    the rest; the owners' shards, joined, are the sum every worker receives. Without
    ``residuals_kept`` (no memory) neither side keeps one; ``memory``: the workers' own (a
    ``ResidualMemory`` by default). ``seeded``: a codec that draws random numbers, called with
    ``(x, key)``, ``key`` = (the name its draws are keyed by, the rank, the step): a worker encodes
    shard ``j`` of ``name`` as ``name/j``, an owner its sum as ``name@owner``. ``float32``: every
    sum in float32, as the pipeline adds (one worker's decoded shard onto the others' in rank
    order), for a codec that ties between equal values or draws make sensitive to the last bit.
    Returns ``exchange(name, step, gradients) -> sum`` for ``simulate``."""

    memory = memory or ResidualMemory()
    owners = {}

    def exchange(name, step, gradients):
        shape = gradients[0].shape
        size = gradients[0].size
        base, extra = divmod(size, workers)
        bounds = np.cumsum([0] + [base + (1 if j < extra else 0) for j in range(workers)])
        shards = [slice(bounds[j], bounds[j + 1]) for j in range(workers)]
        dtype = np.float32 if float32 else np.float64
        totals = [np.zeros(s.stop - s.start, dtype) for s in shards]
        for rank, g in enumerate(gradients):
            key = (name, rank)
            g = g.reshape(-1).astype(dtype)
            c = memory.compensate(key, g) if residuals_kept else g
            if seeded:
                sent = np.concatenate([encode(c[s], (f"{name}/{j}", rank, step))
                                       for j, s in enumerate(shards)])
            else:
                sent = np.concatenate([encode(c[s]) for s in shards])
            sent = sent.astype(dtype)
            if residuals_kept:
                memory.update(key, c, sent)
            for j, s in enumerate(shards):
                totals[j] = totals[j] + sent[s]
        out = []
        for j, total in enumerate(totals):
            t = total + owners.get((name, j), 0.0)
            sent = (owner_encode(t, (f"{name}@owner", j, step)) if seeded else owner_encode(t)).astype(dtype)
            if residuals_kept:
                owners[(name, j)] = t - sent
            out.append(sent)
        return np.concatenate(out).reshape(shape)
    return exchange


def two_stage_topk(ratio, workers, owner_ratio=None):
    """Top-k through the owners: the workers keep the top ``ratio`` of each shard, the owners the
    top ``owner_ratio`` of their shard's sum, twice ``ratio`` unless given (``OWNERS_KEEP``)."""
    owner_ratio = min(1.0, 2 * ratio) if owner_ratio is None else owner_ratio
    return two_stage(workers, keep_top(ratio), keep_top(owner_ratio))


def two_stage_dgc(workers, ratio, momentum=0.9):
    """DGC through the owners, from its definition: each worker keeps DGC's memory of the whole
    tensor (``DGCMemory``: momentum correction and factor masking) and sends the top ``ratio`` of
    each shard of ``v`` (at least 16 entries, as top-k); each owner adds the workers' shards and
    its own residual, sends DGC's own ``ratio`` of that (its ``k``, no more), and keeps the rest."""
    return two_stage(workers, keep_top(ratio), keep_top(ratio), memory=DGCMemory(momentum))


# 8-bit's table from its definition: 0 and 2^((i - 127) / 8) for i = 1..127; the boundaries the
# geometric means of neighbours (in float32, as the table is), half the smallest magnitude first.
TABLE = np.concatenate([[0.0], 2.0 ** ((np.arange(1, 128) - 127) / 8.0)]).astype(np.float32)
BOUNDARIES = np.concatenate([[TABLE[1] / 2], np.sqrt(TABLE[1:-1] * TABLE[2:])]).astype(np.float32)


def u8bit_encode(x):
    """8-bit approximation of a shard, in float32 as it is computed: each element divided by the
    shard's largest magnitude goes to the nearest of the table's 128 magnitudes (in the log
    domain: the count of the boundaries at or below it), with its sign, times that magnitude."""
    from grace.compressor import TINY

    x = np.asarray(x, np.float32)
    scale = np.abs(x).max() if x.size else np.float32(0)
    relative = (np.abs(x) / np.maximum(scale, np.float32(TINY))).astype(np.float32)
    value = TABLE[np.searchsorted(BOUNDARIES, relative, side="right")] * np.float32(scale)
    return np.where(x < 0, -value, value).astype(np.float32)


def two_stage_u8bit(workers):
    """8-bit through the owners (no memory, so no residual on either side): each worker's shards
    approximated, each owner's float32 sum of them approximated again."""
    def owner(total):
        return u8bit_encode(total.astype(np.float32)).astype(np.float64)
    return two_stage(workers, lambda x: u8bit_encode(x).astype(np.float64), owner, residuals_kept=False)


def two_stage_twobit(workers, threshold=1.0, block_size=512):
    """Two-bit through the owners: each side quantizes its shard in blocks of ``block_size``
    (the workers their compensated shard, the owners their shard's sum plus their residual)."""
    quantize = twobit_quantize(threshold, True, block_size)
    return two_stage(workers, quantize, quantize)


def error_bounded(error_bound=2.0**-10):
    """INCEPTIONN's encoding of a shard, from its definition, as it decodes: each element (in
    float32) becomes its nearest multiple of ``error_bound`` (ties to even) where that multiple
    fits in 15 bits and a sign, else it travels as it is."""
    def encode(x):
        x = np.asarray(x, np.float32)
        steps = np.rint(x * np.float32(1.0 / error_bound))
        return np.where(np.abs(steps) >= 32768, x, steps * np.float32(error_bound)).astype(np.float64)
    return encode


def two_stage_inceptionn(workers, error_bound=2.0**-10):
    """INCEPTIONN through the owners (its default residual on both sides): each side sends its
    shard rounded to multiples of ``error_bound`` and keeps the rounding error (the dropped
    elements whole)."""
    return two_stage(workers, error_bounded(error_bound), error_bounded(error_bound))


def stochastic_levels(x, scale, levels, draws):
    """Stochastic rounding of ``|x| / scale * levels`` (float32, as it is computed) to an integer
    ``q`` at most ``levels``, up where the draw lies below the fraction; ``±q * (scale / levels)``,
    with ``x``'s sign."""
    level = (np.abs(x) / scale) * np.float32(levels)
    low = np.floor(level)
    q = np.minimum(low + (draws < level - low), np.float32(levels))
    value = q * (scale * np.float32(1.0 / levels))
    return np.where(x < 0, -value, value).astype(np.float32)


def seed_of(key, seed=0):
    """The seed of a worker's draws for ``key`` = (name, rank, step), as ``Seeded`` makes it."""
    from grace.compressor import stable_seed

    name, rank, step = key
    return stable_seed(seed, name, step, rank)


def draws_of(key, n, seed=0):
    """The ``n`` uniform draws of a worker's codec for ``key``: the numbers of ``grace.rng``'s
    generator, its definition in numpy."""
    from grace.rng import reference_uniform

    return reference_uniform(n, seed_of(key, seed))


def qsgd_encode(levels=7, block_size=512, seed=0):
    """QSGD of a flat array, from its definition, as it decodes: in blocks of ``block_size``
    consecutive elements (one block for a smaller array), each element stochastically rounded to
    one of ``levels`` levels of its block's norm (the norm summed in float64, sent in float32)."""
    from grace.compressor import TINY

    def encode(x, key):
        x = np.asarray(x, np.float32)
        draws = draws_of(key, x.size, seed)
        size = x.size if block_size == 0 or block_size >= x.size else block_size
        sent = np.empty_like(x)
        for start in range(0, x.size, size):
            part = x[start:start + size]
            norm = np.float32(np.sqrt(np.sum(part.astype(np.float64) ** 2)))
            sent[start:start + size] = stochastic_levels(part, max(norm, np.float32(TINY)), levels,
                                                         draws[start:start + size])
        return sent
    return encode


def two_stage_qsgd(workers, levels=7, block_size=512):
    """QSGD through the owners (no memory, so no residual on either side): each worker's shards
    quantized with its own draws, each owner's float32 sum of them quantized again with its own."""
    encode = qsgd_encode(levels, block_size)
    return two_stage(workers, encode, encode, residuals_kept=False, seeded=True, float32=True)


def terngrad_encode(clip=2.5, seed=0):
    """TernGrad of a flat array, from its definition, as it decodes: ``s`` the largest magnitude,
    at most ``clip`` times the root mean square; each element ``±s`` with probability ``|x| / s``
    (1 beyond ``s``), else 0."""
    from grace.compressor import TINY

    def encode(x, key):
        x = np.asarray(x, np.float32)
        scale = np.abs(x).max()
        if clip is not None:
            norm = np.float32(np.sqrt(np.sum(x.astype(np.float64) ** 2)))
            rms = norm * np.float32(1.0 / np.sqrt(x.size))
            scale = min(scale, rms * np.float32(clip))
        return stochastic_levels(x, max(np.float32(scale), np.float32(TINY)), 1, draws_of(key, x.size, seed))
    return encode


def two_stage_terngrad(workers, clip=2.5):
    """TernGrad through the owners (no memory): each worker's shards ternarized with its own draws
    and scale, each owner's float32 sum of them again."""
    encode = terngrad_encode(clip)
    return two_stage(workers, encode, encode, residuals_kept=False, seeded=True, float32=True)


def natural_encode(seed=0):
    """Natural compression of a flat array, from its definition, as it decodes: each float32
    magnitude ``2^e <= |x| < 2^(e+1)`` goes to ``2^e`` or, with probability ``(|x| - 2^e) / 2^e``,
    to ``2^(e+1)`` (at most 2^127); one below the smallest normal, 2^-126, to 0 or to it."""
    smallest = np.float32(2.0**-126)

    def encode(x, key):
        x = np.asarray(x, np.float32)
        magnitude = np.abs(x)
        low = np.ldexp(np.float32(1.0), np.frexp(magnitude)[1] - 1).astype(np.float32)
        normal = magnitude >= smallest
        low = np.where(normal, low, smallest)
        down = np.where(normal, low, 0)  # rounded down: 2^e, or 0 below the smallest normal
        up = draws_of(key, x.size, seed) < (magnitude - down) / low
        value = np.where(up, np.minimum(2 * low.astype(np.float64), 2.0**127), down)
        return np.where(x < 0, -value, value).astype(np.float32)
    return encode


def two_stage_natural(workers):
    """Natural compression through the owners (no memory): each worker's shards rounded to powers of
    two with its own draws, each owner's float32 sum of them again."""
    encode = natural_encode()
    return two_stage(workers, encode, encode, residuals_kept=False, seeded=True, float32=True)


def quantile_means(bins=256):
    """SketchML's encoding of a flat array of at most 65,536 elements (its quantiles exact), from
    its definition, as it decodes: cut at the sorted values of ranks ``i * n // bins``, each
    element (in float32) becomes the mean of the elements between its neighbouring cuts (summed in
    float64, sent in float32)."""
    def encode(x):
        x = np.asarray(x, np.float32)
        cuts = np.minimum(x.size - 1, np.arange(1, bins) * x.size // bins)
        ids = np.searchsorted(np.sort(x)[cuts], x, side="right")
        sums = np.bincount(ids, x.astype(np.float64), bins)
        means = (sums / np.maximum(np.bincount(ids, minlength=bins), 1)).astype(np.float32)
        return means[ids]
    return encode


def two_stage_sketch(workers, bins=256):
    """SketchML through the owners (its default residual on both sides): each worker's shards and
    each owner's sum plus its residual sent as the means of their quantile bins."""
    return two_stage(workers, quantile_means(bins), quantile_means(bins), float32=True)


def adaq_encode(ratio=0.01, sample_ratio=0.01, seed=0):
    """AdaQ of a flat array, from its definition, as it decodes: from ``m`` elements drawn without
    replacement (``ratio`` of the array, at least 256), ``top`` the ``k``-th largest and ``bottom``
    the ``k``-th smallest (``k = ratio m``, at least 1); the positive elements at or above ``top``
    become their mean, the negative ones at or below ``bottom`` theirs, the rest 0 (arrays small
    enough that no cap on the indices applies)."""
    from grace.rng import reference_indices

    def encode(x, key):
        x = np.asarray(x, np.float32)
        m = min(x.size, max(1, int(x.size * sample_ratio), 256))
        k = max(1, int(m * ratio))
        sample = np.sort(x[reference_indices(x.size, m, seed_of(key, seed))])
        sent = np.zeros_like(x)
        for chosen in ((x >= sample[m - k]) & (x > 0), (x <= sample[k - 1]) & (x < 0)):
            if chosen.any():
                sent[chosen] = np.float32(x[chosen].sum(dtype=np.float64)) / np.float32(chosen.sum())
        return sent
    return encode


def two_stage_adaq(workers, ratio=0.01):
    """AdaQ through the owners (error feedback on both sides: its momentum memory, without an
    optimizer's momentum, is the residual): each worker's shards and each owner's sum plus its
    residual sent as two means at the positions beyond the sampled thresholds."""
    encode = adaq_encode(ratio)
    return two_stage(workers, encode, encode, seeded=True, float32=True)


def keep_at_least(threshold):
    """Threshold sparsification of a shard: the entries with ``|x| >= threshold``, the rest zero."""
    return lambda x: np.where(np.abs(x) >= threshold, x, 0.0)


def two_stage_threshold(workers, threshold):
    """Threshold through the owners: both sides keep the entries at or above ``threshold``."""
    return two_stage(workers, keep_at_least(threshold), keep_at_least(threshold))


def scaled_signs(bucket=512):
    """EF-signSGD's encoding of a flat array: in blocks of ``bucket`` consecutive elements, each
    element becomes its block's mean magnitude with its own sign (+ at zero), the mean rounded to
    float32 as it is sent."""
    def encode(x):
        sent = np.empty_like(x)
        for start in range(0, x.size, bucket):
            part = x[start:start + bucket]
            scale = np.float32(np.abs(part.astype(np.float32).astype(np.float64)).mean())
            sent[start:start + bucket] = np.where(part >= 0, scale, -scale)
        return sent
    return encode


def two_stage_efsignsgd(workers, bucket=512):
    """EF-signSGD through the owners (error feedback on both sides): each side sends its shard's
    signs with a mean magnitude per block."""
    return two_stage(workers, scaled_signs(bucket), scaled_signs(bucket))


def to_bfloat16(x):
    """``x`` rounded to bfloat16 (to nearest, ties to even), as float32: the top 16 bits of each
    float32, rounded."""
    bits = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
    return rounded.astype(np.uint32).view(np.float32)


def two_stage_bf16(workers):
    """bf16 through the owners (no memory, so no residual on either side): each worker's shards
    rounded to bfloat16, each owner's sum rounded again (in float32, as its decoded shards add)."""
    def owner(total):
        return to_bfloat16(total.astype(np.float32)).astype(np.float64)
    return two_stage(workers, lambda x: to_bfloat16(x).astype(np.float64), owner, residuals_kept=False)


def passes(encode, count):
    """``encode`` ``count`` times, each pass encoding what the ones before it left; the sum."""
    def encoded(x):
        sent = np.zeros_like(x)
        for _ in range(count):
            sent = sent + encode(x - sent)
        return sent
    return encoded


def two_stage_onebit(workers, owner_bits=2, bucket=512):
    """1-bit SGD through the owners: the workers send each shard's signs and two means per
    ``bucket`` elements, the owners their shard's sum in ``owner_bits`` passes of the same."""
    return two_stage(workers, bucket_means(bucket), passes(bucket_means(bucket), owner_bits))


def hierarchical(compress, per_host):
    """``hierarchical=True``: each host's workers (``per_host`` consecutive ranks) sum their
    gradients dense, the host's sum is compressed (``compress(name, host, step, g)``) and the hosts'
    compressed sums are added. Returns ``exchange(name, step, gradients) -> sum`` for ``simulate``."""
    def exchange(name, step, gradients):
        hosts = [sum(gradients[h * per_host:(h + 1) * per_host]) for h in range(len(gradients) // per_host)]
        return sum(compress(name, h, step, g) for h, g in enumerate(hosts))
    return exchange


def velocity(momentum, dampening=0.0):
    """A worker's momentum applied before the exchange, nothing compressed (the dense tensors'
    momentum where it was taken over): ``u = momentum * u + (1 - dampening) * g``, sent."""
    velocities = {}

    def compress(name, rank, step, g):
        velocities[(name, rank)] = momentum * velocities.get((name, rank), 0.0) + (1.0 - dampening) * g
        return velocities[(name, rank)]
    return compress


def signs_of_momentum(beta):
    """signum's encoding: each worker's ``m = beta * m + (1 - beta) * g`` sent as its sign (+1 at
    0); over 2 workers the majority vote in units of a sum, averaged, is the mean of the signs."""
    momenta = {}

    def compress(name, rank, step, g):
        momenta[(name, rank)] = beta * momenta.get((name, rank), 0.0) + (1.0 - beta) * g
        return np.where(momenta[(name, rank)] >= 0, 1.0, -1.0)
    return compress


def simulate(compress=None, workers=2, steps=10, average=True, passes=1, clip=None, adam=False,
             fp16=False, ranks=None, momentum=None, nesterov=False, joined=False, exchange=None,
             compress_b=None, beta1=0.9, adam_start=1, lr=LR, decay=0.0, keras_eps=None):
    """Final (W, b) of data-parallel training of common.py's model. ``compress(name, rank, step, g)``
    is applied to W's gradient (b is below the size threshold and travels dense). ``ranks`` chooses
    whose data the workers train on (default: ``range(workers)``). ``momentum``: SGD's momentum on
    the combined gradient of each tensor, e.g. ``{"w": 0.0, "b": 0.9}`` (Nesterov's if asked).
    ``joined``: ``compress`` takes b and W joined into one vector, as ``granularity="bucket"``
    compresses a bucket (b first: the wrapper's buckets follow the reverse registration order).
    ``exchange(name, step, gradients)``: W's sum over the workers, computed from all of their
    gradients at once (a two-stage exchange), in place of compressing each and adding up.
    ``compress_b``: applied to each worker's b as ``compress`` to W (a momentum taken over).
    Adam (lr 0.01, ``beta1``, beta2 0.999, eps 1e-8) starts at step ``adam_start`` (1 after
    ``hvd.broadcast_optimizer_state``, which initialises Adam with one zero step; else 0).
    ``lr`` and ``momentum``'s values: numbers, or one per step (a scheduler's). ``decay``: SGD's
    weight decay, added to the update after the momentum (the optimizer's, with its momentum taken
    over: ``p -= lr * (v + decay * p)``). ``keras_eps``: Adam as Keras writes it, with this epsilon
    added to the second moment's root before its bias correction (torch's 1e-8 after it, else)."""
    ranks = list(range(workers)) if ranks is None else list(ranks)
    workers = len(ranks)
    w, b = (a.astype(np.float64) for a in init_weights(0))
    m = {"w": 0.0, "b": 0.0}
    v = {"w": 0.0, "b": 0.0}
    t = adam_start if adam else 0
    for step in range(steps):
        gw_all, gb_all = [], []
        for rank in ranks:
            gw, gb = 0.0, 0.0
            for micro in range(passes):
                x, y = batch(rank, step * passes + micro)
                dw, db = gradients(w.astype(np.float32), b.astype(np.float32), x, y)
                gw, gb = gw + dw, gb + db
            if compress is not None and joined:
                both = compress("bucket", rank, step, np.concatenate([gb.reshape(-1), gw.reshape(-1)]))
                gb, gw = both[:gb.size].reshape(gb.shape), both[gb.size:].reshape(gw.shape)
            elif compress is not None:
                gw = compress("weight", rank, step, gw)
            if compress_b is not None:
                gb = compress_b("bias", rank, step, gb)
            gw_all.append(gw)
            gb_all.append(gb)
        if exchange is not None:
            gw, gb = exchange("weight", step, gw_all), np.sum(gb_all, axis=0)
        elif fp16:
            gw, gb = fp16_sum(gw_all), fp16_sum(gb_all)
        else:
            gw, gb = np.sum(gw_all, axis=0), np.sum(gb_all, axis=0)
        if average:
            gw, gb = gw / workers, gb / workers
        if clip is not None:
            norm = np.sqrt((gw**2).sum() + (gb**2).sum())
            factor = min(1.0, clip / (norm + 1e-6))
            gw, gb = gw * factor, gb * factor
        if momentum:
            for key, g in (("w", gw), ("b", gb)):
                beta = at(momentum[key], step)
                m[key] = beta * m[key] + g
                if key == "w":
                    gw = gw + beta * m[key] if nesterov else m[key]
                else:
                    gb = gb + beta * m[key] if nesterov else m[key]
        gw, gb = gw + decay * w, gb + decay * b
        if adam:
            t += 1
            updates = {}
            for key, g in (("w", gw), ("b", gb)):
                m[key] = beta1 * m[key] + (1 - beta1) * g
                v[key] = 0.999 * v[key] + 0.001 * g * g
                if keras_eps is None:
                    denom = np.sqrt(v[key]) / np.sqrt(1 - 0.999**t) + 1e-8
                else:  # lr sqrt(1 - b2^t) / (1 - b1^t) m / (sqrt(v) + eps)
                    denom = (np.sqrt(v[key]) + keras_eps) / np.sqrt(1 - 0.999**t)
                updates[key] = 0.01 / (1 - beta1**t) * m[key] / denom
            w, b = w - updates["w"], b - updates["b"]
        else:
            w, b = w - at(lr, step) * gw, b - at(lr, step) * gb
    return w, b
