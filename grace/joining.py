"""The units a bucket compresses: its tensors one by one, or joined into one vector.

``granularity="bucket"`` joins a bucket's float tensors of one dtype into one vector (top-k over the
bucket, one scale per bucket); at ``granularity="layer"`` an element-wise codec without state
still encodes a bucket's tensors of one dtype and route as one vector, with the same bits as one
by one and its fixed costs (flag, encoding, decoding) paid once per bucket. ``Pipeline`` asks
``entries`` for a bucket's units and encodes each."""

from __future__ import annotations

from typing import Callable

from grace.exchange import Entry
from grace.ops import FLOAT_DTYPES, Ops, Tensor
from grace.plan import Route


def entries(tensors: list[Tensor], names: list[str], ops: Ops, granularity: str,
            join_alike: bool, route: Callable[[tuple, str], Route], overwrite: bool = False,
            lent: bool = False) -> list[Entry]:
    """The units a bucket compresses: each tensor (``granularity="layer"``), or its float tensors
    of one dtype joined into one vector named after the bucket (``"bucket"``, a vector of the
    pipeline's own, which error feedback may write into). ``join_alike``: at ``"layer"``, join the
    tensors of one dtype and ``route`` (shape, dtype -> ``Route``) into one vector, for a codec
    whose bits are the same either way (``Pipeline._joins_alike`` says when). ``overwrite`` and
    ``lent`` as ``Pipeline.start_bucket`` takes them."""
    whole = [Entry(name, [i], [ops.shape(t)], t, owned=overwrite, lent=overwrite and lent)
             for i, (t, name) in enumerate(zip(tensors, names))]
    if len(tensors) > 1 and join_alike and granularity == "layer":
        return _joined_alike(whole, ops, route)
    if granularity == "layer" or len(tensors) == 1:
        return whole
    joined: dict[str, list[int]] = {}
    for i, t in enumerate(tensors):
        if ops.dtype(t) in FLOAT_DTYPES and ops.numel(t) > 0:
            joined.setdefault(ops.dtype(t), []).append(i)
    units = [whole[i] for i in range(len(tensors)) if not any(i in g for g in joined.values())]
    for dtype, positions in joined.items():
        name = f"bucket.{names[positions[0]]}" + (f".{dtype}" if len(joined) > 1 else "")
        flat = ops.concat([ops.flatten(tensors[i]) for i in positions])
        units.append(Entry(name, positions, [ops.shape(tensors[i]) for i in positions], flat,
                           owned=True))  # ``Ops.concat`` makes a new tensor
    return units


def _joined_alike(whole: list[Entry], ops: Ops, route: Callable[[tuple, str], Route]) -> list[Entry]:
    """``whole``'s float tensors joined into one entry per (dtype, route), each entry keeping
    its tensors' route; the others (empty, integer) as they are."""
    groups: dict[tuple[str, Route], list[Entry]] = {}
    kept = []
    for entry in whole:
        dtype = ops.dtype(entry.source)
        way = route(tuple(ops.shape(entry.source)), dtype)
        if dtype in FLOAT_DTYPES and way in (Route.DENSE, Route.COMPRESSED):
            groups.setdefault((dtype, way), []).append(entry)
        else:
            kept.append(entry)
    for (dtype, way), members in groups.items():
        if len(members) == 1:
            kept.append(members[0])
            continue
        # Tensors that lie end to end already (a DDP bucket's) are joined by a view of them;
        # it is written into only where the caller gave them over (``overwrite``).
        view = ops.adjacent([e.source for e in members])
        flat = view if view is not None else ops.concat([ops.flatten(e.source) for e in members])
        kept.append(Entry(f"joined.{members[0].name}.{way.value}",
                          [e.positions[0] for e in members], [e.shapes[0] for e in members],
                          flat, owned=view is None or all(e.owned for e in members),
                          lent=view is not None and any(e.lent for e in members),
                          route=way))
    return kept
