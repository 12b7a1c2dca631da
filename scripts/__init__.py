"""The benchmark harness, run from the checkout as ``python -m scripts.<name>``: the emulated
cluster, the side-by-side comparison and its workers, the workloads, the quality benchmark and
the plots; ``scripts.tools`` holds what is built on it, ``scripts.studies`` one-off studies."""

import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
"""The checkout this package belongs to."""
