"""FlexAttention mods (plain Python) -> normalized aten graphs, without torch.compile.

A ``score_mod(score, b, h, q_idx, kv_idx)`` or ``mask_mod(b, h, q_idx, kv_idx)`` is traced once
with :func:`torch.fx.experimental.proxy_tensor.make_fx` on 0-d fake tensors (``score`` float32,
indices int32, as torch's kernels see them). Indexing a captured tensor with index tensors
(``doc_ids[q_idx]``, ``bias[h, q_idx - kv_idx + off]``) is recorded as ``aten.index`` (not as a
data-dependent ``select``) by :class:`GetItemToIndex`. Every tensor the mod reads from its
closure, its globals or a ``functools.partial`` becomes a *captured tensor*: a graph input passed
to the kernels as a pointer at run time, never a baked-in value.

Two levels of caching keep the per-call cost at a dictionary lookup:

* :func:`describe` walks the mod (code objects, closure cells, referenced globals, partial
  arguments) into a hashable *spec* in which every tensor is a slot (dtype, shape,
  requires_grad); the tensors themselves are returned on the side. A new document layout in the
  same tensor shape gives the same spec, hence no new trace and no new kernel.
* the traced graph's canonical text keys the generated device code (:mod:`solattn.flex.codegen`).

:func:`describe` is written so that Dynamo can trace it (closure and global reads, no
try/except): under ``torch.compile`` the captured tensors become graph inputs of the
``solattn::flex_*`` custom ops, and :func:`lookup` (``assume_constant_result``) runs once at
trace time.
"""

from __future__ import annotations

import functools
import operator
import types
from dataclasses import dataclass

import torch
from torch.overrides import TorchFunctionMode

SCORE, MASK = "score_mod", "mask_mod"
_MAX_DEPTH = 6  # closures of closures (and_masks of and_masks ...) deeper than this: uncacheable


# What a mod may use (the operations solattn.flex.codegen turns into device code).
SUPPORTED = ("arithmetic, comparisons, torch.where, abs, exp, log, sqrt, tanh, sigmoid, pow by a "
             "constant, min/max/clamp, integer // and %, logical/bitwise & | ~ ^, casts, and "
             "indexing a captured tensor with one index per dimension")


class UnsupportedModError(NotImplementedError):
    """A mod uses an operation that solattn cannot turn into device code."""


class GetItemToIndex(TorchFunctionMode):
    """``t[i, j]`` with tensor (or int) indices -> ``aten.index`` (torch's flex does the same):
    a 0-d index tensor would otherwise be turned into a Python int, i.e. a data-dependent
    ``select`` that cannot be traced. ``failed`` keeps the first torch function that raised,
    so that a tracing error names the operation (:func:`_trace_error`)."""

    def __init__(self):
        super().__init__()
        self.failed = None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.__getitem__:
            tensor, index = args
            index = index if isinstance(index, tuple) else (index,)
            if all(isinstance(i, (torch.Tensor, int)) and not isinstance(i, bool)
                   for i in index):
                index = [torch.tensor(i, dtype=torch.int64, device=tensor.device)
                         if isinstance(i, int) else i for i in index]
                return torch.ops.aten.index.Tensor(tensor, index)
        try:
            return func(*args, **(kwargs or {}))
        except Exception:
            if self.failed is None:
                self.failed = func
            raise


# ---------------------------------------------------------------------------------------------
# describe: a hashable spec of a mod, and its captured tensors (Dynamo-traceable)
# ---------------------------------------------------------------------------------------------

_NAMES: dict = {}


@torch._dynamo.assume_constant_result
def _global_names(code: types.CodeType) -> tuple:
    """Names a code object (and the code objects nested in it) may read as globals."""
    names = _NAMES.get(code)
    if names is None:
        found, stack = [], [code]
        while stack:
            c = stack.pop()
            found.extend(c.co_names)
            stack.extend(k for k in c.co_consts if isinstance(k, types.CodeType))
        names = _NAMES[code] = tuple(dict.fromkeys(found))
    return names


def _is_jit(obj) -> bool:
    from triton.runtime.jit import JITFunction

    return isinstance(obj, JITFunction) or type(obj).__name__ == "InterpretedFunction"


