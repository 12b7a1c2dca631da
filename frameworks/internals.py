"""Every place grace reaches past the public API of Horovod, Keras or TensorFlow, in one module.

grace keeps Horovod's behaviour by building Horovod's own wrappers and replacing the one piece that
combines gradients, and routes ``hvd.DistributedOptimizer(..., compression=grace.X())`` to its own
wrappers. That needs a few names that are not public API:

- **Routing** (public names, private timing): Horovod's wrapper functions are wrapped when their
  module is imported, before or after ``import grace``, by a finder on ``sys.meta_path`` that
  patches each module right after it executes. Nothing is copied into Horovod's installation.
  Horovod's TF2 tape, ``broadcast_variables`` and Keras callbacks are routed whatever the
  compression, to mend them for Keras 3 (``MENDED_FUNCTIONS``, ``MENDED_CLASSES``: the callbacks'
  ``__init__`` is wrapped; ``frameworks/tensorflow/keras3.py``).
- **Horovod's Keras callbacks**: ``_local_vars``, ``broadcast_done``, ``backend``, ``initial_lr``,
  ``multiplier``, ``momentum_correction``, ``end_epoch``, ``verbose`` and the methods
  ``_adjust_learning_rate`` and ``_restore_momentum_if_needed``, which the mends read or replace.
- **TensorFlow's AutoGraph**: ``autograph_info__`` marks a routed function, and grace's builders, as
  ones to call unconverted (what ``tf.autograph.experimental.do_not_convert`` sets), so that
  importing TensorFlow is not needed to route or build (``called_unconverted``).
- **Horovod, TensorFlow's tape**: ``_local_sources``, ``process_set`` and
  ``scale_local_gradients`` of ``_DistributedGradientTape``, read by the mended ``gradient()``.
- **Horovod, TensorFlow**: the gradient-combining function of ``DistributedGradientTape`` and of the
  TF1 ``DistributedOptimizer`` (``_allreduce_grads``, also on its ``_agg_helper`` when it
  accumulates), ``_LegacyOptimizer`` to tell a TF1 optimizer from a Keras one, and
  ``mpi_ops._allreduce`` (the op without Horovod's averaging and name scoping).
- **Horovod, PyTorch**: ``hvd.broadcast_optimizer_state`` recognises Horovod's optimizer wrappers by
  their class's module; grace's wrapper presents that module to be treated alike.
- **TensorFlow**: a TF1 ``MomentumOptimizer``'s and ``AdamOptimizer``'s momentum settings are
  private attributes (``_momentum``, ``_use_nesterov``, ``_beta1``).
- **Keras**: ``Trainer._resolve_auto_jit_compile`` decides ``jit_compile='auto'``; grace's
  optimizers need ``False`` (Horovod's ops have no XLA kernels).

Each access was written for the versions in ``WRITTEN_FOR``. On another version, the first access
raises a ``RuntimeError`` naming them (``GRACE_UNTESTED_VERSIONS=1`` turns it into a warning), and a
name that has gone raises naming it: a new release fails loudly at construction rather than
misbehaving in training.
"""

from __future__ import annotations

import functools
import importlib
import importlib.abc
import importlib.metadata
import inspect
import os
import re
import sys
import warnings
import weakref
from typing import Any, Callable

# The package (its distribution's name) -> the releases these accesses were written and tested
# for, as [lowest, highest) version tuples.
WRITTEN_FOR = {
    "horovod": ((0, 28), (0, 29)),
    "keras": ((3, 0), (4, 0)),
    "tensorflow": ((2, 16), (3, 0)),
}
DISTRIBUTIONS = {"horovod": "horovod", "keras": "keras", "tensorflow": ("tensorflow-cpu", "tensorflow")}
ALLOW_ENV = "GRACE_UNTESTED_VERSIONS"


def _installed(package: str) -> str | None:
    names = DISTRIBUTIONS[package]
    for name in (names,) if isinstance(names, str) else names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    module = sys.modules.get(package)
    return getattr(module, "__version__", None)


