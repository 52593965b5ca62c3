"""Traced mods (aten graphs) -> ``@triton.jit`` device functions, generated once per graph.

Generated functions evaluate a mod element-wise on a tile. Their arguments are the kernels'
index vectors shaped for broadcasting (``q_idx`` ``[BLOCK_M, 1]``, ``kv_idx`` ``[1, BLOCK_N]``, or
transposed in the backward's dK/dV kernel), the scalars ``b`` and ``h`` (int32, the *query* head),
the fp32 ``score`` tile (``q.k * scale``, natural units, as torch's ``score_mod`` sees it) and
``ARGS``, a flat tuple with, per captured tensor, its pointer, its sizes and its strides::

    score_mod(score, b, h, q_idx, kv_idx, ARGS)            -> fp32 tile
    mask_mod(b, h, q_idx, kv_idx, ARGS)                    -> bool tile (broadcastable)
    score_mod_bwd(score, b, h, q_idx, kv_idx, ARGS, grad, GRADS, KV_AXIS, ACCUMULATE)
                                                           -> d score tile

``score_mod_bwd`` is the traced derivative (autograd on the graph, :mod:`solattn.flex.trace`):
given ``grad = dL/d score_mod(...)`` it returns ``dL/d score`` and, with ``ACCUMULATE``, adds the
gradients of captured tensors that require grad into fp32 buffers (``GRADS``: pointer and strides
per such tensor) with ``tl.atomic_add`` -- summed in the order the GPU runs the atomics, so these
gradients are not bitwise reproducible. A gradient gathered through an index that does not depend
on ``q_idx`` or ``kv_idx`` (``alibi_slopes[h]``) is first summed over that axis of the tile
(``KV_AXIS`` says which axis holds keys), so it costs one atomic per row, column or tile.

Captured loads are masked to their tensor's bounds (PyTorch's negative indices wrap first): an
index out of range for a padded row or a masked-out position reads 0 instead of faulting.
Integer ``//`` and ``%`` follow PyTorch (floor), not C. Functions are cached by the canonical text
of the traced graph and the captured tensors' dtypes/ranks, never by tensor values.
"""

from __future__ import annotations

import hashlib
import linecache
import math
import re
from dataclasses import dataclass, field

import torch

from solattn.flex.trace import MASK, SCORE, SUPPORTED, TracedMod, UnsupportedModError

TL_DTYPES = {
    torch.float32: "tl.float32", torch.float16: "tl.float16", torch.bfloat16: "tl.bfloat16",
    torch.float64: "tl.float64", torch.int8: "tl.int8", torch.int16: "tl.int16",
    torch.int32: "tl.int32", torch.int64: "tl.int64", torch.uint8: "tl.uint8",
    torch.bool: "tl.int1",
}
_LOW_FLOATS = (torch.float16, torch.bfloat16)
# The mods' index arguments, as the generated functions name them. Every kernel passes them
# non-negative (``b``, ``h``, and row / key indices counted from 0, clamped or padded upward),
# so indexing a captured tensor by one of them directly needs no negative-index wrap.
_NON_NEGATIVE = ("b", "h", "q_idx", "kv_idx")
# The functions' twins for Gluon kernels (ModFns.fwd_gluon, bwd_gluon): the same code without the
# layout-less constructors Gluon rejects (tl.full of a 0-d value, tl.zeros_like).
GLUON_SUFFIX = "_gl"

# Counters the tests read: traces of new mod specs, and device functions generated.
STATS = {"traced": 0, "generated": 0}


@dataclass
class ModFns:
    """The device functions of one traced mod."""

    kind: str
    name: str
    fwd: object                 # @triton.jit
    bwd: object | None          # score mods: the derivative (see module docstring)
    captures: tuple             # of trace.Capture
    noop: bool = False          # a mask_mod that is True everywhere (noop_mask)
    source: str = ""
    grad_captures: tuple = field(default=())  # indices of captures whose gradient bwd adds
    fwd_gluon: object = None    # fwd for a @gluon.jit caller (None: a @triton.jit mod as is)
    bwd_gluon: object = None    # bwd for a @gluon.jit caller (the Hopper flex backward)
    # The forward gathers a captured tensor by q_idx / kv_idx, or runs a transcendental, integer
    # division or modulo on values that vary over the tile: registers the Hopper flex forward's
    # 128-key tiles do not have at d=128 (flex_forward_plan.first_block_ns).
    heavy: bool = False


