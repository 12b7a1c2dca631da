"""Where grace makes the host wait for the GPU: one DDP step of ResNet-50 on CUDA per compressor
under ``torch.cuda.set_sync_debug_mode("warn")``, which flags every operation that synchronizes
(``.item()``, ``nonzero``, a copy to the host, ...). Each flag is traced back to the line of grace
that caused it; the output counts them per compressor and line.

A synchronization inside the hook stops the host until the GPU has caught up with the backward pass
so far: the host can no longer queue the rest of backward ahead of the GPU, and the GPU idles while
the host works. On one H200 such waits took grace's top-k hook to 0.28 of DDP's own img/s
(docs/ddp.md).

    python -m scripts.tools.find_syncs --compressors fp16,topk,qsgd --json out/syncs.json
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import tempfile
import traceback
import warnings

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import grace
from scripts import ROOT
from scripts.resnet import ResNet50

OURS = (os.path.join(ROOT, "grace"), os.path.join(ROOT, "frameworks"))


def _where(stack) -> str:
    """The innermost frame of grace's code in ``stack``, with the one that called it."""
    ours = [f for f in stack if f.filename.startswith(OURS)]
    if not ours:
        return "outside grace"
    inner = ours[-1]
    outer = ours[-2] if len(ours) > 1 else None
    here = f"{os.path.relpath(inner.filename, ROOT)}:{inner.lineno} {inner.name}"
    if outer is not None:
        here += f" <- {os.path.relpath(outer.filename, ROOT)}:{outer.lineno} {outer.name}"
    return here


def syncs_of(name: str, images, labels) -> collections.Counter:
    model = ResNet50().cuda()
    ddp = DDP(model, device_ids=[0])
    ddp.register_comm_hook(grace.build(name), grace.ddp_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def step():
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ddp(images), labels).backward()
        opt.step()

    for _ in range(3):  # past DDP's bucket rebuild and any warm-up
        step()
    torch.cuda.synchronize()
    found: collections.Counter = collections.Counter()
    shown = warnings.showwarning

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" in str(message):
            found[_where(traceback.extract_stack()[:-1])] += 1
        else:
            shown(message, category, filename, lineno, file, line)
    warnings.showwarning = record
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = record
            torch.cuda.set_sync_debug_mode("warn")
            step()
            torch.cuda.set_sync_debug_mode("default")
    finally:
        warnings.showwarning = shown
    torch.cuda.synchronize()
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--compressors", default=",".join(grace.available()))
    parser.add_argument("--json", help="write the counts to this file")
    args = parser.parse_args()
    store = tempfile.mktemp(prefix="grace-syncs-")
    dist.init_process_group("nccl", init_method=f"file://{store}", rank=0, world_size=1)
    torch.manual_seed(0)
    images = torch.randn(8, 3, 64, 64, device="cuda")
    labels = torch.randint(0, 1000, (8,), device="cuda")
    result = {}
    for name in args.compressors.split(","):
        found = syncs_of(name, images, labels)
        result[name] = dict(found.most_common())
        print(f"{name}: {sum(found.values())} synchronizations in one step")
        for where, count in found.most_common(8):
            print(f"  {count:5d}  {where}")
    dist.destroy_process_group()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
