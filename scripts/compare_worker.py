"""One worker of the side-by-side comparison (``scripts/compare.py`` launches it): trains one
workload of ``workloads.py`` with PyTorch or TensorFlow under Horovod, or PyTorch under
DistributedDataParallel (``--framework ddp``, started by torchrun), with one compression; rank 0
prints one ``EPOCH {json}`` line per epoch and a ``RESULT {json}`` line at the end.

    horovodrun -np 2 python -m scripts.compare_worker --framework tf --workload lstm \
        --compression '{"compressor": "topk", "ratio": 0.01}'
    torchrun --standalone --nproc-per-node 2 -m scripts.compare_worker --framework ddp \
        --workload mnist --compression torch-powersgd-r1

``--compression`` is ``fp32`` (the engine's own uncompressed allreduce: Horovod's, or DDP's without
a hook), ``hvd-fp16`` (Horovod's own ``Compression.fp16``), one of PyTorch's DDP hooks by its name
in ``torch_hooks.py`` (``torch-fp16``, ``torch-powersgd-r1``, ...; ``--framework ddp``), or a
``grace.from_params`` JSON object (under DDP through ``grace.ddp_hook``, its state named by the
model's parameter names, as under Horovod). PyTorch's PowerSGD hook does its compression inside
the collectives' callbacks; its ``compression`` time is not separated (0, counted as
communication).

The step time is split by measurement, not by instrumenting the collectives: ``compute`` is the
median time of the same step without Horovod (measured first, locally), ``compression`` the median
time of compressing and decompressing one step's gradients with the same pipeline (no network), and
``communication`` what remains of the distributed step.

Every run, Horovod's own included, keeps freed memory in the process as grace's wrappers do
(``grace.heap.keep_freed_memory``), so that fp32 is timed with the same heap as the compressors.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from scripts import torch_hooks, workloads

CALIBRATION_STEPS = 8
# The test images' forward pass, in parts: the CNN's activations for 5,000 images at once are large.
EVAL_PARTS = {"mnist": 1, "cnn": 10}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--framework", choices=("torch", "tf", "ddp"), required=True,
                        help="ddp: PyTorch through DistributedDataParallel, started by torchrun")
    parser.add_argument("--workload", choices=workloads.WORKLOADS, required=True)
    parser.add_argument("--compression", default="fp32")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--steps", type=int, default=60, help="steps per epoch, per worker")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--optimizer", choices=("sgd", "adam"), default="sgd",
                        help="sgd: the workload's SGD (with its momentum); adam: Adam, lr 1e-3")
    parser.add_argument("--momentum", type=float, default=None,
                        help="the optimizer's momentum: SGD's (default: the workload's; the LSTM's "
                             "and the words model's SGD have none), or Adam's beta_1 (default 0.9)")
    parser.add_argument("--lr", type=float, default=None,
                        help="learning rate (default: the workload's for sgd, 1e-3 for adam)")
    parser.add_argument("--clip", type=float, default=None,
                        help="the LSTM's gradient clipping norm (default: the workload's; 0: none)")
    parser.add_argument("--init", choices=("default", "glorot"), default="default",
                        help="mnist, lstm and words, PyTorch: glorot initializes the layers as Keras does "
                             "(Dense: Glorot-uniform weights, zero biases; LSTM: Glorot-uniform "
                             "input weights, orthogonal recurrent ones, zero biases but the forget "
                             "gate's 1; Embedding: uniform in +-0.05) instead of PyTorch's own")
    parser.add_argument("--layout", choices=("torch", "keras"), default="torch",
                        help="mnist, PyTorch: keras stores each layer's weight as Keras's Dense "
                             "kernel does, (inputs, outputs), so that its gradient is laid out "
                             "as TensorFlow's and a compressor's blocks of it hold the same entries")
    parser.add_argument("--adam-epsilon", type=float, default=None,
                        help="Adam's epsilon (default: the framework's, 1e-8 PyTorch, 1e-7 Keras)")
    parser.add_argument("--wire", action="store_true", help="read eth0's byte counters (emulated host)")
    parser.add_argument("--loop", choices=("step", "fit", "tape"), default="step",
                        help="TensorFlow's training loop: step, a tf.function step handing the gradients "
                             "to the Keras optimizer (grace's wrapper; fp32 and hvd-fp16 through "
                             "Horovod's tape); fit, model.fit with horovod.tensorflow.keras's "
                             "DistributedOptimizer (fp32: with grace.none(), as Horovod's own does "
                             "not average on Keras 3); tape, every compression through Horovod's "
                             "DistributedGradientTape, the optimizer as the user built it (fp32 and "
                             "hvd-fp16 are Horovod's tape in step and tape alike). fit's step time "
                             "includes drawing and joining the epoch's batches and Keras's fit call")
    parser.add_argument("--sparse-as-dense", action="store_true",
                        help="PyTorch: the words model's embedding gradient travels dense")
    return parser.parse_args(argv)


ADAM_LR = 1e-3


def learning_rate(args, cfg) -> float:
    return args.lr if args.lr is not None else (ADAM_LR if args.optimizer == "adam" else cfg["lr"])


def median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def compression_time(pipeline, grads, size: int, compile=lambda fn: fn) -> float:
    """Seconds to compress one step's gradients and decompress them as a receiver does (each
    worker's payload when they are gathered, the summed one when reduced; through the shards'
    owners, a payload's worth of shards decoded twice and one shard encoded again), without the
    network;
    ``compile`` wraps the work as training runs it (``tf.function`` for TensorFlow)."""
    if pipeline is None:
        return 0.0
    from grace.ops import ops_for

    route = pipeline.communicator.resolve(size).name

    @compile
    def once():
        outputs = []  # returned, so that a traced function keeps all the work
        for i, g in enumerate(grads):
            ops = ops_for(g)
            if not pipeline.compresses(ops.shape(g), ops.dtype(g), ops):
                continue
            payload, ctx = pipeline.compressor.compress(g, f"calibrate.{i}", ops)
            copies = {"allreduce": 1, "alltoall": 2}.get(route, size)
            outputs += [pipeline.compressor.decompress(payload, ctx, ops) for _ in range(copies)]
            if route == "alltoall":  # the owner's shard, encoded again
                shard = ops.slice(ops.flatten(g), 0, max(1, ops.numel(g) // size))
                outputs += pipeline.compressor.compress(shard, f"calibrate.{i}.owner", ops)[0]
        return outputs

    once()
    return median_time(once, 3)


class Meter:
    """Per-epoch step time, and bytes on the wire when there is an ``eth0`` to read."""

    def __init__(self, wire: bool):
        self.wire = wire
        self.start_bytes = workloads.wire_bytes() if wire else None
        self.start = time.perf_counter()

    def done(self, steps: int) -> dict:
        seconds = time.perf_counter() - self.start
        out = {"wall_s": seconds, "step_s": seconds / steps}
        if self.wire and self.start_bytes is not None:
            out["wire_bytes_per_step"] = (workloads.wire_bytes() - self.start_bytes) / steps
        return out


# --- PyTorch ------------------------------------------------------------------------------------
def _keras_dense():
    import torch

    class KerasDense(torch.nn.Module):
        """``torch.nn.Linear`` with its weight stored as Keras's Dense kernel, (inputs, outputs)."""

        def __init__(self, inputs: int, outputs: int):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.empty(inputs, outputs))
            self.bias = torch.nn.Parameter(torch.zeros(outputs))
            torch.nn.init.xavier_uniform_(self.weight)

        def forward(self, x):
            return x @ self.weight + self.bias

    return KerasDense


