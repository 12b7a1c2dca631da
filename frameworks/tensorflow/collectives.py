"""``grace.collectives.Collectives`` over Horovod's TensorFlow ops.

TensorFlow ops carry no handles: in eager mode each collective runs when issued, in a graph when the
graph runs (Horovod overlaps them there). ``synchronize`` therefore returns the op's output."""

from __future__ import annotations

import horovod.tensorflow as hvd
import tensorflow as tf
from horovod.tensorflow.mpi_ops import allgather, alltoall, broadcast

from frameworks import internals
from frameworks.process_set import ProcessSetCollectives
from frameworks.tensorflow.ops import TensorFlowOps
from grace.steps import bf16_rows_sum

_allreduce = internals.tf_allreduce()
_OPS = TensorFlowOps()


class HorovodCollectives(ProcessSetCollectives):
    horovod = hvd

    def __init__(self, process_set=None):
        super().__init__(process_set, hvd.global_process_set)

    @property
    def fuses_sums(self) -> bool:
        # In a traced graph each allreduce op starts when its input is computed and Horovod's
        # background thread fuses the ready ones: one op per tensor overlaps backward, where one
        # per joined bucket waits for the bucket's last gradient and copies it twice (measured on
        # ResNet-50, 2 hosts at 1 Gbit/s: grace.none() 1,160 ms a step joined, 1,019 per tensor,
        # Horovod's own tape 1,033-1,057; docs/performance.md). Eagerly each op is a Python call:
        # there joining saves more than it costs.
        return not tf.executing_eagerly()

    def allreduce_async(self, tensor, name):
        if tensor.dtype == tf.bfloat16:
            # Horovod 0.28.1 cannot reduce bfloat16: gather the bits, add in float32 in rank order
            # (the same on every worker), round once (grace.steps.bf16_rows_sum).
            rows = allgather(tf.bitcast(tf.reshape(tensor, [1, -1]), tf.int16), name=_op_name(name),
                             ignore_name_scope=True, process_set=self.process_set)
            return summed_bf16(rows, tensor, self.size)
        return _allreduce(tensor, name=_op_name(name), op=hvd.Sum, ignore_name_scope=True,
                          process_set=self.process_set)

    # Horovod 0.28.1 has no bfloat16 ops: gathers and broadcasts carry such tensors as their bits.
    def allgather_async(self, tensor, name):
        return _bits_in(tensor, lambda t: allgather(t, name=_op_name(name), ignore_name_scope=True,
                                                    process_set=self.process_set))

    def broadcast_async(self, tensor, root, name):
        return _bits_in(tensor, lambda t: broadcast(t, self.global_rank(root), name=_op_name(name),
                                                    ignore_name_scope=True,
                                                    process_set=self.process_set))

    def alltoall_async(self, tensor, splits, name):
        # The received splits are left out: grace's payloads carry their own lengths.
        return _bits_in(tensor, lambda t: alltoall(t, splits=splits, name=_op_name(name),
                                                   ignore_name_scope=True,
                                                   process_set=self.process_set)[0])

    def synchronize(self, handle):
        return handle


def summed_bf16(rows, tensor, workers: int):
    """The bfloat16 sum, shaped as ``tensor``, of the ``workers`` rows of its bits that Horovod
    gathered (``grace.steps.bf16_rows_sum``)."""
    n = tensor.shape.num_elements()
    # A size known only when the graph runs: the composite, whose slices take it then.
    add = bf16_rows_sum if n is not None else bf16_rows_sum.composite
    bits = add(_OPS, rows, workers=workers, n=tf.size(tensor) if n is None else n)
    return tf.reshape(tf.bitcast(bits, tf.bfloat16), tf.shape(tensor))


def _bits_in(tensor, run):
    if tensor.dtype == tf.bfloat16:
        return tf.bitcast(run(tf.bitcast(tensor, tf.int16)), tf.bfloat16)
    return run(tensor)


def _op_name(name: str) -> str:
    # Horovod matches collectives across workers by op name; TensorFlow allows [A-Za-z0-9_.-] only.
    return "".join(c if c.isalnum() or c in "_." else "_" for c in name)
