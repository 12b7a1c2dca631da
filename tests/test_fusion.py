"""The fused exchange: buckets of tensors, one collective per bucket and round, the non-finite flag
and the lengths inside the payload, results identical to compressing tensor by tensor."""

from __future__ import annotations

import threading
import warnings

import numpy as np
import pytest

import grace
from grace.backends import InProcessGroup, NumpyOps
from grace.bucketing import form_buckets
from grace.packing import pack_bytes, pack_sums, unpack_bytes, unpack_sums
from tests.test_properties import run_threads

OPS = NumpyOps()
# A small model's gradients: matrices, biases below min_numel, a vector, in backward order.
SHAPES = [(64, 48), (64,), (48, 32), (48,), (32, 32), (32,), (5000,), (16, 40)]


def gradients(rank: int, step: int, shapes=SHAPES) -> list[np.ndarray]:
    rng = np.random.default_rng(100 * step + rank)
    return [rng.standard_normal(s).astype(np.float32) for s in shapes]


class Counting:
    """A worker's collectives, counting the calls (the collectives layer, wrapped)."""

    def __init__(self, worker):
        self.worker, self.calls = worker, []
        self.size, self.rank = worker.size, worker.rank

    def allreduce_async(self, t, n):
        self.calls.append(("allreduce", n))
        return self.worker.allreduce_async(t, n)

    def allgather_async(self, t, n):
        self.calls.append(("allgather", n))
        return self.worker.allgather_async(t, n)

    def broadcast_async(self, t, root, n):
        self.calls.append(("broadcast", n))
        return self.worker.broadcast_async(t, root, n)

    def synchronize(self, h):
        return self.worker.synchronize(h)


class Ordered(Counting):
    """Counting, and each wait too, named after the collective it waits for."""

    def __init__(self, worker):
        super().__init__(worker)
        self.names: dict = {}

    def allreduce_async(self, t, n):
        handle = super().allreduce_async(t, n)
        self.names[id(handle)] = n
        return handle

    def synchronize(self, h):
        self.calls.append(("wait", self.names.get(id(h))))
        return super().synchronize(h)


def exchange(pipelines, steps=2, bucketed=True, grads=gradients, scale=0.5, recorder=Counting):
    """``steps`` steps on 2 in-process workers, each in a thread; per worker, per step, its
    results, and per worker its counting collectives."""
    group = InProcessGroup(2)
    workers = [recorder(group.worker(r)) for r in range(2)]
    names = [f"t{i}" for i in range(len(grads(0, 0)))]
    results = [[] for _ in pipelines]
    # Each step's collectives are complete everywhere before the next reuses their names.
    barrier = threading.Barrier(2)

    def run(rank):
        pipeline, worker = pipelines[rank], workers[rank]
        for step in range(steps):
            g = grads(rank, step)
            if bucketed:
                buckets = pipeline.buckets([(x.shape, "float32") for x in g], OPS)
                started = [pipeline.start_bucket([g[i] for i in b], [names[i] for i in b], worker, OPS)
                           for b in buckets]
                out = [None] * len(g)
                for b, res in zip(buckets, pipeline.finish_step(started, worker, scale)):
                    for i, r in zip(b, res):
                        out[i] = r
            else:
                out = pipeline.finish_step([pipeline.start(x, n, worker, OPS) for x, n in zip(g, names)],
                                           worker, scale)
            results[rank].append(out)
            barrier.wait()
    run_threads([lambda r=r: run(r) for r in range(2)])
    return results, workers


COMPRESSORS = ["none", "fp16", "topk", "randomk", "threshold", "qsgd", "terngrad", "onebit",
               "efsignsgd", "powersgd", "dgc", "natural", "u8bit", "sketch", "adaq", "inceptionn",
               "twobit"]


def collectives_per_step(name: str) -> int:
    """Worked out from the algorithms: the dense tensors' bucket takes one allreduce; the
    compressed tensors' bucket one collective per round (PowerSGD: two), and one more where the
    workers vote each step on sending it encoded or dense (threshold, INCEPTIONN)."""
    if name == "none":
        return 1
    compressor = grace.build(name).compressor
    return 1 + compressor.rounds + (1 if compressor.agrees_on_form else 0)


@pytest.mark.parametrize("name", COMPRESSORS)
def test_one_collective_per_bucket_and_round(name):
    """Exactly one collective per bucket and round (and the vote), where tensor by tensor would
    take one or more per tensor; the non-finite flag rides inside a payload."""
    pipelines = [grace.build(name, min_numel=1024) for _ in range(2)]
    _, workers = exchange(pipelines, steps=1)
    buckets = pipelines[0].buckets([(s, "float32") for s in SHAPES], OPS)
    calls = workers[0].calls
    assert len(calls) == collectives_per_step(name), calls
    assert len(buckets) == (1 if name == "none" else 2)  # the dense tensors, the compressed ones
    assert not any(n.endswith(".nonfinite") for _, n in calls)  # the flag rides in the payload


@pytest.mark.parametrize("name, joined", [("none", True), ("fp16", True), ("topk", False),
                                           ("qsgd", False)])
def test_element_wise_codecs_without_state_encode_a_bucket_at_once(name, joined):
    """none and fp16 encode a bucket's tensors of one dtype and plan as one vector (the results,
    the same bits, are compared above): one encoding and one decoding per bucket, not per tensor.
    Codecs with state or with blocks (top-k's residual, QSGD's scales) encode tensor by tensor."""
    pipelines = [grace.build(name, min_numel=1024) for _ in range(2)]
    calls = []
    for pipeline in pipelines:  # the compressor, and the one of the tensors that travel dense
        for codec in (pipeline.compressor, pipeline.encoding.dense_compressor):
            original = codec.compress_flat

            def counted(flat, *args, original=original, **kwargs):
                calls.append(flat.size)
                return original(flat, *args, **kwargs)
            codec.compress_flat = counted
    exchange(pipelines, steps=1)
    sizes = [int(np.prod(s)) for s in SHAPES]
    large, small = [n for n in sizes if n >= 1024], [n for n in sizes if n < 1024]
    if name == "none":  # nothing is smaller encoded: every tensor travels dense, one vector
        expected = [sum(sizes)]
    elif joined:  # one vector of the compressed tensors, one of those below min_numel
        expected = [sum(large), sum(small)]
    else:
        expected = sizes
    assert sorted(calls) == sorted(expected * 2)


