"""The result cache of ``solattn aot``: one JSON file per compiled (spec, architecture).

A result is keyed by a hash of what its compile depends on (:func:`spec_key`):

- the source files of the kernel's own module and of every solattn module it imports,
  transitively (:func:`module_files`), e.g. the portable forward's key reads
  ``kernels/triton/forward.py``, ``kernels/common.py``, ``masking.py``, ``configs.py``, ... but
  not the Hopper kernels; a generated flex mod (no file) adds the modules its code calls into
  (``flex/device.py`` and what that imports) and its own text;
- the spec (signature, constexprs, options, specialization attributes), the architecture, the
  Triton version and the ``TRITON_*`` settings of the environment;
- the code that turns a compile into a result (``compile_spec`` and ``kernels/sass.py``).

So an edit to one kernel recompiles only the specs whose kernel imports it; an edit to a shared
helper (``kernels/common.py``) recompiles every kernel that imports it. The cache lives in
``$SOLATTN_CI_CACHE/aot`` (default ``~/.cache/solattn-ci/aot``); ``SOLATTN_AOT_CACHE=0`` turns it
off. Entries no run has read for :data:`CACHE_DAYS` days are removed. A compile error is never
stored, so a failure never hides behind the cache.

Interface: :class:`ResultCache` (``from_env``, ``get``, ``put``, ``prune``, ``where``).
"""

from __future__ import annotations

import ast
import functools
import hashlib
import inspect
import json
import os
import re
import sys
import time

ROOT = os.path.dirname(os.path.abspath(__file__))  # the solattn package
PACKAGE = "solattn"
CACHE_DAYS = 14  # entries not read for this long are removed (old source versions)
# Files whose code turns a compile into the cached fields (the SASS reading), in every key.
_TOOL_FILES = ("kernels/sass.py",)
# Triton environment variables that do not change what a compile produces.
_ENV_IGNORED = ("TRITON_CACHE_DIR", "TRITON_HOME", "TRITON_INTERPRET", "TRITON_DUMP_DIR",
                "TRITON_OVERRIDE_DIR", "TRITON_PRINT_AUTOTUNING")