def _lit(v) -> str:
    if isinstance(v, bool):
        return "True" if v else "False"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v):
            return "float('nan')"
        if math.isinf(v):
            return "float('inf')" if v > 0 else "float('-inf')"
        return repr(v)
    raise UnsupportedModError(f"constant {v!r} of type {type(v).__name__}")


def _dtype(node) -> torch.dtype:
    val = node.meta.get("val")
    return val.dtype if isinstance(val, torch.Tensor) else None


def _shape(node):
    val = node.meta.get("val")
    return tuple(val.shape) if isinstance(val, torch.Tensor) else ()


class _Emitter:
    """Emits the body of one generated function from one aten graph."""

    def __init__(self, gm, kind: str, mod_name: str, captures: tuple, backward: bool,
                 gluon: bool = False):
        self.gm, self.kind, self.mod_name, self.captures = gm, kind, mod_name, captures
        self.backward = backward
        self.gluon = gluon  # Gluon callers: no layout-less constructors (see scalar / tile)
        self.lines: list[str] = []
        self.val: dict = {}    # node -> expression (a variable name or a literal)
        self.deps: dict = {}   # node -> frozenset of "q" / "kv": the tile axes a value varies on
        self.const: dict = {}  # node -> Python value, for values known at codegen time
        self.caps: dict = {}   # node -> capture index (placeholders of captured tensors)
        self.n = 0
        self.heavy = False  # a gather or a long-latency op on values that vary over the tile
        base, self.cap_base = 0, []
        for c in captures:
            self.cap_base.append(base)
            base += 1 + 2 * c.ndim

    # -- helpers ------------------------------------------------------------------------------
    def fail(self, what: str):
        raise UnsupportedModError(
            f"flex_attention: {self.kind} `{self.mod_name}` uses {what}, which solattn cannot "
            f"compile to device code. Supported: {SUPPORTED}")

    def new(self, expr: str, node=None, cast=True) -> str:
        name = f"v{self.n}"
        self.n += 1
        dt = _dtype(node) if node is not None else None
        if cast and dt is not None:
            if self.backward and dt in _LOW_FLOATS:
                dt = torch.float32  # derivatives stay in fp32 (accumulated in fp32 anyway)
            if dt not in TL_DTYPES:
                self.fail(f"dtype {dt}")
            expr = f"({expr}).to({TL_DTYPES[dt]})"
        self.lines.append(f"    {name} = {expr}")
        return name

    def arg(self, a):
        if isinstance(a, torch.fx.Node):
            if a in self.caps:
                return self.load_scalar_capture(a)
            return self.val[a]
        if isinstance(a, (bool, int, float)):
            return _lit(a)
        self.fail(f"an argument {a!r}")

    def dep(self, *args):
        out = frozenset()
        for a in args:
            if isinstance(a, torch.fx.Node):
                out |= self.deps.get(a, frozenset())
            elif isinstance(a, (list, tuple)):
                out |= self.dep(*a)
        return out

    def ARG(self, cap: int, k: int) -> str:
        return f"ARGS[{self.cap_base[cap] + k}]"

    def load_scalar_capture(self, node):
        """A 0-d captured tensor used as a value."""
        if node not in self.val:
            i = self.caps[node]
            if self.captures[i].ndim != 0:
                self.fail(f"a captured tensor of rank {self.captures[i].ndim} as a value "
                          "(index it with one index per dimension)")
            self.val[node] = self.new(f"tl.load({self.ARG(i, 0)})")
            self.deps[node] = frozenset()
        return self.val[node]

    def index_offsets(self, cap: int, indices, strides) -> tuple[str, str]:
        """``(offset, in-bounds mask)`` expressions of ``cap[indices]`` in a tensor of ``cap``'s
        shape whose ``k``-th stride is the expression ``strides(k)``."""
        ndim = self.captures[cap].ndim
        if len(indices) != ndim or any(i is None for i in indices):
            self.fail(f"indexing a {ndim}-D captured tensor with {len(indices)} index(es) "
                      "(one index tensor per dimension is needed, no slices)")
        offs, masks = [], []
        for k, i in enumerate(indices):
            size = self.ARG(cap, 1 + k)
            if isinstance(i, torch.fx.Node) and self.val.get(i) in _NON_NEGATIVE:
                # An index argument itself: never negative, so nothing wraps and only the upper
                # bound is checked (per column of the tile: 4 instructions fewer each).
                iv = self.val[i]
                masks.append(f"({iv} < {size})")
            else:
                iv = self.new(f"wrap_index({self.arg(i)}, {size})", cast=False)
                masks.append(f"({iv} >= 0) & ({iv} < {size})")
            offs.append(f"{iv} * {strides(k)}")
        return " + ".join(offs) or "0", " & ".join(masks) or "True"

    # -- one node -----------------------------------------------------------------------------
    def emit(self, node):
        op = node.op
        if op == "get_attr":
            value = getattr(self.gm, node.target)
            self.const[node] = value.item()
            self.val[node] = self.new(self.scalar(_lit(value.item()), TL_DTYPES[value.dtype]),
                                      cast=False)
            self.deps[node] = frozenset()
            return
        if op != "call_function":
            self.fail(f"a `{op}` node")
        if _shape(node) != () and not _is_grad_buffer(node):
            self.fail(f"`{_opname(node)}` producing a tensor of shape {_shape(node)} (a mod must "
                      "compute one value per (b, h, q_idx, kv_idx))")
        name, overload = _opname(node), node.target._overloadname
        args, kw = node.args, node.kwargs
        self.deps[node] = self.dep(*args, *kw.values())
        dt = _dtype(node)
        if name in _CONSTANT_MAKERS:
            value = _CONSTANT_MAKERS[name](node)
            self.const[node] = value
            self.val[node] = self.new(self.scalar(_lit(value), TL_DTYPES[dt]), cast=False)
            return
        if name in ("alias", "clone", "detach", "lift_fresh", "view", "reshape", "expand",
                    "squeeze", "unsqueeze", "_unsafe_view", "sum", "mean", "permute",
                    "lift_fresh_copy", "contiguous"):
            if name == "lift_fresh_copy" and args[0] in self.const:
                self.const[node] = self.const[args[0]]
            self.val[node] = self.arg(args[0])
            self.deps[node] = self.dep(args[0])
            return
        if name == "_to_copy":
            self.val[node] = self.new(self.arg(args[0]), node)
            return
        if name == "index":
            cap = self.caps.get(args[0])
            if cap is None:
                self.fail("indexing a value that is not a captured tensor")
            ndim = self.captures[cap].ndim
            off, mask = self.index_offsets(cap, list(args[1]),
                                           lambda k: self.ARG(cap, 1 + ndim + k))
            self.val[node] = self.new(
                f"tl.load({self.ARG(cap, 0)} + {off}, mask=({mask}) != 0, other=0)", node)
            self.heavy |= bool(self.deps[node])
            return
        expr = self.expression(node, name, overload, args, kw)
        self.heavy |= bool(self.deps[node]) and _HEAVY_OPS.search(expr) is not None
        self.val[node] = self.new(expr, node)

    def expression(self, node, name, overload, args, kw) -> str:
        a = [self.arg(x) if isinstance(x, (torch.fx.Node, bool, int, float)) else None
             for x in args]
        dt = _dtype(node)
        in_dt = _dtype(args[0]) if isinstance(args[0], torch.fx.Node) else None
        is_float = dt is not None and dt.is_floating_point
        if name in _BINARY:
            x, y = a[0], a[1]
            alpha = kw.get("alpha", 1)
            if name == "rsub":
                x, y = y, x
            if alpha != 1:
                y = f"{_lit(alpha)} * {y}"
            return f"{x} {_BINARY[name]} {y}"
        if name == "div":
            mode = kw.get("rounding_mode")
            if mode is None:
                if self.gluon and dt == torch.float32:
                    # div.full.f32 (2 ulp): IEEE division is a called subroutine, whose
                    # registers spill the Hopper kernel's consumers
                    return f"tl.fdiv(({a[0]}) * 1.0, ({a[1]}) * 1.0)"  # (fp32 operands)
                return f"{a[0]} / {a[1]}"
            if mode == "floor":
                return (f"floordiv_float({a[0]}, {a[1]})" if is_float
                        else f"floordiv_int({a[0]}, {a[1]})")
            return f"trunc_float({a[0]} / {a[1]})" if is_float else f"{a[0]} // {a[1]}"
        if name == "floor_divide":
            return (f"floordiv_float({a[0]}, {a[1]})" if is_float
                    else f"floordiv_int({a[0]}, {a[1]})")
        if name == "remainder":
            return (f"remainder_float({a[0]}, {a[1]})" if is_float
                    else f"remainder_int({a[0]}, {a[1]})")
        if name == "fmod" and not is_float:
            return f"{a[0]} % {a[1]}"
        if name in ("logical_and", "logical_or", "logical_xor"):
            sym = {"logical_and": "&", "logical_or": "|", "logical_xor": "^"}[name]
            return f"({a[0]} != 0) {sym} ({a[1]} != 0)"
        if name == "logical_not" or (name == "bitwise_not" and in_dt == torch.bool):
            return f"{a[0]} == 0"
        if name == "bitwise_not":
            return f"~{a[0]}"
        if name == "neg":
            return f"-{a[0]}"
        if name == "abs":
            return f"tl.abs({a[0]})"
        if name in _UNARY:
            x = a[0] if in_dt is not None and in_dt.is_floating_point else f"{a[0]}.to(tl.float32)"
            if self.gluon and name in _GLUON_UNARY:
                return _GLUON_UNARY[name].format(x=x)
            return _UNARY[name].format(x=x)
        if name in ("sign", "sgn"):
            return f"sign({a[0]})"
        if name == "reciprocal":
            return f"1.0 / {a[0]}"
        if name in ("maximum", "max"):
            return f"tl.maximum({a[0]}, {a[1]})"
        if name in ("minimum", "min"):
            return f"tl.minimum({a[0]}, {a[1]})"
        if name in ("clamp", "clamp_min", "clamp_max"):
            lo = args[1] if name != "clamp_max" and len(args) > 1 else kw.get("min")
            hi = args[2] if name == "clamp" and len(args) > 2 else (
                args[1] if name == "clamp_max" else kw.get("max"))
            x = a[0]
            if lo is not None:
                x = f"tl.maximum({x}, {self.arg(lo)})"
            if hi is not None:
                x = f"tl.minimum({x}, {self.arg(hi)})"
            return x
        if name == "where":
            return f"tl.where({a[0]}, {a[1]}, {a[2]})"
        if name == "masked_fill":
            return f"tl.where({a[1]}, {a[2]}, {a[0]})"
        if name == "pow":
            return self.power(node, overload, args, a, is_float)
        if name == "tanh_backward":
            return f"{a[0]} * (1.0 - {a[1]} * {a[1]})"
        if name == "sigmoid_backward":
            return f"{a[0]} * {a[1]} * (1.0 - {a[1]})"
        self.fail(f"`aten.{name}.{overload}`")

    def power(self, node, overload, args, a, is_float) -> str:
        if overload == "Tensor_Scalar":
            e = args[1]
            if isinstance(e, (int, float)) and float(e).is_integer() and 0 <= e <= 8:
                e = int(e)
                return " * ".join([a[0]] * e) if e else self.scalar("1", TL_DTYPES[_dtype(node)])
            if e == 0.5:
                return f"tl.sqrt({a[0]})"
            if e == -0.5:
                return f"tl.rsqrt({a[0]})"
            if e == -1:
                return f"1.0 / {a[0]}"
            if is_float:  # a positive base is assumed, as exp2(e * log2(x))
                return f"tl.exp2({_lit(float(e))} * tl.log2({a[0]}))"
        if overload == "Scalar" and is_float and isinstance(args[0], (int, float)) and args[0] > 0:
            return f"tl.exp2({a[1]} * {_lit(math.log2(args[0]))})"
        if overload == "Tensor_Tensor" and is_float:
            return f"tl.exp2({a[1]} * tl.log2({a[0]}))"
        self.fail("`pow` with these operands (only a constant integer/float exponent, or a "
                  "positive constant base, on floats)")

    # -- whole functions ----------------------------------------------------------------------
    def bind_inputs(self, names):
        placeholders = [n for n in self.gm.graph.nodes if n.op == "placeholder"]
        fixed = {"score": {"q", "kv"}, "b": set(), "h": set(), "q_idx": {"q"},
                 "kv_idx": {"kv"}, "grad": {"q", "kv"}}
        cap = 0
        for node, name in zip(placeholders, names):
            if name == "cap":
                self.caps[node] = cap
                cap += 1
            else:
                self.val[node] = name
                self.deps[node] = frozenset(fixed[name])

    def body(self, outputs):
        needed = _ancestors(outputs)
        for node in self.gm.graph.nodes:
            if node in needed and node.op not in ("placeholder", "output"):
                if _is_grad_buffer(node):
                    continue
                self.emit(node)

    def tile(self, node, like: str) -> str:
        """``node``'s value as a full ``[M, N]`` tile (broadcast when it varies on fewer axes)."""
        v = self.arg(node) if isinstance(node, torch.fx.Node) else _lit(node)
        if isinstance(node, torch.fx.Node) and self.dep(node) == {"q", "kv"}:
            return v
        if self.gluon:
            return f"tl.where(True, {v}, {like})"
        return f"{v} + tl.zeros_like({like})"

    def scalar(self, lit: str, dtype: str) -> str:
        """A constant as a 0-d value. Gluon's ``full`` needs a layout (a 0-d value has none):
        the Gluon variant casts the literal instead."""
        if self.gluon:
            return f"tl.cast({lit}, {dtype})"
        return f"tl.full([], {lit}, {dtype})"

    def accumulate(self, tree, cap: int, out: list):
        """Atomics of one captured tensor's gradient (a sum of ``index_put`` scatters)."""
        name = _opname(tree) if tree.op == "call_function" else ""
        if name == "add":
            for x in tree.args[:2]:
                self.accumulate(x, cap, out)
            return
        if name in ("new_zeros", "zeros", "zeros_like", "full") or name in ("detach", "alias"):
            if name in ("detach", "alias"):
                self.accumulate(tree.args[0], cap, out)
            return
        if name == "_to_copy":
            self.accumulate(tree.args[0], cap, out)
            return
        if name in ("index_put", "index_put_", "_index_put_impl_"):
            base, indices, values = tree.args[:3]
            accumulate = tree.args[3] if len(tree.args) > 3 else tree.kwargs.get("accumulate")
            if not accumulate or _opname(base) not in ("new_zeros", "zeros", "zeros_like"):
                self.fail("a gradient scatter other than index_put(zeros, ..., accumulate=True)")
            out.append((list(indices), values))
            return
        if self.captures[cap].ndim == 0 and _shape(tree) == ():
            out.append(([], tree))
            return
        self.fail(f"a captured-tensor gradient computed with `{name or tree.op}`")

    def atomics(self, grads_of_caps):
        """Lines adding each captured gradient into its fp32 buffer (``GRADS``)."""
        gbase, j = [], 0
        for cap in grads_of_caps:
            gbase.append(j)
            j += 1 + self.captures[cap].ndim
        lines = []
        for g, (cap, scatters) in enumerate(zip(grads_of_caps, self._scatters)):
            for indices, values in scatters:
                v = self.new(f"tl.where(grad != 0, {self.tile(values, 'grad')}, 0.0)",
                             cast=False)
                d = self.dep(*indices)
                if not d:  # one element per tile (alibi_slopes[h]): one atomic
                    v = self.new(f"tl.sum(tl.sum({v}, 1), 0)", cast=False)
                elif "kv" not in d:  # one per query row
                    v = self.new(f"tl.sum({v}, axis=KV_AXIS, keep_dims=True)", cast=False)
                elif "q" not in d:  # one per key column
                    v = self.new(f"tl.sum({v}, axis=1 - KV_AXIS, keep_dims=True)", cast=False)
                if indices:  # strides of the fp32 gradient buffer (sizes: the tensor's)
                    off, mask = self.index_offsets(cap, indices,
                                                   lambda k: f"GRADS[{gbase[g] + 1 + k}]")
                else:
                    off, mask = "0", "True"
                lines.append(f"        tl.atomic_add(GRADS[{gbase[g]}] + {off}, "
                             f"{v}.to(tl.float32), mask=({mask}) != 0, sem='relaxed')")
        return lines


