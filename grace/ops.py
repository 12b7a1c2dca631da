"""The tensor-operations protocol every algorithm in ``grace`` is written against.

An algorithm never touches torch, TensorFlow or numpy directly: it calls the few primitives below, and
each framework adapter (``frameworks/<fw>/ops.py``) provides them over its own tensors, on the tensor's
own device. ``ops_for(tensor)`` picks the adapter from the tensor's type, so ``compressor.compress(x,
name)`` works on a numpy array, a torch tensor or a TensorFlow tensor alike.

Dtypes are named by strings (``grace.dtypes``) so that algorithm code does not depend on any
framework's dtype objects.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Callable, NamedTuple, Sequence

from grace import adapters
from grace.dtypes import FLOAT_DTYPES, INDEX_BYTES, INT32_MAX, Tensor, index_dtype
from grace.rng import draw_indices, draw_uniform
from grace.selection import exact_top_k

__all__ = ["FLOAT_DTYPES", "INDEX_BYTES", "INT32_MAX", "THIN_COLUMNS", "HostAccess", "Ops", "Tensor",
           "host_row_sums", "index_dtype", "ops_for", "unpack_table"]

THIN_COLUMNS = 8
"""Adapters' ``matmul`` reorders a CPU product with a thin operand of at most this many columns
(PowerSGD's rank): BLAS is 2-10 times slower on a row-major thin operand than one pass over the
large matrix; from 16 columns on it serves one as well (measured on 512 × 4608, one thread)."""


_UNPACK_TABLES: dict = {}


def unpack_table(bits: int):
    """The one byte-to-codes table of every adapter, for ``bits`` dividing 8: row ``b`` (a numpy
    uint8 array of 256 × ``8 // bits``) holds the codes ``pack_bits`` packed into byte value ``b``,
    lowest bits first."""
    if bits not in _UNPACK_TABLES:
        import numpy as np

        values = np.arange(256, dtype=np.int32).reshape(-1, 1)
        shifts = np.arange(0, 8, bits, dtype=np.int32)
        _UNPACK_TABLES[bits] = ((values >> shifts) & ((1 << bits) - 1)).astype(np.uint8)
    return _UNPACK_TABLES[bits]


class HostAccess(NamedTuple):
    """What ``grace.native.worth_running`` needs to know of an adapter's tensors."""

    on_host: bool
    """In host memory, where a loop reads them in place (a CUDA tensor is not)."""
    contiguous: bool
    """Laid out densely, as a loop walks them."""
    crossing: bool
    """Each call crosses into the host at a fixed cost (TensorFlow's ``tf.numpy_function``)."""


class Ops(ABC):
    """Tensor primitives over one framework. Every method takes and returns that framework's tensors.

    Each primitive is general: no algorithm's name is in it. Steps that several algorithms share are
    written once on top of these (``grace.steps``), grace/native's loops are found by their own layer
    (``grace.kernels``), state and its transaction live in ``grace.state``, and the random numbers
    are defined in ``grace.rng``. A new adapter implements the abstract methods (the numpy reference,
    ``grace.backends.numpy_ops``, in about 200 lines) and may override the others for speed;
    docs/adding-an-adapter.md is the checklist.
    """

    name: str = "abstract"

    # --- introspection -------------------------------------------------------------------------
    @abstractmethod
    def shape(self, x: Tensor) -> tuple[int, ...]:
        """The static shape as a tuple of ints."""

    @abstractmethod
    def dtype(self, x: Tensor) -> str:
        """The dtype's canonical name (see the module docstring)."""

    def numel(self, x: Tensor) -> int:
        n = 1
        for d in self.shape(x):
            n *= int(d)
        return n

    @abstractmethod
    def itemsize(self, dtype: str) -> int:
        """Bytes per element of ``dtype``."""

    def nbytes(self, x: Tensor) -> Any:
        """Bytes of ``x``'s elements (a scalar tensor where the size is only known at run time)."""
        return self.size(x) * self.itemsize(self.dtype(x))

    # --- construction and layout ---------------------------------------------------------------
    @abstractmethod
    def zeros(self, n: int, dtype: str, like: Tensor) -> Tensor:
        """A 1-d tensor of ``n`` zeros of ``dtype`` on ``like``'s device."""

    @abstractmethod
    def flatten(self, x: Tensor) -> Tensor:
        """A 1-d view (or contiguous copy) of ``x``."""

    @abstractmethod
    def reshape(self, x: Tensor, shape: Sequence[int]) -> Tensor: ...

    @abstractmethod
    def cast(self, x: Tensor, dtype: str) -> Tensor:
        """``x`` as ``dtype``; returns ``x`` itself when it already has that dtype."""

    @abstractmethod
    def copy(self, x: Tensor) -> Tensor:
        """A copy that does not alias ``x``."""

    @abstractmethod
    def concat(self, xs: Sequence[Tensor]) -> Tensor:
        """1-d tensors joined end to end, in a new tensor (of one tensor too: the pipeline writes
        into a joined bucket)."""

    def adjacent(self, xs: Sequence[Tensor]) -> Tensor | None:
        """The tensors as one 1-d view, where they already lie end to end in one buffer, in
        order (a DDP bucket's gradients are views of its flat buffer), else ``None``. Joining them
        then copies nothing. A framework without views keeps this default."""
        return None

    @abstractmethod
    def split(self, x: Tensor, sizes: Sequence[int] | Tensor) -> list[Tensor]:
        """A 1-d tensor cut into consecutive pieces of the given sizes (ints, or a 1-d tensor)."""

    @abstractmethod
    def slice(self, x: Tensor, start: Any, length: Any) -> Tensor:
        """``length`` consecutive elements of the 1-d ``x`` from ``start`` (ints, or scalar
        tensors in a traced graph)."""

    @abstractmethod
    def strided(self, x: Tensor, stride: int) -> Tensor:
        """Every ``stride``-th element of the 1-d ``x``, from the first (``x[::stride]``)."""

    def static_shape(self, x: Tensor) -> tuple[int | None, ...]:
        """The shape as far as it is known before a traced graph runs (``None`` where not)."""
        return self.shape(x)

    def host_access(self, tensors: Sequence[Tensor]) -> HostAccess:
        """How a host loop (``on_host``) would reach these tensors; see ``HostAccess``."""
        return HostAccess(on_host=True, contiguous=True, crossing=False)

    def static_numel(self, x: Tensor) -> int | None:
        """The element count when it is known before a traced graph runs, else ``None``."""
        return self.numel(x)

    @abstractmethod
    def to_bytes(self, x: Tensor) -> Tensor:
        """The bytes of ``x``, as a 1-d uint8 tensor (native byte order), so that payload tensors of
        any dtypes travel in one buffer."""

    @abstractmethod
    def from_bytes(self, b: Tensor, dtype: str) -> Tensor:
        """The 1-d uint8 ``b`` read back as a 1-d tensor of ``dtype`` (``to_bytes``'s inverse)."""

    # --- arithmetic ----------------------------------------------------------------------------
    @abstractmethod
    def add(self, a: Tensor, b: Tensor) -> Tensor: ...

    def add_into(self, a: Tensor, b: Tensor) -> Tensor:
        """``a + b``, written into ``a`` where the adapter can (``a`` is read no more, and is
        ``writable``), else a new tensor: the same values either way."""
        return self.add(a, b)

    def writable(self, x: Tensor) -> bool:
        """Whether ``add_into`` may write into ``x`` itself: a tensor that autograd does not
        track and that is all of its memory (no other tensor's view)."""
        return False

    @abstractmethod
    def sub(self, a: Tensor, b: Tensor) -> Tensor: ...

    @abstractmethod
    def scale(self, x: Tensor, factor: float) -> Tensor:
        """``x * factor`` in ``x``'s dtype; 16-bit tensors are multiplied in float32 and rounded
        once (as torch does), so every adapter gives the same bits."""

    def scale_into(self, x: Tensor, factor: float, out: Tensor) -> Tensor:
        """``x`` cast to ``out``'s dtype, in ``out``'s shape, times ``factor`` (``scale``): written
        into ``out`` where the adapter can (``out`` is read no more), else a new tensor. The same
        bits either way."""
        result = self.reshape(self.cast(x, self.dtype(out)), self.shape(out))
        return self.scale(result, factor) if factor != 1.0 else result

    @abstractmethod
    def abs(self, x: Tensor) -> Tensor: ...

    # --- selection -----------------------------------------------------------------------------
    def topk_indices(self, x: Tensor, k: int) -> Tensor:
        """Indices (of ``index_dtype(numel)``, ascending) of the ``k`` entries of 1-d ``x`` with
        the largest magnitude. Ascending, so that gathering them and scattering into them walk
        memory forwards: measured 7 times faster than in random order for 2.4 M elements.

        From ``SAMPLED_TOPK_MIN`` elements (k at most an eighth of them) the exact top-k is found
        among candidates above a threshold estimated on a strided sample (``sampled_topk_indices``),
        in every adapter alike; else by ``full_topk_indices``. Where grace/native runs, its kernel
        does either in one call (``grace.selection.exact_top_k``), ties at the k-th magnitude going to
        the lowest indices."""
        return exact_top_k(self, x, k=k)

    @abstractmethod
    def full_topk_indices(self, x: Tensor, k: int) -> Tensor:
        """``topk_indices`` by ranking every element (the framework's own top-k)."""

    @abstractmethod
    def gather(self, x: Tensor, indices: Tensor) -> Tensor:
        """``x[indices]`` for 1-d ``x``."""

    @abstractmethod
    def scatter_add(self, n: int, indices: Tensor, values: Tensor) -> Tensor:
        """A 1-d tensor of ``n`` zeros (``values``' dtype and device) with ``values`` added at
        ``indices``; repeated indices add up."""

    @abstractmethod
    def unique(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """The distinct values of the 1-d integer ``x`` in ascending order, and for each element of
        ``x`` the position of its value among them (int64)."""

    @abstractmethod
    def divmod(self, x: Tensor, divisor: int) -> tuple[Tensor, Tensor]:
        """The quotient and remainder of the non-negative integer ``x`` by ``divisor``, in
        ``x``'s dtype (a flat index as row and column)."""

    @abstractmethod
    def add_rows(self, count: Any, positions: Tensor, rows: Tensor) -> Tensor:
        """A 2-d tensor of ``count`` rows of zeros (``rows``' width, dtype and device) with each row
        of the 2-d ``rows`` added at its position (``positions``: one int64 per row); repeated
        positions add up. ``count`` may be a scalar tensor in a traced graph."""

    def zero_at(self, x: Tensor, indices: Tensor, overwrite: bool = False,
                after: Sequence[Tensor] = ()) -> Tensor:
        """1-d ``x`` with zeros at ``indices`` (repeated indices allowed), as a new tensor; with
        ``overwrite``, ``x`` is not used afterwards and an adapter may zero it where it is (no copy
        of the tensor), once the tensors ``after`` (those read from ``x``: in a traced graph the
        order is the data's alone) are computed. An adapter overrides it with its one-pass fill;
        this composite takes three."""
        n = self.numel(x)
        hits = self.scatter_add(n, indices, self.full(self.size(indices), 1.0, self.dtype(x), like=x))
        return self.where(self.equal(hits, 0.0), x, self.zeros(n, self.dtype(x), like=x))

    @abstractmethod
    def from_numpy(self, array: Any, like: Tensor) -> Tensor:
        """A numpy array as a tensor on ``like``'s device."""

    @abstractmethod
    def to_numpy(self, x: Tensor) -> Any:
        """A host copy of ``x`` as a numpy array (bfloat16 comes back as float32)."""

    def on_host(self, fn: Callable, inputs: Sequence[Tensor], dtypes: Sequence[str],
                shapes: Sequence[Sequence[int | None]], pure: bool = False) -> list[Tensor]:
        """``fn`` over the inputs as numpy arrays, returning numpy arrays of ``dtypes`` (of
        ``shapes``, ``None`` where a size varies), run now, or when a traced graph runs (in order
        with the graph's other effects: ``fn`` may keep state, unless ``pure``). The way to run
        numpy code, grace/native's loops among it (``grace.kernels``), where a graph's sizes are
        only known when it runs."""
        import numpy as np

        outputs = fn(*[self.to_numpy(x) for x in inputs])
        return [self.from_numpy(np.asarray(o), like=inputs[0]) for o in outputs]

    def rows_on_host(self, codec: Any, name: str, rank: int) -> Any:
        """For an adapter that traces graphs whose number of rows is known only when they run: an
        object that does ``codec``'s (a ``grace.sparse.RowsCodec``) work on the host then, with
        ``encode_rows(indices, rows, ops)``, ``aggregate_payloads(payloads, ctx, ops, scale)`` and
        ``settle(discard, ops)`` (TensorFlow: ``frameworks/tensorflow/rows.py``). An eager
        adapter never needs one."""
        raise NotImplementedError(f"{type(self).__name__} knows every size before it runs: it has "
                                  f"no rows to encode on the host")

    # --- more arithmetic, reductions and selection ----------------------------------------------
    def size(self, x: Tensor) -> Any:
        """The element count; unlike ``numel`` it may be a scalar tensor (a payload whose length is
        only known when a traced graph runs)."""
        return self.numel(x)

    def lengths(self, tensors: Sequence[Tensor]) -> Tensor:
        """The tensors' element counts as a 1-d int32 tensor (on the first one's device)."""
        return self.constant([self.size(t) for t in tensors], "int32", like=tensors[0])

    @abstractmethod
    def full(self, n: int, value: float, dtype: str, like: Tensor) -> Tensor: ...

    @abstractmethod
    def arange(self, n: int, dtype: str, like: Tensor) -> Tensor: ...

    @abstractmethod
    def constant(self, values: Any, dtype: str, like: Tensor) -> Tensor:
        """A small 1-d tensor from a Python/numpy sequence (tables, scalars) on ``like``'s device."""

    @abstractmethod
    def mul(self, a: Tensor, b: Tensor) -> Tensor: ...

    @abstractmethod
    def div(self, a: Tensor, b: Tensor) -> Tensor: ...

    @abstractmethod
    def sign(self, x: Tensor) -> Tensor: ...

    @abstractmethod
    def where(self, cond: Tensor, a: Tensor, b: Tensor) -> Tensor: ...

    @abstractmethod
    def greater_equal(self, a: Tensor, b: Tensor | float) -> Tensor:
        """Element-wise ``a >= b`` as a boolean tensor."""

    @abstractmethod
    def less(self, a: Tensor, b: Tensor | float) -> Tensor: ...

    @abstractmethod
    def equal(self, a: Tensor, b: Tensor | float) -> Tensor: ...

    @abstractmethod
    def floor(self, x: Tensor) -> Tensor: ...

    @abstractmethod
    def round(self, x: Tensor) -> Tensor:
        """Round half to even."""

    @abstractmethod
    def exponent_bits(self, x: Tensor) -> Tensor:
        """The biased exponent field (0..255, int32) of each element as float32: exact, and the same
        in every framework, unlike a floating-point log2."""

    @abstractmethod
    def power_of_two(self, exponent: Tensor) -> Tensor:
        """float32 ``2 ** (exponent - 127)`` for int32 biased exponents in 1..254, built from the
        bits (exact)."""

    @abstractmethod
    def bucketize(self, x: Tensor, boundaries: Tensor) -> Tensor:
        """For each element, how many of the ascending ``boundaries`` are ``<= x`` (int32)."""

    @abstractmethod
    def sqrt(self, x: Tensor) -> Tensor: ...

    @abstractmethod
    def maximum(self, a: Tensor, b: Tensor | float) -> Tensor: ...

    @abstractmethod
    def minimum(self, a: Tensor, b: Tensor | float) -> Tensor: ...

    @abstractmethod
    def sum(self, x: Tensor) -> Tensor:
        """The sum of all elements, as a 1-element 1-d tensor (so it can join a payload).
        Floating-point sums accumulate in float64 and round once to ``x``'s dtype, which makes them
        the same in every framework for float32 and 16-bit tensors, whatever order the framework
        adds in (for float64 tensors the last bit may differ)."""

    @abstractmethod
    def max(self, x: Tensor) -> Tensor:
        """The largest element, as a 1-element 1-d tensor (0 for an empty tensor)."""

    def norm(self, x: Tensor) -> Tensor:
        """The Euclidean norm, as a 1-element 1-d tensor, computed in float64 (squares of large
        float32 values would overflow) and rounded to ``x``'s dtype (Inf if it does not fit)."""
        wide = self.cast(x, "float64")
        return self.cast(self.sqrt(self.sum(self.mul(wide, wide))), self.dtype(x))

    def row_sums(self, x: Tensor) -> Tensor:
        """The sum of each row of the 2-d ``x``, as a 1-d tensor, accumulated in float64 and rounded
        to ``x``'s dtype (as ``sum``). On the CPU every adapter adds in ``host_row_sums``' order,
        so that float64 sums too are the same bits in every framework."""
        return self.cast(self.from_numpy(host_row_sums(self.to_numpy(x)), like=x), self.dtype(x))

    def row_norms(self, x: Tensor) -> Tensor:
        """The Euclidean norm of each row of the 2-d ``x``, as a 1-d tensor, computed in float64 and
        rounded to ``x``'s dtype (as ``norm``)."""
        wide = self.cast(x, "float64")
        return self.cast(self.sqrt(self.row_sums(self.mul(wide, wide))), self.dtype(x))

    @abstractmethod
    def nonfinite_flag(self, x: Tensor) -> Tensor:
        """A 1-element float32 tensor: 1 if ``x`` holds an Inf or NaN, else 0 (no host sync)."""

    @abstractmethod
    def nonzero(self, mask: Tensor) -> Tensor:
        """Indices (``index_dtype``) of the true entries of a 1-d boolean tensor, in order."""

    @abstractmethod
    def sort(self, x: Tensor) -> Tensor:
        """Ascending."""

    @abstractmethod
    def cond(self, pred: Tensor | bool, true_fn: Callable, false_fn: Callable) -> Any:
        """``true_fn()`` if ``pred`` else ``false_fn()``; in a traced graph both are traced and the
        choice is made when it runs."""

    # --- bits ----------------------------------------------------------------------------------
    @abstractmethod
    def pack_bits(self, codes: Tensor, bits: int) -> Tensor:
        """Integer codes in ``[0, 2**bits)`` packed into ``ceil(n * bits / 8)`` uint8: the code bits
        least significant first, codes one after another, bytes filled from their lowest bit."""

    @abstractmethod
    def unpack_bits(self, packed: Tensor, bits: int, n: int) -> Tensor:
        """The ``n`` codes that ``pack_bits`` packed, as an integer tensor (int32, or uint8 where
        ``bits`` divides 8 and the adapter has a faster path for it)."""

    def unpack_values(self, packed: Tensor, bits: int, n: int, values: Tensor) -> Tensor:
        """``values[code]`` for each of the ``n`` codes ``pack_bits`` packed: decoding by a table of
        the ``2**bits`` possible values, computed once per tensor instead of once per element."""
        return self.gather(values, self.cast(self.unpack_bits(packed, bits, n), "int32"))

    def order_statistics(self, x: Tensor, ranks: Sequence[int]) -> Tensor:
        """``sort(x)[ranks]`` for 1-d ``x``: a few order statistics, which an adapter may find
        without sorting everything."""
        return self.gather(self.sort(x), self.constant(list(ranks), "int32", like=x))

    def count_at_least(self, x: Tensor, threshold: float) -> Any:
        """How many elements have ``|x| >= threshold`` (an int, or a scalar tensor)."""
        return self.size(self.indices_at_least(x, threshold))

    def indices_at_least(self, x: Tensor, threshold: Tensor | float) -> Tensor:
        """The indices (``index_dtype``, in order) of the elements with ``|x| >= threshold``."""
        return self.nonzero(self.greater_equal(self.abs(x), threshold))

    def max_abs(self, x: Tensor) -> Tensor:
        """The largest magnitude, as a 1-element tensor (NaN if ``x`` holds one)."""
        return self.max(self.abs(x))

    # --- linear algebra ------------------------------------------------------------------------
    @abstractmethod
    def matmul(self, a: Tensor, b: Tensor, transpose_a: bool = False, transpose_b: bool = False,
               subtract_from: Tensor | None = None) -> Tensor:
        """``a @ b`` (either transposed if asked), or ``subtract_from - a @ b``, which BLAS's gemm
        does in the product's own pass."""

    @abstractmethod
    def orthogonalize(self, x: Tensor) -> Tensor:
        """An orthonormal basis of the columns of the 2-d ``x`` (Q of its QR decomposition), or of
        each matrix of a 3-d batch."""

    # --- randomness ----------------------------------------------------------------------------
    def random_indices(self, n: int, k: int, seed_of: Callable[[Any], int], step: Any,
                       like: Tensor) -> Tensor:
        """``k`` distinct indices in ``[0, n)``, uniform, from a private generator seeded with
        ``seed_of(step)``. Every adapter draws them the same way (``grace.rng.draw_indices``, never
        a global RNG), so all workers and all frameworks agree given the seed. ``step`` is what a
        counter returned (a tensor under ``tf.function``, where the draw happens when the graph
        runs)."""
        return self.from_numpy(draw_indices(n, k, seed_of(int(step))), like)

    # --- storage that outlives a step ----------------------------------------------------------
    # ``grace.state.StateStore`` keeps per-tensor state in plain dicts through these, so that an
    # adapter whose code is traced once (TensorFlow's tf.function) can hold it in variables that the
    # traced graph reads and updates on every call. The defaults hold values in the dict itself,
    # which is all an eager framework needs.

    def read_state(self, store: dict, key: str, like: Tensor, initial: Any = None) -> Tensor | None:
        """``store[key]``; before the first write, ``initial`` (a numpy array) if given, else
        ``None`` (zeros shaped like ``like`` in an adapter whose state must exist from the first
        traced call)."""
        if key in store:
            return store[key]
        return None if initial is None else self.from_numpy(initial, like)

    def write_state(self, store: dict, key: str, value: Any, unless: Any = False) -> None:
        """Hold ``value`` as ``store[key]``, unless ``unless`` (``is_set``'s answer) is true; in a
        traced graph, where that is only known when it runs, the old value is kept then."""
        if not unless:
            store[key] = value

    def count_of(self, store: dict, key: str) -> Any:
        """The integer counter ``store[key]`` (0 before the first addition)."""
        return store.get(key, 0)

    def add_to_count(self, store: dict, key: str, increment: Any) -> Any:
        """Add ``increment`` to the counter ``store[key]`` and return its value before."""
        value = store.get(key, 0)
        store[key] = value + increment
        return value

    def as_count(self, increment: Any) -> Any:
        """``increment`` in the type counters add up in (an int, or an int64 scalar tensor)."""
        return increment

    def prepare_rows(self, index_store: dict, value_store: dict, key: str, like_indices: Tensor,
                     like: Tensor) -> None:
        """Make rows kept as state (indices and 2-d values whose number changes from step to step)
        exist before their first write, where the adapter's state must exist from the first traced
        call (with no rows); nothing by default."""

    def is_set(self, flag: Tensor) -> Any:
        """Whether the 1-element ``flag`` is non-zero (a bool, or a boolean tensor in a traced
        graph)."""
        return bool(float(self.to_numpy(flag).reshape(-1)[0]))

    def nan_if(self, dropped: Any, x: Tensor) -> Tensor:
        """``x``, or a tensor of NaN of its shape and dtype where ``dropped`` (``is_set``'s answer)
        is true."""
        if not dropped:
            return x
        return self.reshape(self.full(self.numel(x), float("nan"), self.dtype(x), like=x),
                            self.shape(x))

    def snapshot(self, value: Any) -> Any:
        """A copy of a held value that later writes do not change (for ``state_dict``)."""
        return self.copy(value)

    def random_uniform(self, n: int, seed_of: Callable[[Any], int], step: Any, like: Tensor) -> Tensor:
        """``n`` float32 draws from [0, 1) from the counter-based generator keyed by
        ``seed_of(step)`` (``grace.rng.counter_uniform_bits``): the same in every adapter and on
        every device."""
        return self.from_numpy(draw_uniform(n, seed_of(int(step))), like)


def host_row_sums(rows):
    """The one definition of ``Ops.row_sums`` on the CPU: numpy's sums along each row, in float64."""
    import numpy as np

    return np.sum(np.asarray(rows, dtype=np.float64), axis=1)


_INSTANCES: dict[type, Ops] = {}


def ops_for(x: Tensor) -> Ops:
    """The ``Ops`` adapter for ``x``'s framework, registered under its top-level module
    (``grace.adapters``) and imported on first use (so ``grace`` itself never imports torch or
    TensorFlow); one instance per adapter class."""
    top = type(x).__module__.split(".")[0]
    known = adapters.registered("grace.ops")
    if top not in known:
        raise TypeError(
            f"grace cannot operate on a {type(x).__module__}.{type(x).__name__}; "
            f"expected a tensor of one of: {', '.join(sorted(known))}"
        )
    cls = adapters.load("grace.ops", top)
    if cls not in _INSTANCES:
        _INSTANCES[cls] = cls()
    return _INSTANCES[cls]
