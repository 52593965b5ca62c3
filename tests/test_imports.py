"""The package's import graph: no circles, and every import runs down the layers below.

The graph is read from the source with ``ast`` (module-level and function-level imports alike;
nothing is imported), plus the kernel modules :mod:`solattn.dispatch` imports by name from its
route tables. A module's layer is that of the longest prefix of :data:`LAYERS` naming it; an
import may stay in its layer or go down, never up. Leaves (layer 0) import nothing of solattn.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent / "solattn"

# Bottom up. A name is a module or a package (then every module under it, unless a longer name
# says otherwise).
LAYERS = {
    # 0: leaves -- the machine and what each architecture allows, the mask predicate, dropout's
    # fields, sinks, the oracle, the SASS reader, bf16 under the interpreter
    "solattn.device": 0, "solattn.arch": 0, "solattn.masking": 0, "solattn.dropout": 0,
    "solattn.sinks": 0, "solattn.reference": 0, "solattn.kernels.sass": 0,
    "solattn.interpreter": 0,
    # 1: what every kernel reads -- config tables, normalized parameters, launches, validation
    "solattn.configs": 1, "solattn.params": 1, "solattn.launch": 1, "solattn.validation": 1,
    # 2: kernels (device code and their host plans) and the flex mods' code generation
    "solattn.kernels": 2, "solattn.flex.trace": 2, "solattn.flex.codegen": 2,
    "solattn.flex.device": 2,
    # 3: the dispatcher, and the flex registry and BlockMask
    "solattn.dispatch": 3, "solattn.flex.registry": 3, "solattn.flex.block_mask": 3,
    "solattn.flex.examples": 3,
    # 4: internal entry points: custom ops and autograd
    "solattn.core": 4, "solattn.paged_kv": 4,
    # 5: the APIs
    "solattn.interface": 5, "solattn.kvcache": 5, "solattn.flex": 5,
    "solattn.distributed": 5,
    # 6: the package's face, integrations and tools
    "solattn": 6, "solattn.integrations": 6, "solattn.aot": 6, "solattn.warmup": 6,
    "solattn.bench": 6, "solattn.cli": 6,
}


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _target(name: str) -> str | None:
    """The solattn module an import of ``name`` loads (a package: its ``__init__``)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(module: str, path: pathlib.Path) -> set[str]:
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            # `from pkg import mod` imports pkg.mod where that is a module, else pkg itself
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base
                     for a in node.names]
        else:
            continue
        found |= {t for n in names if n.startswith("solattn") and (t := _target(n))}
    found.discard(module)
    return found


def _graph() -> dict[str, set[str]]:
    graph = {m: _imports(m, p) for m, p in MODULES.items()}
    from solattn import dispatch  # the kernels its routes import by name

    for direction in (v for v in vars(dispatch).values() if isinstance(v, dispatch.Direction)):
        graph["solattn.dispatch"] |= {route.kernel for route in direction.routes}
    return graph


GRAPH = _graph()


def layer(module: str) -> int:
    name = module
    while name not in LAYERS:
        name = name.rpartition(".")[0]
        if not name:
            raise KeyError(f"{module}: no layer in tests/test_imports.py LAYERS")
    return LAYERS[name]


def test_every_module_has_a_layer():
    for module in MODULES:
        layer(module)


def test_no_import_circles():
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(module, path):
        state[module] = 1
        for dep in sorted(GRAPH[module]):
            if state.get(dep) == 1:
                circle = path[path.index(dep):] + [dep]
                pytest.fail("import circle: " + " -> ".join(circle))
            if dep not in state:
                visit(dep, path + [dep])
        state[module] = 2

    for module in sorted(GRAPH):
        if module not in state:
            visit(module, [module])


def test_imports_run_down_the_layers():
    upward = [f"{m} (layer {layer(m)}) -> {d} (layer {layer(d)})"
              for m, deps in sorted(GRAPH.items()) for d in sorted(deps) if layer(d) > layer(m)]
    assert not upward, "imports that run back up:\n" + "\n".join(upward)


def test_leaves_import_nothing_of_solattn():
    leaves = [m for m in MODULES if layer(m) == 0]
    assert "solattn.device" in leaves
    assert {m: sorted(GRAPH[m]) for m in leaves if GRAPH[m]} == {}
