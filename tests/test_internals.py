"""The one module that reaches past Horovod's, Keras's and TensorFlow's public API
(frameworks/internals.py): a release it was not written for fails loudly, naming the versions, and
every access works on the versions installed here."""

from __future__ import annotations

import pytest

from frameworks import internals


@pytest.mark.parametrize("package, version", [("horovod", "0.29.0"), ("horovod", "0.27.3"),
                                              ("keras", "4.0.0"), ("tensorflow", "2.15.1")])
def test_a_version_it_was_not_written_for_is_a_clear_error(package, version, monkeypatch):
    monkeypatch.delenv(internals.ALLOW_ENV, raising=False)
    with pytest.raises(RuntimeError) as error:
        internals.check_version(package, version)
    message = str(error.value)
    assert package in message and version in message
    assert internals._span(package) in message and internals.ALLOW_ENV in message


def test_the_override_turns_the_error_into_a_warning(monkeypatch):
    monkeypatch.setenv(internals.ALLOW_ENV, "1")
    with pytest.warns(RuntimeWarning, match="horovod>=0.28,<0.29"):
        internals.check_version("horovod", "0.30.0")


@pytest.mark.parametrize("package", sorted(internals.WRITTEN_FOR))
def test_the_installed_versions_are_those_it_was_written_for(package):
    internals.check_version(package)  # raises otherwise
    assert internals._installed(package) is not None


def test_a_name_that_has_gone_is_named():
    class Tape:
        pass

    with pytest.raises(RuntimeError, match=r"Tape\._allreduce_grads from horovod"):
        internals.combine_gradients_with(Tape(), lambda grads, variables=None: grads)


def test_every_access_works_on_the_installed_versions():
    import horovod.tensorflow as hvd
    import keras
    import tensorflow as tf

    assert callable(internals.tf_allreduce())
    legacy = tf.compat.v1.train.MomentumOptimizer(0.1, momentum=0.9, use_nesterov=True)
    assert internals.is_tf1_optimizer(legacy)
    assert not internals.is_tf1_optimizer(keras.optimizers.SGD(0.1))
    assert internals.tf1_setting(legacy, "momentum") == 0.9
    assert internals.tf1_setting(legacy, "nesterov") is True
    internals.set_tf1_setting(legacy, "momentum", 0.0)
    assert internals.tf1_setting(legacy, "momentum") == 0.0
    assert internals.tf1_setting(tf.compat.v1.train.AdamOptimizer(0.1, beta1=0.8), "beta1") == 0.8

    with tf.GradientTape() as tape:
        pass
    wrapper = internals.original("horovod.tensorflow", "DistributedGradientTape")(tape)
    marker = lambda grads, variables=None, use_generic_names=False: grads
    internals.combine_gradients_with(wrapper, marker)
    assert wrapper._allreduce_grads is marker

    from keras.src.trainers.trainer import Trainer

    import frameworks.tensorflow.keras  # noqa: F401  (installs the jit_compile='auto' choice)

    assert Trainer._resolve_auto_jit_compile._grace
    assert internals.original("horovod.tensorflow", "DistributedOptimizer") is not hvd.DistributedOptimizer


def test_the_torch_wrapper_is_presented_as_horovods(monkeypatch):
    """hvd.broadcast_optimizer_state steps a newly built optimizer without communicating only when
    its class's module is that of horovod.torch.optimizer.DistributedOptimizer; otherwise the one
    worker whose state is empty (rank 0 loaded a checkpoint) steps grace's wrapper alone and
    waits forever (Horovod's own test_broadcast_state hung so). Also when hvd.DistributedOptimizer
    has been wrapped again around grace's routing, as a test harness or a user may."""
    import horovod.torch as hvd
    import horovod.torch.optimizer

    def users_wrapper(*args, **kwargs):
        return hvd.DistributedOptimizer(*args, **kwargs)

    monkeypatch.setattr(hvd, "DistributedOptimizer", users_wrapper)

    class Wrapper:
        pass

    assert internals.treated_as_horovods_optimizer(Wrapper).__module__ == \
        horovod.torch.optimizer.DistributedOptimizer.__module__ == "horovod.torch.optimizer"