@pytest.fixture(scope="module")
def horovod_counts(tmp_path_factory):
    import json
    import os

    from tests.launch import ROOT, horovodrun

    out = tmp_path_factory.mktemp("fusion") / "counts.json"
    horovodrun(os.path.join(ROOT, "tests", "workers", "torch_fusion.py"), str(out),
               ",".join(COMPRESSORS), json.dumps(SHAPES))
    return json.loads(out.read_text())


@pytest.mark.parametrize("name", COMPRESSORS)
def test_one_collective_per_bucket_and_round_under_real_horovod(horovod_counts, name):
    """The same count at Horovod's own ops, two real workers, grace's PyTorch wrapper over the same
    shapes (tests/workers/torch_fusion.py): exactly that many each step, and on the first step one
    more, the agreement on which gradients are sparse. The sums of none and fp16 (buffers the
    exchange joined, or cast) run in Horovod's in-place op (``allreduce_``)."""
    first, second = horovod_counts[name]
    assert len(second) == collectives_per_step(name), second
    assert len(first) == collectives_per_step(name) + 1, first
    assert [c for c in first if c not in second] == [["allreduce", "grace.sparse_gradients"]]
    if name in ("none", "fp16"):
        assert {kind for kind, _ in second} == {"allreduce_"}, second


def test_every_buckets_second_round_is_sent_before_any_is_awaited():
    """PowerSGD's buckets each send their second round before the step waits for the first of
    them, so that the rounds travel together instead of one round trip after another; the results
    are those of the buckets taken one by one (tensor by tensor, above)."""
    small = 3000 * 4  # the largest matrix a bucket, the two others another
    pipelines = [grace.powersgd(rank=2, min_numel=1024, bucket_bytes=small) for _ in range(2)]
    results, workers = exchange(pipelines, steps=2, recorder=Ordered)
    calls = workers[0].calls
    sent = [i for i, (kind, n) in enumerate(calls) if kind == "allreduce" and ".2." in n]
    awaited = [i for i, (kind, n) in enumerate(calls) if kind == "wait" and n and ".2." in n]
    per_step = len(sent) // 2
    assert per_step == 2, calls
    assert max(sent[:per_step]) < min(awaited[:per_step]), calls
    alone, _ = exchange([grace.powersgd(rank=2, min_numel=1024) for _ in range(2)], steps=2,
                        bucketed=False)
    for step_a, step_b in zip(results[0], alone[0]):
        for x, y in zip(step_a, step_b):
            np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("name", COMPRESSORS)
def test_layer_granularity_gives_the_same_results_bucketed_or_not(name):
    """Results, state and bytes at granularity="layer" do not depend on the buckets."""
    fused = [grace.build(name) for _ in range(2)]
    alone = [grace.build(name) for _ in range(2)]
    a, _ = exchange(fused, steps=3)
    b, _ = exchange(alone, steps=3, bucketed=False)
    for step_a, step_b in zip(a[0], b[0]):
        for x, y in zip(step_a, step_b):
            np.testing.assert_array_equal(x, y)
    # Per tensor, the flag took 4 bytes each; fused, 4 bytes per bucket.
    sa, sb = fused[0].stats(), alone[0].stats()
    assert (sa["bytes_sent"], sa["bytes_dense"], sa["tensors"]) == \
        (sb["bytes_sent"], sb["bytes_dense"], sb["tensors"])
    assert sa["bytes_control"] <= sb["bytes_control"]


def test_bucket_granularity_compresses_the_joined_bucket():
    """granularity="bucket": top-k over the bucket's tensors joined, with one residual per bucket:
    the same as top-k of the concatenation, tensor by tensor the pieces."""
    joined = [grace.topk(0.01, granularity="bucket") for _ in range(2)]
    whole = [grace.topk(0.01, min_numel=0) for _ in range(2)]
    a, _ = exchange(joined, steps=3)

    def concatenated(rank, step):
        return [np.concatenate([g.reshape(-1) for g in gradients(rank, step)])]
    group = InProcessGroup(2)
    expected = [[], []]
    barrier = threading.Barrier(2)

    def run(rank):
        for step in range(3):
            (g,) = concatenated(rank, step)
            expected[rank].append(whole[rank].reduce(g, "bucket.t0", group.worker(rank), 0.5))
            barrier.wait()
    run_threads([lambda r=r: run(r) for r in range(2)])
    for step in range(3):
        got = np.concatenate([x.reshape(-1) for x in a[0][step]])
        np.testing.assert_array_equal(got, expected[0][step])
    assert joined[0].stats()["tensors"] == 3 * len(SHAPES)
    assert list(joined[0].memory.state()["residuals"]) == ["bucket.t0"]


def test_rollback_is_per_step_across_buckets():
    """An Inf in one tensor of one worker: every worker gets NaN everywhere and every tensor's state,
    in every bucket, is as before the step."""
    pipelines = [grace.topk(0.01, bucket_bytes=8_000) for _ in range(2)]
    exchange(pipelines, steps=1)
    before = [{k: dict(v) for k, v in p.memory.state().items()} for p in pipelines]
    before = [{k: {n: x.copy() for n, x in v.items()} for k, v in b.items()} for b in before]

    def poisoned(rank, step):
        g = gradients(rank, step + 1)
        if rank == 1:
            g[2][3, 4] = np.inf
        return g
    results, _ = exchange(pipelines, steps=1, grads=poisoned)
    assert len(pipelines[0].buckets([(s, "float32") for s in SHAPES], OPS)) > 2
    for rank in range(2):
        assert all(np.isnan(x).all() for x in results[rank][0])
        state = pipelines[rank].memory.state()
        for key, entries in before[rank].items():
            for name, value in entries.items():
                np.testing.assert_array_equal(state[key][name], value)


