"""Worker for tests/test_momentum.py: the wrapped optimizer's momentum taken over by the compressors
that apply it themselves, on common.py's linear model, 2 workers.

    horovodrun -np 2 python tests/workers/torch_momentum.py OUTDIR

Each scenario saves each rank's final weights, the optimizer's settings after wrapping and after
training, and the error message where the wrapper must refuse."""

from __future__ import annotations

import json
import os
import sys
import warnings

import horovod.torch as hvd
import numpy as np
import torch

import grace
from tests.workers.common import LR, batch, torch_linear, train_linear

MOMENTUM = 0.9
SCENARIOS = {
    # name: (compression, optimizer)
    "dgc": (lambda: grace.dgc(0.05, sample_ratio=1.0), lambda p: torch.optim.SGD(p, LR, MOMENTUM)),
    # The momentum given to DGC over an SGD without one: what the wrapper takes over in "dgc",
    # given instead; b, which travels dense, gets it too.
    "dgc_given": (lambda: grace.dgc(0.05, sample_ratio=1.0, momentum=MOMENTUM),
                  lambda p: torch.optim.SGD(p, LR)),
    "dgc_nesterov": (lambda: grace.dgc(0.05, sample_ratio=1.0),
                     lambda p: torch.optim.SGD(p, LR, MOMENTUM, nesterov=True)),
    # Top-k at its defaults: error feedback on the velocity, SGD's momentum taken over.
    "topk": (lambda: grace.topk(0.05), lambda p: torch.optim.SGD(p, LR, MOMENTUM)),
    "randomk": (lambda: grace.randomk(0.05, seed=3, min_kept=1), lambda p: torch.optim.SGD(p, LR, MOMENTUM)),
    # Plain error feedback owns no momentum: the optimizer keeps its own, after the exchange.
    "topk_residual": (lambda: grace.topk(0.05, memory="residual"),
                      lambda p: torch.optim.SGD(p, LR, MOMENTUM)),
    "dgc_warmup": (lambda: grace.dgc(0.05, sample_ratio=1.0, warmup_steps=4),
                   lambda p: torch.optim.SGD(p, LR, MOMENTUM)),
    "signum_adam": (lambda: grace.signum(), lambda p: torch.optim.Adam(p, 0.01)),
    "dgc_adam": (lambda: grace.dgc(0.05, sample_ratio=1.0), lambda p: torch.optim.Adam(p, 0.01)),
    "onebit_adam": (lambda: grace.onebit(), lambda p: torch.optim.Adam(p, 0.01)),
    "randomk_adam": (lambda: grace.randomk(0.05, seed=3, min_kept=1), lambda p: torch.optim.Adam(p, 0.01)),
    "randomk_adamw": (lambda: grace.randomk(0.05, seed=3, min_kept=1),
                      lambda p: torch.optim.AdamW(p, 0.01, weight_decay=0.5)),
    "randomk_amsgrad": (lambda: grace.randomk(0.05, seed=3, min_kept=1),
                        lambda p: torch.optim.Adam(p, 0.01, amsgrad=True)),
    # Clipped between synchronize() and step(): the updates, not gradients (a warning says so).
    "randomk_adam_clipped": (lambda: grace.randomk(0.05, seed=3, min_kept=1),
                             lambda p: torch.optim.Adam(p, 0.01)),
    # Each worker its own momentum, then rank 0's for all by hvd.broadcast_optimizer_state.
    "dgc_broadcast": (lambda: grace.dgc(0.05, sample_ratio=1.0),
                      lambda p: torch.optim.SGD(p, LR, MOMENTUM if rank == 0 else 0.5)),
    "conflict": (lambda: grace.dgc(0.05, momentum=0.5), lambda p: torch.optim.SGD(p, LR, MOMENTUM)),
    # keep_optimizer=True: the optimizer's momentum stays the optimizer's, on every tensor.
    "dgc_keep_optimizer": (lambda: grace.dgc(0.05, sample_ratio=1.0, keep_optimizer=True),
                           lambda p: torch.optim.SGD(p, LR, MOMENTUM)),
    "topk_keep_optimizer": (lambda: grace.topk(0.05, keep_optimizer=True),
                            lambda p: torch.optim.SGD(p, LR, MOMENTUM)),
    "randomk_keep_optimizer": (lambda: grace.randomk(0.05, seed=3, min_kept=1, keep_optimizer=True),
                               lambda p: torch.optim.SGD(p, LR, MOMENTUM)),
    # What is said at construction or at the first step: a sign method's rate far above what it
    # needs (signSGD at SGD's 0.1), and signum's own beta kept over an SGD without momentum (at
    # the rate it needs, about which nothing is said).
    "signsgd_sgd": (lambda: grace.signsgd(), lambda p: torch.optim.SGD(p, LR)),
    "signum_sgd": (lambda: grace.signum(), lambda p: torch.optim.SGD(p, 1e-4)),
    "groups_differ": (lambda: grace.dgc(0.05),
                      lambda p: torch.optim.SGD([{"params": [p[0]], "momentum": 0.9},
                                                 {"params": [p[1]], "momentum": 0.5}], LR)),
}

outdir = sys.argv[1]
torch.set_num_threads(1)
hvd.init()
rank = hvd.rank()

for name, (make_compression, make_optimizer) in SCENARIOS.items():
    model = torch_linear()
    info = {}
    try:
        optimizer = hvd.DistributedOptimizer(make_optimizer([model.weight, model.bias]),
                                             named_parameters=model.named_parameters(),
                                             compression=make_compression())
    except ValueError as e:
        info["error"] = str(e)
    else:
        group = optimizer.param_groups[0]
        info.update(momentum=group.get("momentum"), betas=group.get("betas"),
                    config=repr(optimizer._pipeline))
        if name == "dgc_broadcast":
            hvd.broadcast_optimizer_state(optimizer, root_rank=0)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if name == "randomk_adam_clipped":
                for step in range(3):
                    x, y = (torch.from_numpy(a) for a in batch(rank, step))
                    optimizer.zero_grad()
                    torch.nn.functional.mse_loss(model(x), y).backward()
                    optimizer.synchronize()
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                    with optimizer.skip_synchronize():
                        optimizer.step()
            else:
                train_linear(model, optimizer, rank, 10)
        info["warnings"] = [str(w.message) for w in caught if str(w.message).startswith("grace:")]
        info.update(momentum_after=group.get("momentum"), betas_after=group.get("betas"),
                    config_after=repr(optimizer._pipeline),
                    stepped_by_optimizer=sorted(optimizer._parameter_names[p] for p in optimizer.state),
                    moments=sorted(optimizer.state_dict()["grace"]["moments"]))
    np.savez(os.path.join(outdir, f"{name}.rank{rank}.npz"), w=model.weight.detach().numpy(),
             b=model.bias.detach().numpy())
    with open(os.path.join(outdir, f"{name}.rank{rank}.json"), "w") as f:
        json.dump(info, f)
