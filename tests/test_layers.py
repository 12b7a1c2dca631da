"""The layers under the algorithms keep to one concern each: ``Ops`` holds general tensor
primitives, grace/native's loops are found by one layer (``grace.kernels``) for any adapter, and
state lives in a store its pipeline owns, whose transaction no part can escape; the core imports
no framework and none of its modules imports one that imports it back."""

from __future__ import annotations

import ast
import collections
import contextlib
import graphlib
import importlib
import inspect
import os
import pkgutil
import re
from pathlib import Path

import numpy as np
import pytest
import torch

import grace
import grace.compressors
from grace import kernels, native, selection, steps
from grace.backends import NumpyOps
from grace.ops import Ops
from grace.state import DEFAULT, StateStore
from tests.test_fusion import exchange


def as_numpy(x) -> np.ndarray:
    """A tensor's values, as numpy; bfloat16 (which numpy lacks) as its bits."""
    if isinstance(x, torch.Tensor):
        return x.view(torch.int16).numpy() if x.dtype == torch.bfloat16 else x.numpy()
    return np.asarray(x)

ROOT = Path(__file__).resolve().parents[1]


def accelerated_steps() -> dict[str, object]:
    """Every ``@accelerated`` step of grace.steps, grace.selection and the compressors, by kernel."""
    modules = [steps, selection] + [importlib.import_module(f"grace.compressors.{m.name}")
                         for m in pkgutil.iter_modules(grace.compressors.__path__)]
    found = {}
    for module in modules:
        for _, fn in inspect.getmembers(module, inspect.isfunction):
            if hasattr(fn, "kernel") and fn.__module__ == module.__name__:
                found[fn.kernel] = fn
    return found


def test_ops_holds_no_step_named_after_a_kernel_and_no_dispatch_to_them():
    names = {n for n in dir(Ops) if not n.startswith("_")}
    assert "fused" not in names
    # The kernels that remain Ops primitives are the general ones every adapter defines itself.
    assert names & set(native.KERNELS) == {"unpack_values"}
    assert not {"quantize_levels", "sign_bits", "block_sums", "unpack_blocks", "scaled_sum",
                "sub_matmul", "load", "save", "counter", "within", "commit"} & names


def _names_in(node) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)} | {
        n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)}


def test_no_algorithm_calls_a_kernel_or_the_native_library_by_name():
    """By the code's structure, not its text (a docstring may say "native"): no algorithm (a
    compressor's or memory's class) and no composite step (a function marked ``@accelerated``)
    names the native layer, its runners, a name it was imported as, or a module-level function
    that names them (a compressor's own loop drivers), and nothing takes from grace.kernels
    anything but the ``accelerated`` decorator. A compressor module's own loops, declared and
    registered at module level beside its C file, are the only native code it holds (memories
    hold none)."""
    banned = {"native", "kernels", "run_kernel", "fused", "KERNELS"}
    for path in sorted((ROOT / "grace" / "compressors").glob("*.py")) + sorted(
            (ROOT / "grace" / "memories").glob("*.py")):
        tree = ast.parse(path.read_text())
        has_loops = path.parent.name == "compressors" and path.with_suffix(".c").exists()
        forbidden = set(banned)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                names = {a.name for a in node.names}
                assert (node.module or "").split(".")[-1] != "native", path.name
                if (node.module or "").endswith("kernels"):
                    assert names == {"accelerated"}, (path.name, names)
                assert not names & (banned - {"native"} if has_loops else banned), path.name
                forbidden |= {a.asname for a in node.names if a.asname and a.name in banned}
            elif isinstance(node, ast.Import):
                assert not {a.name for a in node.names if a.name.split(".")[-1] in banned}, path.name
        # The module's own loop drivers: module-level functions that name the native layer.
        forbidden |= {node.name for node in tree.body if isinstance(node, ast.FunctionDef)
                      and _names_in(node) & forbidden}
        for node in tree.body:
            marked = isinstance(node, ast.FunctionDef) and any(
                "accelerated" in _names_in(d) for d in node.decorator_list)
            if isinstance(node, ast.ClassDef) or marked:
                assert not _names_in(node) & forbidden, (path.name, node.name, _names_in(node) & forbidden)
            elif not has_loops:
                assert not _names_in(node) & forbidden, (path.name, getattr(node, "name", None))


def _exported(c_file) -> set[str]:
    return set(re.findall(r"^(?:void|int64_t) (grace_\w+)\(", c_file.read_text(), re.M))


