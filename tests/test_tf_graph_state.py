"""TensorFlow's adapter under ``tf.function``: a step's state writes and its non-finite result are
chosen whole by the step's flag, which is known only when the graph runs, and no op walks every
element to choose (an element-wise ``tf.where`` over the broadcast flag cost 135 ms a step on
ResNet-50's gradients: docs/performance.md, "TensorFlow's choices by the step's flag")."""

from __future__ import annotations

import numpy as np
import tensorflow as tf

N = 1 << 16


def _ops():
    from frameworks.tensorflow.ops import TensorFlowOps

    return TensorFlowOps()


def _element_wise_selects(function, *args) -> list[str]:
    graph = function.get_concrete_function(*args).graph
    return [op.name for op in graph.get_operations() if op.type in ("Select", "SelectV2")]


def test_a_state_write_keeps_the_old_value_when_the_flag_is_set_and_selects_no_element():
    ops = _ops()
    store: dict = {}
    old = np.arange(N, dtype=np.float32)
    ops.write_state(store, "w", tf.constant(old))

    @tf.function
    def write(value, flag):
        ops.write_state(store, "w", value, unless=ops.is_set(flag))
        return ops.read_state(store, "w", like=value)

    new = tf.constant(-old)
    assert _element_wise_selects(write, new, tf.constant([0.0])) == []
    np.testing.assert_array_equal(write(new, tf.constant([1.0])).numpy(), old)  # a dropped step
    np.testing.assert_array_equal(write(new, tf.constant([0.0])).numpy(), -old)  # a kept one


def test_a_dropped_steps_result_is_nan_everywhere_and_a_kept_one_is_untouched():
    ops = _ops()

    @tf.function
    def result(x, flag):
        return ops.nan_if(ops.is_set(flag), x)

    x = tf.constant(np.linspace(-1, 1, N, dtype=np.float32))
    assert _element_wise_selects(result, x, tf.constant([0.0])) == []
    assert np.isnan(result(x, tf.constant([1.0])).numpy()).all()
    np.testing.assert_array_equal(result(x, tf.constant([0.0])).numpy(), x.numpy())
