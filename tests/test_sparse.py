"""Sparse gradients (grace/sparse.py) through the pipeline, on simulated workers: rows exchanged as
rows, compressed, with error feedback kept as rows."""

from __future__ import annotations

import numpy as np
import pytest

import grace
from grace.backends import InProcessGroup, NumpyOps
from grace.sparse import Rows

OPS = NumpyOps()
TABLE = (4000, 8)


def batch(rng, rows=200, table=TABLE, repeats=True):
    """A step's sparse gradient: ``rows`` looked-up indices (some repeated), their values."""
    indices = rng.integers(0, table[0], rows) if repeats else rng.choice(table[0], rows, replace=False)
    return Rows(indices, rng.standard_normal((rows, table[1])).astype(np.float32), table)


def dense(rows: Rows) -> np.ndarray:
    out = np.zeros(rows.dense_shape, np.float64)
    np.add.at(out, np.asarray(rows.indices), np.asarray(rows.values, np.float64))
    return out


def exchange(pipelines, grads, group, scale=None):
    """One step: every worker starts its sparse gradient, then every worker finishes."""
    workers = [group.worker(r) for r in range(len(pipelines))]
    scale = 1.0 / len(pipelines) if scale is None else scale
    started = [p.start_sparse(g, "emb", w, OPS) for p, g, w in zip(pipelines, grads, workers)]
    return [p.finish(s, w, scale) for p, s, w in zip(pipelines, started, workers)]


def test_rows_travel_exactly_with_none_one_row_per_distinct_index():
    rng = np.random.default_rng(0)
    group = InProcessGroup(3)
    pipelines = [grace.none() for _ in range(3)]
    grads = [batch(rng) for _ in range(3)]
    results = exchange(pipelines, grads, group)
    expected = sum(dense(g) for g in grads) / 3
    touched = np.unique(np.concatenate([g.indices for g in grads]))
    for r in results:
        np.testing.assert_array_equal(r.indices, touched)  # distinct, ascending
        np.testing.assert_allclose(dense(r), expected, rtol=1e-6, atol=1e-7)
        assert r.dense_shape == TABLE
        np.testing.assert_array_equal(r.values, results[0].values)  # every worker alike


def test_bytes_are_counted_exactly_and_against_horovods_sparse_allgather():
    rng = np.random.default_rng(1)
    group = InProcessGroup(2)
    pipelines = [grace.none(check_finite=False) for _ in range(2)]
    grads = [batch(rng) for _ in range(2)]
    exchange(pipelines, grads, group)
    stats = pipelines[0].stats()
    distinct = np.unique(grads[0].indices).size
    # Horovod: int64 indices and float32 values of every looked-up row, repeats included.
    assert stats["bytes_dense"] == 200 * 8 + 200 * 8 * 4
    # grace: one int32 index and the row per distinct index, and the two parts' int32 lengths.
    assert stats["bytes_sent"] == distinct * 4 + distinct * 8 * 4 + 2 * 4