def test_every_loop_is_declared_once_beside_its_c_file():
    """Each exported C loop is declared (a ``native.Loop`` of its symbol, written anywhere in
    grace/ or frameworks/) exactly once, in the Python module beside its C file: the shared steps'
    in grace/native/__init__.py, a compressor's own in its module (``natural.c`` in
    ``natural.py``); and the library is built from exactly those files."""
    declared: dict[str, list[str]] = {}
    for path in sorted((ROOT / "grace").rglob("*.py")) + sorted((ROOT / "frameworks").rglob("*.py")):
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        for node in ast.walk(ast.parse(path.read_text())):  # every Loop(...) written anywhere
            if isinstance(node, ast.Call) and "Loop" in {getattr(node.func, "attr", None),
                                                         getattr(node.func, "id", None)}:
                symbol = node.args[0]
                assert isinstance(symbol, ast.Constant), (module, ast.dump(node)[:80])
                declared.setdefault(symbol.value, []).append(module)
    sources = [ROOT / "grace" / "native" / "kernels.c", *sorted((ROOT / "grace" / "compressors").glob("*.c"))]
    assert [os.path.realpath(s) for s in native.sources()] == [os.path.realpath(s) for s in sources]
    for source in sources:
        owner = "grace.native" if source.stem == "kernels" else f"grace.compressors.{source.stem}"
        for symbol in _exported(source):
            assert declared.get(symbol) == [owner], (symbol, declared.get(symbol))
    assert set(declared) == set().union(*map(_exported, sources))


def test_every_kernel_has_one_composite_step_written_against_the_protocol():
    found = accelerated_steps()
    assert set(found) == set(native.KERNELS)
    for kernel, step in found.items():
        assert step.composite is not step and callable(step.composite), kernel


@pytest.mark.skipif(not native.available(), reason=f"no C compiler: {native.reason()}")
@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_the_layer_runs_every_compressors_loops_for_any_adapter(backend, monkeypatch):
    """The numpy reference adapter defines no native code of its own, yet gets every loop: the
    layer reaches it through ``on_host`` and ``host_access`` alone."""
    calls = collections.Counter()
    run = native.run_kernel
    monkeypatch.setattr(native, "run_kernel",
                        lambda kernel, *a, **kw: calls.update([kernel]) or run(kernel, *a, **kw))
    x = np.random.default_rng(0).standard_normal(1 << 19).astype(np.float32)
    tensor = x if backend == "numpy" else torch.from_numpy(x)
    for name in grace.available():
        if backend == "numpy" and name == "bf16":  # numpy has no bfloat16
            continue
        t = tensor.reshape(512, -1) if name == "powersgd" else tensor
        results = []
        for loops in (True, False):  # the loops, then the composite code: the same bits
            compressor = grace.build(name).compressor  # a fresh one: the same draws
            with contextlib.nullcontext() if loops else native.disabled():
                payload, ctx = compressor.compress(t, "w")
                results.append([as_numpy(p) for p in payload]
                               + [as_numpy(compressor.decompress(payload, ctx))])
        for fast, composite in zip(*results):
            np.testing.assert_array_equal(fast, composite, err_msg=name)
    # residuals and momenta; the sum of gathered bfloat16 bits, a collective's (tests/test_native.py)
    expected = set(native.KERNELS) - {"unpack_blocks_onto", "scaled_sum", "bf16_rows_sum"}
    assert expected <= set(calls), expected - set(calls)


def test_a_kernel_that_does_not_exist_fails_where_the_step_is_written():
    with pytest.raises(KeyError, match="no kernel 'no_such_loop'"):
        kernels.accelerated("no_such_loop")


@pytest.mark.skipif(not native.available(), reason=f"no C compiler: {native.reason()}")
def test_a_step_runs_its_composite_code_where_the_policy_says_no():
    x = torch.randn(native.MIN_NUMEL + 3)
    fast = steps.sign_bits(NumpyOps(), x.numpy())
    with native.disabled():
        composite = steps.sign_bits(NumpyOps(), x.numpy())
    assert kernels.run(NumpyOps(), "sign_bits", [x.numpy()[:100]]) is None  # too small
    assert kernels.run(NumpyOps(), "sign_bits", [x.numpy().astype(np.float64)]) is None  # a dtype
    np.testing.assert_array_equal(fast, composite)


def test_a_pipeline_hands_its_own_store_to_every_part():
    pipeline = grace.build("dgc")
    assert pipeline.state_store is not DEFAULT
    for part in (pipeline.compressor, pipeline.memory, pipeline.takeover.dense_memory,
                 pipeline.rows.residual, pipeline.takeover.row_velocity):
        assert part.state_store is pipeline.state_store
    assert grace.build("dgc").state_store is not pipeline.state_store


def test_commit_applies_or_drops_every_pending_write():
    ops, store = NumpyOps(), StateStore()
    residuals, counts = {}, {}
    for flag, kept in ((1.0, False), (0.0, True)):
        transaction = {}
        with store.within(transaction):
            store.save(ops, residuals, "w", np.ones(3, np.float32))
            assert store.counter(ops, counts, "w") == 0 and store.counter(ops, counts, "w") == 1
            np.testing.assert_array_equal(store.load(ops, residuals, "w", like=np.zeros(3)), np.ones(3))
        assert residuals == {} and counts == {}  # pending until the verdict
        dropped = ops.is_set(np.array([flag], np.float32))
        assert dropped is not kept
        store.commit(ops, transaction, dropped)
        assert ("w" in residuals) is kept and counts.get("w", 0) == (2 if kept else 0)