def test_packed_bytes_round_trip_with_lengths_and_flag():
    """Parts of several dtypes and sizes, two of them variable: each worker's buffer is read back
    at the offset where the previous one ended; the flags add up."""
    parts = [[((0, 0), np.arange(5, dtype=np.float32) + r, False),
              ((0, 1), np.arange(3 + r, dtype=np.int32), True),
              ((1, 0), np.array([7 + r], np.uint8), False),
              ((1, 1), np.arange(r, dtype=np.float16), True)] for r in range(3)]
    buffers = []
    for r in range(3):
        buffer, layout = pack_bytes(parts[r], np.array([float(r == 2)], np.float32), OPS)
        buffers.append(buffer)
    workers, flag = unpack_bytes(np.concatenate(buffers), layout, 3, OPS)
    assert float(flag[0]) == 1.0
    for r in range(3):
        for key, tensor, _ in parts[r]:
            np.testing.assert_array_equal(workers[r][key], tensor)
            assert workers[r][key].dtype == tensor.dtype


def test_summed_buffers_one_per_dtype_flag_inside():
    parts = [((0, 0), np.ones(4, np.float32)), ((1, 0), np.ones(3, np.float16)),
             ((2, 0), np.full(2, 2.0, np.float32))]
    buffers, layout = pack_sums(parts, np.array([1.0], np.float32), OPS)
    assert len(buffers) == 2 and buffers[0].size == 4 + 2 + 1  # the flag ends the float32 one
    assert layout.made == [True, False]  # joined here (free to sum in place), a part as it was
    got, flag = unpack_sums(buffers, layout, OPS)
    np.testing.assert_array_equal(got[(2, 0)], [2.0, 2.0])
    assert got[(1, 0)].dtype == np.float16 and float(flag[0]) == 1.0


def test_buckets_keep_kinds_apart_and_respect_the_bound():
    assert form_buckets([10, 1, 10, 1, 10], 20, "cdcdc") == [[0, 2], [1, 3], [4]]
    assert form_buckets([10, 30, 10], 20) == [[0], [1], [2]]
    assert form_buckets([5, 5, 5], 0) == [[0], [1], [2]]


def test_bad_granularity_and_bucket_bytes_are_refused_at_construction():
    with pytest.raises(ValueError, match="granularity.*allowed: bucket, layer"):
        grace.topk(0.01, granularity="model")
    with pytest.raises(ValueError, match="bucket_bytes must be an int >= 0"):
        grace.topk(0.01, bucket_bytes=-1)
    with pytest.raises(ValueError, match="powersgd.*granularity='layer'"):
        grace.powersgd(granularity="bucket")


def test_powersgd_orthogonalizes_a_buckets_matrices_of_one_shape_together():
    """Matrices of one shape in one bucket share one batched QR call, with the bits each gets
    alone: results equal tensor by tensor, bit for bit."""
    shapes = [(64, 48), (64, 48), (32, 96), (64, 48), (32, 96)]

    def grads(rank, step):
        return gradients(rank, step, shapes)
    calls = []
    fused = [grace.powersgd() for _ in range(2)]
    original = OPS.orthogonalize
    OPS.orthogonalize = lambda x: calls.append(x.shape) or original(x)
    try:
        a, _ = exchange(fused, steps=2, grads=grads)
    finally:
        OPS.orthogonalize = original
    b, _ = exchange([grace.powersgd() for _ in range(2)], steps=2, grads=grads, bucketed=False)
    for step_a, step_b in zip(a[0], b[0]):
        for x, y in zip(step_a, step_b):
            np.testing.assert_array_equal(x, y)
    # Per worker and step one call for the 3 matrices of (64, 48) and one for the 2 of (32, 96).
    assert sorted(calls) == [(2, 32, 2)] * 4 + [(3, 64, 2)] * 4


class SummingInPlace:
    """A worker's collectives that also sum a tensor given over in place
    (``allreduce_given_async``), as Gloo's and Horovod's in-place allreduce do; each such call's
    name is recorded in ``given``."""

    def __init__(self, worker):
        self.worker, self.given = worker, []
        self.size, self.rank = worker.size, worker.rank

    def __getattr__(self, name):
        return getattr(self.worker, name)

    def allreduce_given_async(self, tensor, name):
        self.given.append(name)
        handle = _InPlace(tensor, self.worker.allreduce_async(tensor.clone(), name))
        # Given over, the tensor is the collective's until the wait: anything that read it
        # meanwhile would read NaN, and anything written into it is found below.
        tensor.fill_(float("nan"))
        return handle

    def synchronize(self, handle):
        if isinstance(handle, _InPlace):
            assert handle.tensor.isnan().all(), "a tensor given over was written before the wait"
            handle.tensor.copy_(self.worker.synchronize(handle.inner))
            return handle.tensor
        return self.worker.synchronize(handle)


class _InPlace:
    def __init__(self, tensor, inner):
        self.tensor, self.inner = tensor, inner


