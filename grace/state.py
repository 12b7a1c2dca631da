"""Per-tensor state kept across steps, and the step's non-finite transaction.

Memories, compressors and the pipeline keep state per tensor (residuals, momenta, PowerSGD's warm
start, step counters, byte counts) in plain dicts of their own, a ``store`` each, keyed by the
tensor's name. They read and write it through a ``StateStore``, never by hand, for two reasons:

- **A traced graph.** Under ``tf.function`` the algorithm's code runs once, at tracing; a value that
  must change from call to call lives in a variable that every call of the graph reads and updates.
  The adapter's storage primitives (``Ops.read_state``, ``Ops.write_state``, ``Ops.add_to_count``,
  ...) decide how a value is held: in the dict itself for eager frameworks (the ``Ops`` defaults), in
  ``tf.Variable``s for TensorFlow.
- **The non-finite transaction.** While a transaction is open (``within``), writes stay pending and
  reads see them; ``commit`` applies them, or drops them all where the step must leave no trace (an
  Inf or NaN in some worker's gradient), so that a skipped step leaves the state as it was.

Each ``Pipeline`` owns one store and hands it to the parts it drives (``state_store``); a compressor
or memory used on its own gets ``DEFAULT``. A transaction belongs to one thread (workers simulated in
threads, or autograd's device threads, never write into another's), and a write into a store while
another store's transaction is open in the same thread is refused: a part left out of its
pipeline's store would otherwise escape the rollback silently.

``snapshot``, ``restore`` and ``plain`` are what ``state_dict``/``load_state_dict`` and ``stats`` need:
copies of held values as framework tensors or numpy arrays, put back into whatever holds them.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Any

from grace.ops import Ops, Tensor, ops_for

_OPEN = threading.local()
"""Per thread: the stores with a transaction open, innermost last."""


def _held(value: Any) -> bool:
    """Whether ``value`` is held by a framework (a tensor, an array, a variable) rather than being
    a plain Python number."""
    return not isinstance(value, (bool, int, float))


def snapshot(value: Any) -> Any:
    """A copy of a held value that later writes do not change (a numpy array for a TensorFlow
    variable, as its adapter's ``Ops.snapshot`` says); a plain number as it is."""
    return ops_for(value).snapshot(value) if _held(value) else value


def plain(value: Any) -> Any:
    """A held value as a Python number or numpy array (``stats()``, inspection)."""
    return ops_for(value).to_numpy(value) if _held(value) else value


class StateStore:
    """Reads and writes of per-tensor state, with the step's transaction (see the module
    docstring). Every method takes the ``ops`` of the tensors involved."""

    def __init__(self) -> None:
        self._local = threading.local()

    # --- the transaction ------------------------------------------------------------------------
    @property
    def _pending(self) -> dict | None:
        return getattr(self._local, "transaction", None)

    @contextmanager
    def within(self, transaction: dict | None):
        """Route writes into ``transaction`` (a dict from ``{}``) for the ``with`` block; ``None``
        writes through."""
        previous = self._pending
        self._local.transaction = transaction
        stack = _OPEN.__dict__.setdefault("stores", [])
        stack.append(self if transaction is not None else None)
        try:
            yield
        finally:
            stack.pop()
            self._local.transaction = previous

    def _check_owner(self) -> None:
        stack = getattr(_OPEN, "stores", None)
        open_elsewhere = stack and stack[-1] is not None and stack[-1] is not self
        if open_elsewhere and self._pending is None:
            raise RuntimeError("grace: state written into a store other than the one whose step is "
                               "open: a part of the pipeline was not given the pipeline's "
                               "state_store, and its writes would escape the non-finite rollback")

    def commit(self, ops: Ops, transaction: dict, dropped: Any) -> None:
        """Apply the pending writes, unless ``dropped`` (``Ops.is_set`` of the step's non-finite
        flag, asked once per step; in a traced graph each write keeps the old value where it is
        set)."""
        for store, key, value in transaction.values():
            ops.write_state(store, key, value, unless=dropped)

    # --- reads and writes -----------------------------------------------------------------------
    def load(self, ops: Ops, store: dict, key: str, like: Tensor, initial: Any = None) -> Tensor | None:
        """The state ``store[key]`` (shaped like ``like``). Before the first ``save`` it is
        ``initial`` (a numpy array) if given, else ``None`` here, zeros in adapters whose state must
        exist from the first traced call."""
        pending = self._pending
        if pending is not None and (id(store), key) in pending:
            return pending[(id(store), key)][2]
        return ops.read_state(store, key, like, initial)

    def load_rows(self, ops: Ops, index_store: dict, value_store: dict, key: str, like_indices: Tensor,
                  like: Tensor) -> tuple[Tensor, Tensor] | None:
        """Rows kept as state (``save`` of indices into ``index_store`` and their 2-d values into
        ``value_store``), whose number changes from step to step; ``None`` before the first save
        here, no rows in adapters whose state must exist from the first traced call."""
        ops.prepare_rows(index_store, value_store, key, like_indices, like)
        indices = self.load(ops, index_store, key, like=like_indices)
        return None if indices is None else (indices, self.load(ops, value_store, key, like=like))

    def save(self, ops: Ops, store: dict, key: str, value: Tensor) -> None:
        pending = self._pending
        if pending is not None:
            pending[(id(store), key)] = (store, key, value)
        else:
            self._check_owner()
            ops.write_state(store, key, value)

    def counter(self, ops: Ops, store: dict, key: str, increment: Any = 1) -> Any:
        """Add ``increment`` to the integer counter ``store[key]`` (0 at first) and return its value
        before the addition."""
        increment = ops.as_count(increment)
        pending = self._pending
        if pending is None:
            self._check_owner()
            return ops.add_to_count(store, key, increment)
        entry = pending.get((id(store), key))
        value = entry[2] if entry is not None else ops.count_of(store, key)
        pending[(id(store), key)] = (store, key, value + increment)
        return value

    # --- checkpoints and counters ---------------------------------------------------------------
    @staticmethod
    def export(stores: dict[str, dict]) -> dict[str, dict]:
        """Copies of every value of named stores (``{attribute: store}``), as ``state_dict`` saves
        them."""
        return {attr: {key: snapshot(v) for key, v in entries.items()} for attr, entries in stores.items()}

    @staticmethod
    def restore(store: dict, key: str, value: Any, ops: Ops | None = None) -> None:
        """Put a saved ``value`` back into ``store[key]``, held as ``ops`` holds state (a TensorFlow
        variable is assigned); without ``ops``, as the value already there is held."""
        if ops is None and _held(store.get(key, 0)):
            ops = ops_for(store[key])
        if ops is None:
            store[key] = snapshot(value)
        else:
            ops.write_state(store, key, snapshot(value))

    @staticmethod
    def zero_counts(store: dict) -> None:
        """Set every counter of ``store`` to 0, in place (a traced graph keeps updating the
        variables it holds)."""
        for key, value in store.items():
            if _held(value):
                ops_for(value).write_state(store, key, 0)
            else:
                store[key] = 0


DEFAULT = StateStore()
"""The store of compressors and memories used outside a pipeline."""
