"""Horovod's own TensorFlow 2 examples (``examples/tensorflow2/`` of a Horovod source checkout, not
shipped in its sdist), run with their compression line changed to grace, on 2 Gloo workers.

    .venv/bin/python -m scripts.tools.horovod_examples /path/to/horovod/examples/tensorflow2 \\
        --compressors horovod-none,horovod-fp16,topk,powersgd

Each example is copied to a temporary folder and changed there, by exact text substitutions that fail
loudly if Horovod's text has moved:

- the compression: ``compression=grace.<name>()`` where the example passes Horovod's (or none);
  ``horovod-none`` and ``horovod-fp16`` keep Horovod's own ``hvd.Compression.none`` / ``.fp16``,
  the baselines (they run through Horovod's own code, with ``import grace``'s Keras 3 mends);
- what Keras 3 itself requires of user code: ``opt.variables`` is a list, not a method;
  ``ModelCheckpoint`` writes ``.keras`` files; ``compile`` takes no ``experimental_run_tf_function``;
- what this machine requires: MNIST comes from Debian's Fashion-MNIST files (nothing downloads),
  no GPU (``--no-cuda`` or none visible), the synthetic benchmark's images at ``--image-size`` and
  the number of steps cut to ``--steps`` (a smoke run, not a benchmark).

Prints a line per (example, compression): whether it exited 0, and its last line of output;
``--out FILE.md`` writes the table of which ran (``--from-output`` makes it from such printed lines).
The examples' own throughput figures are smoke-run figures, not a benchmark: they are not kept.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile

import grace
from scripts import ROOT

# Debian's Fashion-MNIST as ``tf.keras.datasets.mnist.load_data`` returns MNIST (the examples read
# only the train split).
OFFLINE_MNIST = "(__import__('scripts.fashion_mnist', fromlist=['raw']).raw('train'), None)"


def compression_expression(name: str) -> str:
    """The Python expression an example's compression line gets for ``name`` (``horovod-none``,
    ``horovod-fp16``: Horovod's own; else ``grace.<name>()``)."""
    if name == "horovod-none":
        return "hvd.Compression.none"
    if name == "horovod-fp16":
        return "hvd.Compression.fp16"
    if name not in grace.available():
        raise SystemExit(f"--compressors: {name!r} is not one of horovod-none, horovod-fp16, "
                         f"{', '.join(grace.available())}")
    return f"grace.{name}()"


def edits(example: str, compression: str, steps: int, image_size: int) -> list[tuple[str, str]]:
    """(Horovod's text, the replacement) for ``example``; each must occur in the file."""
    keras3 = [("opt.variables()", "opt.variables")]  # where the example calls it (OPTIONAL)
    if example == "tensorflow2_synthetic_benchmark.py":
        return [
            ("import horovod.tensorflow as hvd\n", "import horovod.tensorflow as hvd\nimport grace\n"),
            ("compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none",
             f"compression = {compression}"),
            ("(weights=None)", f"(weights=None, input_shape=({image_size}, {image_size}, 3))"),
            ("[args.batch_size, 224, 224, 3]", f"[args.batch_size, {image_size}, {image_size}, 3]"),
            *keras3]
    if example == "tensorflow2_mnist.py":
        return [
            ("import horovod.tensorflow as hvd\n", "import horovod.tensorflow as hvd\nimport grace\n"),
            ("hvd.DistributedGradientTape(tape)",
             f"hvd.DistributedGradientTape(tape, compression={compression})"),
            ("tf.keras.datasets.mnist.load_data(path='mnist-%d.npz' % hvd.rank())", OFFLINE_MNIST),
            ("dataset.take(10000 // hvd.size())", f"dataset.take({steps})"),
            ("checkpoint.save(checkpoint_dir)", "None"),
            *keras3]
    if example == "tensorflow2_keras_mnist.py":
        return [
            ("import horovod.tensorflow.keras as hvd\n",
             "import horovod.tensorflow.keras as hvd\nimport grace\n"),
            ("opt, backward_passes_per_step=1, average_aggregated_gradients=True)",
             f"opt, backward_passes_per_step=1, average_aggregated_gradients=True, "
             f"compression={compression})"),
            ("tf.keras.datasets.mnist.load_data(path='mnist-%d.npz' % hvd.rank())", OFFLINE_MNIST),
            (",\n                        experimental_run_tf_function=False)", ")"),
            ("'./checkpoint-{epoch}.h5'", "'./checkpoint-{epoch}.keras'"),
            ("steps_per_epoch=500 // hvd.size(), callbacks=callbacks, epochs=24",
             f"steps_per_epoch={steps}, callbacks=callbacks, epochs=2"),
            *keras3]
    raise SystemExit(f"no edits known for {example}")