_BINARY = {"add": "+", "sub": "-", "rsub": "-", "mul": "*", "eq": "==", "ne": "!=", "lt": "<",
           "le": "<=", "gt": ">", "ge": ">=", "bitwise_and": "&", "bitwise_or": "|",
           "bitwise_xor": "^", "__and__": "&", "__or__": "|", "__xor__": "^"}
_UNARY = {"exp": "tl.exp({x})", "exp2": "tl.exp2({x})",
          "log": "tl.log({x})", "log2": "tl.log2({x})", "sqrt": "tl.sqrt({x})",
          "rsqrt": "tl.rsqrt({x})", "tanh": "tanh_f32({x})", "sigmoid": "sigmoid({x})",
          "sin": "tl.sin({x})", "cos": "tl.cos({x})", "floor": "tl.floor({x})",
          "ceil": "tl.ceil({x})", "trunc": "trunc_float({x})", "log1p": "tl.log(1.0 + {x})",
          "expm1": "(tl.exp({x}) - 1.0)"}


# What makes an expression heavy (ModFns.heavy): exp/log/sqrt/tanh/sigmoid and powers (through
# exp2/log2), floor division and modulo, division.
_HEAVY_OPS = re.compile(r"tl\.(exp|exp2|log|log2|sqrt|rsqrt|fdiv)\(|tanh|sigmoid|floordiv|"
                        r"remainder| % | / ")