def test_a_part_left_out_of_its_pipelines_store_is_refused_not_left_out_of_the_rollback():
    """A memory writing into another store during its pipeline's step would keep a step that the
    non-finite rollback drops: it is an error, at the write."""
    pipelines = [grace.build("topk", ratio=0.1) for _ in range(2)]
    for pipeline in pipelines:
        pipeline.memory.state_store = StateStore()
    with pytest.raises(RuntimeError, match="state_store"):
        exchange(pipelines, steps=1)


def grace_modules(root: Path) -> dict[str, tuple[Path, ast.Module]]:
    """Every module of ``root``'s ``grace`` package by its dotted name: its file, parsed."""
    modules = {}
    for path in sorted((root / "grace").rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        modules[name] = (path, ast.parse(path.read_text()))
    return modules


def grace_imports(root: Path) -> dict[str, set[str]]:
    """Per module of ``root``'s ``grace`` package, the modules it imports, anywhere in its code
    (at the top or inside a function): ``from grace import native`` names ``grace.native``, and
    ``grace`` itself only where one of the names is the package's own attribute."""
    modules = grace_modules(root)
    graph = {}
    for name, (path, tree) in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                found |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the package, one level up per extra dot
                    anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                submodules = {f"{base}.{a.name}" for a in node.names} & modules.keys()
                found |= submodules
                if len(submodules) < len(node.names):
                    found.add(base)
        graph[name] = found
    return graph


def import_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle among the modules of ``graph`` (``graphlib``'s), or None."""
    inside = {name: {m for m in imported if m in graph and m != name} for name, imported in graph.items()}
    try:
        graphlib.TopologicalSorter(inside).prepare()
    except graphlib.CycleError as error:
        return error.args[1]
    return None


ABOVE_THE_CORE = ("frameworks", "scripts", "tests", "torch", "tensorflow", "keras", "horovod")
"""What grace/ never imports: its adapters, the harness, and the frameworks themselves."""


def upward_imports(graph: dict[str, set[str]]) -> set[tuple[str, str]]:
    """(module, what it imports) for every import of ``graph`` from ``ABOVE_THE_CORE``."""
    return {(name, m) for name, imported in graph.items() for m in imported
            if m.split(".")[0] in ABOVE_THE_CORE}


def imports_by_name(root: Path) -> set[str]:
    """The modules of ``root``'s grace/ that import a module named by a string
    (``importlib.import_module``, ``__import__``), which ``grace_imports`` cannot follow."""
    found = set()
    for path, tree in grace_modules(root).values():
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and (getattr(node.func, "attr", None) == "import_module"
                                               or getattr(node.func, "id", None) == "__import__"):
                found.add(str(path.relative_to(root)))
    return found


def test_the_core_imports_no_framework_and_has_no_import_cycle():
    """grace/ is the core the adapters build on: no module of it imports an adapter
    (``frameworks``), the harness (``scripts``, ``tests``) or a framework (torch, TensorFlow, Keras,
    Horovod), and its modules import one another without a cycle, at the top or inside a function
    (no import deferred to dodge one). Adapters, grace's own numpy backend among them, are found
    through their entry points (``grace-entry-points.cfg``), by ``grace/adapters.py`` alone: the
    one module that imports by name, so that no other string import escapes this check."""
    graph = grace_imports(ROOT)
    assert len(graph) > 60 and {"grace.pipeline", "grace.joining", "grace.native"} <= graph.keys()
    assert "grace.exchange" in graph["grace.joining"] and "grace.native" in graph["grace.kernels"]
    assert not upward_imports(graph)
    assert import_cycle(graph) is None
    assert imports_by_name(ROOT) == {"grace/adapters.py"}


def test_the_import_check_finds_a_cycle_and_a_relative_import(tmp_path):
    """The checks above on a planted package: a cycle through a relative import inside a
    function, ``from . import`` in a package, ``from package import attribute`` naming the package
    itself, an import of an adapter and one by name."""
    (tmp_path / "grace" / "sub").mkdir(parents=True)
    (tmp_path / "grace" / "__init__.py").write_text("from grace.a import f\n")
    (tmp_path / "grace" / "a.py").write_text("from grace.sub import b\ndef f():\n    pass\n")
    (tmp_path / "grace" / "sub" / "__init__.py").write_text("from . import b\n")
    (tmp_path / "grace" / "sub" / "b.py").write_text("def g():\n    from ..c import h\n")
    (tmp_path / "grace" / "c.py").write_text("import frameworks.torch\nfrom grace import a, VERSION\n"
                                             "import importlib\nimportlib.import_module('torch')\n")
    graph = grace_imports(tmp_path)
    assert graph["grace.sub"] == {"grace.sub.b"}
    assert graph["grace.sub.b"] == {"grace.c"}
    assert graph["grace.c"] == {"frameworks.torch", "grace.a", "grace", "importlib"}
    assert upward_imports(graph) == {("grace.c", "frameworks.torch")}
    assert imports_by_name(tmp_path) == {"grace/c.py"}
    assert {"grace.a", "grace.sub.b", "grace.c"} <= set(import_cycle(graph))
    (tmp_path / "grace" / "sub" / "b.py").write_text("def g():\n    pass\n")
    assert import_cycle(grace_imports(tmp_path)) is None
