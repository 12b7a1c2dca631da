"""The compressor catalogue: one module per algorithm, each written once against ``grace.ops.Ops``."""

from grace.compressors.adaq import AdaQ
from grace.compressors.cast import BF16, FP16
from grace.compressors.dgc import DGC
from grace.compressors.inceptionn import Inceptionn
from grace.compressors.natural import Natural
from grace.compressors.none import NoneCompressor
from grace.compressors.powersgd import PowerSGD
from grace.compressors.qsgd import QSGD
from grace.compressors.randomk import RandomK
from grace.compressors.sign import EFSignSGD, OneBit, SignSGD, Signum
from grace.compressors.sketch import Sketch
from grace.compressors.terngrad import TernGrad
from grace.compressors.threshold import Threshold
from grace.compressors.topk import TopK
from grace.compressors.twobit import TwoBit
from grace.compressors.u8bit import U8bit

CATALOGUE = (NoneCompressor, FP16, BF16, TopK, RandomK, Threshold, DGC, QSGD, TernGrad, OneBit,
             SignSGD, Signum, EFSignSGD, Natural, PowerSGD, U8bit, Sketch, AdaQ, Inceptionn, TwoBit)

__all__ = [cls.__name__ for cls in CATALOGUE] + ["CATALOGUE"]