class TorchCollectives:
    """The few collectives of the workers' own bookkeeping (evaluation sums, the epochs' barrier):
    Horovod's, or torch.distributed's under DDP (started by torchrun)."""

    def __init__(self, ddp: bool):
        self.ddp = ddp
        if ddp:
            import torch.distributed as dist

            dist.init_process_group("gloo")
            self.rank, self.size = dist.get_rank(), dist.get_world_size()
        else:
            import horovod.torch as hvd

            hvd.init()
            self.rank, self.size = hvd.rank(), hvd.size()

    def sum(self, tensor):
        if self.ddp:
            import torch.distributed as dist

            tensor = tensor.clone()
            dist.all_reduce(tensor)
            return tensor
        import horovod.torch as hvd

        return hvd.allreduce(tensor, op=hvd.Sum, name="eval")

    def mean(self, tensor):
        return self.sum(tensor) / self.size

    def gather(self, obj) -> list:
        """Every worker's ``obj`` (any picklable value), in rank order."""
        if self.ddp:
            import torch.distributed as dist

            out = [None] * self.size
            dist.all_gather_object(out, obj)
            return out
        import horovod.torch as hvd

        return hvd.allgather_object(obj, name="gather")

    def barrier(self) -> None:
        import torch

        self.sum(torch.zeros(1))


