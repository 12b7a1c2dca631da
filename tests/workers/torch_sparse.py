"""Worker for tests/test_sparse_workers.py: sparse gradients (``nn.Embedding(sparse=True)``) through
``hvd.DistributedOptimizer`` with grace compression, on real workers.

    horovodrun -np 2 python tests/workers/torch_sparse.py OUTDIR

Writes OUTDIR/rank{r}.json with what each scenario measured; the test asserts on it."""

from __future__ import annotations

import json
import os
import sys

import horovod.torch as hvd
import numpy as np
import torch
from torch import nn

import grace
from tests.workers.sparse_model import (
    BAG,
    BATCH,
    CLASSES,
    LR,
    POSITION,
    TABLE,
    WIDTH,
    batch,
    initial_weights,
    numpy_run,
)

outdir = sys.argv[1]
torch.set_num_threads(1)
hvd.init()
rank, size = hvd.rank(), hvd.size()
report: dict = {}


# --- Horovod's own scenario (test/parallel/test_torch.py::test_sparse_embeddings) ----------------
def horovods_scenario(compression, sparse_as_dense: bool) -> np.ndarray:
    torch.manual_seed(0)
    model = nn.Embedding(10, 3, sparse=True)
    if rank == 0:
        inp = torch.LongTensor([[1, 2, 4, 5], [4, 3, 2, 9]])
    else:
        inp = torch.LongTensor([[1, 3, 4], [4, 7, 9]])
    opt = torch.optim.SparseAdam(list(model.parameters()), lr=0.1)
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                   compression=compression, sparse_as_dense=sparse_as_dense)
    loss = model(inp).sum()
    opt.zero_grad()
    loss.backward()
    opt.step()
    return model.weight.detach().numpy().copy()


report["horovod"] = {}
for sparse_as_dense in (False, True):
    reference = horovods_scenario(hvd.Compression.none, sparse_as_dense)
    for name in ("none", "fp16", "topk", "randomk", "powersgd"):
        weight = horovods_scenario(getattr(grace, name)(), sparse_as_dense)
        report["horovod"][f"{name}.{sparse_as_dense}"] = float(np.abs(weight - reference).max())


# --- an embedding model against a numpy model of the same exchange ------------------------------
class Bag(nn.Module):
    def __init__(self, rows: int = TABLE):
        super().__init__()
        self.embedding = nn.Embedding(rows, WIDTH, sparse=True)
        self.linear = nn.Linear(WIDTH, CLASSES, bias=False)
        table, linear = initial_weights()
        with torch.no_grad():
            self.embedding.weight[:TABLE] = torch.from_numpy(table)
            self.linear.weight.copy_(torch.from_numpy(linear))

    def forward(self, x):
        weights = torch.from_numpy(POSITION.astype(np.float32)).reshape(1, BAG, 1)
        return self.linear((self.embedding(x) * weights).sum(1))


def torch_run(steps: int, compression, resume_at: int | None = None, rows: int = TABLE):
    model = Bag(rows)

    def wrap(model):
        return hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR),
                                        named_parameters=model.named_parameters(),
                                        compression=compression())
    optimizer = wrap(model)
    bytes_sent = []
    for step in range(steps):
        if step == resume_at:  # a new process would do the same: fresh objects, saved state
            saved = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
            model = Bag(rows)
            model.load_state_dict(saved["model"])
            optimizer = wrap(model)
            optimizer.load_state_dict(saved["optimizer"])
        x, t = batch(step, rank)
        optimizer.zero_grad()
        counted = hasattr(optimizer, "compression_stats")  # not on Horovod's own optimizer
        before = optimizer.compression_stats()["bytes_sent"] if counted else 0
        loss = ((model(torch.from_numpy(x)) - torch.from_numpy(t)) ** 2).mean()
        loss.backward()  # the buckets start in backward's hooks
        optimizer.step()
        if counted:
            bytes_sent.append(optimizer.compression_stats()["bytes_sent"] - before)
    return (model.embedding.weight.detach().numpy().astype(np.float64),
            model.linear.weight.detach().numpy().astype(np.float64), optimizer, bytes_sent)


E_ref, W_ref = numpy_run(5, None, size)
E, W, optimizer, _ = torch_run(5, grace.none)
E_hvd, W_hvd, _, _ = torch_run(5, lambda: hvd.Compression.none)
report["none"] = {"embedding": float(np.abs(E - E_ref).max()), "linear": float(np.abs(W - W_ref).max()),
                  "horovod": float(max(np.abs(E - E_hvd).max(), np.abs(W - W_hvd).max()))}

E_ref, W_ref = numpy_run(5, 0.05, size)
E, W, optimizer, sent = torch_run(5, lambda: grace.topk(0.05))
stats = optimizer.compression_stats()
report["topk"] = {"embedding": float(np.abs(E - E_ref).max()), "linear": float(np.abs(W - W_ref).max()),
                  "bytes_sent": stats["bytes_sent"], "bytes_dense": stats["bytes_dense"],
                  "sent_per_step": sent}
state = optimizer.state_dict()["grace"]["rows"]
report["topk"]["residual_rows"] = int(state["row_indices"]["embedding.weight"].numel())

# The same lookups into a table 100 times larger: the same bytes.
report["topk"]["sent_per_step_large_table"] = torch_run(5, lambda: grace.topk(0.05), rows=100 * TABLE)[3]

E_full, W_full, _, _ = torch_run(8, lambda: grace.topk(0.05))
E_resumed, W_resumed, _, _ = torch_run(8, lambda: grace.topk(0.05), resume_at=4)
report["resume"] = float(max(np.abs(E_full - E_resumed).max(), np.abs(W_full - W_resumed).max()))

# A worker that makes no gradient for the table in a step (no lookup): the workers agreed at the
# first step that the table's gradient is sparse, so that worker takes part with no rows, at the
# first step as later.
model = Bag()
optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR),
                                     named_parameters=model.named_parameters(),
                                     compression=grace.topk(0.05))
for step in range(4):
    x, t = batch(step, rank)
    optimizer.zero_grad()
    if rank == 1 and step in (0, 2):
        loss = (model.linear(torch.ones(BATCH, WIDTH)) ** 2).mean()
    else:
        loss = ((model(torch.from_numpy(x)) - torch.from_numpy(t)) ** 2).mean()
    loss.backward()
    optimizer.step()
report["unused"] = [model.embedding.weight.detach().numpy().tolist()[:50],
                    model.linear.weight.detach().numpy().tolist()]

with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
    json.dump(report, f)