def _release(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", version.split("+")[0])[:3])


def _span(package: str) -> str:
    low, high = WRITTEN_FOR[package]
    return f">={'.'.join(map(str, low))},<{'.'.join(map(str, high))}"


@functools.lru_cache(maxsize=None)
def check_version(package: str, version: str | None = None) -> None:
    """Raise (or, with ``GRACE_UNTESTED_VERSIONS=1``, warn) when ``package``'s installed version is
    outside the span its accesses here were written for."""
    version = version or _installed(package)
    if version is None:
        return  # not installed as a distribution (a source tree): nothing to compare
    low, high = WRITTEN_FOR[package]
    if low <= _release(version) < high:
        return
    message = (f"grace reaches into {package}'s internals (frameworks/internals.py) as written for "
               f"{package} {_span(package)}, and {version} is installed; set {ALLOW_ENV}=1 to try "
               f"anyway, or install {package}{_span(package)}")
    if os.environ.get(ALLOW_ENV) == "1":
        warnings.warn(message, RuntimeWarning, stacklevel=3)
    else:
        raise RuntimeError(message)


def _require(package: str, owner: Any, name: str) -> Any:
    """``owner.name``, after the version check; a clear error if the name has gone."""
    check_version(package)
    if not hasattr(owner, name):
        raise RuntimeError(
            f"grace needs {getattr(owner, '__name__', type(owner).__name__)}.{name} from {package} "
            f"(frameworks/internals.py, written for {package} {_span(package)}), and the installed "
            f"{package} {_installed(package)} has none")
    return getattr(owner, name)


# --- routing hvd.DistributedOptimizer(..., compression=grace.X()) ------------------------------
# Horovod module -> {its wrapper function: "the grace wrapper with the same signature"}
ROUTES = {
    "horovod.torch": {
        "DistributedOptimizer": "frameworks.torch.optimizer:DistributedOptimizer",
    },
    "horovod.tensorflow": {
        "DistributedGradientTape": "frameworks.tensorflow.tape:DistributedGradientTape",
        "DistributedOptimizer": "frameworks.tensorflow.tape:DistributedOptimizer",
    },
    "horovod.tensorflow.keras": {
        "DistributedOptimizer": "frameworks.tensorflow.keras:DistributedOptimizer",
    },
    "horovod.tensorflow.keras.callbacks": {},
}
# Horovod's TF2 entry points mended for Keras 3 variables where the compression is not grace's
# ("module:function", called as function(horovods_own, *args, **kwargs); frameworks/tensorflow/
# keras3.py): each calls Horovod's own, and only mends it where GRACE_MEND_HOROVOD allows.
MENDED_FUNCTIONS = {
    "horovod.tensorflow": {
        "DistributedGradientTape": "frameworks.tensorflow.keras3:horovods_tape",
        "broadcast_variables": "frameworks.tensorflow.keras3:horovods_broadcast_variables",
    },
}
# Horovod classes whose instances are mended after Horovod's own __init__ ("module:function", called
# as function(instance, init, *args, **kwargs), which calls init): the class stays Horovod's (its
# methods name it through the module, so it cannot be replaced), for Keras 3.
MENDED_CLASSES = {
    "horovod.tensorflow.keras.callbacks": {
        "BroadcastGlobalVariablesCallback": "frameworks.tensorflow.keras3:mend_broadcast_callback",
        "MetricAverageCallback": "frameworks.tensorflow.keras3:mend_metric_average",
        "LearningRateScheduleCallback": "frameworks.tensorflow.keras3:mend_schedule",
        "LearningRateWarmupCallback": "frameworks.tensorflow.keras3:mend_schedule",
    },
}


def mend_class(cls: type, target: str) -> None:
    """Have ``target`` build (and mend) every new ``cls`` instance in place of ``cls.__init__``;
    ``original_init(cls)`` gives Horovod's back. Idempotent."""
    init = cls.__dict__["__init__"]
    if hasattr(init, "__grace_original__"):
        return

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        module, function = target.split(":")
        getattr(importlib.import_module(module), function)(self, init, *args, **kwargs)

    __init__.__grace_original__ = init
    cls.__init__ = __init__


def _resolve(target: str) -> Callable:
    module, function = target.split(":")
    return getattr(importlib.import_module(module), function)


def route(original: Callable, target: str | None, mend: str | None = None) -> Callable:
    """``target`` ("module:function", imported on first use) with the same arguments where the
    ``compression`` argument is a grace ``Pipeline``; else ``mend`` (called with ``original``
    first) where there is one; else ``original``, Horovod's own, as it is."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    def routed(*args, **kwargs):
        from grace.pipeline import Pipeline

        if target is not None and isinstance(
                signature.bind(*args, **kwargs).arguments.get("compression"), Pipeline):
            return _resolve(target)(*args, **kwargs)
        if mend is not None:
            return _resolve(mend)(original, *args, **kwargs)
        return original(*args, **kwargs)

    routed.__grace_original__ = original
    return called_unconverted(routed)


def called_unconverted(function: Callable) -> Callable:
    """``function``, marked for TensorFlow's AutoGraph to call as it is inside a traced step rather
    than convert it (what ``tf.autograph.experimental.do_not_convert`` marks, without importing
    TensorFlow): for plain Python with no control flow on tensors (routing, grace's builders, whose
    callers' line must stay the user's: ``tensorflow_trace_site``)."""
    function.autograph_info__ = frozenset()
    return function


def original(module: str, name: str) -> Callable:
    """Horovod's own ``module.name``, whether or not routing has wrapped it."""
    function = getattr(importlib.import_module(module), name)
    return getattr(function, "__grace_original__", function)


def _patch(module) -> None:
    if getattr(module, "_grace_patched", False):
        return
    mends = MENDED_FUNCTIONS.get(module.__name__, {})
    for name in dict.fromkeys([*ROUTES[module.__name__], *mends]):
        if hasattr(module, name):
            setattr(module, name, route(getattr(module, name), ROUTES[module.__name__].get(name),
                                        mends.get(name)))
    for name, target in MENDED_CLASSES.get(module.__name__, {}).items():
        if isinstance(getattr(module, name, None), type):
            mend_class(getattr(module, name), target)
    module._grace_patched = True


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: lets the other finders find a Horovod module and wraps its loader so
    that the module is patched right after it executes."""

    def find_spec(self, fullname, path, target=None):
        if fullname not in ROUTES:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                exec_module = spec.loader.exec_module

                def exec_and_patch(module, _exec=exec_module):
                    _exec(module)
                    _patch(module)

                spec.loader.exec_module = exec_and_patch
                return spec
        return None


_PACKAGES = tuple(os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep + name + os.sep
                  for name in ("grace", "frameworks"))


def tensorflow_trace_site() -> tuple | None:
    """Where the user's code is while TensorFlow, if it is imported, traces a function
    (``tf.function``): (file, line of the first frame outside grace and TensorFlow, whose AutoGraph
    calls the user's converted code through its own; a weak reference to the function being
    traced, the same ``tf.function`` object for all its traces). ``None`` when not tracing."""
    tf = sys.modules.get("tensorflow")
    if tf is None or not hasattr(tf, "inside_function") or not tf.inside_function():
        return None
    skip = _PACKAGES + (os.path.dirname(os.path.abspath(tf.__file__)) + os.sep,)
    frame, site = sys._getframe(1), None
    function = None
    while frame is not None:
        if site is None and not os.path.abspath(frame.f_code.co_filename).startswith(skip):
            site = (frame.f_code.co_filename, frame.f_lineno)
        owner = frame.f_locals.get("self")
        if isinstance(owner, tf.types.experimental.GenericFunction):  # the outermost: the step
            function = owner
        frame = frame.f_back
    if site is None:
        return None
    return (*site, None if function is None else weakref.ref(function))


def install_routes() -> None:
    """Patch the Horovod modules already imported and those imported later, and tell pipelines
    built while TensorFlow traces (``grace.pipeline.BUILT_WHILE_TRACING``). Idempotent."""
    from grace import pipeline

    if tensorflow_trace_site not in pipeline.BUILT_WHILE_TRACING:
        pipeline.BUILT_WHILE_TRACING.append(tensorflow_trace_site)
    if not any(isinstance(f, _PatchOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _PatchOnImport())
    for name in ROUTES:
        if name in sys.modules:
            _patch(sys.modules[name])


def on_import_grace() -> None:
    """Run at the end of ``import grace`` (the ``grace.on_import`` entry point, setup.py): route
    Horovod's wrappers to grace (``install_routes``), and have AutoGraph call grace's builders as
    they are inside a traced step."""
    import grace

    install_routes()
    for builder in (grace.build, grace.from_params, *(getattr(grace, n) for n in grace.available())):
        called_unconverted(builder)


# --- Horovod, TensorFlow ------------------------------------------------------------------------
def tf_allreduce() -> Callable:
    """``horovod.tensorflow.mpi_ops._allreduce``: the bare op (no averaging, no name scope)."""
    from horovod.tensorflow import mpi_ops

    return _require("horovod", mpi_ops, "_allreduce")


def is_tf1_optimizer(optimizer: Any) -> bool:
    """Whether Horovod's TF ``DistributedOptimizer`` treats ``optimizer`` as a TF1 optimizer."""
    import horovod.tensorflow as hvd

    return isinstance(optimizer, _require("horovod", hvd, "_LegacyOptimizer"))


def tf_tape_internals(tape: Any) -> tuple[set, Any, Callable[[], Any]]:
    """Horovod's ``_DistributedGradientTape`` ``tape``'s set of local sources' keys, its process set,
    and the count of workers its ``gradient()`` divides local gradients by (as Horovod counts it:
    the size op under elastic Horovod)."""
    local = _require("horovod", tape, "_local_sources")
    _require("horovod", tape, "scale_local_gradients")
    process_set = _require("horovod", tape, "process_set")

    def size() -> Any:
        if int(os.environ.get("HOROVOD_ELASTIC", 0)):
            from horovod.tensorflow import mpi_ops

            return _require("horovod", mpi_ops, "size_op")(process_set_id=process_set.process_set_id)
        return process_set.size()

    return local, process_set, size


def horovod_attribute(owner: Any, name: str) -> Any:
    """``owner.name``, a private attribute of a Horovod object (after the version check)."""
    return _require("horovod", owner, name)


def combine_gradients_with(wrapper: Any, reduce_grads: Callable) -> None:
    """Make Horovod's ``DistributedGradientTape`` or TF1 ``DistributedOptimizer`` ``wrapper``
    combine gradients with ``reduce_grads`` (Horovod's signature), everything else Horovod's."""
    _require("horovod", wrapper, "_allreduce_grads")
    wrapper._allreduce_grads = reduce_grads
    helper = getattr(wrapper, "_agg_helper", None)  # the TF1 optimizer's, accumulating passes
    if helper is not None:
        _require("horovod", helper, "_allreduce_grads")
        helper._allreduce_grads = reduce_grads


# --- Horovod, PyTorch ---------------------------------------------------------------------------
def treated_as_horovods_optimizer(cls: type) -> type:
    """``cls``, presented as Horovod's optimizer wrapper: ``hvd.broadcast_optimizer_state`` then
    steps the wrapped optimizer without communicating, as it does for Horovod's own."""
    check_version("horovod")
    # The very name hvd.broadcast_optimizer_state compares with (horovod.torch.functions imports it
    # from horovod.torch.optimizer): hvd.DistributedOptimizer may be another wrapper by then (a
    # user's or a test harness's, around grace's routing), whose module is its own.
    cls.__module__ = original("horovod.torch.optimizer", "DistributedOptimizer").__module__
    return cls


# --- TensorFlow's TF1 optimizers ----------------------------------------------------------------
# name of the setting -> the private attribute that holds it
TF1_SETTINGS = {"momentum": "_momentum", "nesterov": "_use_nesterov", "beta1": "_beta1",
                "learning_rate": "_learning_rate"}


def tf1_setting(optimizer: Any, setting: str) -> Any:
    """A TF1 ``tf.compat.v1.train`` optimizer's ``setting`` (``TF1_SETTINGS``)."""
    return _require("tensorflow", optimizer, TF1_SETTINGS[setting])


def set_tf1_setting(optimizer: Any, setting: str, value: Any) -> None:
    """Change it before the optimizer first applies gradients (when it reads it)."""
    _require("tensorflow", optimizer, TF1_SETTINGS[setting])
    setattr(optimizer, TF1_SETTINGS[setting], value)


# --- Keras --------------------------------------------------------------------------------------
def keras_auto_jit_off_for(predicate: Callable[[Any], bool]) -> None:
    """Make Keras's ``jit_compile='auto'`` choose ``False`` for a model whose optimizer satisfies
    ``predicate`` (Keras 3 chooses XLA on CPU too). Idempotent."""
    from keras.src.trainers import trainer

    trainer_class = _require("keras", trainer, "Trainer")
    resolve = _require("keras", trainer_class, "_resolve_auto_jit_compile")
    if getattr(resolve, "_grace", False):
        return

    def _resolve_auto_jit_compile(self):
        if predicate(getattr(self, "optimizer", None)):
            return False
        return resolve(self)

    _resolve_auto_jit_compile._grace = True
    trainer_class._resolve_auto_jit_compile = _resolve_auto_jit_compile