_GLUON_UNARY = {"tanh": "tanh_fast({x})", "sigmoid": "sigmoid_fast({x})"}


def _fill_value(node):
    name = _opname(node)
    if name in ("new_ones", "ones", "ones_like"):
        return 1
    if name in ("new_zeros", "zeros", "zeros_like"):
        return 0
    if name in ("full", "new_full", "full_like"):
        return node.args[1] if name != "new_full" else node.args[2]
    if name == "scalar_tensor":
        return node.args[0]
    raise KeyError(name)


def _typed(node, value):
    dt = _dtype(node)
    if dt == torch.bool:
        return bool(value)
    return float(value) if dt.is_floating_point else int(value)


_CONSTANT_MAKERS = {n: (lambda node: _typed(node, _fill_value(node))) for n in (
    "new_ones", "ones", "ones_like", "new_zeros", "zeros", "zeros_like", "full", "new_full",
    "full_like", "scalar_tensor")}


def _opname(node) -> str:
    return node.target.overloadpacket.__name__ if hasattr(node.target, "overloadpacket") else str(
        node.target)


def _is_grad_buffer(node) -> bool:
    """Full-size gradient buffers of captured tensors (turned into atomics, never values)."""
    return (node.op == "call_function"
            and _opname(node) in ("new_zeros", "zeros", "index_put", "index_put_",
                                  "_index_put_impl_")
            and _shape(node) != ())


