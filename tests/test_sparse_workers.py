"""Sparse gradients on real workers (horovodrun, Gloo): Horovod's own sparse-embedding scenario
with grace compression, an embedding model against a numpy model of the exchange, bytes that follow
the rows touched, and resuming with residual rows."""

from __future__ import annotations

import json
import os

import pytest

from tests.launch import ROOT, horovodrun

TORCH_WORKER = os.path.join(ROOT, "tests", "workers", "torch_sparse.py")


def reports(tmp_path_factory, worker: str) -> list[dict]:
    """Each of 2 workers' report of ``worker``'s scenarios."""
    out = tmp_path_factory.mktemp(os.path.basename(worker)[:-3])
    horovodrun(worker, str(out))
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.fixture(scope="module")
def torch_report(tmp_path_factory):
    return reports(tmp_path_factory, TORCH_WORKER)


def test_horovods_sparse_embedding_scenario_matches_horovods_own_optimizer(torch_report):
    """test/parallel/test_torch.py::test_sparse_embeddings (SparseAdam, each rank its own lookups)
    with grace.none, fp16, topk, randomk and powersgd, sparse_as_dense False and True: the same
    weights as Horovod's own optimizer, bit for bit. What that checks is the wrapper's handling of
    sparse gradients, not compression: the 10 x 3 table is below the min_numel of none, top-k,
    random-k and PowerSGD, which send it as it is (random-k and PowerSGD encode no rows in any
    case); fp16 (min_numel 0) casts it, and this scenario's gradients (counts of lookups, small
    integers) are exact in float16. Compressed rows: the next tests."""
    for report in torch_report:
        assert len(report["horovod"]) == 10
        assert all(diff == 0.0 for diff in report["horovod"].values()), report["horovod"]


def test_embedding_model_matches_the_numpy_model(torch_report):
    """5 SGD steps of an embedding (1000 x 16, sparse) and a linear layer on 2 workers. The numpy
    model computes in float64, so float32 rounding (~1e-7 of weights of order 1) is the gap with
    grace.none(); top-k (5%) with error feedback on the rows within 1e-5."""
    for report in torch_report:
        assert report["none"]["embedding"] < 1e-6 and report["none"]["linear"] < 1e-6
        # Horovod's own optimizer adds a row's repeats in another order: float32 rounding apart.
        assert report["none"]["horovod"] < 1e-6
        assert report["topk"]["embedding"] < 1e-5 and report["topk"]["linear"] < 1e-5


def test_sparse_bytes_follow_the_rows_touched(torch_report):
    for report in torch_report:
        topk = report["topk"]
        # The same lookups into a table 100 times larger send the same bytes, step by step.
        assert topk["sent_per_step_large_table"] == topk["sent_per_step"]
        # Horovod's sparse allgather: int64 indices and float32 values of each of the 160 lookups
        # per step, plus the dense linear layer's 64 float32; grace sends a fraction of it.
        assert topk["bytes_dense"] == 5 * (160 * 8 + 160 * 16 * 4 + 64 * 4)
        assert topk["bytes_sent"] < topk["bytes_dense"] / 3
        # Error feedback holds rows, at most the distinct rows the 5 steps touched (800 lookups).
        assert 0 < topk["residual_rows"] <= 800


def test_resuming_continues_the_residual_rows_exactly(torch_report):
    for report in torch_report:
        assert report["resume"] == 0.0


def test_a_worker_without_the_tables_gradient_takes_part(torch_report):
    """Rank 1 looks nothing up at steps 0 and 2 (no gradient for the table); the workers still end
    with the same weights: the table's gradient travels sparse on both, with no rows from rank 1."""
    assert torch_report[0]["unused"] == torch_report[1]["unused"]


TF_WORKER = os.path.join(ROOT, "tests", "workers", "tf_sparse.py")


@pytest.fixture(scope="module")
def tf_report(tmp_path_factory):
    return reports(tmp_path_factory, TF_WORKER)