def describe(obj, tensors: list, depth: int = 0):
    """Hashable spec of ``obj`` (a mod, or something it reads); tensors are appended to
    ``tensors`` and stand in the spec as ``("tensor", dtype, shape, requires_grad)``.

    Numbers are recorded exactly (``operator.index`` / ``float.hex`` also make Dynamo specialize
    on them). Objects solattn cannot fingerprint become ``("opaque", type name)``: the mod still
    runs (traced on every call in eager mode), but its trace is not cached.
    """
    if depth > _MAX_DEPTH:
        return ("opaque", "nesting")
    if isinstance(obj, torch.Tensor):
        tensors.append(obj)
        return ("tensor", obj.dtype, tuple(operator.index(s) for s in obj.shape),
                obj.requires_grad)
    if obj is None or isinstance(obj, (bool, str, torch.dtype)):
        return ("c", obj)
    if isinstance(obj, int):
        return ("int", operator.index(obj))
    if isinstance(obj, float):
        return ("float", obj.hex())
    if isinstance(obj, (tuple, list)):
        return ("seq", tuple(describe(x, tensors, depth + 1) for x in obj))
    if isinstance(obj, types.ModuleType):
        return ("module", obj.__name__)
    if isinstance(obj, type) or isinstance(obj, (types.BuiltinFunctionType,
                                                 torch._ops.OpOverloadPacket)):
        return ("c", obj)
    if isinstance(obj, functools.partial):
        return ("partial", describe(obj.func, tensors, depth + 1),
                describe(obj.args, tensors, depth + 1),
                tuple((k, describe(v, tensors, depth + 1)) for k, v in obj.keywords.items()))
    if isinstance(obj, types.MethodType):
        return ("method", describe(obj.__func__, tensors, depth + 1),
                describe(obj.__self__, tensors, depth + 1))
    if isinstance(obj, types.FunctionType):
        code = obj.__code__
        cells = tuple(describe(c.cell_contents, tensors, depth + 1)
                      for c in (obj.__closure__ or ()))
        glob = obj.__globals__
        names = tuple((n, describe(glob[n], tensors, depth + 1))
                      for n in _global_names(code) if n in glob)
        return ("fn", code, cells, names, describe(obj.__defaults__, tensors, depth + 1))
    if _is_jit(obj):
        return ("jit", obj)
    return ("opaque", type(obj).__name__)


def _cacheable(spec) -> bool:
    if isinstance(spec, tuple):
        if spec and spec[0] == "opaque":
            return False
        return all(_cacheable(s) for s in spec)
    return True


# ---------------------------------------------------------------------------------------------
# tracing
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Capture:
    """A captured tensor as the generated code sees it."""

    dtype: torch.dtype
    ndim: int
    grad: bool  # float tensor with requires_grad: the backward accumulates its gradient


@dataclass
class TracedMod:
    """A mod as aten graphs over placeholders ``[score,] b, h, q_idx, kv_idx, cap0, ...``.

    ``bwd`` (score mods) adds a trailing ``grad`` placeholder and returns
    ``(d score, d cap_i for the captures with grad=True)``.
    """

    kind: str
    name: str
    fwd: torch.fx.GraphModule
    bwd: torch.fx.GraphModule | None
    captures: tuple
    order: tuple  # captured tensor i of the graph is describe()'s tensors[order[i]]


def _examples(kind, device):
    idx = [torch.zeros((), dtype=torch.int32, device=device) for _ in range(4)]
    if kind == SCORE:
        return [torch.zeros((), dtype=torch.float32, device=device)] + idx
    return idx


def _op_name(func) -> str:
    """The public name of torch function ``func`` (``torch.fft.fft``, ``Tensor.item``)."""
    for prefix, module in (("torch.fft.", torch.fft), ("torch.linalg.", torch.linalg),
                           ("torch.special.", torch.special),
                           ("torch.nn.functional.", torch.nn.functional), ("torch.", torch)):
        for name in dir(module):
            if getattr(module, name, None) is func:
                return prefix + name
    name = getattr(func, "__name__", None)
    if name is not None and getattr(torch.Tensor, name, None) is func:
        return f"Tensor.{name}"
    return getattr(func, "__qualname__", None) or repr(func)


def _trace_error(fn, kind, exc, failed=None) -> Exception:
    """The :class:`UnsupportedModError` (a ``NotImplementedError``) of a mod whose tracing
    raised ``exc``: it names the mod, the operation that raised (``failed``, a torch function,
    when known) and what mods may use."""
    name = getattr(fn, "__name__", repr(fn))
    msg = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if "data-dependent" in str(exc).lower() or "GuardOnDataDependent" in type(exc).__name__:
        hint = (" (Python control flow on a tensor value, e.g. `if q_idx > 5:` or `.item()`: "
                "write it with torch.where)")
        return UnsupportedModError(f"flex_attention: cannot trace {kind} `{name}`: {msg}{hint}")
    op = f" uses {_op_name(failed)}, which" if failed is not None else ""
    return UnsupportedModError(
        f"flex_attention: {kind} `{name}`{op} cannot be traced into device code ({msg}). "
        f"Supported: {SUPPORTED}")