def _ancestors(outputs) -> set:
    seen, stack = set(), [o for o in outputs if isinstance(o, torch.fx.Node)]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        stack.extend(n.all_input_nodes)
    return seen


def _output_args(gm):
    out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    return list(out) if isinstance(out, (list, tuple)) else [out]


_HEADER = """import triton
import triton.language as tl

from solattn.flex.device import (floordiv_float, floordiv_int, remainder_float, remainder_int,
                                 sigmoid, sigmoid_fast, sign, tanh_f32, tanh_fast, trunc_float,
                                 wrap_index)
"""


def generate(mod: TracedMod) -> tuple[str, str, str | None, bool, tuple, bool]:
    """Source of ``mod``'s device functions -> ``(source, fwd name, bwd name, noop,
    grad_captures, heavy)`` (``ModFns.heavy``)."""
    safe = re.sub(r"\W", "_", mod.name)[:40]
    n_caps = len(mod.captures)
    idx_names = ["b", "h", "q_idx", "kv_idx"] + ["cap"] * n_caps
    fwd_names = (["score"] if mod.kind == SCORE else []) + idx_names
    digest = hashlib.sha1(canonical_text(mod).encode()).hexdigest()[:10]
    fwd_name = f"{mod.kind}_{safe}_{digest}"
    params = ("score, " if mod.kind == SCORE else "") + "b, h, q_idx, kv_idx, ARGS"
    src, noop = [], False
    for name, gluon in ((fwd_name, False), (fwd_name + GLUON_SUFFIX, True)):
        em = _Emitter(mod.fwd, mod.kind, mod.name, mod.captures, backward=False, gluon=gluon)
        em.bind_inputs(fwd_names)
        (out,) = _output_args(mod.fwd)
        if isinstance(out, torch.fx.Node):
            em.body([out])
        noop = mod.kind == MASK and (out is True or (isinstance(out, torch.fx.Node)
                                                     and em.const.get(out) is True))
        if mod.kind == SCORE:
            ret = f"({em.tile(out, 'score')}).to(tl.float32)"
        else:
            ret = f"({em.arg(out) if isinstance(out, torch.fx.Node) else _lit(out)}) != 0"
        src += [f"@triton.jit\ndef {name}({params}):", *em.lines, f"    return {ret}", ""]
    bwd_name, grad_caps = None, ()
    if mod.kind == SCORE:
        bwd_name = f"{fwd_name}_bwd"
        grad_caps = tuple(i for i, c in enumerate(mod.captures) if c.grad)
        for name, gluon in ((bwd_name, False), (bwd_name + GLUON_SUFFIX, True)):
            src += _bwd_source(mod, name, idx_names, grad_caps, gluon)
    return _HEADER + "\n\n" + "\n".join(src), fwd_name, bwd_name, noop, grad_caps, em.heavy


