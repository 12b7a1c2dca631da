"""Worker for tests/test_elastic.py: a real Horovod elastic job whose workers leave and join.

    horovodrun -np 3 --min-np 2 --max-np 3 --host-discovery-script OUTDIR/discover.sh \
        python tests/workers/torch_elastic.py OUTDIR COMPRESSION

The discovery script prints the lines of ``OUTDIR/hosts``: ``localhost:2`` and ``127.0.0.1:1`` at
the start (3 workers). Rank 0 rewrites the file after step 4 without ``127.0.0.1`` (its worker is
removed: 2 workers) and after step 8 with it again (a new worker joins: 3), and the job trains to
step 12. Each time, the workers wait at the same step, checking for the update, so that the job's
course does not depend on when the driver's discovery runs.

Every worker writes one JSON line per event to ``OUTDIR/log.<pid>``: ``sync`` once the state is
synchronized (after the start and after each reset: the size, the step, a digest of this worker's
compression state as it was at its last commit and as it is after the sync), and ``step`` for
every step: the size, a digest of the weights, and the largest difference between the weights'
change and ``-lr`` x the mean over the workers of what each sent, gathered from every worker: its
gradient for ``none``; for ``topk``, what a numpy model of top-k with error feedback sends, whose
residual starts at zero when the worker starts and is kept across resets; and the control bytes
the step's votes took (the sparse-gradient vote among them).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time

import horovod.torch as hvd
import numpy as np
import torch

import grace
from tests import reference

outdir, compression = sys.argv[1], sys.argv[2]  # "topk" (top-k(0.3), error feedback) or "none"
STEPS, LEAVE, JOIN, LR = 12, 4, 8, 0.1
LOG = os.path.join(outdir, f"log.{os.getpid()}")
HOSTS = os.path.join(outdir, "hosts")
torch.set_num_threads(1)
hvd.init()

model = torch.nn.Linear(16, 4, bias=False)
base = torch.optim.SGD(model.parameters(), lr=LR)
optimizer = hvd.DistributedOptimizer(base, named_parameters=model.named_parameters(),
                                     compression=grace.topk(0.3, min_numel=0) if compression == "topk"
                                     else grace.none())


def log(**event) -> None:
    with open(LOG, "a") as f:
        f.write(json.dumps(event) + "\n")


def digest() -> str:
    """A digest of this worker's compression state (its memory's tensors, as checkpoints hold it)."""
    h = hashlib.sha256()
    for name, held in sorted(optimizer.state_dict()["grace"]["memory"].get("residuals", {}).items()):
        h.update(name.encode() + held.detach().numpy().tobytes())
    return h.hexdigest()[:16]


reference_sent = reference.topk_with_residual(0.3)  # this worker's residual, in numpy


def wait_for_hosts_update(state) -> None:
    """Every worker checks, at the same step, until the driver's update reaches them all at once
    (``check_host_updates`` agrees across workers); a minute without one fails the job."""
    for _ in range(600):
        time.sleep(0.1)
        state.check_host_updates()
    raise RuntimeError(f"no hosts update within a minute at step {state.step}")


committed = None  # this worker's compression state at its last commit (its own: not synchronized)


@hvd.elastic.run
def train(state):
    global committed
    log(event="sync", rank=hvd.rank(), size=hvd.size(), step=state.step, committed=committed,
        now=digest())
    while state.step < STEPS:
        for when, hosts in ((LEAVE, "localhost:2\n"), (JOIN, "localhost:2\n127.0.0.1:1\n")):
            if state.step == when and state.moved < when:
                state.moved = when
                state.save()  # what the sync after the reset restores: the move is made
                if hvd.rank() == 0:
                    with open(HOSTS, "w") as f:
                        f.write(hosts)
                wait_for_hosts_update(state)
        # This worker's batch: its own for each step and place in the job.
        gen = torch.Generator().manual_seed(1000 * state.step + hvd.rank())
        x, y = torch.randn(8, 16, generator=gen), torch.randn(8, 4, generator=gen)
        before_w = model.weight.detach().clone()
        # The gradient, computed apart: the hooks' exchange may work in p.grad once backward runs.
        w = before_w.clone().requires_grad_()
        g = torch.autograd.grad(torch.nn.functional.mse_loss(x @ w.T, y), w)[0].numpy()
        control = optimizer.compression_stats()["bytes_control"]
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        control = optimizer.compression_stats()["bytes_control"] - control  # the votes' bytes
        sent = reference_sent("weight", 0, state.step, g) if compression == "topk" else g
        every = hvd.allgather(torch.from_numpy(sent)[None], name=f"sent.{state.step}").numpy()
        expected = before_w.numpy() - LR * every.mean(axis=0)
        log(event="step", rank=hvd.rank(), size=hvd.size(), step=state.step,
            error=float(np.abs(model.weight.detach().numpy() - expected).max()), control=control,
            weights=hashlib.sha256(model.weight.detach().numpy().tobytes()).hexdigest()[:16])
        state.step += 1
        committed = digest()
        state.commit()


train(hvd.elastic.TorchState(model=model, optimizer=optimizer, step=0, moved=0))