@pytest.mark.slow  # their module's TensorFlow run takes a minute (Makefile: test-slow)
def test_tensorflow_tape_sends_indexed_slices_as_rows(tf_report):
    """DistributedGradientTape, eagerly and under tf.function: the table's gradient stays a
    tf.IndexedSlices, and the model matches the numpy model (float32 rounding apart) as Horovod's
    own tape does; fp16 within its rounding (2**-11 of each row, 5 steps)."""
    for report in tf_report:
        for mode in ("eager", "function"):
            for name in ("none", "horovod", "fp16"):
                assert report[f"tape.{mode}.{name}"]["kinds"] == ["IndexedSlices"]
            assert report[f"tape.{mode}.none"]["gap"] < 1e-6
            assert report[f"tape.{mode}.horovod"]["gap"] < 1e-6
            assert report[f"tape.{mode}.fp16"]["gap"] < 1e-5
            # fp16 halves the values' bytes; the int32 row indices stay.
            none, fp16 = (report[f"tape.{mode}.{n}"]["stats"] for n in ("none", "fp16"))
            assert none["bytes_dense"] == fp16["bytes_dense"] == 5 * (160 * 8 + 160 * 16 * 4 + 64 * 4)
            assert fp16["bytes_sent"] < 0.6 * none["bytes_sent"]


@pytest.mark.slow  # their module's TensorFlow run takes a minute (Makefile: test-slow)
def test_tensorflow_topk_on_rows_matches_the_numpy_model(tf_report):
    """Eagerly, and under tf.function (where the number of rows is known only when the graph
    runs: the rows are encoded by numpy then, as the same algorithm)."""
    for report in tf_report:
        for mode in ("eager", "function"):
            topk = report[f"tape.{mode}.topk"]
            assert topk["gap"] < 1e-5
            assert topk["stats"]["bytes_sent"] < topk["stats"]["bytes_dense"] / 3
            assert report[f"resume.{mode}"] == 0.0  # tf.train.Checkpoint with the residual rows
        assert report["legacy.none"] < 1e-6 and report["legacy.topk"] < 1e-5  # the TF1 optimizer


@pytest.mark.slow  # their module's TensorFlow run takes a minute (Makefile: test-slow)
def test_keras_embedding_trains_as_one_process_on_all_the_data(tf_report):
    """model.fit with a Keras Embedding, SGD and Adam: 2 workers match one process stepping on
    both workers' batches at once. fp16 with Adam: Adam divides each element by its own size, so
    fp16's rounding reaches the update itself; within 2% of the largest update (4 steps x 0.01)."""
    for report in tf_report:
        assert report["keras.sgd.none"] < 1e-6 and report["keras.adam.none"] < 1e-6
        assert report["keras.sgd.fp16"] < 1e-5
        assert report["keras.adam.fp16"] < 0.02 * 4 * 0.01


@pytest.mark.slow  # their module's TensorFlow run takes a minute (Makefile: test-slow)
def test_keras_fit_compresses_the_embeddings_rows(tf_report):
    """Top-k inside model.fit: the workers end alike, having sent under a third of what Horovod's
    sparse allgather would (4 steps of 160 lookups)."""
    assert tf_report[0]["keras.adam.topk"]["weights"] == tf_report[1]["keras.adam.topk"]["weights"]
    stats = tf_report[0]["keras.adam.topk"]["stats"]
    assert stats["bytes_sent"] < stats["bytes_dense"] / 3


def test_tensorflow_sparse_gradient_of_unknown_table_shape_is_a_clear_error():
    """A ``tf.IndexedSlices`` travels as rows of its table: without a variable and with no static
    ``dense_shape`` the table is unknown when the graph is traced, which is an error naming the
    way out; a static ``dense_shape`` is enough."""
    import tensorflow as tf

    from frameworks.tensorflow.reduce import _rows

    values, indices = tf.ones((2, 3)), tf.constant([0, 4])
    rows = _rows(tf.IndexedSlices(values, indices, dense_shape=tf.constant([5, 3])), None)
    assert rows.dense_shape == (5, 3)

    @tf.function(input_signature=[tf.TensorSpec([None], tf.int64)])
    def traced(shape):
        return _rows(tf.IndexedSlices(values, indices, dense_shape=shape), None)

    with pytest.raises(ValueError, match="sparse_as_dense=True"):
        traced.get_concrete_function()
    with pytest.raises(ValueError, match="whose shape must be known"):
        _rows(tf.IndexedSlices(values, indices), None)
