"""The compressor catalogue: one module per algorithm, each written once against ``grace.ops.Ops``."""

from grace.compressors.cast import FP16
from grace.compressors.none import NoneCompressor
from grace.compressors.randomk import RandomK
from grace.compressors.topk import TopK

__all__ = ["NoneCompressor", "FP16", "TopK", "RandomK"]
