"""grace/native's loops as one layer that every framework adapter gets.

A step that the composite protocol code makes in several passes over a gradient (quantizing, packing
signs, decoding by tables, a compressor's encoder) is written once, against ``Ops``, and marked
``@accelerated("kernel")``: where ``grace.native.worth_running`` (the one policy: size, dtypes, host
memory, the library built) and the kernel's own ``accepts`` allow it, this layer runs the kernel of
that name on the step's tensors instead, through the adapter's ``on_host``; else the composite code
runs. Both give the same bits (tests/test_native.py holds them to that), so an algorithm never names a
kernel nor asks whether one runs, and a new adapter gets every kernel by providing ``on_host`` and
``host_access``.

The marked function takes ``(ops, *tensors, seed=None, **params)``: ``tensors`` are the kernel's
inputs in its order (``None`` ones are left out), ``params`` its keyword parameters (plain numbers),
and ``seed``, for a step that draws random numbers, ``(seed_of, step)`` as ``Ops.random_uniform``
takes them. It returns what the kernel does: one tensor, or a tuple of them.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

from grace import native
from grace.dtypes import Tensor

ACCEPTED = ("float32", "uint8", "int16")
"""The first input's dtypes the loops read: float32 gradients, packed codes for the decoders, and
bfloat16 values carried as their int16 bits (``grace.steps.bf16_rows_sum``)."""


def applies(ops: Any, tensors: list[Tensor], numel: int | None = None, dtypes: list[str] | None = None,
            accept: tuple[str, ...] = native.KERNEL_DTYPES) -> bool:
    """Whether a loop should run on ``tensors``: ``grace.native.worth_running`` (the one policy)
    asked with what the adapter says of them (``Ops.host_access``). ``numel``: the size that decides
    (the first tensor's, if known before a graph runs, by default); ``dtypes``: those to check (the
    tensors', by default). Adapters ask this for the loops behind their own primitives (float64
    sums, selections, scatters), as ``run`` does for the steps."""
    access = ops.host_access(tensors)
    return native.worth_running(ops.static_numel(tensors[0]) if numel is None else numel,
                                [ops.dtype(t) for t in tensors] if dtypes is None else dtypes,
                                on_host=access.on_host, contiguous=access.contiguous,
                                crossing=access.crossing, accept=accept)


def run(ops: Any, kernel: str, tensors: list[Tensor], seed: tuple | None = None,
        **params: Any) -> tuple | None:
    """``grace.native.KERNELS[kernel]`` on ``tensors`` as a tuple of tensors, where the policy and
    the kernel take them; else ``None``."""
    spec = native.KERNELS[kernel]
    dtypes = [ops.dtype(t) for t in tensors]
    # Where the first input's size is known only when a graph runs, the output's (``n``) decides.
    if not (applies(ops, tensors, params.get("n"), dtypes[:1], ACCEPTED)
            and spec.accepts(dtypes, **params)):
        return None
    specs = spec.outputs(*[ops.static_shape(t) for t in tensors], **params)
    inputs = list(tensors)
    if seed is None:
        def loop(*arrays):
            return native.run_kernel(kernel, list(arrays), **params)
    elif isinstance(seed[1], int):  # a step known now: the seed too
        value = seed[0](seed[1])

        def loop(*arrays):
            return native.run_kernel(kernel, list(arrays), value, **params)
    else:  # a step that a traced graph counts: the seed when it runs
        inputs.append(ops.cast(seed[1], "int64"))

        def loop(*arrays):
            return native.run_kernel(kernel, list(arrays[:-1]), seed[0](int(arrays[-1])), **params)

    outputs = ops.on_host(loop, inputs, [dtype for dtype, _ in specs], [shape for _, shape in specs],
                          pure=True)
    return tuple(outputs)


def accelerated(kernel: str) -> Callable[[Callable], Callable]:
    """Mark a composite step as one that ``grace.native``'s loop ``kernel`` may run instead (see the
    module docstring). The composite function stays reachable as ``.composite``."""
    if kernel not in native.KERNELS:  # fails at import, not at the first large tensor
        raise KeyError(f"grace.native has no kernel {kernel!r}; it has: {', '.join(native.KERNELS)}")

    def mark(composite: Callable) -> Callable:
        @functools.wraps(composite)
        def step(ops: Any, *tensors: Tensor, seed: tuple | None = None, **params: Any):
            present = [t for t in tensors if t is not None]
            fast = run(ops, kernel, present, seed, **params)
            if fast is None:
                return composite(ops, *tensors, seed=seed, **params) if seed is not None \
                    else composite(ops, *tensors, **params)
            return fast[0] if len(fast) == 1 else fast

        step.composite = composite
        step.kernel = kernel
        return step

    return mark
