"""Worker for tests/test_reliability.py: parameters of every awkward kind, through several
compressors, on 2 workers.

    horovodrun -np 2 python tests/workers/torch_edges.py OUTDIR"""

from __future__ import annotations

import os
import sys

import horovod.torch as hvd
import numpy as np
import torch

import grace

outdir = sys.argv[1]
torch.set_num_threads(1)
hvd.init()
rank = hvd.rank()


class Awkward(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.scalar = torch.nn.Parameter(torch.tensor(0.5))                 # 0-d
        self.single = torch.nn.Parameter(torch.tensor([0.25]))              # one element
        self.empty = torch.nn.Parameter(torch.zeros(0, 4))                  # no elements
        self.transposed = torch.nn.Parameter(torch.randn(1500, 8).t())      # non-contiguous
        self.fp16_weight = torch.nn.Parameter(torch.randn(2000, dtype=torch.float16) * 0.1)
        self.bf16_weight = torch.nn.Parameter(torch.randn(2000, dtype=torch.bfloat16) * 0.1)
        self.fp64_weight = torch.nn.Parameter(torch.randn(3000, dtype=torch.float64) * 0.1)
        self.embedding = torch.nn.Embedding(300, 8, sparse=True)            # sparse gradients
        self.frozen = torch.nn.Linear(8, 8)
        self.frozen.requires_grad_(False)

    def forward(self, x, ids):
        h = x @ self.transposed[:, :8].t()
        h = self.frozen(h[:, :8]) * self.scalar + self.single
        out = h.sum() + self.empty.sum() + self.embedding(ids).sum()
        out = out + (self.fp16_weight.float() ** 2).sum() + (self.bf16_weight.float() ** 2).sum()
        return out + (self.fp64_weight ** 2).sum().float()


for name, sparse_as_dense in [(n, d) for n in ("topk", "qsgd", "powersgd", "signum", "none")
                              for d in (True, False)]:
    tag = name if sparse_as_dense else f"{name}.sparse"
    torch.manual_seed(0)
    model = Awkward()
    assert not model.transposed.is_contiguous()
    frozen_before = model.frozen.weight.detach().clone()
    np.savez(os.path.join(outdir, f"{tag}.start.rank{rank}.npz"),
             **{k: v.detach().float().numpy() for k, v in model.named_parameters()})
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                         named_parameters=model.named_parameters(),
                                         compression=grace.build(name, min_numel=0),
                                         sparse_as_dense=sparse_as_dense)
    rng = np.random.default_rng(rank)
    for step in range(4):
        x = torch.from_numpy(rng.standard_normal((4, 8)).astype(np.float32))
        ids = torch.from_numpy(rng.integers(0, 300, 6))
        optimizer.zero_grad()
        model(x, ids).backward()
        optimizer.step()
    assert torch.equal(model.frozen.weight, frozen_before)
    np.savez(os.path.join(outdir, f"{tag}.rank{rank}.npz"),
             **{k: v.detach().float().numpy() for k, v in model.named_parameters()},
             dtypes=np.array([str(p.dtype) for p in model.parameters()]))
