"""The study behind docs/quality.md, "Two-bit quantization": how unevenly the mnist MLP's gradients
spread along each weight tensor. For each weight's gradient at a few steps of SGD + momentum
training (PyTorch, one process, seed 0): the share of its buckets of 512 consecutive elements whose
root mean square is below a quarter of the whole tensor's, and the share of those buckets'
elements that reach one threshold of the tensor's root mean square.

    .venv/bin/python -m scripts.studies.twobit_bucket_scale      # from the repository root
"""


import numpy as np
import torch

from scripts import workloads

BUCKET = 512


def main() -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    images, labels, _, _ = workloads.fashion_mnist()
    images, labels = torch.from_numpy(images), torch.from_numpy(labels).long()
    model = torch.nn.Sequential(torch.nn.Linear(784, 512), torch.nn.ReLU(), torch.nn.Linear(512, 256),
                                torch.nn.ReLU(), torch.nn.Linear(256, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    rng = np.random.default_rng(0)
    for step in range(2001):
        idx = torch.from_numpy(rng.integers(0, len(images), 64))
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(images[idx]), labels[idx]).backward()
        if step in (0, 100, 1000, 2000):
            for name, p in model.named_parameters():
                g = p.grad.detach().reshape(-1).numpy().astype(np.float64)
                if g.size < 2 * BUCKET:
                    continue
                n = -(-g.size // BUCKET)
                rows = np.concatenate([g, np.zeros(n * BUCKET - g.size)]).reshape(n, BUCKET)
                rms, whole = np.sqrt((rows ** 2).mean(1)), np.sqrt((g ** 2).mean())
                quiet = rms < whole / 4
                reach = (np.abs(rows[quiet]) >= whole).mean() if quiet.any() else float("nan")
                print(f"step {step:5d} {name:8s} {n:4d} buckets: {quiet.mean():.2f} below a quarter of the "
                      f"tensor's root mean square; {reach:.4f} of their elements at or beyond it")
        opt.step()


if __name__ == "__main__":
    main()