def _bwd_source(mod: TracedMod, name: str, idx_names: list, grad_caps: tuple,
                gluon: bool) -> list[str]:
    """Lines of the score_mod's derivative ``name`` (module docstring), for a Triton or a
    Gluon caller."""
    eb = _Emitter(mod.bwd, mod.kind, mod.name, mod.captures, backward=True, gluon=gluon)
    eb.bind_inputs(["score"] + idx_names + ["grad"])
    outs = _output_args(mod.bwd)
    dscore, cap_grads = outs[0], outs[1:]
    eb._scatters = []
    for i, tree in zip(grad_caps, cap_grads):
        scatters: list = []
        if isinstance(tree, torch.fx.Node):
            eb.accumulate(tree, i, scatters)
        eb._scatters.append(scatters)
    value_nodes = [dscore] + [v for s in eb._scatters for idx, v in s] + [
        i for s in eb._scatters for idx, _ in s for i in idx]
    eb.body(value_nodes)
    ret = f"({eb.tile(dscore, 'grad')}).to(tl.float32)"
    body = list(eb.lines)
    eb.lines = []
    atomics = eb.atomics(grad_caps)  # reductions/index math land in eb.lines
    if atomics:
        body += ["    if ACCUMULATE:"] + ["    " + ln for ln in eb.lines] + atomics
    return [f"@triton.jit\ndef {name}(score, b, h, q_idx, kv_idx, ARGS, grad, GRADS, "
            "KV_AXIS: tl.constexpr, ACCUMULATE: tl.constexpr):",
            *body, f"    return {ret}", ""]


