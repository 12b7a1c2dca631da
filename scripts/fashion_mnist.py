"""Fashion-MNIST from Debian's ``dataset-fashion-mnist`` package (IDX files, read with numpy)."""

from __future__ import annotations

import gzip
import os

import numpy as np

DATA_DIR = os.environ.get("FASHION_MNIST_DIR", "/usr/share/datasets/fashion-mnist")
FILES = {"train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
         "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")}
CLASSES = ("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker",
           "Bag", "Ankle boot")


def _read_idx(path: str) -> np.ndarray:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        data = f.read()
    if data[:2] != b"\x00\x00" or data[2] != 0x08:
        raise ValueError(f"{path} is not an IDX file of unsigned bytes")
    ndim = data[3]
    dims = [int.from_bytes(data[4 + 4 * i: 8 + 4 * i], "big") for i in range(ndim)]
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim).reshape(dims)


def _find(name: str, data_dir: str) -> str:
    for candidate in (name + ".gz", name):
        path = os.path.join(data_dir, candidate)
        if os.path.exists(path):
            return path
    raise FileNotFoundError(
        f"Fashion-MNIST file {name}[.gz] not found in {data_dir}. Install Debian's package "
        f"(`apt-get install dataset-fashion-mnist`, which `make setup` does) or set "
        f"FASHION_MNIST_DIR to a folder holding the four IDX files.")


def raw(split: str = "train", data_dir: str = DATA_DIR) -> tuple[np.ndarray, np.ndarray]:
    """Images as uint8 (N, 28, 28) and labels as uint8 (N,), as ``keras.datasets.mnist`` gives
    MNIST's."""
    if split not in FILES:
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    images_file, labels_file = FILES[split]
    return _read_idx(_find(images_file, data_dir)), _read_idx(_find(labels_file, data_dir))


def load(split: str = "train", data_dir: str = DATA_DIR) -> tuple[np.ndarray, np.ndarray]:
    """Images as float32 (N, 784), standardised, and labels as int64 (N,)."""
    if split not in FILES:
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    images_file, labels_file = FILES[split]
    images = _read_idx(_find(images_file, data_dir)).reshape(-1, 28 * 28).astype(np.float32)
    labels = _read_idx(_find(labels_file, data_dir)).astype(np.int64)
    images = (images / 255.0 - 0.2860) / 0.3530  # the training set's mean and std
    return images, labels
