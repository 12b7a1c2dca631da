"""Worker for tests/test_docs_examples.py: runs every ```python example of a docs page, in order, each
as a script of its own (``runpy``, ``__main__``), and saves what each left behind: its ``model``'s
weights, else its ``variables``' values, else nothing but a mark that it ran.

Run by ``horovodrun -np 2 python tests/workers/docs_examples.py PAGE OUTDIR``."""

from __future__ import annotations

import json
import os
import re
import runpy
import sys

import horovod.tensorflow as hvd
import keras
import numpy as np

page, outdir = sys.argv[1], sys.argv[2]
hvd.init()
rank = hvd.rank()
with open(page) as f:
    examples = re.findall(r"^```python\n(.*?)^```", f.read(), re.S | re.M)
for i, code in enumerate(examples):
    path = os.path.join(outdir, f"example{i}.rank{rank}.py")  # a file, so that AutoGraph reads it
    with open(path, "w") as f:
        f.write(code)
    keras.utils.set_random_seed(1000 + rank)  # each worker its own initial weights
    names = runpy.run_path(path, run_name="__main__")
    if "model" in names:
        arrays = [np.asarray(w) for w in names["model"].get_weights()]
    else:
        arrays = [np.asarray(v.numpy()) for v in names.get("variables", [])]
    np.savez(os.path.join(outdir, f"example{i}.rank{rank}.npz"), *arrays)
    pipeline = names.get("compression", getattr(names.get("opt"), "_grace_pipeline", None))
    with open(os.path.join(outdir, f"example{i}.rank{rank}.json"), "w") as f:
        json.dump({"stats": pipeline.stats() if hasattr(pipeline, "stats") else None}, f)
with open(os.path.join(outdir, f"ran.rank{rank}.json"), "w") as f:
    json.dump({"examples": len(examples)}, f)
