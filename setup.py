from setuptools import find_packages, setup

setup(
    name="grace-compression",
    version="0.1.0",
    description="Gradient compression for Horovod, written once for PyTorch and TensorFlow",
    packages=find_packages(include=["grace", "grace.*", "frameworks", "frameworks.*"]),
    package_data={"grace.native": ["kernels.c"]},
    python_requires=">=3.9",
    install_requires=["numpy"],
    extras_require={"progress": ["tqdm"], "plots": ["matplotlib"]},
)
