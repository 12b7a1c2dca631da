"""Workers must agree on how they compress and on what: a check made once, when a wrapper is built.

Each worker describes its set-up (``describe``); the descriptions of all workers are gathered (the
framework wrapper does that with Horovod's ``allgather_object``), and ``disagreements`` lists what
differs, so that every worker raises the same clear error instead of hanging in a collective or, worse,
adding up payloads of different layouts."""

from __future__ import annotations

from typing import Any, Iterable, Sequence


def describe(pipeline: Any, tensors: Iterable[tuple[str, Sequence[int], str]], **options: Any) -> dict:
    """This worker's set-up: the pipeline (its class and parameters), the wrapper's options, and
    each tensor's name, shape and dtype."""
    return {"pipeline": repr(pipeline), "options": {k: repr(v) for k, v in sorted(options.items())},
            "tensors": {name: (tuple(int(d) for d in shape), str(dtype)) for name, shape, dtype in tensors}}


def disagreements(descriptions: Sequence[dict]) -> list[str]:
    """What the workers' descriptions disagree on, each difference in one sentence naming the
    workers (empty when they all agree)."""
    problems = []
    first = descriptions[0]
    for rank, other in enumerate(descriptions[1:], start=1):
        if other["pipeline"] != first["pipeline"]:
            problems.append(f"worker 0 compresses with {first['pipeline']} but worker {rank} with "
                            f"{other['pipeline']}")
        for key in sorted(set(first["options"]) | set(other["options"])):
            a, b = first["options"].get(key), other["options"].get(key)
            if a != b:
                problems.append(f"{key} is {a} on worker 0 but {b} on worker {rank}")
        names0, names = set(first["tensors"]), set(other["tensors"])
        for name in sorted(names0 - names):
            problems.append(f"tensor {name!r} exists on worker 0 but not on worker {rank}")
        for name in sorted(names - names0):
            problems.append(f"tensor {name!r} exists on worker {rank} but not on worker 0")
        for name in sorted(names0 & names):
            (shape0, dtype0), (shape, dtype) = first["tensors"][name], other["tensors"][name]
            if (shape0, dtype0) != (shape, dtype):
                problems.append(f"tensor {name!r} is {dtype0} {list(shape0)} on worker 0 but "
                                f"{dtype} {list(shape)} on worker {rank}")
    return problems


def check(descriptions: Sequence[dict]) -> None:
    """Raise ``ValueError`` listing every disagreement."""
    problems = disagreements(descriptions)
    if problems:
        raise ValueError("grace: the workers are not set up alike, so their gradients cannot be "
                         "combined: " + "; ".join(problems))