def trace(fn, kind: str, tensors: list) -> TracedMod:
    """Trace ``fn`` (``kind`` SCORE or MASK); ``tensors`` are the tensors :func:`describe` found
    in it (graph constants that are one of them become captured inputs)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    device = tensors[0].device if tensors else torch.device("cpu")

    mode = GetItemToIndex()

    def run(*args):
        with mode:
            return fn(*args)

    # Our own fake mode, not Dynamo's: under torch.compile this runs at trace time, inside a
    # TracingContext whose fake mode would reject the real captured tensors.
    with torch._guards.tracing(None):
        try:
            gm = make_fx(run, tracing_mode="fake", _allow_non_fake_inputs=True)(
                *_examples(kind, device))
        except UnsupportedModError:
            raise
        except Exception as exc:  # noqa: BLE001 - any tracing failure is reported with the mod
            raise _trace_error(fn, kind, exc, mode.failed) from exc
        fwd, order = _lift_captures(gm, fn, kind, tensors)
        caps = tuple(Capture(tensors[i].dtype, tensors[i].dim(),
                             tensors[i].requires_grad and tensors[i].is_floating_point())
                     for i in order)
        bwd = _trace_backward(fwd, caps, fn, device) if kind == SCORE else None
    return TracedMod(kind, getattr(fn, "__name__", type(fn).__name__), fwd, bwd, caps, order)


def _lift_captures(gm, fn, kind, tensors):
    """Rewrite ``gm`` so that constants that are captured tensors become placeholders
    ``cap0, cap1, ...`` (first-use order); 0-d constants made inside the mod stay constants."""
    graph = torch.fx.Graph()
    env, order, cap_nodes = {}, [], []
    names = (["score"] if kind == SCORE else []) + ["b", "h", "q_idx", "kv_idx"]
    olds = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for old, name in zip(olds, names):
        env[old] = graph.placeholder(name)
        env[old].meta = dict(old.meta)
    consts = {}
    for node in gm.graph.nodes:
        if node.op != "get_attr":
            continue
        value = getattr(gm, node.target)
        slot = next((i for i, t in enumerate(tensors) if t is value), None)
        if slot is None:
            if value.dim() != 0:
                raise UnsupportedModError(
                    f"flex_attention: {kind} `{getattr(fn, '__name__', fn)}` reads a tensor "
                    f"of shape {tuple(value.shape)} that solattn cannot pass to the kernel "
                    "(made inside the mod, or reached through an object attribute): create it "
                    "outside and capture it in a closure or a global")
            consts[node] = value
            continue
        if slot not in order:
            order.append(slot)
            cap_nodes.append(None)
        consts[node] = ("cap", order.index(slot))
    # placeholders for the captures, in first-use order (after the index placeholders)
    for i in range(len(order)):
        cap_nodes[i] = graph.placeholder(f"cap{i}")
        cap_nodes[i].meta["val"] = tensors[order[i]]
    root = torch.nn.Module()
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            continue
        if node.op == "get_attr":
            c = consts[node]
            if isinstance(c, tuple):
                env[node] = cap_nodes[c[1]]
            else:
                setattr(root, node.target, c)
                env[node] = graph.get_attr(node.target)
                env[node].meta = dict(node.meta)
            continue
        env[node] = graph.node_copy(node, lambda n: env[n])
    graph.eliminate_dead_code()
    return torch.fx.GraphModule(root, graph), tuple(order)


def _trace_backward(fwd, caps, fn, device):
    """The graph of ``(d score, d cap_i ...) = vjp(score_mod)(grad)`` (autograd, traced once)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    grad_caps = [i for i, c in enumerate(caps) if c.grad]

    def vjp(score, b, h, q_idx, kv_idx, *rest):
        *cap_vals, grad = rest
        with torch.enable_grad():
            out = fwd(score, b, h, q_idx, kv_idx, *cap_vals)
            wrt = [score] + [cap_vals[i] for i in grad_caps]
            if not out.requires_grad:
                return tuple(torch.zeros_like(w) for w in wrt)
            grads = torch.autograd.grad(out, wrt, grad, allow_unused=True)
        return tuple(torch.zeros_like(w) if g is None else g for w, g in zip(wrt, grads))

    cap_examples = []
    for i, c in enumerate(caps):
        shape = fwd.graph.find_nodes(op="placeholder", target=f"cap{i}")[0].meta["val"].shape
        t = torch.empty(shape, dtype=c.dtype, device=device)
        cap_examples.append(t.requires_grad_() if c.grad else t)
    score, *idx = _examples(SCORE, device)
    args = [score.requires_grad_()] + idx + cap_examples + [torch.zeros((), device=device)]
    try:
        return make_fx(vjp, tracing_mode="fake", _allow_non_fake_inputs=True)(*args)
    except Exception as exc:  # noqa: BLE001
        raise _trace_error(fn, SCORE + " (derivative)", exc) from exc