def canonical_text(mod: TracedMod) -> str:
    """What identifies the generated code: the graphs (constants inlined) and the captures'
    dtypes/ranks/grad flags -- never tensor values or sizes."""
    parts = [mod.kind]
    for gm in (mod.fwd, mod.bwd):
        if gm is None:
            continue
        for node in gm.graph.nodes:
            if node.op == "get_attr":
                parts.append(f"{node.name}=const({getattr(gm, node.target).item()!r})")
            else:
                parts.append(f"{node.name}={node.op}:{node.target}:{_fmt(node.args)}:"
                             f"{_fmt(sorted(node.kwargs.items()))}")
    parts.append(repr([(str(c.dtype), c.ndim, c.grad) for c in mod.captures]))
    return "\n".join(parts)


def _fmt(x) -> str:
    if isinstance(x, torch.fx.Node):
        return f"%{x.name}"
    if isinstance(x, (list, tuple)):
        return "(" + ",".join(_fmt(i) for i in x) + ")"
    if isinstance(x, torch.device):
        return "dev"  # the trace's device does not change the code
    return repr(x)


# ---------------------------------------------------------------------------------------------
# compile + cache
# ---------------------------------------------------------------------------------------------

_BY_TEXT: dict[str, ModFns] = {}


def compile_mod(mod: TracedMod) -> ModFns:
    """The (cached) device functions of a traced mod."""
    text = canonical_text(mod)
    fns = _BY_TEXT.get(text)
    if fns is not None:
        return fns
    source, fwd_name, bwd_name, noop, grad_caps, heavy = generate(mod)
    digest = hashlib.sha1(source.encode()).hexdigest()[:12]
    filename = f"<solattn-flex-{digest}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    scope = {"__name__": f"solattn_flex_generated_{digest}"}
    exec(compile(source, filename, "exec"), scope)  # noqa: S102 - our own generated source
    STATS["generated"] += 1
    fns = ModFns(mod.kind, mod.name, scope[fwd_name], scope.get(bwd_name) if bwd_name else None,
                 mod.captures, noop=noop, source=source, grad_captures=grad_caps,
                 fwd_gluon=scope[fwd_name + GLUON_SUFFIX],
                 bwd_gluon=scope.get(bwd_name + GLUON_SUFFIX) if bwd_name else None,
                 heavy=heavy)
    _BY_TEXT[text] = fns
    return fns