def run_torch(args, spec):
    import torch

    import grace

    ddp = args.framework == "ddp"
    comm = TorchCollectives(ddp)
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    rank, size = comm.rank, comm.size
    rng = np.random.default_rng(args.seed + rank)

    if args.workload in ("mnist", "cnn"):
        cfg = workloads.MNIST if args.workload == "mnist" else workloads.CNN
        train_x, train_y, test_x, test_y = workloads.fashion_mnist()
        if args.workload == "mnist":
            dense = _keras_dense() if args.layout == "keras" else torch.nn.Linear
            layers, width = [], 784
            for h in cfg["hidden"]:
                layers += [dense(width, h), torch.nn.ReLU()]
                width = h
            model = torch.nn.Sequential(*layers, dense(width, 10))
            if args.init == "glorot":
                for layer in model:
                    if isinstance(layer, (torch.nn.Linear, dense)):
                        keras_init_dense(layer)
        else:
            from scripts import cnn

            train_x, test_x = (a.reshape(-1, 1, 28, 28) for a in (train_x, test_x))
            model = cnn.torch_model(cfg)
        base = torch_optimizer(args, model.parameters(), learning_rate(args, cfg), cfg["momentum"])

        def batch():
            idx = rng.integers(0, len(train_x), cfg["batch"])
            return torch.from_numpy(train_x[idx]), torch.from_numpy(train_y[idx])

        def loss_of(x, y):
            return torch.nn.functional.cross_entropy(model(x), y)

        def evaluate():
            share = slice(rank, None, size)
            parts = np.array_split(test_x[share], EVAL_PARTS[args.workload])
            model.eval()  # the CNN's batch norm with its running statistics
            with torch.no_grad():
                pred = np.concatenate([model(torch.from_numpy(part)).argmax(1).numpy() for part in parts])
            model.train()
            totals = comm.sum(torch.tensor([float((pred == test_y[share]).sum()),
                                            float(len(pred))], dtype=torch.float64))
            return {"test_accuracy": float(totals[0] / totals[1])}
        samples = cfg["batch"]
    elif args.workload == "lstm":
        cfg = workloads.LSTM
        train, valid, vocab = workloads.shakespeare(cfg["seq"])

        class CharLSTM(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.embed = torch.nn.Embedding(vocab, cfg["embed"])
                self.lstm = torch.nn.LSTM(cfg["embed"], cfg["hidden"], batch_first=True)
                self.out = torch.nn.Linear(cfg["hidden"], vocab)

            def forward(self, x):
                return self.out(self.lstm(self.embed(x))[0])

        model = CharLSTM()
        if args.init == "glorot":
            keras_init_lstm(model.embed, model.lstm, model.out)
        base = torch_optimizer(args, model.parameters(), learning_rate(args, cfg), 0.0)

        def batch():
            w = torch.from_numpy(train[rng.integers(0, len(train), cfg["batch"])])
            return w[:, :-1], w[:, 1:]

        def loss_of(x, y):
            return torch.nn.functional.cross_entropy(model(x).reshape(-1, vocab), y.reshape(-1))

        def evaluate():
            share = torch.from_numpy(valid[rank::size][:256])
            with torch.no_grad():
                nll = float(loss_of(share[:, :-1], share[:, 1:]))
            mean = float(comm.mean(torch.tensor(nll)))
            return {"perplexity": float(np.exp(mean))}
        samples = cfg["batch"]
    elif args.workload == "words":
        cfg = workloads.WORDS
        train, valid = workloads.shakespeare_words(cfg["context"], cfg["vocab"])

        model = torch_word_model(args.init)
        # No momentum: PyTorch's optimizers other than SGD refuse sparse gradients, and the sparse
        # embedding models of Horovod's examples train with plain SGD.
        base = torch_optimizer(args, model.parameters(), learning_rate(args, cfg), 0.0)

        def batch():
            w = torch.from_numpy(train[rng.integers(0, len(train), cfg["batch"])])
            return w[:, :-1], w[:, -1]

        def loss_of(x, y):
            return torch.nn.functional.cross_entropy(model(x), y)

        def evaluate():
            share = torch.from_numpy(valid[rank::size])
            with torch.no_grad():
                nll = float(loss_of(share[:, :-1], share[:, -1]))
            mean = float(comm.mean(torch.tensor(nll)))
            return {"perplexity": float(np.exp(mean))}
        samples = cfg["batch"]
    elif args.workload == "resnet50":
        from scripts.resnet import ResNet50

        cfg = workloads.RESNET50
        model = ResNet50(cfg["classes"])
        base = torch_optimizer(args, model.parameters(), learning_rate(args, cfg), cfg["momentum"])
        gen = torch.Generator().manual_seed(args.seed + rank)
        images = torch.randn(cfg["batch"], 3, cfg["image"], cfg["image"], generator=gen)
        labels = torch.randint(0, cfg["classes"], (cfg["batch"],), generator=gen)

        def batch():
            return images, labels

        def loss_of(x, y):
            return torch.nn.functional.cross_entropy(model(x), y)

        def evaluate():
            return {}
        samples = cfg["batch"]
    else:
        shapes = workloads.resnet50_shapes()
        gen = torch.Generator().manual_seed(args.seed + rank)
        params = [torch.nn.Parameter(torch.zeros(s)) for _, s in shapes]
        fixed = [torch.randn(s, generator=gen) * 1e-3 for _, s in shapes]
        model = torch.nn.ParameterList(params)
        base = torch.optim.SGD(params, lr=0.0)

        class GivenGradients(torch.nn.Module):
            """The exchange under DDP, whose hooks see gradients only as autograd hands them
            over: the loss sum(p * g) over the parameters p (zeros, never moved: lr 0) and their
            fixed gradients g, whose gradient with respect to each p is its g."""

            def __init__(self, params):
                super().__init__()
                self.params = params

            def forward(self, given):
                return sum((p * g).sum() for p, g in zip(self.params, given))

        given = GivenGradients(model)
        loss_of = batch = None

        def evaluate():
            return {}
        samples = workloads.EXCHANGE["batch"]

    named = list(model.named_parameters())

    def local_step():
        base.zero_grad()
        if args.workload == "exchange" and ddp:
            given(fixed).backward()  # as DDP's step makes them, compute measured alike
        elif args.workload == "exchange":
            for p, g in zip(params, fixed):
                p.grad = g.clone()
        else:
            loss = loss_of(*batch())
            loss.backward()
            if args.workload == "lstm":
                if clip_norm(args):
                    torch.nn.utils.clip_grad_norm_(model.parameters(), clip_norm(args))
        base.step()

    compute_s = median_time(local_step, CALIBRATION_STEPS)
    pipeline = grace.from_params(spec) if isinstance(spec, dict) else None
    if ddp:
        from torch.nn.parallel import DistributedDataParallel

        # DDP broadcasts rank 0's parameters as it wraps the model (Horovod's broadcast_parameters).
        wrapped = DistributedDataParallel(given if args.workload == "exchange" else model)
        if pipeline is not None:  # state named as under Horovod: the same bits (tests/test_ddp.py)
            wrapped.register_comm_hook(grace.DDPState(pipeline, named_parameters=named),
                                       grace.ddp_hook)
        elif spec != "fp32":
            hook, state = torch_hooks.make(spec)
            wrapped.register_comm_hook(state, hook)
        model = wrapped  # the workloads' loss and evaluation now run through DDP's forward
        # The calibration's momentum differs by rank: start afresh, as Horovod's wrapper does (it
        # builds a new optimizer over the same parameter groups).
        base.state.clear()
        optimizer = base
    else:
        import horovod.torch as hvd

        compression = hvd.Compression.fp16 if spec == "hvd-fp16" else pipeline
        optimizer = hvd.DistributedOptimizer(base, named_parameters=named,
                                             sparse_as_dense=args.sparse_as_dense,
                                             **({} if compression is None else
                                                {"compression": compression}))
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    grads = [p.grad.detach().clone() for p in model.parameters() if p.grad is not None]
    torch_hook = spec if isinstance(spec, str) and spec in torch_hooks.HOOKS else None
    if torch_hook is not None:
        sent = torch_hooks.payload_bytes(torch_hook, [tuple(g.shape) for g in grads])
    else:
        sent = dense_bytes([sparse_size(g) for g in grads], spec)
    # A sparse gradient's compression is timed on its rows, what the pipeline compresses.
    grads = [g.coalesce().values() if g.is_sparse else g for g in grads]
    compress_s = compression_time(pipeline, grads, size)
    if spec in ("hvd-fp16", "torch-fp16"):
        compress_s = median_time(lambda: [g.half().float() for g in grads], 3)

    def dist_step():
        optimizer.zero_grad()
        if args.workload == "exchange":
            if ddp:
                model(fixed).backward()
            else:
                for p, g in zip(params, fixed):
                    p.grad = g.clone()
            optimizer.step()
            return
        loss = loss_of(*batch())
        loss.backward()  # under DDP, the gradients are averaged when backward returns
        if args.workload == "lstm":
            if not ddp:
                optimizer.synchronize()
            if clip_norm(args):
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip_norm(args))
            if ddp:
                optimizer.step()
            else:
                with optimizer.skip_synchronize():
                    optimizer.step()
        else:
            optimizer.step()

    # Steps outside the timings: Horovod negotiates each tensor, DDP rebuilds its buckets, and
    # PyTorch's PowerSGD hook allreduces dense until its start_powerSGD_iter.
    hook_warmup = torch_hooks.warmup_steps(torch_hook) if torch_hook is not None else 0
    for _ in range(max(1, hook_warmup)):
        dist_step()
    report(args, rank, size, samples, compute_s, compress_s, each_step(dist_step), evaluate,
           lambda: pipeline.stats() if pipeline else None, sent, comm.barrier, pipeline,
           weights=lambda: [p.detach().numpy() for p in model.parameters()], gather=comm.gather)