def torch_exchange(pipelines, steps, overwrite, grads=gradients, poison=None, copying=False,
                   in_place=None, flat=False, lent=None, placed=None, scale=0.5):
    """``exchange`` with torch tensors through ``TorchOps``, handed over as the PyTorch wrapper
    hands its gradients: each worker keeps one gradient tensor per name across steps (a
    ``p.grad``: zeroed, then the step's gradient added, as ``zero_grad(set_to_none=False)`` and
    backward do), passes ``detach()`` aliases of them with ``overwrite``, and after the step points
    each at its result with ``set_``. Per worker, per step: the results and the gradients as the
    caller held them just before ``set_`` (numpy). ``poison``: (rank, step) whose first gradient
    gets a NaN. ``copying``: an adapter that never writes into a tensor (``writable`` False): the
    way error feedback went before it could write into the gradient. ``in_place``: a list that
    gets each worker's ``SummingInPlace`` collectives. ``flat``: the gradients are views of one
    flat buffer, as a DDP bucket's are, and each step's results are copied into them; they are
    then lent (``start_bucket(lent=True)``, as the DDP hook lends them) unless ``lent`` says
    otherwise. ``placed``: a list that gets, per worker and step, whether each result lies in
    the memory of the gradient it came from. ``scale``: the results' factor (1 / workers)."""
    import torch

    from frameworks.torch.ops import TorchOps
    from grace.ops import Ops

    class CopyingOps(TorchOps):
        def writable(self, x):
            return False

        def scale_into(self, x, factor, out):  # a new tensor, as ``Ops``'s default makes
            return Ops.scale_into(self, x, factor, out)

    ops = CopyingOps() if copying else TorchOps()
    group = InProcessGroup(2)
    names = [f"t{i}" for i in range(len(grads(0, 0)))]
    results = [[] for _ in pipelines]
    after = [[] for _ in pipelines]
    barrier = threading.Barrier(2, timeout=60)

    def run(rank):
        pipeline, worker = pipelines[rank], group.worker(rank)
        if in_place is not None:
            worker = SummingInPlace(worker)
            in_place.append(worker)
        first = grads(rank, 0)
        if flat:
            buffer = torch.zeros(sum(x.size for x in first), dtype=torch.from_numpy(first[0]).dtype)
            held = [piece.view(x.shape) for piece, x in
                    zip(buffer.split([x.size for x in first]), first)]
        else:
            held = [torch.zeros(x.shape, dtype=torch.from_numpy(x).dtype) for x in first]
        for step in range(steps):
            for h, x in zip(held, grads(rank, step)):
                h.zero_()  # the result of the last step, as p.grad holds it now
                h.add_(torch.from_numpy(x))
            if poison == (rank, step):
                held[0][3, 5] = float("nan")
            buckets = pipeline.buckets([(tuple(x.shape), ops.dtype(x)) for x in held], ops)
            started = [pipeline.start_bucket([held[i].detach() for i in b], [names[i] for i in b],
                                             worker, ops, overwrite=overwrite,
                                             lent=flat if lent is None else lent)
                       for b in buckets]
            out = [None] * len(held)
            for b, res in zip(buckets, pipeline.finish_step(started, worker, scale)):
                for i, r in zip(b, res):
                    out[i] = r
            if placed is not None:
                placed.append((rank, [r.data_ptr() == h.data_ptr() for r, h in zip(out, held)]))
            after[rank].append([h.numpy().copy() for h in held])
            results[rank].append([r.numpy().copy() for r in out])
            if flat:  # into the caller's buffer, as DDP's bucket takes its results
                for h, r in zip(held, [r.clone() for r in out]):
                    h.copy_(r)
            else:
                for h, r in zip(held, out):
                    h.set_(r)
            barrier.wait()
    run_threads([lambda r=r: run(r) for r in range(2)])
    return results, after


@pytest.mark.parametrize("name", COMPRESSORS)
@pytest.mark.parametrize("overwrite", [False, True])
@pytest.mark.parametrize("shapes, flat, dtype", [(SHAPES, False, np.float32),
                                                 (SHAPES, True, np.float32),
                                                 ([(64, 48)], False, np.float32),
                                                 ([(64, 48)], False, np.float16)],
                         ids=["bucket", "flat-bucket", "one-tensor", "one-float16"])
def test_only_what_nothing_reads_again_is_summed_in_place(name, overwrite, shapes, flat, dtype):
    """Collectives that can sum in place (``allreduce_given_async``: Gloo's, Horovod's) are given
    a payload only where nothing reads it after it is sent: a buffer the exchange joined itself,
    or a gradient handed over (``overwrite``) sent as it is or cast, with no state; a DDP-like
    bucket's gradients (views of one buffer: ``flat``) are joined as a view of it. Results and
    state are the copying way's, bit for bit, over three steps, with the given tensors NaN until
    the wait (``SummingInPlace``); a caller that did not hand its gradients over finds them as
    they were (a lone tensor sent as it is, a float16 one fp16 passes through, or the view of a
    flat bucket would otherwise get the sum); and the element-wise codecs do sum in place."""
    def build():
        return [grace.build(name, min_numel=1024) for _ in range(2)]

    def grads(rank, step):
        return [g.astype(dtype) for g in gradients(rank, step, shapes)]

    copying, summing, workers = build(), build(), []
    expected, held_expected = torch_exchange(copying, 3, overwrite, grads=grads, flat=flat)
    results, held = torch_exchange(summing, 3, overwrite, grads=grads, in_place=workers, flat=flat)
    assert len(workers) == 2
    for rank in range(2):
        for step in range(3):
            for a, b in zip(results[rank][step], expected[rank][step]):
                np.testing.assert_array_equal(a, b)
            if not overwrite:
                for a, b in zip(held[rank][step], held_expected[rank][step]):
                    np.testing.assert_array_equal(a, b)
    if state_arrays(copying[0]):  # the stateless ones have none to compare
        assert_same_state(copying, summing)
    # What is sent is the caller's own tensor, or may be: a lone one not handed over (sent as it
    # is by none, cast or passed through by fp16), or none's joined view of a flat bucket.
    own = name in ("none", "fp16") and (len(shapes) == 1 or (flat and name == "none"))
    if name in ("none", "fp16") and (overwrite or not own):
        assert all(w.given for w in workers)
    if own and not overwrite:
        assert not any(w.given for w in workers)


def state_arrays(pipeline) -> dict:
    import torch

    flat = {}
    for part, tensors in pipeline.state_dict().items():
        if isinstance(tensors, dict):
            for key, by_name in tensors.items():
                if isinstance(by_name, dict):
                    for name, value in by_name.items():
                        if isinstance(value, torch.Tensor):
                            flat[f"{part}.{key}.{name}"] = value.numpy().copy()
                        elif isinstance(value, np.ndarray):  # the numpy backend's
                            flat[f"{part}.{key}.{name}"] = value.copy()
    return flat


