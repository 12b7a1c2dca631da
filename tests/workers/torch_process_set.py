"""Worker for tests/test_horovod_torch.py: grace in a Horovod process set. Three workers; ranks 0 and
1 train common.py's model with top-k in the set {0, 1}, rank 2 takes no part, and the set's result
must be that of a 2-worker job.

    horovodrun -np 3 python tests/workers/torch_process_set.py OUTDIR"""

from __future__ import annotations

import os
import sys

import horovod.torch as hvd
import numpy as np
import torch

import grace
from tests.workers.common import LR, torch_linear, train_linear

outdir = sys.argv[1]
torch.set_num_threads(1)
pair = hvd.ProcessSet([0, 1])
hvd.init(process_sets=[pair])
rank = hvd.rank()
model = torch_linear()
if pair.included():
    compression = grace.topk(0.05)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR),
                                         named_parameters=model.named_parameters(),
                                         compression=compression, process_set=pair)
    train_linear(model, optimizer, rank, 10)
np.savez(os.path.join(outdir, f"process_set.rank{rank}.npz"), w=model.weight.detach().numpy(),
         b=model.bias.detach().numpy())
hvd.allreduce(torch.zeros(1), name="done")  # every worker, the set's and the others, ends together
