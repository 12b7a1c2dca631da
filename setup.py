import os

from setuptools import find_packages, setup

setup(
    name="grace-compression",
    version="0.1.0",
    description="Gradient compression for Horovod, written once for PyTorch and TensorFlow",
    packages=find_packages(include=["grace", "grace.*", "frameworks", "frameworks.*"]),
    # The C loops, compiled on first use: the shared steps, and each compressor's own beside it.
    package_data={"grace.native": ["kernels.c", "common.h"], "grace.compressors": ["*.c"]},
    python_requires=">=3.9",
    install_requires=["numpy"],
    extras_require={"progress": ["tqdm"], "plots": ["matplotlib"],
                    "lightning": ["pytorch-lightning>=2.0"]},
    # The adapters register themselves with the core (grace/adapters.py), which names none of them.
    entry_points=open(os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                   "grace-entry-points.cfg")).read(),
)