def assert_same_state(a_pipelines, b_pipelines) -> None:
    for a_pipeline, b_pipeline in zip(a_pipelines, b_pipelines):
        a, b = state_arrays(a_pipeline), state_arrays(b_pipeline)
        assert a.keys() == b.keys() and a
        for key in a:
            np.testing.assert_array_equal(a[key], b[key], err_msg=key)


# Every memory that keeps state (residual, delayed, momentum, efsignsgd, powersgd, dgc), at both
# granularities (PowerSGD compresses matrices: not a joined bucket).
KEEPING_STATE = ["topk", "randomk", "dgc", "efsignsgd", "powersgd", "onebit", "threshold", "sketch",
                 "inceptionn", "adaq", "twobit"]


@pytest.mark.parametrize("name,granularity", [(n, g) for n in KEEPING_STATE for g in ("layer", "bucket")
                                              if (n, g) != ("powersgd", "bucket")])
def test_error_feedback_written_into_the_gradients_computes_the_same_bits(name, granularity):
    """Handing the gradients over to be written into (``overwrite=True``, as the PyTorch wrapper
    does: Horovod's allreduce writes over them too) must change where error feedback adds its
    residual, nothing else: over four steps of the wrapper's handling (its gradient tensors
    zeroed and refilled each step, pointed at the results with ``set_``) the same results and the
    same kept state on both workers, bit for bit, as error feedback that never writes into a
    tensor; the caller's gradients are written where a residual memory compresses them (else
    nothing was saved), and left alone without ``overwrite``."""
    def build():
        return [grace.build(name, min_numel=1024, granularity=granularity) for _ in range(2)]

    baseline, written, unwritten = build(), build(), build()
    expected, _ = torch_exchange(baseline, 4, overwrite=True, copying=True)
    got, written_after = torch_exchange(written, 4, overwrite=True)
    kept, kept_after = torch_exchange(unwritten, 4, overwrite=False)
    for rank in range(2):
        for step in range(4):
            for want, a, b in zip(expected[rank][step], got[rank][step], kept[rank][step]):
                np.testing.assert_array_equal(a, want)
                np.testing.assert_array_equal(b, want)
            if granularity == "layer":
                for held, given in zip(kept_after[rank][step], gradients(rank, step)):
                    np.testing.assert_array_equal(held, given)
    assert_same_state(baseline, written)
    assert_same_state(baseline, unwritten)
    if granularity == "layer" and name in ("topk", "randomk"):
        # Sent sparse every step (the others may send a tensor dense some steps, or encode it
        # otherwise). At "bucket" it is the joined vector, the pipeline's own, that is written.
        assert any(not np.array_equal(held, given)
                   for held, given in zip(written_after[0][2], gradients(0, 2)))


@pytest.mark.parametrize("name", KEEPING_STATE)
def test_a_gradient_lent_for_the_step_never_holds_its_residual(name):
    """A DDP bucket of one gradient: its flat buffer is all of the gradient's memory, so it could
    be written into (``writable``), but DDP fills it with the step's result and then with the next
    gradient. Lent for the step (``lent=True``, as the DDP hook lends it), error feedback keeps its
    residual in a tensor of its own: over four steps the results and the kept state are, bit for
    bit, those of error feedback that never writes into a tensor. (Kept in the buffer, the
    residual was overwritten by the result: a DDP layer alone in its bucket lost it each step.)"""
    def build():
        return [grace.build(name, min_numel=1024) for _ in range(2)]

    def grads(rank, step):
        return gradients(rank, step, [(64, 48)])

    baseline, lent, kept = build(), build(), build()
    expected, _ = torch_exchange(baseline, 4, False, grads=grads, flat=True)  # nothing handed over
    got, _ = torch_exchange(lent, 4, True, grads=grads, flat=True)
    for rank in range(2):
        for step in range(4):
            for a, b in zip(got[rank][step], expected[rank][step]):
                np.testing.assert_array_equal(a, b)
    assert_same_state(baseline, lent)
    if name not in ("topk", "randomk"):
        return  # their residual is a new tensor (a difference): nothing of the buffer is kept
    # The sparsifiers zero the sent entries of the compensated tensor itself: not lent, the buffer
    # is kept as the residual and the result overwrites it, which the test above tells apart.
    wrong, _ = torch_exchange(kept, 4, True, grads=grads, flat=True, lent=False)
    assert any(not np.array_equal(a, b) for rank in range(2) for step in range(4)
               for a, b in zip(wrong[rank][step], expected[rank][step]))


@pytest.mark.parametrize("name", ["none", "fp16"])
@pytest.mark.parametrize("flat", [False, True], ids=["own-memory", "flat-bucket"])
@pytest.mark.parametrize("scale", [0.5, 1.0 / 3.0], ids=["half", "third"])
def test_a_summed_cast_is_decoded_into_the_gradients_given_over(name, flat, scale):
    """none's and fp16's sum decodes by a cast: handed over, a gradient gets its result in its own
    memory (a DDP bucket's view, or a lone gradient's storage), decoded and scaled in one go
    (``Compressor.aggregate_into``, ``TorchOps.scale_into``), with the bits of decoding into new
    tensors, also at a factor that rounds (1/3: the product in float32, after the cast). Every
    tensor here (min_numel=0: a bucket's tensors lie end to end, or each alone) has its result in
    place; without ``overwrite`` none has."""
    shapes = [(64, 48)] if not flat else [(64, 48), (64,), (48, 32)]

    def build():
        return [grace.build(name, min_numel=0) for _ in range(2)]

    def grads(rank, step):
        return gradients(rank, step, shapes)

    placed, unplaced = [], []
    expected, _ = torch_exchange(build(), 3, False, grads=grads, flat=flat, placed=unplaced,
                                 scale=scale)
    got, _ = torch_exchange(build(), 3, True, grads=grads, flat=flat, placed=placed, scale=scale)
    for rank in range(2):
        for step in range(3):
            for a, b in zip(got[rank][step], expected[rank][step]):
                np.testing.assert_array_equal(a, b)
    assert len(placed) == 6 and all(all(p) for _, p in placed)
    assert len(unplaced) == 6 and not any(any(p) for _, p in unplaced)