def torch_optimizer(args, params, lr: float, momentum: float):
    import torch

    if args.optimizer == "adam":
        eps = {} if args.adam_epsilon is None else {"eps": args.adam_epsilon}
        betas = {} if args.momentum is None else {"betas": (args.momentum, 0.999)}
        return torch.optim.Adam(params, lr=lr, **eps, **betas)
    return torch.optim.SGD(params, lr=lr, momentum=momentum if args.momentum is None else args.momentum)


def keras_init_dense(layer) -> None:
    """Keras's ``Dense`` initialization on a PyTorch layer with ``weight`` and ``bias``:
    Glorot-uniform weights (symmetric in fan-in and fan-out, so either layout), zero bias."""
    import torch

    with torch.no_grad():
        torch.nn.init.xavier_uniform_(layer.weight)
        torch.nn.init.zeros_(layer.bias)


def keras_init_lstm(embed, lstm, out) -> None:
    """Keras's initialization of the character LSTM's layers, on PyTorch's (``--init glorot``):
    ``Embedding`` uniform in [-0.05, 0.05]; ``LSTM`` Glorot-uniform input weights, orthogonal
    recurrent weights, zero biases with the forget gate's at 1 (``unit_forget_bias``; PyTorch's
    two biases add, so one of them carries it; its gates are input, forget, cell, output as
    Keras's); ``Dense`` Glorot-uniform, zero bias."""
    import torch

    with torch.no_grad():
        torch.nn.init.uniform_(embed.weight, -0.05, 0.05)
        hidden = lstm.hidden_size
        # Keras draws the (inputs, 4 * units) kernel whole, so Glorot's bound is the whole
        # matrix's, as xavier_uniform_ computes it for PyTorch's (4 * hidden, inputs).
        torch.nn.init.xavier_uniform_(lstm.weight_ih_l0)
        torch.nn.init.orthogonal_(lstm.weight_hh_l0)
        torch.nn.init.zeros_(lstm.bias_ih_l0)
        torch.nn.init.zeros_(lstm.bias_hh_l0)
        lstm.bias_ih_l0[hidden:2 * hidden] = 1.0
    keras_init_dense(out)