OPTIONAL = {"opt.variables()"}

ARGS = {"tensorflow2_synthetic_benchmark.py": ["--no-cuda", "--batch-size", "4",
                                               "--num-warmup-batches", "1", "--num-iters", "2",
                                               "--num-batches-per-iter", "2"]}


def changed(source: str, example: str, compression: str, steps: int, image_size: int) -> str:
    """``source`` with ``edits`` applied; a required text that is not there stops the run."""
    for old, new in edits(example, compression, steps, image_size):
        if old not in source and old not in OPTIONAL:
            raise SystemExit(f"{example}: Horovod's text {old!r} is not there (another Horovod "
                             "version?): nothing to change")
        source = source.replace(old, new)
    return source


def parse_line(line: str) -> tuple[str, str, bool] | None:
    """(example, compression, ran) from a line this script printed, else ``None``."""
    parts = line.split()
    if len(parts) < 3 or not parts[0].endswith(".py") or parts[2] not in ("ok", "FAILED"):
        return None
    return parts[0], parts[1], parts[2] == "ok"


def markdown(results: list[tuple[str, str, bool]]) -> str:
    """A row per compression, a column per example: ``ok``, ``fails``, or empty where not run."""
    examples = list(dict.fromkeys(r[0] for r in results))
    names = list(dict.fromkeys(r[1] for r in results))
    ran = {(e, n): ok for e, n, ok in results}
    lines = ["| compression | " + " | ".join(f"`{e}`" for e in examples) + " |",
             "|---|" + "---|" * len(examples)]
    for name in names:
        cells = [("ok" if ran[(e, name)] else "fails") if (e, name) in ran else "" for e in examples]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    """Run each example with each compression on 2 Gloo workers (or, ``--from-output``, make the
    table from printed lines); exit 1 if any failed."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("examples", help="examples/tensorflow2 of a Horovod source checkout")
    parser.add_argument("--compressors", default="horovod-none,horovod-fp16," + ",".join(
        grace.available()))
    parser.add_argument("--examples", dest="names", default="tensorflow2_synthetic_benchmark.py,"
                        "tensorflow2_mnist.py,tensorflow2_keras_mnist.py")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--image-size", type=int, default=64)
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--out", default=None, help="a markdown table of which ran")
    parser.add_argument("--from-output", nargs="+", default=None, metavar="FILE",
                        help="no runs: the table from this script's printed lines")
    args = parser.parse_args(argv)
    if args.from_output:
        results = []
        for path in args.from_output:
            with open(path) as f:
                results += [r for r in map(parse_line, f) if r is not None]
        text = markdown(results)
        if args.out:
            with open(args.out, "w") as f:
                f.write(text)
        print(text, end="")
        return 0
    compressions = [(c, compression_expression(c)) for c in args.compressors.split(",")]
    env = dict(os.environ, PYTHONPATH=ROOT, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1",
               TF_CPP_MIN_LOG_LEVEL="2", OMPI_ALLOW_RUN_AS_ROOT="1",
               OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    horovodrun = os.path.join(os.path.dirname(sys.executable), "horovodrun")
    failures, results = 0, []
    for example in args.names.split(","):
        with open(os.path.join(args.examples, example)) as f:
            source = f.read()
        for name, expression in compressions:
            work = tempfile.mkdtemp(prefix="grace-example-")
            try:
                path = os.path.join(work, example)
                with open(path, "w") as f:
                    f.write(changed(source, example, expression, args.steps, args.image_size))
                proc = subprocess.run([horovodrun, "-np", "2", "-H", "localhost:2", "--gloo",
                                       sys.executable, path, *ARGS.get(example, [])], cwd=work,
                                      env=env, capture_output=True, text=True, timeout=args.timeout)
                lines = [line for line in proc.stdout.splitlines() if line.startswith("[0]<stdout>")]
                last = lines[-1].split(">:", 1)[1].strip() if lines else ""
                if proc.returncode != 0:
                    failures += 1
                    last = (proc.stdout + proc.stderr).strip().splitlines()[-1][:200]
                print(f"{example:36} {name:14} {'ok' if proc.returncode == 0 else 'FAILED':6} {last}",
                      flush=True)
                results.append((example, name, proc.returncode == 0))
            finally:
                shutil.rmtree(work, ignore_errors=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write(markdown(results))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