def test_scale_into_writes_the_bits_of_a_cast_and_a_scale():
    """``TorchOps.scale_into``: ``x`` cast to ``out``'s dtype times the factor, written into
    ``out``, with ``scale``'s bits (a factor of 1/3 rounds: the product is in float32, as
    ``Ops.scale`` computes it, not in float16); where ``out`` cannot be written (autograd tracks
    it, it is strided, or ``x`` overlaps part of it) a new tensor, ``out`` left alone."""
    import torch

    from frameworks.torch.ops import TorchOps

    ops = TorchOps()
    generator = torch.Generator().manual_seed(3)
    base = torch.randn(6, 5, generator=generator)
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        x = base.reshape(-1).to(dtype)
        for factor in (1.0 / 3.0, 1.0):
            want = ops.scale(x.to(torch.float32), factor) if factor != 1.0 else x.to(torch.float32)
            out = torch.full((6, 5), 7.0)
            got = ops.scale_into(x, factor, out)
            assert got is out and torch.equal(out.reshape(-1), want.reshape(-1))
            half = torch.full((30,), 7.0, dtype=torch.float16)
            got = ops.scale_into(x, factor, half)
            assert got is half and torch.equal(half, ops.scale(x.to(torch.float16), factor)
                                               if factor != 1.0 else x.to(torch.float16))
            # A view at an offset in a larger buffer (a DDP bucket's gradient): written there.
            bucket = torch.full((40,), 7.0)
            place = bucket[5:35].view(6, 5)
            assert ops.scale_into(x, factor, place) is place
            assert torch.equal(bucket[5:35], want.reshape(-1)) and (bucket[:5] == 7).all() \
                and (bucket[35:] == 7).all()
    own = base.clone()
    assert ops.scale_into(own, 0.5, own) is own and torch.equal(own, base * 0.5)  # x is out
    for out in (torch.zeros(6, 5, requires_grad=True), torch.zeros(5, 6).t()):
        got = ops.scale_into(base.reshape(-1), 0.5, out)
        assert got is not out and torch.equal(got, base * 0.5)
        assert not out.detach().any()
    buffer = torch.arange(12.0)
    got = ops.scale_into(buffer[0:6], 2.0, buffer[3:9])  # overlapping: read before any write
    assert torch.equal(got, torch.arange(6.0) * 2) and torch.equal(buffer, torch.arange(12.0))


def test_a_gradient_that_cannot_be_written_into_is_left_as_it_is():
    """``overwrite`` lets error feedback write only where the adapter can: a gradient autograd
    still tracks, or a view that is not contiguous (another tensor's memory read with strides),
    is compensated into a tensor of its own, and the results are those of the copying way."""
    import torch

    from frameworks.torch.ops import TorchOps

    ops = TorchOps()
    base = torch.randn(64, 80)
    strided = base.T  # not contiguous
    tracked = torch.randn(80, 64, requires_grad=True)
    assert not ops.writable(strided) and not ops.writable(tracked) and ops.writable(base.clone())
    memory = grace.build("topk", min_numel=0).memory
    residual = torch.randn(80, 64)
    memory.residuals["w"] = residual.clone()
    for given in (strided, tracked):
        before = given.detach().clone()
        out = memory.compensate(given, "w", ops, overwrite=True)
        np.testing.assert_array_equal(given.detach().numpy(), before.numpy())
        np.testing.assert_array_equal(out.detach().numpy(), (before + residual).numpy())
    mine = torch.randn(80, 64)
    out = memory.compensate(mine, "w", ops, overwrite=True)
    assert out.data_ptr() == mine.data_ptr()  # written where it lies
    # Views into a larger buffer (a flat gradient buffer's pieces, at its start and further in)
    # are another tensor's memory too: neither compensate (with a residual kept, or on the first
    # step, without) nor the residual's zeroing writes into the buffer.
    flat = torch.randn(3 * 5120)
    pristine = flat.clone()
    for view in (flat[:5120].view(80, 64), flat[5120:10240].view(80, 64)):
        assert not ops.writable(view)
        for kept in (residual.clone(), None):
            fresh = grace.build("topk", min_numel=0)
            if kept is not None:
                fresh.memory.residuals["w"] = kept
            compensated = fresh.memory.compensate(view, "w", ops, overwrite=True)
            payload, ctx = fresh.compressor.compress(compensated, "w", ops)
            fresh.memory.update(compensated, "w", fresh.compressor, payload, ctx, ops)
            np.testing.assert_array_equal(flat.numpy(), pristine.numpy())


@pytest.mark.parametrize("name", ["topk", "randomk", "dgc"])
@pytest.mark.parametrize("granularity", ["layer", "bucket"])
def test_a_nan_in_a_gradient_written_into_still_drops_the_step(name, granularity):
    """The non-finite flag is read from the gradient before error feedback writes into it: top-k
    picks the NaN (its magnitude counts as infinite) and its residual zeroes it, so a flag read
    afterwards would miss it. The step's results are NaN and no state is written, on both
    workers: the state is that of a run that never had the NaN step, and the results before it
    are the copying way's."""
    def build():
        return [grace.build(name, min_numel=1024, granularity=granularity) for _ in range(2)]

    poisoned, clean = build(), build()
    results, _ = torch_exchange(poisoned, 2, overwrite=True, poison=(1, 1))
    expected, _ = torch_exchange(clean, 1, overwrite=True, copying=True)
    for rank in range(2):
        for a, b in zip(results[rank][0], expected[rank][0]):
            np.testing.assert_array_equal(a, b)
        assert all(np.isnan(r).all() for r in results[rank][1] if r.size)
    assert_same_state(clean, poisoned)