def directory() -> str | None:
    """Where results are cached (``$SOLATTN_CI_CACHE/aot``), or None under
    ``SOLATTN_AOT_CACHE=0``."""
    if os.environ.get("SOLATTN_AOT_CACHE", "1") in ("0", ""):
        return None
    root = os.environ.get("SOLATTN_CI_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "solattn-ci")
    return os.path.join(root, "aot")


# ---------------------------------------------------------------------------------------------
# What a kernel depends on: its module and the solattn modules it imports, transitively
# ---------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def module_path(name: str) -> str | None:
    """Path of solattn module ``name`` relative to the package (``kernels/common.py``, a
    package's ``__init__.py``), or None for a module outside solattn or the package itself
    (the root ``__init__`` re-exports the public API and holds no device code)."""
    parts = name.split(".")
    if parts[0] != PACKAGE or len(parts) == 1:
        return None
    base = os.path.join(*parts[1:])
    for rel in (base + ".py", os.path.join(base, "__init__.py")):
        if os.path.isfile(os.path.join(ROOT, rel)):
            return rel.replace(os.sep, "/")
    return None


@functools.lru_cache(maxsize=None)
def _imports(name: str) -> tuple[str, ...]:
    """The solattn modules that module ``name``'s source imports anywhere in it (top level or
    inside functions)."""
    rel = module_path(name)
    with open(os.path.join(ROOT, rel)) as f:
        tree = ast.parse(f.read(), rel)
    package = name if rel.endswith("__init__.py") else name.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from the package, up level - 1
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(base + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            for alias in node.names:  # `from pkg import mod` imports the submodule
                sub = f"{base}.{alias.name}"
                out.append(sub if module_path(sub) else base)
    return tuple(dict.fromkeys(m for m in out if module_path(m) and m != name))


@functools.lru_cache(maxsize=None)
def module_files(name: str) -> tuple[str, ...]:
    """Sorted package-relative paths of module ``name`` and of every solattn module it imports,
    transitively, with their parent packages' ``__init__.py`` below the root (importing a module
    runs them; what they import in turn is the package's API, not the kernel's code, and is not
    followed). Empty for a module outside solattn."""
    seen, todo = set(), [name] if module_path(name) else []
    while todo:
        mod = todo.pop()
        if mod not in seen:
            seen.add(mod)
            todo += _imports(mod)
    parents = {".".join(m.split(".")[:i]) for m in seen for i in range(2, len(m.split(".")))}
    return tuple(sorted({module_path(m) for m in seen | parents}))


@functools.lru_cache(maxsize=None)
def file_digest(rel: str) -> str:
    """SHA-256 of one package file's bytes (``rel`` relative to the package)."""
    with open(os.path.join(ROOT, rel), "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _python_fn(obj):
    """The Python function under a (Gluon) JIT function, or None for anything else."""
    while hasattr(obj, "fn") and not inspect.isfunction(obj):
        obj = obj.fn
    return obj if inspect.isfunction(obj) else None


def _jit_values(value):
    """Every function object in a constexpr or option value (nested in tuples, lists, dicts)."""
    if isinstance(value, (tuple, list)):
        for item in value:
            yield from _jit_values(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _jit_values(item)
    elif _python_fn(value) is not None:
        yield value


def _function_sources(fn) -> list[tuple[str, str]]:
    """``(name, digest)`` of the source files function ``fn`` depends on: its solattn module's
    :func:`module_files`; for a module outside solattn with a file (a test's kernel) that file;
    for generated code without a file (flex mods) its module's name (which carries a digest of
    the whole generated source, :func:`solattn.flex.codegen.compile_mod`) and the modules of the
    solattn objects its code refers to."""
    py = _python_fn(fn)
    module = getattr(py, "__module__", "") or ""
    if module_path(module):
        return [(rel, file_digest(rel)) for rel in module_files(module)]
    path = getattr(sys.modules.get(module), "__file__", None)
    if path and os.path.isfile(path):
        with open(path, "rb") as f:
            return [(os.path.basename(path), hashlib.sha256(f.read()).hexdigest())]
    used = {("<generated>", module)}
    for value in getattr(py, "__globals__", {}).values():
        inner = _python_fn(value)  # a JIT function's own module, not its wrapper class's
        owner = (value.__name__ if inspect.ismodule(value)
                 else getattr(inner or value, "__module__", None))
        if isinstance(owner, str) and module_path(owner):
            used.update((rel, file_digest(rel)) for rel in module_files(owner))
    return sorted(used)


def spec_sources(spec) -> list[tuple[str, str]]:
    """``(path, digest)`` of every source file ``spec``'s compile reads: the kernel's and those
    of the JIT functions among its constexprs and options (generated flex mods)."""
    out = set(_function_sources(spec.fn))
    for value in list(spec.constexprs.values()) + list(spec.options.values()):
        for fn in _jit_values(value):
            out.update(_function_sources(fn))
    return sorted(out)


def stable_text(value) -> str:
    """Text of a constexpr or option that is the same in every process: a jit function by its
    name and source (generated flex mods have no file), other callables by name, the rest by
    ``repr`` without memory addresses."""
    src = getattr(value, "src", None)
    if isinstance(src, str):
        name = getattr(value, "__name__", None) or getattr(getattr(value, "fn", None),
                                                           "__name__", "?")
        return f"jit {name} {hashlib.sha256(src.encode()).hexdigest()}"
    if callable(value) and hasattr(value, "__qualname__"):
        return f"{getattr(value, '__module__', '')}.{value.__qualname__}"
    return re.sub(r" at 0x[0-9a-fA-F]+", "", repr(value))


def compile_env() -> list:
    """Every ``TRITON_*`` environment variable that is set (ptxas paths, FP fusion, ...) but
    :data:`_ENV_IGNORED`: coarser than Triton's own list, so a setting never reads a result
    compiled without it."""
    return sorted((k, v) for k, v in os.environ.items()
                  if k.startswith("TRITON_") and k not in _ENV_IGNORED)


def spec_key(spec, arch: int, tool: tuple = ()) -> str:
    """Content hash of what one compile of ``spec`` for ``sm_{arch}`` depends on
    (:func:`spec_sources`, the spec, the architecture, the Triton version and settings) and of
    the code that reads its result (``tool``: functions hashed by their source, and
    :data:`_TOOL_FILES`)."""
    import triton

    payload = dict(
        sources=spec_sources(spec), fn=stable_text(spec.fn), name=spec.name,
        gluon=spec.gluon, signature=sorted(spec.signature.items()),
        constexprs=sorted((k, stable_text(v)) for k, v in spec.constexprs.items()),
        options=sorted((k, stable_text(v)) for k, v in spec.options.items()),
        pointer_args=list(spec.pointer_args), divisible_args=list(spec.divisible_args),
        arch=arch, triton=triton.__version__, env=compile_env(),
        tool=[file_digest(rel) for rel in _TOOL_FILES]
        + [hashlib.sha256(inspect.getsource(fn).encode()).hexdigest() for fn in tool])
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:32]


# ---------------------------------------------------------------------------------------------
# The store
# ---------------------------------------------------------------------------------------------

class ResultCache:
    """Results of ``(spec, arch)`` compiles under ``path`` (None: off), each a dict of
    ``fields``; ``tool`` are the functions whose source is part of every key (the compile and
    the reading of its result)."""

    def __init__(self, path: str | None, fields: tuple, tool: tuple = ()):
        self.path, self.fields, self.tool = path, tuple(fields), tuple(tool)
        self._keys: dict = {}

    @classmethod
    def from_env(cls, fields: tuple, tool: tuple = ()) -> ResultCache:
        """The cache :func:`directory` names (off under ``SOLATTN_AOT_CACHE=0``)."""
        return cls(directory(), fields, tool)

    @property
    def where(self) -> str:
        return self.path or "off (SOLATTN_AOT_CACHE=0)"

    def key(self, spec, arch: int) -> str:
        memo = (id(spec), arch)
        if memo not in self._keys:
            self._keys[memo] = (spec, spec_key(spec, arch, self.tool))  # spec: keeps id valid
        return self._keys[memo][1]

    def get(self, spec, arch: int) -> dict | None:
        """The stored fields of this compile, or None (not stored, unreadable, cache off).
        Reading an entry marks it used (its mtime), which keeps it from :meth:`prune`."""
        if self.path is None:
            return None
        path = os.path.join(self.path, f"{self.key(spec, arch)}.json")
        try:
            with open(path) as f:
                entry = json.load(f)
            os.utime(path)
        except (OSError, ValueError):
            return None
        return entry if set(self.fields) <= set(entry) else None

    def put(self, spec, arch: int, fields: dict) -> None:
        """Store a result's ``fields``; the caller stores only successful compiles."""
        if self.path is None:
            return
        os.makedirs(self.path, exist_ok=True)
        path = os.path.join(self.path, f"{self.key(spec, arch)}.json")
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump({name: fields[name] for name in self.fields}, f)
        os.replace(tmp, path)  # atomic: concurrent runs never read half a file

    def prune(self) -> None:
        """Remove entries no run has read for :data:`CACHE_DAYS` days (a few hundred bytes
        each, one set per version of a kernel's sources)."""
        if self.path is None or not os.path.isdir(self.path):
            return
        cutoff = time.time() - CACHE_DAYS * 86400
        for entry in os.scandir(self.path):
            try:
                if entry.name.endswith(".json") and entry.stat().st_mtime < cutoff:
                    os.remove(entry.path)
            except OSError:  # another run removed it first
                pass