def torch_word_model(init: str = "default"):
    """The word model in PyTorch (``workloads.WORDS``): a sparse embedding of the context's words,
    flattened, a hidden ReLU layer, the next word's logits; ``init="glorot"`` starts it from
    Keras's initial weights (``keras_init_words``)."""
    import torch

    cfg = workloads.WORDS

    class WordModel(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(cfg["vocab"], cfg["embed"], sparse=True)
            self.hidden = torch.nn.Linear(cfg["context"] * cfg["embed"], cfg["hidden"])
            self.out = torch.nn.Linear(cfg["hidden"], cfg["vocab"])

        def forward(self, x):
            return self.out(torch.relu(self.hidden(self.embed(x).flatten(1))))

    model = WordModel()
    if init == "glorot":
        keras_init_words(model.embed, model.hidden, model.out)
    return model


def keras_init_words(embed, hidden, out) -> None:
    """Keras's initialization of the word model's layers, on PyTorch's (``--init glorot``):
    ``Embedding`` uniform in [-0.05, 0.05] (PyTorch's is a unit normal, 20-35 times larger);
    both ``Dense`` layers Glorot-uniform, zero bias."""
    import torch

    with torch.no_grad():
        torch.nn.init.uniform_(embed.weight, -0.05, 0.05)
    keras_init_dense(hidden)
    keras_init_dense(out)


def clip_norm(args) -> float:
    """The LSTM's gradient clipping norm: ``--clip``, else the workload's (0: no clipping)."""
    return workloads.LSTM["clip"] if args.clip is None else args.clip


def keras_optimizer(args, lr: float, momentum: float, clip: float | None = None):
    import keras

    if args.optimizer == "adam":
        eps = {} if args.adam_epsilon is None else {"epsilon": args.adam_epsilon}
        beta = {} if args.momentum is None else {"beta_1": args.momentum}
        return keras.optimizers.Adam(lr, global_clipnorm=clip, **eps, **beta)
    return keras.optimizers.SGD(lr, momentum=momentum if args.momentum is None else args.momentum,
                                global_clipnorm=clip)


def dense_bytes(sizes, spec) -> int:
    """What a worker gives Horovod per step without grace: ``sizes`` holds a dense gradient's
    shape, or a sparse one's (rows, row elements), sent by Horovod's allgather with its int64
    indices."""
    per_value = 2 if spec == "hvd-fp16" else 4
    total = 0
    for size in sizes:
        if isinstance(size, tuple) and size and size[0] == "rows":
            total += size[1] * (size[2] * per_value + 8)
        else:
            total += int(np.prod(size)) * per_value
    return total


def sparse_size(g):
    """A gradient's size for ``dense_bytes``: torch sparse COO or ``tf.IndexedSlices`` as rows."""
    if getattr(g, "is_sparse", False):  # torch: Horovod sends the rows as the gradient holds them
        return ("rows", int(g._values().shape[0]), int(np.prod(g._values().shape[1:])))
    if type(g).__name__ == "IndexedSlices":
        return ("rows", int(g.values.shape[0]), int(np.prod(g.values.shape[1:])))
    return tuple(g.shape)


# --- TensorFlow ---------------------------------------------------------------------------------
def exchange_loss(variables, fixed):
    """The exchange workload's loss for TensorFlow's tape: a zero whose gradient with respect to
    each variable is that variable's fixed gradient, handed over as it is (``tf.custom_gradient``),
    as PyTorch's exchange workload sets each ``p.grad``. The workload has no model compute: a loss
    of ``sum(v * g)`` would make the tape multiply every one of the 25.6 M elements twice a step
    (11-32 ms of a 155-195 ms step at 2 workers here, timed in pairs), which PyTorch's runs never
    paid."""
    import tensorflow as tf

    def given(g):
        @tf.custom_gradient
        def zero(v):
            return tf.zeros([]), lambda upstream: tf.identity(g)  # a graph tensor Horovod can name
        return zero

    return tf.add_n([given(g)(v) for v, g in zip(variables, fixed)])


def run_tf(args, spec):
    import horovod.tensorflow as hvd
    import keras
    import tensorflow as tf

    import grace

    tf.config.threading.set_inter_op_parallelism_threads(1)
    tf.config.threading.set_intra_op_parallelism_threads(1)
    hvd.init()
    keras.utils.set_random_seed(args.seed)
    rank, size = hvd.rank(), hvd.size()
    rng = np.random.default_rng(args.seed + rank)

    if args.workload in ("mnist", "cnn"):
        cfg = workloads.MNIST if args.workload == "mnist" else workloads.CNN
        train_x, train_y, test_x, test_y = workloads.fashion_mnist()
        if args.workload == "mnist":
            model = keras.Sequential([keras.Input((784,))] +
                                     [keras.layers.Dense(h, activation="relu") for h in cfg["hidden"]] +
                                     [keras.layers.Dense(10)])
        else:
            from scripts import cnn

            train_x, test_x = (a.reshape(-1, 28, 28, 1) for a in (train_x, test_x))
            model = cnn.keras_model(cfg)
        base = keras_optimizer(args, learning_rate(args, cfg), cfg["momentum"])
        xent = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

        def batch():
            idx = rng.integers(0, len(train_x), cfg["batch"])
            return tf.constant(train_x[idx]), tf.constant(train_y[idx])

        def loss_of(x, y):
            return xent(y, model(x, training=True))

        def evaluate():
            share = slice(rank, None, size)
            parts = np.array_split(test_x[share], EVAL_PARTS[args.workload])
            pred = np.concatenate([np.argmax(model.predict_on_batch(part), 1) for part in parts])
            totals = hvd.allreduce(tf.constant([float((pred == test_y[share]).sum()), float(len(pred))],
                                               tf.float64), op=hvd.Sum, name="eval")
            return {"test_accuracy": float(totals[0] / totals[1])}
        samples = cfg["batch"]
    elif args.workload == "lstm":
        cfg = workloads.LSTM
        train, valid, vocab = workloads.shakespeare(cfg["seq"])
        model = keras.Sequential([keras.Input((cfg["seq"],), dtype="int64"),
                                  keras.layers.Embedding(vocab, cfg["embed"]),
                                  keras.layers.LSTM(cfg["hidden"], return_sequences=True),
                                  keras.layers.Dense(vocab)])
        base = keras_optimizer(args, learning_rate(args, cfg), 0.0, clip_norm(args) or None)
        xent = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

        def batch():
            w = train[rng.integers(0, len(train), cfg["batch"])]
            return tf.constant(w[:, :-1]), tf.constant(w[:, 1:])

        def loss_of(x, y):
            return xent(y, model(x, training=True))

        def evaluate():
            share = valid[rank::size][:256]
            nll = float(xent(share[:, 1:], model(share[:, :-1], training=False)))
            mean = float(hvd.allreduce(tf.constant(nll), name="eval"))
            return {"perplexity": float(np.exp(mean))}
        samples = cfg["batch"]
    elif args.workload == "words":
        cfg = workloads.WORDS
        train, valid = workloads.shakespeare_words(cfg["context"], cfg["vocab"])
        model = keras.Sequential([keras.Input((cfg["context"],), dtype="int64"),
                                  keras.layers.Embedding(cfg["vocab"], cfg["embed"]),
                                  keras.layers.Flatten(),
                                  keras.layers.Dense(cfg["hidden"], activation="relu"),
                                  keras.layers.Dense(cfg["vocab"])])
        base = keras_optimizer(args, learning_rate(args, cfg), 0.0)
        xent = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

        def batch():
            w = train[rng.integers(0, len(train), cfg["batch"])]
            return tf.constant(w[:, :-1]), tf.constant(w[:, -1])

        def loss_of(x, y):
            return xent(y, model(x, training=True))

        def evaluate():
            share = valid[rank::size]
            nll = float(xent(share[:, -1], model(share[:, :-1], training=False)))
            mean = float(hvd.allreduce(tf.constant(nll), name="eval"))
            return {"perplexity": float(np.exp(mean))}
        samples = cfg["batch"]
    elif args.workload == "resnet50":
        cfg = workloads.RESNET50
        model = keras.applications.ResNet50(weights=None, input_shape=(cfg["image"], cfg["image"], 3),
                                            classes=cfg["classes"])
        base = keras_optimizer(args, learning_rate(args, cfg), cfg["momentum"])
        xent = keras.losses.SparseCategoricalCrossentropy(from_logits=False)  # a softmax head
        images = tf.constant(rng.standard_normal((cfg["batch"], cfg["image"], cfg["image"], 3),
                                                 np.float32))
        labels = tf.constant(rng.integers(0, cfg["classes"], cfg["batch"]))

        def batch():
            return images, labels

        def loss_of(x, y):
            return xent(y, model(x, training=True))

        def evaluate():
            return {}
        samples = cfg["batch"]
    else:
        shapes = workloads.resnet50_shapes()
        variables = [tf.Variable(tf.zeros(s)) for _, s in shapes]
        fixed = [tf.constant(np.random.default_rng(args.seed + rank).standard_normal(s, np.float32)
                             * 1e-3) for _, s in shapes]
        base = keras.optimizers.SGD(0.0)
        model = None
        batch = None

        def loss_of():
            return exchange_loss(variables, fixed)

        def evaluate():
            return {}
        samples = workloads.EXCHANGE["batch"]

    if model is not None:
        variables = model.trainable_variables
    if args.loop != "step" and model is None:
        raise SystemExit(f"--loop {args.loop}: the {args.workload} workload has no Keras model")
    if args.loop == "fit" and spec == "hvd-fp16":
        raise SystemExit("--loop fit --compression hvd-fp16: Horovod's own Keras optimizer does not "
                         "combine gradients on Keras 3 (docs/tensorflow.md); run it with --loop step")
    pipeline = grace.from_params(spec) if isinstance(spec, dict) else None
    compression = hvd.Compression.fp16 if spec == "hvd-fp16" else hvd.Compression.none
    # The words workload's embedding gradient travels sparse (Horovod's allgather of rows, grace's
    # rows); the others' dense (sparse_as_dense).
    sparse = args.workload == "words"
    # --loop step: grace's compressions through the Keras optimizer wrapper, which sees the optimizer
    # and can take its momentum over (as a Keras user's model.fit does); Horovod's own baselines
    # through its tape (its Keras optimizer does not average on Keras 3). --loop tape: every
    # compression through Horovod's tape, the optimizer as the user built it. --loop fit: model.fit
    # with horovod.tensorflow.keras's DistributedOptimizer (fp32: compression=grace.none(), the
    # uncompressed averaging that works there on Keras 3, docs/tensorflow.md). Gradients are
    # clipped after they are combined in each (the optimizer's global_clipnorm), as PyTorch's are.
    through_tape = args.loop == "tape" or pipeline is None
    if args.loop == "fit":
        import horovod.tensorflow.keras as hvd_keras

        dist_opt = hvd_keras.DistributedOptimizer(
            base, sparse_as_dense=not sparse, compression=grace.none() if pipeline is None else pipeline)
    elif through_tape:
        # A new optimizer of the user's settings, as the wrappers of the other branches build: the
        # calibration's steps left ``base`` with momentum (Adam's moments, step count) that differ by rank.
        dist_opt = base.__class__.from_config(base.get_config())
    else:
        dist_opt = hvd.DistributedOptimizer(base, compression=pipeline)

    def make_step(distributed):
        optimizer = dist_opt if distributed else base

        @tf.function
        def step(*data):
            with tf.GradientTape() as tape:
                loss = loss_of(*data)
            if distributed and through_tape:
                tape = hvd.DistributedGradientTape(
                    tape, compression=compression if pipeline is None else pipeline,
                    sparse_as_dense=not sparse)
            grads = tape.gradient(loss, variables)
            if distributed and not through_tape and not sparse:
                grads = [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g for g in grads]
            optimizer.apply(grads, variables)
            return grads
        return step

    local = make_step(False)
    data = (lambda: batch()) if batch else (lambda: ())
    local(*data())
    compute_s = median_time(lambda: local(*data()), CALIBRATION_STEPS)
    grads = [g for g in local(*data()) if g is not None]
    # After the calibration's local steps, so that every worker starts from rank 0's weights.
    hvd.broadcast_variables(variables, root_rank=0)  # Keras 3 variables too, with import grace
    sent = dense_bytes([sparse_size(g) for g in grads], spec)
    grads = [g.values if isinstance(g, tf.IndexedSlices) and sparse else tf.convert_to_tensor(g)
             for g in grads]
    if spec == "hvd-fp16":
        compress_s = median_time(lambda: [tf.cast(tf.cast(g, tf.float16), tf.float32) for g in grads], 3)
    else:
        compress_s = compression_time(pipeline, grads, size, compile=tf.function)

    if args.loop == "fit":
        model.compile(optimizer=dist_opt, loss=xent)

        def run_steps(n: int) -> None:
            # The same batches, in the same order, as the other loops draw them.
            drawn = [batch() for _ in range(n)]
            x, y = (np.concatenate([np.asarray(d[i]) for d in drawn]) for i in (0, 1))
            model.fit(x, y, batch_size=len(drawn[0][0]), epochs=1, shuffle=False, verbose=0)
    else:
        distributed = make_step(True)
        run_steps = each_step(lambda: distributed(*data()))

    run_steps(1)  # traces, and lets Horovod negotiate each tensor once
    report(args, rank, size, samples, compute_s, compress_s, run_steps, evaluate,
           lambda: pipeline.stats() if pipeline else None, sent,
           lambda: hvd.allreduce(tf.zeros(1), name="barrier"), pipeline,
           weights=lambda: [np.asarray(v) for v in variables], gather=hvd.allgather_object,
           loop=args.loop)


# --- both ---------------------------------------------------------------------------------------
def each_step(dist_step):
    """``run_steps`` for ``report`` from a function that trains one step."""
    def run_steps(n: int) -> None:
        for _ in range(n):
            dist_step()
    return run_steps


def report(args, rank, size, samples, compute_s, compress_s, run_steps, evaluate, stats, dense,
           barrier, pipeline=None, weights=None, gather=None, loop=None):
    """Train ``--epochs`` × ``--steps`` (``run_steps(n)`` trains n steps); rank 0 prints per-epoch
    and final JSON lines (with the communicator the pipeline used at this size, the payload bytes it
    received per step, TensorFlow's ``loop``, and, given ``weights()`` (the trained variables: a
    normalization layer's moving statistics are each worker's own), the SHA-256 of the final
    weights' bytes and, given ``gather`` (an allgather of Python objects), whether every worker
    ends with those weights)."""
    epochs = []
    sent_before = (stats() or {}).get("bytes_sent", 0)
    received_before = (stats() or {}).get("bytes_received", 0)
    wall = 0.0
    for epoch in range(1, args.epochs + 1):
        barrier()
        meter = Meter(args.wire)
        run_steps(args.steps)
        barrier()
        row = {"epoch": epoch, **meter.done(args.steps)}
        s = stats()
        if s is None:
            row["bytes_per_step"] = dense
        else:
            row["bytes_per_step"] = (s["bytes_sent"] - sent_before) / args.steps
            row["received_per_step"] = (s["bytes_received"] - received_before) / args.steps
            sent_before, received_before = s["bytes_sent"], s["bytes_received"]
        wall += row["wall_s"]
        row.update(evaluate(), train_wall_s=wall)
        epochs.append(row)
        if rank == 0:
            print("EPOCH " + json.dumps(row), flush=True)
    step_s = float(np.median([e["step_s"] for e in epochs]))
    result = {"framework": args.framework, "workload": args.workload, "workers": size,
              "step_s": step_s, "samples_per_s": samples * size / step_s,
              "compute_s": compute_s, "compression_s": compress_s,
              "communication_s": max(0.0, step_s - compute_s - compress_s),
              "bytes_per_step": float(np.mean([e["bytes_per_step"] for e in epochs])),
              "epochs": epochs}
    if pipeline is not None:
        result["communicator"] = pipeline.communicator.resolve(size).name
        if result["communicator"] == "alltoall":  # the cost model's input (scripts/tools/cost_model.py)
            from grace.communicators.alltoall import owner_share

            result["owner_share"] = owner_share(pipeline.compressor)
        result["received_per_step"] = float(np.mean([e["received_per_step"] for e in epochs]))
    wire = [e["wire_bytes_per_step"] for e in epochs if "wire_bytes_per_step" in e]
    if wire:
        result["wire_bytes_per_step"] = float(np.mean(wire))
    if loop is not None:
        result["loop"] = loop
    if weights is not None:
        import hashlib

        result["weights_sha256"] = hashlib.sha256(b"".join(
            np.ascontiguousarray(w).tobytes() for w in weights())).hexdigest()
        if gather is not None:
            result["workers_agree"] = len(set(gather(result["weights_sha256"]))) == 1
    if rank == 0:
        print("RESULT " + json.dumps(result), flush=True)


def main(argv=None):
    args = parse_args(argv)
    spec = args.compression
    if spec in torch_hooks.HOOKS and args.framework != "ddp":
        raise SystemExit(f"--compression {spec}: PyTorch's DDP hooks run with --framework ddp")
    if spec == "hvd-fp16" and args.framework == "ddp":
        raise SystemExit("--compression hvd-fp16 is Horovod's; under DDP, torch-fp16 is PyTorch's")
    if args.loop != "step" and args.framework != "tf":
        raise SystemExit(f"--loop {args.loop} is TensorFlow's (--framework tf)")
    if spec not in ("fp32", "hvd-fp16", *torch_hooks.HOOKS):
        spec = json.loads(spec)
    from grace import heap

    heap.keep_freed_memory()  # the baselines too: one heap for every run compared
    (run_tf if args.framework == "tf" else run_torch)(args, spec)
    if args.framework == "ddp":
        close_ddp()


def close_ddp() -> None:
    """Ends the process group once DDP's model is gone (its reducer holds the group): a Gloo group
    still alive when the interpreter exits can abort the process ("terminate called without an
    active exception"), which torchrun reports as the run's failure."""
    import gc

    import torch.distributed as dist

    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