def test_a_memory_written_with_three_arguments_keeps_working_where_gradients_are_handed_over():
    """``Memory.compensate`` gained ``overwrite``; a memory written before, with
    ``compensate(tensor, name, ops)``, is called as it was written, also where the PyTorch
    wrapper hands its gradients over to be written into: the same results as grace's own
    residual memory, and the caller's gradients it compresses are not written (it makes tensors
    of its own); those sent dense, without state, hold their results (``result_place``)."""
    from grace.communicators.allgather import Allgather
    from grace.compressors.topk import TopK
    from grace.memory import Memory
    from grace.pipeline import Pipeline

    class OldResidual(Memory):
        name = "old_residual"

        def __init__(self):
            self.residuals = {}

        def compensate(self, tensor, name, ops):
            kept = self.residuals.get(name)
            return ops.copy(tensor) if kept is None else ops.add(tensor, kept)

        def update(self, compensated, name, compressor, payload, ctx, ops):
            self.residuals[name] = compressor.residual(compensated, payload, ctx, ops)

    for granularity, overwrite in (("layer", True), ("bucket", True), ("bucket", False)):
        old = [Pipeline(TopK(0.05), OldResidual(), Allgather(), min_numel=1024,
                        granularity=granularity) for _ in range(2)]
        new = [grace.topk(0.05, min_numel=1024, granularity=granularity) for _ in range(2)]
        got, after = torch_exchange(old, 3, overwrite=overwrite)
        want, _ = torch_exchange(new, 3, overwrite=overwrite, copying=True)
        for rank in range(2):
            for step in range(3):
                for a, b in zip(got[rank][step], want[rank][step]):
                    np.testing.assert_array_equal(a, b)
                for held, given, result in zip(after[rank][step], gradients(rank, step),
                                               got[rank][step]):
                    dense = given.size < 1024 and granularity == "layer" and overwrite
                    np.testing.assert_array_equal(held, result if dense else given)


@pytest.mark.parametrize("codec", ["fp16", "passing"])
def test_a_tensor_a_memory_may_keep_is_neither_summed_in_place_nor_written_with_the_result(codec):
    """A memory with state may hold the very tensor it was given (this one keeps it as it is), and
    must find it as it was. So the gradient handed over is neither given to the collectives to sum
    in place (``_given_over``: a codec whose payload is the tensor itself, ``passing``) nor written
    with the result (``result_place``: a cast, fp16), where the memory has state; with the same
    codec and no state, it is (so the guards, not the codec, decide)."""
    from grace.communicators.allreduce import Allreduce
    from grace.compressors.cast import FP16
    from grace.compressors.none import NoneCompressor
    from grace.memories.none import NoneMemory
    from grace.memory import Memory
    from grace.pipeline import Pipeline

    class Keeping(Memory):
        name = "keeping"

        def __init__(self):
            self.kept = {}

        def compensate(self, tensor, name, ops, overwrite=False):
            return tensor

        def update(self, compensated, name, compressor, payload, ctx, ops):
            self.kept[name] = compensated

    class Passing(NoneCompressor):  # its payload is the tensor itself, and it is compressed
        def payload_nbytes(self, shape, itemsize):
            return None

    def grads(rank, step):
        return gradients(rank, step, [(64, 48)])

    make = FP16 if codec == "fp16" else Passing
    pipelines = [Pipeline(make(), Keeping(), Allreduce(), min_numel=0) for _ in range(2)]
    workers: list = []
    results, held = torch_exchange(pipelines, 2, True, grads=grads, in_place=workers)
    for rank, pipeline in enumerate(pipelines):
        np.testing.assert_array_equal(pipeline.memory.kept["t0"].numpy(), grads(rank, 1)[0])
        assert not np.array_equal(results[rank][1][0], grads(rank, 1)[0])
        np.testing.assert_array_equal(held[rank][1][0], grads(rank, 1)[0])
    stateless = [Pipeline(make(), NoneMemory(), Allreduce(), min_numel=0) for _ in range(2)]
    workers = []
    same, held = torch_exchange(stateless, 2, True, grads=grads, in_place=workers)
    for rank in range(2):
        np.testing.assert_array_equal(same[rank][1][0], results[rank][1][0])
        np.testing.assert_array_equal(held[rank][1][0], results[rank][1][0])  # written with it
    assert all(w.given for w in workers)


def test_a_subclass_of_a_cast_that_decodes_its_own_way_is_decoded_its_way():
    """``decodes_by_cast`` lets a summed payload skip ``decompress_flat``; a subclass of a cast
    that decodes otherwise (here: halves what it decodes) is not taken for one unless it says so,
    and its results handed over are its own decoding's, as without ``overwrite``."""
    from grace.communicators.allreduce import Allreduce
    from grace.compressors.cast import FP16
    from grace.memories.none import NoneMemory
    from grace.pipeline import Pipeline

    class Halved(FP16):
        def decompress_flat(self, payload, ctx, ops):
            return ops.scale(super().decompress_flat(payload, ctx, ops), 0.5)

    with warnings.catch_warnings():  # a former method name (``combine``): a FutureWarning
        warnings.simplefilter("ignore", FutureWarning)

        class Renamed(FP16):  # (none's tensors travel dense, through the plain none)
            def combine(self, payloads, ctx, ops, scale=1.0):
                return ops.scale(FP16.aggregate_payloads(self, payloads, ctx, ops, scale), 2.0)

    class Said(FP16):
        decodes_by_cast = True

        def aggregate(self, tensors, ops):
            return super().aggregate(tensors, ops)

    assert FP16.decodes_by_cast and Said.decodes_by_cast
    assert not Halved.decodes_by_cast and not Renamed.decodes_by_cast
    for cls in (Halved, Renamed):
        def build():
            return [Pipeline(cls(), NoneMemory(), Allreduce(), min_numel=0) for _ in range(2)]

        handed, _ = torch_exchange(build(), 2, True)
        kept, _ = torch_exchange(build(), 2, False)
        plain, _ = torch_exchange([grace.build("none", min_numel=0) for _ in range(2)], 2, False)
        for rank in range(2):
            for a, b, c in zip(handed[rank][1], kept[rank][1], plain[rank][1]):
                np.testing.assert_array_equal(a, b)
                assert not np.allclose(a, c)  # the subclass's own decoding, not a plain cast