@pytest.mark.parametrize("table_rows", [4000, 400_000])
def test_bytes_follow_the_rows_touched_not_the_table(table_rows):
    rng = np.random.default_rng(2)
    table = (table_rows, 8)
    group = InProcessGroup(2)
    pipelines = [grace.topk(0.01, check_finite=False) for _ in range(2)]
    grads = [batch(rng, 300, table, repeats=False) for _ in range(2)]
    exchange(pipelines, grads, group)
    # 1% of the 300 x 8 touched elements as float32 value + int32 position, the int32 index of
    # each row holding one of them, and the 3 parts' int32 lengths: the same for a table 100
    # times larger.
    order = np.argsort(grads[0].indices)
    largest = np.argsort(-np.abs(grads[0].values[order].reshape(-1)))[:24]
    holding = np.unique(largest // 8).size
    assert pipelines[0].stats()["bytes_sent"] == holding * 4 + 24 * 8 + 3 * 4


def test_topk_error_feedback_on_rows_loses_nothing():
    """Over steps, what a worker sent plus the rows it kept equals everything it was given; the
    residual holds only rows that were touched."""
    rng = np.random.default_rng(3)
    group = InProcessGroup(2)
    pipelines = [grace.topk(0.05) for _ in range(2)]
    given = [np.zeros(TABLE) for _ in range(2)]
    received = np.zeros(TABLE)
    touched = [set() for _ in range(2)]
    for _ in range(6):
        grads = [batch(rng) for _ in range(2)]
        for r in range(2):
            given[r] += dense(grads[r])
            touched[r].update(np.asarray(grads[r].indices).tolist())
        received += dense(exchange(pipelines, grads, group, scale=1.0)[0])
    kept = []
    for r in range(2):
        rows = pipelines[r].rows.residual
        indices, values = rows.row_indices["emb"], rows.row_values["emb"]
        assert set(np.asarray(indices).tolist()) <= touched[r]
        kept.append(dense(Rows(indices, values, TABLE)))
    np.testing.assert_allclose(received + kept[0] + kept[1], given[0] + given[1], atol=1e-4)


def test_sign_rows_are_combined_by_majority_vote_per_index():
    group = InProcessGroup(3)
    pipelines = [grace.signsgd(min_numel=0) for _ in range(3)]
    values = [np.array([[1.0, -2.0]], np.float32), np.array([[3.0, 1.0]], np.float32),
              np.array([[-1.0, -1.0]], np.float32)]
    grads = [Rows(np.array([5]), v, (10, 2)) for v in values]
    grads[2] = Rows(np.array([7]), values[2], (10, 2))  # worker 2 touches another row
    result = exchange(pipelines, grads, group, scale=1.0)[0]
    np.testing.assert_array_equal(result.indices, [5, 7])
    # Row 5: signs (+,-) and (+,+) vote (+, 0); row 7 has one vote, (-,-); in sum units (x3).
    np.testing.assert_array_equal(result.values, [[3.0, 0.0], [-3.0, -3.0]])


@pytest.mark.parametrize("name", ["powersgd", "randomk", "signum"])
def test_compressors_that_cannot_encode_rows_send_them_as_they_are(name):
    rng = np.random.default_rng(4)
    group = InProcessGroup(2)
    pipelines = [getattr(grace, name)() for _ in range(2)]
    grads = [batch(rng) for _ in range(2)]
    result = exchange(pipelines, grads, group)[0]
    np.testing.assert_allclose(dense(result), (dense(grads[0]) + dense(grads[1])) / 2, rtol=1e-6,
                               atol=1e-7)


def test_a_nonfinite_row_rolls_the_step_back_on_every_worker():
    rng = np.random.default_rng(5)
    group = InProcessGroup(2)
    pipelines = [grace.topk(0.05) for _ in range(2)]
    exchange(pipelines, [batch(rng) for _ in range(2)], group)
    before = [dict(p.rows.residual.row_values) for p in pipelines]
    grads = [batch(rng) for _ in range(2)]
    grads[1].values[3, 2] = np.inf
    results = exchange(pipelines, grads, group)
    for p, kept, result in zip(pipelines, before, results):
        assert np.isnan(result.values).all()
        np.testing.assert_array_equal(p.rows.residual.row_values["emb"], kept["emb"])


@pytest.mark.parametrize("how", ["taken", "given", "unseen"])
def test_taken_momentum_steps_the_exchanged_rows_as_the_optimizer_would(how):
    """DGC owns the momentum; a sparse gradient's rows get it after the exchange: u = m u + g over
    the rows ever touched (the table's rows outside them stay 0). Taken from the optimizer, given
    to DGC (``momentum=0.9``, the optimizer without), or DGC's own where no optimizer is seen (the
    tape, a DDP hook) alike."""
    from grace.momentum import OptimizerMomentum

    rng = np.random.default_rng(6)
    group = InProcessGroup(2)
    given = {"momentum": 0.9} if how == "given" else {}
    pipelines = [grace.dgc(min_numel=10**9, **given) for _ in range(2)]  # the table travels as it is
    for p in pipelines:
        if how == "taken":
            assert p.take_momentum(OptimizerMomentum(0.9)) is not None
        elif how == "given":
            assert p.take_momentum(OptimizerMomentum(0.0)) is None  # an SGD without momentum
    velocity = np.zeros(TABLE)
    for _ in range(3):
        grads = [batch(rng) for _ in range(2)]
        velocity = 0.9 * velocity + (dense(grads[0]) + dense(grads[1])) / 2
        result = exchange(pipelines, grads, group)[0]
        np.testing.assert_allclose(dense(result), velocity, rtol=1e-5, atol=1e-6)


def test_resuming_from_state_dict_continues_the_residual_rows_exactly():
    rng = np.random.default_rng(7)
    steps = [[batch(rng) for _ in range(2)] for _ in range(6)]

    def run(resume_at=None):
        group = InProcessGroup(2)
        pipelines = [grace.topk(0.05) for _ in range(2)]
        out = []
        for i, grads in enumerate(steps):
            if i == resume_at:
                saved = [p.state_dict() for p in pipelines]
                pipelines = [grace.topk(0.05) for _ in range(2)]
                for p, state in zip(pipelines, saved):
                    p.load_state_dict(state)
            out.append(exchange(pipelines, grads, group)[0])
        return out

    for a, b in zip(run(), run(resume_at=3)):
        np.testing.assert_array_equal(a.indices, b.indices)
        np.testing.assert_array_equal(a.values, b.values)


def test_check_finite_set_after_construction_reaches_the_rows_and_the_dense_tensors():
    """``pipeline.check_finite = False`` after building it is as ``check_finite=False`` given to it:
    no flag rides with the rows, nor with the dense buckets (the encoding's part, test_fusion's
    exchange), where the default sends one."""
    from tests import test_fusion

    def sparse_stats(built: bool, later: bool | None = None):
        pipelines = [grace.topk(0.01, check_finite=built) for _ in range(2)]
        for p in pipelines:
            if later is not None:
                p.check_finite = later
        exchange(pipelines, [batch(np.random.default_rng(7)) for _ in range(2)], InProcessGroup(2))
        return pipelines[0].stats()

    given = sparse_stats(False)
    assert sparse_stats(True, later=False) == given
    assert sparse_stats(True)["bytes_control"] > given["bytes_control"] == 0  # the flag, when on

    def dense_stats(pipeline_of):
        pipelines = [pipeline_of() for _ in range(2)]
        test_fusion.exchange(pipelines, steps=1)
        return pipelines[0].stats()

    def switched_off():
        pipeline = grace.topk(0.01)
        pipeline.check_finite = False
        return pipeline

    off = dense_stats(lambda: grace.topk(0.01, check_finite=False))
    assert dense_stats(switched_off) == off
    assert dense_stats(lambda: grace.topk(0.01)) != off
