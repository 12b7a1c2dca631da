from __future__ import annotations

import numpy as np

from grace.compressor import Compressor, compute_dtype, numel_of, stable_seed
from grace.validation import check_int


class PowerSGD(Compressor):
    """PowerSGD, rank ``r``: a gradient reshaped to an n×m matrix M is approximated by ``P Qᵀ`` from
    one step of power iteration warm-started with the previous step's Q: ``P = M Q`` is summed over
    the workers (first allreduce) and orthogonalized, ``Q = Mᵀ P`` is summed (second allreduce), and
    every worker applies ``P Qᵀ``. Error feedback (its ``powersgd`` memory) keeps ``M - P Q_localᵀ``.
    Vectors, and matrices too small for ``(n + m) r < n m``, travel dense. Vogels et al., "PowerSGD:
    Practical Low-Rank Gradient Compression for Distributed Optimization", NeurIPS 2019."""

    name = "powersgd"
    layout_sensitive = True  # the matrix view of a tensor
    summable = True
    default_memory = "powersgd"
    default_communicator = "allreduce"
    rounds = 2
    encodes_rows = False

    def __init__(self, rank: int = 2, seed: int = 0):
        self.rank = check_int("rank", rank, minimum=1)
        self.seed = check_int("seed", seed, minimum=0)
        self.q: dict = {}

    def params(self):
        return {"rank": self.rank, "seed": self.seed}

    def _dims(self, shape):
        n = int(shape[0])
        m = numel_of(shape) // n
        return n, m, min(self.rank, n, m)

    def accepts(self, shape):
        return len(shape) >= 2 and min(shape) > 0

    def payload_nbytes(self, shape, itemsize):
        n, m, r = self._dims(shape)
        return (n + m) * r * itemsize

    def compress_flat(self, flat, name, ctx, ops):
        n, m, r = self._dims(ctx.shape)
        dtype = compute_dtype(ctx.dtype)
        matrix = ops.reshape(ops.cast(flat, dtype), (n, m))
        # The same initial Q on every worker (and in every framework): drawn from the tensor's name.
        initial = np.random.default_rng(stable_seed(self.seed, name)).standard_normal((m, r))
        q = self.state_store.load(ops, self.q, name, like=ops.zeros(m * r, dtype, like=flat),
                                  initial=initial.astype(dtype).reshape(-1))
        p = ops.matmul(matrix, ops.reshape(q, (m, r)))
        ctx.data.update(matrix=matrix, dims=(n, m, r), name=name)
        return [ops.cast(ops.flatten(p), ctx.dtype)]

    def second_round(self, aggregated, ctx, ops):
        n, m, r = ctx.data["dims"]
        dtype = compute_dtype(ctx.dtype)
        return self._q_payload(ops.orthogonalize(ops.reshape(ops.cast(aggregated[0], dtype), (n, r))),
                               ctx, ops)

    def second_rounds(self, aggregated, ctxs, ops):
        # One QR call for all of a bucket's P matrices of one shape (a batch gives each matrix the
        # bits it gets alone, in every adapter), instead of one call per matrix.
        shapes: dict = {}
        for i, ctx in enumerate(ctxs):
            n, _, r = ctx.data["dims"]
            shapes.setdefault((n, r, compute_dtype(ctx.dtype)), []).append(i)
        ps: list = [None] * len(ctxs)
        for (n, r, dtype), members in shapes.items():
            if len(members) == 1:
                i = members[0]
                ps[i] = ops.orthogonalize(ops.reshape(ops.cast(aggregated[i][0], dtype), (n, r)))
                continue
            stacked = ops.concat([ops.cast(aggregated[i][0], dtype) for i in members])
            basis = ops.flatten(ops.orthogonalize(ops.reshape(stacked, (len(members), n, r))))
            for i, piece in zip(members, ops.split(basis, [n * r] * len(members))):
                ps[i] = ops.reshape(piece, (n, r))
        return [self._q_payload(p, ctx, ops) for p, ctx in zip(ps, ctxs)]

    def _q_payload(self, p, ctx, ops):
        """The second payload, ``Q = Mᵀ P``, from the orthogonalized ``P``."""
        ctx.data["p"] = p
        return [ops.cast(ops.flatten(ops.matmul(ctx.data["matrix"], p, transpose_a=True)), ctx.dtype)]

    def after_aggregate(self, aggregated, ctx, ops):
        self.state_store.save(ops, self.q, ctx.data["name"],
                              ops.cast(aggregated[0], compute_dtype(ctx.dtype)))

    def residual(self, compensated, payload, ctx, ops, overwrite=False):
        # M - P Q_localᵀ in one product-and-subtract, without the n × m approximation.
        n, m, r = ctx.data["dims"]
        dtype = compute_dtype(ctx.dtype)
        q = ops.reshape(ops.cast(payload[0], dtype), (m, r))
        matrix = ops.reshape(ops.cast(compensated, dtype), (n, m))
        left = ops.matmul(ctx.data["p"], q, transpose_b=True, subtract_from=matrix)
        return ops.reshape(ops.cast(left, ctx.dtype), ops.shape(compensated))

    def aggregate_payloads(self, payloads, ctx, ops, scale=1.0):
        if len(payloads) != 1 or scale == 1.0 or "p" not in ctx.data:
            return super().aggregate_payloads(payloads, ctx, ops, scale)
        # The summed Q scaled (m × r values), not the n × m product.
        (q,) = payloads[0]
        return self.decompress([ops.scale(q, scale)], ctx, ops)

    def decompress_flat(self, payload, ctx, ops):
        n, m, r = ctx.data["dims"]
        if "p" not in ctx.data:
            # A first-round payload decompressed on its own (inspection, one worker): finish the
            # power iteration locally.
            payload = self.second_round(payload, ctx, ops)
        dtype = compute_dtype(ctx.dtype)
        q = ops.reshape(ops.cast(payload[0], dtype), (m, r))
        return ops.cast(ops.flatten(ops.matmul(ctx.data["p"], q, transpose_b=True)), ctx.dtype)