class Fusing(Counting):
    """Counting collectives that fuse sums themselves (``fuses_sums``: Horovod's TensorFlow ops in
    a traced graph), with the size of each allreduce recorded."""

    fuses_sums = True

    def allreduce_async(self, t, n):
        self.calls.append(("allreduce", n, int(np.size(t))))
        return self.worker.allreduce_async(t, n)


@pytest.mark.parametrize("name", ["none", "fp16", "topk"])
def test_where_the_collectives_fuse_sums_large_parts_travel_alone(name):
    """Under collectives that fuse sums themselves the pipeline joins no element-wise codec's
    tensors and allreduces each part of ``ALONE_FROM`` bytes or more alone (it starts as soon as
    that tensor exists), the smaller ones and the flag joined as before; the results are the
    joined exchange's, bit for bit."""
    from grace.communicators.allreduce import ALONE_FROM

    large = ALONE_FROM // 2 + 8  # elements: above the bound in float16 as in float32
    shapes = [(large,), (64,), (300, 900), (32,), (5000,)]
    fused, fused_workers = exchange([grace.build(name) for _ in range(2)], steps=2, recorder=Fusing,
                                    grads=lambda r, s: gradients(r, s, shapes))
    joined, _ = exchange([grace.build(name) for _ in range(2)], steps=2,
                         grads=lambda r, s: gradients(r, s, shapes))
    for a, b in zip(fused, joined):
        for step_a, step_b in zip(a, b):
            for x, y in zip(step_a, step_b):
                np.testing.assert_array_equal(x, y)
    sizes = sorted(c[2] for c in fused_workers[0].calls if c[0] == "allreduce")
    if name == "none":  # per step: the two tensors of 1 MiB or more alone, the rest joined (its
        # sum carries any NaN itself: no flag)
        assert sizes == sorted(2 * [large, 300 * 900, 64 + 32 + 5000])
    if name == "fp16":  # per step: the large one alone (its float16 payload over 1 MiB), the
        # 300 x 900 one's (540 kB) with the 5,000 and the biases (fp16 casts every float tensor:
        # min_numel 0), all float16 (a cast's sum carries any NaN itself too: no flag)
        assert sizes == sorted(2 * [large, 300 * 900 + 5000 + 64 + 32])
    if name == "topk":  # top-k's dense leftovers are small: they stay joined, as without fusion
        assert [c[:2] for c in fused_workers[0].calls] == [c for c in exchange(
            [grace.build(name) for _ in range(2)], steps=2,
            grads=lambda r, s: gradients(r, s, shapes))[1][0].calls]


@pytest.mark.parametrize("name, memory", [("none", None), ("fp16", None), ("fp16", "residual")])
def test_an_inf_sent_without_a_flag_reaches_every_worker(name, memory):
    """none and fp16 (no state, summed as they are or cast) send no non-finite flag: one worker's
    Inf or NaN is in the sum every worker receives, at its place, so a loss scaler skips the step
    on every worker, with no state to roll back; no control bytes are sent. fp16 with a residual
    has state: it sends the flag, every result is NaN and the residuals stay as they were."""
    def poisoned(rank, step):
        g = gradients(rank, step)
        if rank == 1 and step == 1:
            g[0][3, 5], g[6][7] = np.inf, np.nan  # a compressed matrix, a compressed vector
        return g

    def build():
        return [grace.build(name, min_numel=1024, **({"memory": memory} if memory else {}))
                for _ in range(2)]

    pipelines, before = build(), build()
    results, _ = exchange(pipelines, steps=2, grads=poisoned)
    exchange(before, steps=1, grads=poisoned)
    for rank in range(2):
        matrix, vector = results[rank][1][0], results[rank][1][6]
        control = pipelines[rank].stats()["bytes_control"]
        if memory is None:
            assert matrix[3, 5] == np.inf and np.isnan(vector[7])
            assert np.isfinite(np.delete(matrix.reshape(-1), 3 * 48 + 5)).all()
            assert control == 0
        else:
            assert all(np.isnan(r).all() for r in results[rank][1])
            assert control > 0
    if memory is not None:
        assert_same_state(before, pipelines)


def test_a_gradient_autograd_tracks_is_not_summed_in_place():
    """A gradient handed over that autograd tracks (``create_graph=True``) is never written into
    (``Ops.writable``): sent alone as it is, it is not given to be summed in place, and stays as
    it was; the result is the workers' mean all the same."""
    import torch

    from frameworks.torch.ops import TorchOps

    ops, group, workers = TorchOps(), InProcessGroup(2), []
    pipelines = [grace.none() for _ in range(2)]
    grads = [torch.randn(64, 48, generator=torch.Generator().manual_seed(r)).requires_grad_()
             for r in range(2)]
    kept = [g.detach().clone() for g in grads]
    out = [None, None]

    def run(rank):
        worker = SummingInPlace(group.worker(rank))
        workers.append(worker)
        started = pipelines[rank].start_bucket([grads[rank]], ["t0"], worker, ops, overwrite=True)
        out[rank] = pipelines[rank].finish_step([started], worker, 0.5)[0][0]
    run_threads([lambda r=r: run(r) for r in range(2)])
    assert len(workers) == 2 and not any(w.given for w in workers)
    for rank in range(2):
        assert torch.equal(grads[rank].detach(), kept[rank])
        assert torch.equal(out[rank].detach(), (kept[0] + kept[1]) * 0.5)
