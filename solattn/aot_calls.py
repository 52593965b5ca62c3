"""The calls ``solattn aot`` replays: each kernel configuration it compiles is the launch of a
real launcher, on tiny CPU tensors, through the path ``solattn warmup`` uses
(:func:`solattn.warmup.targeting`: a stand-in driver that names the GPU, and Triton's
``jit_cache_hook``, which receives each launch's specialization and stops it). The specs are
read off those launches (:func:`specs`): their signature, constexprs, specialization
attributes and options are what ``JITFunction.run`` computed, never written a second time.

A :class:`Call` runs one launcher for one flag set of a kernel module's ``AOT_VARIANTS``
(constexpr names, read as the call's arguments by :class:`Problem`) and names the kernels it
compiles (a backward call also launches its preprocess, which only one call keeps). Kernel
modules are looked up by attribute through :data:`MODULES`: moving a launcher or its
variant table is one line there. Kernel modules never import this module.

The tiny problems keep every length odd (17 rows, windows 37/5) so that no length is
specialized as a multiple of 16, and the head counts at 4 query / 2 KV heads so that the GQA
group is a runtime value (as on a real GQA call; an MHA call specializes the group as 1).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import json
from dataclasses import dataclass, field
from typing import Callable

import torch

# Where each launcher and its AOT data live (module attribute lookup: a move is one line here).
# A tuple names the modules a family's names are spread over (plan, configs, device code): each
# name is read from the first module that has it.
MODULES = {
    "fwd": "solattn.kernels.triton.forward",
    "bwd": "solattn.kernels.triton.backward",
    "decode": "solattn.kernels.triton.decode",
    "combine": "solattn.kernels.triton.combine",
    "hopper_fwd": ("solattn.kernels.hopper.forward_plan", "solattn.configs.hopper_forward",
                   "solattn.kernels.hopper.forward"),
    "hopper_bwd": ("solattn.kernels.hopper.backward_plan", "solattn.configs.hopper_backward",
                   "solattn.kernels.hopper.backward"),
    "hopper_flex_fwd": ("solattn.kernels.hopper.flex_forward_plan",
                        "solattn.configs.hopper_flex_forward",
                        "solattn.kernels.hopper.flex_forward"),
    "hopper_flex_bwd": ("solattn.kernels.hopper.flex_backward_plan",
                        "solattn.configs.hopper_flex_backward",
                        "solattn.kernels.hopper.flex_backward"),
}


class _Names:
    """The attributes of several modules, each read from the first module that has it."""

    def __init__(self, modules):
        self._modules = modules

    def __getattr__(self, name):
        for module in self._modules:
            if hasattr(module, name):
                return getattr(module, name)
        raise AttributeError(f"{name} in none of {[m.__name__ for m in self._modules]}")


def mod(name: str):
    """The module :data:`MODULES` names ``name`` (several: their names, :class:`_Names`)."""
    where = MODULES[name]
    if isinstance(where, str):
        return importlib.import_module(where)
    return _Names([importlib.import_module(m) for m in where])


@dataclass(frozen=True)
class Call:
    """One launcher call to replay: ``run()`` launches; ``kernels`` maps the jit functions'
    names it launches to the spec names they compile under (launches of other kernels are not
    compiled for this call); ``variant`` and ``head_dim`` (the padded tile; 0: none) are what
    :data:`solattn.aot.REPRESENTATIVE` picks by; ``accepted_spill(spec name)`` a measured
    spill's reason ("" for none)."""

    run: Callable[[], object]
    kernels: dict
    variant: str = ""
    head_dim: int = 0
    accepted_spill: Callable[[str], str] = lambda name: ""
    label: str = ""  # the variant as printed (default: variant)
    # The launcher compiles through JITFunction.warmup and reads the binary (the Hopper flex
    # plans check their spills): the hook stops that compile, so the run ends in an error
    # once its launch is recorded, which is expected then.
    stops_at_compile: bool = False


BF16 = torch.bfloat16
ROWS = 17        # an odd length: never specialized as a multiple of 16
LEFT, RIGHT = 37, 5


@dataclass(frozen=True)
class Problem:
    """A tiny call's inputs from constexpr flag names (``AOT_VARIANTS`` rows): HAS_UPPER causal
    (with HAS_LOWER a two-sided window), HAS_LOWER a left window, HAS_SOFTCAP, HAS_ALIBI,
    IS_VARLEN packed sequences, HAS_SEQUSED_K, HAS_DROPOUT, PAGE_SIZE a paged pool,
    DETERMINISTIC ``deterministic=True``."""

    d: int
    dv: int | None = None
    flags: dict = field(default_factory=dict)
    heads: int = 4
    heads_kv: int = 2
    rows: int = ROWS
    dtype: torch.dtype = BF16

    def tensors(self):
        """-> ``(q, k, v, p)``: empty tensors and the call's AttnParams."""
        from solattn.core import make_params

        f = self.flags
        dv = self.dv or self.d
        rows = self.rows
        lower, upper = f.get("HAS_LOWER", False), f.get("HAS_UPPER", False)
        window = (LEFT if lower else -1, RIGHT if lower and upper else -1)
        kw = dict(causal=upper and not lower, window_size=window,
                  softcap=30.0 if f.get("HAS_SOFTCAP") else 0.0,
                  dropout_p=0.1 if f.get("HAS_DROPOUT") else 0.0,
                  deterministic=f.get("DETERMINISTIC", False))
        if f.get("HAS_ALIBI"):
            kw["alibi_slopes"] = torch.empty(self.heads, dtype=torch.float32)
        page = f.get("PAGE_SIZE", 1) if f.get("PAGE_MODE") else 0
        if f.get("IS_VARLEN") or page:
            q = torch.empty(rows, self.heads, self.d, dtype=self.dtype)
            cu = torch.tensor([0, rows // 2, rows], dtype=torch.int32)
            if page:
                pages = 3
                k = torch.empty(2 * pages, page, self.heads_kv, self.d, dtype=self.dtype)
                v = torch.empty(2 * pages, page, self.heads_kv, dv, dtype=self.dtype)
                kw["block_table"] = torch.zeros(2, pages, dtype=torch.int32)
            else:
                k = torch.empty(rows, self.heads_kv, self.d, dtype=self.dtype)
                v = torch.empty(rows, self.heads_kv, dv, dtype=self.dtype)
            kw.update(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=rows // 2 + 1,
                      max_seqlen_k=rows // 2 + 1)
        else:
            q = torch.empty(1, rows, self.heads, self.d, dtype=self.dtype)
            k = torch.empty(1, rows, self.heads_kv, self.d, dtype=self.dtype)
            v = torch.empty(1, rows, self.heads_kv, dv, dtype=self.dtype)
        if f.get("HAS_SEQUSED_K"):
            kw["seqused_k"] = torch.zeros(2 if f.get("IS_VARLEN") or page else 1,
                                          dtype=torch.int32)
        return q, k, v, make_params(q, k, **kw)


@dataclass(frozen=True)
class AotSpec:
    """One kernel configuration to compile.

    ``signature`` maps every argument name to a Triton type string (``"*bf16"``, ``"i32"``,
    ``"fp32"``, ``"constexpr"``, a tuple of them, or a Gluon ``"tensordesc<...>"``);
    ``constexprs`` maps the constexpr arguments' names (``"NAME[i]"`` inside a tuple) to
    values. :func:`launch_spec` reads them off a replayed launch; a spec written by hand (the
    ladder's) builds them with :func:`solattn.aot.make_signature`. (Here, not in
    :mod:`solattn.aot`, which imports this module.)
    """

    name: str
    config: str
    fn: object
    signature: dict
    constexprs: dict
    options: dict = field(default_factory=dict)
    gluon: bool = False
    pointer_args: tuple = ()
    divisible_args: tuple = ()  # int args assumed multiples of 16, as Triton specializes at launch
    # A spill measured and accepted for this config with this Triton (the measurement, e.g. the
    # spill-free alternative's TFLOP/s): reported as "spill (accepted: ...)", never a failure.
    accepted_spill: str = ""
    # The kernel multiplies tiles (tl.dot): its SASS must hold the part's tensor-core ops.
    tensor_cores: bool = True
    # The variant (flag set) and padded head dim it compiles: REPRESENTATIVE picks by them.
    variant: str = ""
    head_dim: int = 0
    # A replayed launch's own specialization (launch_spec): its constexprs
    # and attributes by argument path, as JITFunction.run computed them; () for a spec built
    # from a signature.
    launch: tuple = ()


# ---------------------------------------------------------------------------------------------
# Reading a launch into an AotSpec
# ---------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _default_options(arch: int) -> dict:
    """The compile options Triton's backend for ``sm_{arch}`` defaults to (as JSON values)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import make_backend

    opts = make_backend(GPUTarget("cuda", arch, 32)).parse_options({})
    return json.loads(json.dumps(opts.__dict__, default=repr))


# Kernels without a matrix product: not held to the tensor-core check.
NO_MATRIX_PRODUCT = ("bwd_preprocess", "combine", "fwd_hopper_fp8_v", "bwd_hopper_preprocess",
                     "bwd_hopper_reduce", "bwd_hopper_dq_convert")


def _arg_type(sig: dict, params: list, path: tuple):
    t = sig[params[path[0]]]
    for i in path[1:]:
        t = t[i]
    return t


def launch_spec(arch: int, jit, compile: dict, name: str, config: str, call: Call):
    """The :class:`AotSpec` of one launch the ``jit_cache_hook`` received."""
    try:
        from triton.experimental.gluon._runtime import GluonJITFunction
        gluon = isinstance(jit, GluonJITFunction)
    except ImportError:  # a Triton without Gluon has no Gluon kernels either
        gluon = False
    params = [p.name for p in jit.params]

    def text(path):
        return params[path[0]] + "".join(f"[{i}]" for i in path[1:])

    constants = dict(compile["constants"])
    attrs = dict(compile["configs"][0])
    sig = dict(compile["signature"])
    divisible = [path for path, a in attrs.items() if ["tt.divisibility", 16] in
                 [list(x) for x in a]]
    pointers = tuple(text(p) for p in divisible
                     if str(_arg_type(sig, params, p)).startswith("*"))
    ints = tuple(text(p) for p in divisible
                 if not str(_arg_type(sig, params, p)).startswith("*"))
    spec_opts = json.loads(compile["specialization_data"])["options"]
    defaults = _default_options(arch)
    options = {k: v for k, v in spec_opts.items() if k == "num_warps" or defaults.get(k) != v}
    options = {k: tuple(v) if isinstance(v, list) else v for k, v in options.items()}
    return AotSpec(
        name=name, config=config, fn=jit, signature=sig,
        constexprs={text(p): v for p, v in constants.items()}, options=options, gluon=gluon,
        pointer_args=pointers, divisible_args=ints,
        accepted_spill=call.accepted_spill(name), tensor_cores=name not in NO_MATRIX_PRODUCT,
        variant=call.variant,
        head_dim=call.head_dim, launch=(constants, attrs))


@contextlib.contextmanager
def _jit_functions_serialized():
    """Inside the block, the specialization text Triton builds for its hooks tolerates jit
    functions as constexprs (the flex kernels' generated mods: json cannot write them, and
    Triton builds the text before it calls the hook; this module reads only its options)."""
    from triton.runtime import jit as jit_module

    real = getattr(jit_module, "serialize_specialization_data", None)
    if real is None:  # a Triton that builds no such text
        yield
        return

    def tolerant(name, signature, constants, attrs, options, *rest):
        try:
            return real(name, signature, constants, attrs, options, *rest)
        except TypeError:
            return json.dumps({"name": name, "options": options.__dict__}, default=repr)

    jit_module.serialize_specialization_data = tolerant
    try:
        yield
    finally:
        jit_module.serialize_specialization_data = real


def specs(arch: int, calls: list[Call]):
    """The distinct kernel specs ``calls`` launch on ``sm_{arch}``, in launch order, each named
    by its call (:data:`CONFIG_LINES` formats the config text from the launch's constexprs)."""
    from solattn.device import interpreting
    from solattn.warmup import targeting

    if interpreting():
        raise RuntimeError("solattn aot: TRITON_INTERPRET=1 runs kernels in Triton's "
                           "interpreter, which compiles nothing: unset it")
    found: dict = {}
    state: dict = {}

    def hook(*, key, fn, compile, **_):
        jit = fn.jit_function
        call = state["call"]
        name = call.kernels.get(jit.__name__)
        if name is None:
            return True
        state["recorded"] += 1
        ident = (name, jit.__module__, jit.__name__, key)
        if ident not in found:
            consts = {jit.params[p[0]].name: v for p, v in compile["constants"].items()
                      if len(p) == 1}
            opts = json.loads(compile["specialization_data"])["options"]
            line = CONFIG_LINES.get(name, lambda c, o, v: v)  # (default: the label alone)
            config = line(consts, opts, call.label or call.variant)
            found[ident] = launch_spec(arch, jit, compile, name, config, call)
        return True

    with targeting(arch, hook) as drv, _jit_functions_serialized():
        try:
            for call in calls:
                state["call"], state["recorded"] = call, 0
                try:
                    call.run()
                except Exception:
                    if not (call.stops_at_compile and state["recorded"]):
                        raise
        finally:
            for spec in found.values():
                spec.fn.device_caches.pop(drv.device, None)
    return list(found.values())


# ---------------------------------------------------------------------------------------------
# Config lines (the text after the spec name: tiles, warps, stages, the variant)
# ---------------------------------------------------------------------------------------------

def _tiles(c, o, bm="BLOCK_M", bn="BLOCK_N"):
    return (f"d{c['HEAD_DIM']} bm{c[bm]} bn{c[bn]} w{o['num_warps']} s{o['num_stages']}")


def _pass(c):
    if c["COMPUTE_DK"] and c["COMPUTE_DV"]:
        return ""
    return "dk-pass " if c["COMPUTE_DK"] else "dv-pass "


def _hopper_fwd_line(c, o, v):
    # the head dims the tiles run (d=96 in the 128 tile, ...): V_COLS is V's own
    dims = next((d, dv) for (d, dv), tiles in mod("hopper_fwd").HEAD_DIM_TILES.items()
                if tiles == (c["HEAD_DIM"], c.get("HEAD_DIM_V", c["HEAD_DIM"]))
                and dv == c.get("V_COLS", c["HEAD_DIM"]))
    text = f"d{dims[0]}" if dims[0] == dims[1] else f"d{dims[0]}/{dims[1]}"
    return (f"{text} bm{c.get('CONSUMERS', 2) * c['BLOCK_M']} bn{c['BLOCK_N']} s{c['STAGES']} "
            f"{_hopper_fwd_schedule(c)} {v}")


def _hopper_fwd_schedule(c):
    # (an O staged in its own tile is persistent's; a TMA store through Q's tile, one CTA's)
    if c.get("O_STAGING"):
        return "persistent-staged"
    return "persistent" if c["REGISTER_EPILOGUE"] else "grid=tiles"


def _hopper_bwd_line(c, o, v):
    swizzle = f" dq-swz{c['DQ_VEC']}x{c['WRITER_ROWS']}" if c["DQ_VEC"] != 2 else ""
    return (f"d{c['HEAD_DIM']} bm{c['BLOCK_M']} bn{c['BLOCK_N']} s{c['STAGES']} "
            f"la{c['LOOKAHEAD']} {'dq-warp' if c['DQ_WRITER'] else 'dq-red'}"
            f"{' dk-rs' if c['DK_FROM_REGS'] else ''}{' dq-pad' if c['DQ_PAD'] else ''}"
            f"{swizzle}{' wg-sync' if c.get('LOCAL_SYNC') else ''}"
            f" {v}{' split fp32-dkv lpt' if 'kv_splits' not in c else ''}")


CONFIG_LINES = {
    "fwd_portable": lambda c, o, v: f"{_tiles(c, o)} {v}",
    "bwd_preprocess": lambda c, o, v: (f"dv{c['HEAD_DIM_V']} bm{c['BLOCK_M']} w{o['num_warps']}"
                                       f" {v}"),
    "bwd_dkdv": lambda c, o, v: (f"{_tiles(c, o)} {'atomic-dq ' if c['ATOMIC_DQ'] else ''}"
                                 f"{_pass(c)}{v}"),
    "bwd_dq": lambda c, o, v: f"{_tiles(c, o)} {v}",
    "decode_splitkv": lambda c, o, v: f"{_tiles(c, o)} {v}",
    "combine": lambda c, o, v: f"d{c['HEAD_DIM']} br{c['BLOCK_R']} w{o['num_warps']}",
    "fwd_flex": lambda c, o, v: f"{_tiles(c, o)} {v}",
    "bwd_flex_dkdv": lambda c, o, v: f"{_tiles(c, o)} {_pass(c)}{v}",
    "bwd_flex_dq": lambda c, o, v: f"{_tiles(c, o)} {v}",
    "fwd_hopper": _hopper_fwd_line,
    "fwd_hopper_fp8": _hopper_fwd_line,
    "fwd_hopper_fp8_v": lambda c, o, v: (f"d{c['HEAD_DIM']} bk{c['BLOCK_K']} w{o['num_warps']}"
                                         f"{' varlen' if 'TAIL' in c else ''}"),
    "bwd_hopper_preprocess": lambda c, o, v: (f"d{c['HEAD_DIM']} bm{c['BLOCK_M']} "
                                              f"w{o['num_warps']} {v}"),
    "bwd_hopper_reduce": lambda c, o, v: (f"d{c['HEAD_DIM']} br{c['BLOCK_R']} w{o['num_warps']}"
                                          f"{' varlen' if c['IS_VARLEN'] else ''}"),
    "bwd_hopper_dq_convert": lambda c, o, v: (f"d{c['HEAD_DIM']} bm{c['BLOCK_M']} "
                                              f"w{o['num_warps']}"),
    "bwd_hopper": _hopper_bwd_line,
    "fwd_flex_hopper": lambda c, o, v: (f"d{c['HEAD_DIM']} bm{c['CONSUMERS'] * c['BLOCK_M']} "
                                        f"bn{c['BLOCK_N']} s{c['STAGES']} {v}"),
    "bwd_flex_hopper": lambda c, o, v: (f"d{c['HEAD_DIM']} bm{c['BLOCK_M']} bn{c['BLOCK_N']} "
                                        f"s{c['STAGES']} {v}"
                                        f"{' gqa fp32-dkv' if not c['TMA_EPILOGUE'] else ''}"),
}


# ---------------------------------------------------------------------------------------------
# The calls, one family per kernel module
# ---------------------------------------------------------------------------------------------

def _ragged(d: int) -> int:
    """A head dim padded into the tile ``d`` (96 in the 128 tile, ...)."""
    return d * 3 // 4 if d > 16 else d


def fwd_portable_calls(arch: int) -> list[Call]:
    """Per forward table entry (head-dim tile, upper-banded): each of the forward module's
    AOT_VARIANTS through ``attn_fwd`` (the config the table gives for the call's flags)."""
    from solattn.configs import all_fwd_configs

    fwd = mod("fwd")
    calls = []
    for d, upper in all_fwd_configs(arch):
        for vname, variant in fwd.AOT_VARIANTS.items():
            flags = dict(variant, HAS_UPPER=upper)
            hd = _ragged(d) if flags.pop("RAGGED_HEAD_DIM", False) else d
            prob = Problem(hd, flags=flags)
            name = f"{'causal ' if upper else ''}{vname}"

            def run(prob=prob):
                q, k, v, p = prob.tensors()
                fwd.attn_fwd(q, k, v, p, return_lse=True, arch=arch)

            calls.append(Call(run, {"attn_fwd_kernel": "fwd_portable"}, name, d))
    return calls


def _backward(launcher, prob, **kw):
    """Run a backward launcher on ``prob``'s tensors (out, lse, dO empty)."""
    q, k, v, p = prob.tensors()
    out = torch.empty(*q.shape[:-1], v.shape[-1], dtype=q.dtype)
    heads = q.shape[-2]
    lse_shape = (heads, q.shape[0]) if p.varlen else (q.shape[0], heads, q.shape[1])
    lse = torch.empty(lse_shape, dtype=torch.float32)
    return launcher(torch.empty_like(out), q, k, v, out, lse, p, **kw)


def bwd_portable_calls(arch: int) -> list[Call]:
    """The preprocess kernel (with a dLSE), and per backward table entry (head-dim tile, scores
    config) the dK/dV kernel (each pass when split) and the dQ kernel through ``attn_bwd``: with
    the scores config every feature, else no mask, causal, every mask (only this one at
    d <= 32) and causal dropout; the dQ kernel with the superset variants and dropout."""
    from solattn.configs import all_bwd_configs

    bwd = mod("bwd")
    calls = []
    prob = Problem(128)

    def preprocess(prob=prob):
        q, k, v, p = prob.tensors()
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[0], q.shape[2], q.shape[1], dtype=torch.float32)
        bwd.attn_bwd(torch.empty_like(out), q, k, v, out, lse, p, dlse=torch.empty_like(lse),
                     arch=arch)

    calls.append(Call(preprocess, {"attn_bwd_preprocess_kernel": "bwd_preprocess"}, "dlse"))
    for d, scores in all_bwd_configs(arch):
        if scores:
            names = ["all-features"]
        elif d <= 32:
            names = ["masks"]
        else:  # near the register limit, where ptxas's choices are not monotone in the flags
            names = ["plain", "causal", "masks", "causal-dropout"]
        for vname in names:
            flags = bwd.AOT_VARIANTS[vname]
            hd = _ragged(d) if vname in ("masks", "all-features") else d
            kernels = {"attn_bwd_dkdv_kernel": "bwd_dkdv"}
            if vname in ("masks", "all-features", "causal-dropout"):
                kernels["attn_bwd_dq_kernel"] = "bwd_dq"
            prob = Problem(hd, flags=flags)
            calls.append(Call(lambda prob=prob: _backward(bwd.attn_bwd, prob, arch=arch),
                              kernels, vname, d))
    return calls


_CACHE_KEYS = 801  # keys in every decode cache: three key tiles or more at every block_n


def _decode(arch: int, d: int, flags: dict, split: bool, rows: int):
    """Replay one ``flash_attn_with_kvcache`` step at head dim ``d`` with the decode module's
    constexpr ``flags`` (PAGE_MODE/PAGE_SIZE, APPEND and FUSE_COMBINE: the single fused launch,
    HAS_LEFTPAD, the mask and score flags), ``split``: three splits (fp32 partials), and
    ``rows`` query rows per sequence."""
    dec = mod("decode")
    prob = Problem(d, flags={k: v for k, v in flags.items() if k.startswith("HAS_")},
                   rows=rows)
    _, _, _, p = prob.tensors()
    b, heads, heads_kv = 2, prob.heads, prob.heads_kv
    q = torch.empty(b, rows, heads, d, dtype=BF16)
    page = flags["PAGE_SIZE"] if flags.get("PAGE_MODE") else 0
    if page:
        pages = -(-_CACHE_KEYS // page)
        k_cache = torch.empty(b * pages, page, heads_kv, d, dtype=BF16)
        table = torch.zeros(b, pages, dtype=torch.int32)
    else:
        k_cache, table = torch.empty(b, _CACHE_KEYS, heads_kv, d, dtype=BF16), None
    v_cache = torch.empty_like(k_cache)
    lens = torch.zeros(b, dtype=torch.int32)
    leftpad = lens if flags.get("HAS_LEFTPAD") else None
    splits = 3 if split else 1
    if flags.get("FUSE_COMBINE") or flags.get("APPEND"):
        new = torch.empty(b, 1, heads_kv, d, dtype=BF16) if flags.get("APPEND") else None
        dec.fused_decode(q, k_cache, v_cache, new, new, p, cache_seqlens=lens,
                         cache_batch_idx=None, cache_leftpad=leftpad, block_table=table,
                         num_splits=splits, arch=arch)
    else:
        dec.attn_decode(q, k_cache, v_cache, p, cache_seqlens=lens, seqlen_new=0,
                        cache_batch_idx=None, cache_leftpad=leftpad, block_table=table,
                        num_splits=splits, arch=arch)


def decode_calls(arch: int) -> list[Call]:
    """Head dims 64 and 128 (the serving models' dims): decode tiles (block_m 16: one query
    row, a GQA group of 2) in each of the decode module's AOT_VARIANTS, the wide-query tile
    (17 rows: block_m 64) in AOT_WIDE_VARIANT."""
    dec = mod("decode")
    calls = []
    for d in (64, 128):
        for wide in (False, True):
            for vname, (flags, o_type) in dec.AOT_VARIANTS.items():
                if wide and vname != dec.AOT_WIDE_VARIANT:
                    continue
                split = o_type == "*fp32"
                calls.append(Call(
                    lambda d=d, flags=flags, split=split, wide=wide:
                    _decode(arch, d, flags, split, 17 if wide else 1),
                    {"decode_kernel": "decode_splitkv"},
                    f"{vname}{' wide' if wide else ''}", d, label=vname))
    return calls


def combine_calls(arch: int) -> list[Call]:
    """The split-KV merge at each of the combine module's AOT_HEAD_DIMS, as a split decode step
    (``attn_decode``, three splits) launches it."""
    from solattn.configs.decode import combine_accepted_spill

    comb, dec = mod("combine"), mod("decode")
    flags = dec.AOT_VARIANTS["contiguous"][0]
    return [Call(lambda d=d: _decode(arch, d, flags, True, 1), {"combine_kernel": "combine"},
                 "", d, accepted_spill=lambda name, d=d: combine_accepted_spill(arch, d))
            for d in comb.AOT_HEAD_DIMS]


_FLEX_HEAD_DIMS = (64, 128)
_FLEX_HEADS = (8, 4)
# Three 128-row blocks and a partial one (odd): the block lists' extents are not 1 (an int
# argument equal to 1 is specialized as a constant), as on a real flex call.
FLEX_ROWS = 401  # query and KV heads (the catalogue's captured tensors have 8 heads)


def flex_problem(score_name, mask_name, d: int, rows: int = FLEX_ROWS, heads_kv: int = 0):
    """``(q, k, v, FlexParams)`` of a flex call with two mods of
    :mod:`solattn.flex.examples` by name (traced and generated here; captured tensors that
    require grad), over a dense 128 x 128 block list; ``q``/``k``/``v`` are ``(b, s, h, d)``
    views of flex's ``(B, H, L, E)`` tensors, as the flex ops hand them to the kernels."""
    from solattn.flex import block_mask as bm_lib
    from solattn.flex import ops
    from solattn.flex.examples import mods
    from solattn.flex.registry import MASK, SCORE, resolve

    catalogue = mods(4096, 8, 2, "cpu", requires_grad=True)
    score = catalogue[score_name][0] if score_name else None
    mask = catalogue[mask_name][1] if mask_name else None
    score_key, score_caps = resolve(score, SCORE) if score is not None else (-1, [])
    mask_key, mask_caps = resolve(mask, MASK) if mask is not None else (-1, [])
    heads, heads_kv = _FLEX_HEADS[0], heads_kv or _FLEX_HEADS[1]
    q = torch.empty(2, heads, rows, d, dtype=BF16)
    k, v = (torch.empty(2, heads_kv, rows, d, dtype=BF16) for _ in range(2))
    lists = bm_lib.dense_lists(2, heads, rows, rows, (128, 128), "cpu", cache=False)
    fp = ops._params(q, k, lists, score_caps, mask_caps, None, score_key, mask_key, d ** -0.5,
                     128, 128, 0.0)
    t = (lambda x: x.transpose(1, 2))
    return t(q), t(k), t(v), fp


def fwd_flex_calls(arch: int) -> list[Call]:
    """The portable flex forward per the forward module's AOT_FLEX_VARIANTS at head dims 64
    and 128 (``attn_fwd_flex``)."""
    fwd = mod("fwd")
    calls = []
    for vname, (score_name, mask_name) in fwd.AOT_FLEX_VARIANTS.items():
        for d in _FLEX_HEAD_DIMS:
            def run(s=score_name, m=mask_name, d=d):
                q, k, v, fp = flex_problem(s, m, d)
                fwd.attn_fwd_flex(q, k, v, fp, arch=arch)

            calls.append(Call(run, {"attn_fwd_flex_kernel": "fwd_flex"}, vname, d))
    return calls


def bwd_flex_calls(arch: int) -> list[Call]:
    """The portable flex dK/dV (each pass when split) and dQ kernels per the backward module's
    AOT_FLEX_VARIANTS at head dims 64 and 128 (``attn_bwd_flex``)."""
    from solattn.configs.portable import flex_bwd_accepted_spill

    bwd = mod("bwd")
    calls = []
    for vname, (score_name, mask_name) in bwd.AOT_FLEX_VARIANTS.items():
        for d in _FLEX_HEAD_DIMS:
            def run(s=score_name, m=mask_name, d=d):
                q, k, v, fp = flex_problem(s, m, d)
                out = torch.empty_like(q)
                lse = torch.empty(q.shape[0], q.shape[2], q.shape[1], dtype=torch.float32)
                bwd.attn_bwd_flex(torch.empty_like(out), q, k, v, out, lse, fp, arch=arch)

            calls.append(Call(run, {"attn_bwd_dkdv_flex_kernel": "bwd_flex_dkdv",
                                    "attn_bwd_dq_flex_kernel": "bwd_flex_dq"}, vname, d,
                              accepted_spill=lambda name, d=d, v=vname: flex_bwd_accepted_spill(
                                  arch, name, d, v)))
    return calls


def fwd_hopper_calls(arch: int) -> list[Call]:
    """Per Hopper head dim, each of the Hopper forward's AOT_VARIANTS, and its
    AOT_EXTRA_VARIANTS (ALiBi, padded head dims), through its ``attn_fwd`` with the config
    ``hopper_fwd_config`` gives the flags (``seqlen_k``: the problem size that picks it; None:
    long; ``tiles_per_sm``: the grid's tiles per SM, few_tiles_config), and the schedule a
    variant names (DYNAMIC: claimed tiles, LPT: longest first)."""
    from solattn.dispatch import hopper_unavailable

    if hopper_unavailable(arch):
        return []
    hf = mod("hopper_fwd")
    variants = [(d, d, vname, flags) for d in hf.SUPPORTED_HEAD_DIMS
                for vname, flags in hf.AOT_VARIANTS.items()]
    variants += [(d, d_v, vname, flags) for (d, d_v), extra in hf.AOT_EXTRA_VARIANTS.items()
                 for vname, flags in extra.items()]
    calls = []
    for d, d_v, vname, flags in variants:
        d_tile, dv_tile = hf.HEAD_DIM_TILES[(d, d_v)]
        flags = dict(flags)
        cfg = hf.hopper_fwd_config(d_tile, flags.get("HAS_UPPER", False),
                                   flags.get("HAS_SOFTCAP", False), head_dim_v=dv_tile,
                                   has_lower=flags.get("HAS_LOWER", False),
                                   varlen=flags.get("IS_VARLEN", False),
                                   seqlen_k=flags.pop("seqlen_k", None),
                                   dropout=flags.get("HAS_DROPOUT", False))
        if "tiles_per_sm" in flags:
            cfg = hf.few_tiles_config(cfg, flags.get("HAS_LOWER", False)
                                      or flags.get("HAS_UPPER", False), flags.pop("tiles_per_sm"))
        if flags.get("DYNAMIC"):
            cfg = dataclasses.replace(cfg, persistent=True, dynamic=True)
        if "LPT" in flags:
            cfg = dataclasses.replace(cfg, lpt=flags["LPT"])
        prob = Problem(d, d_v, flags=flags)

        def run(prob=prob, cfg=cfg):
            q, k, v, p = prob.tensors()
            hf.attn_fwd(q, k, v, p, return_lse=True, config=cfg)

        calls.append(Call(run, {"attn_fwd_kernel": "fwd_hopper"}, vname, d_tile,
                          accepted_spill=lambda name, d=d_tile, v=vname: hf.accepted_spill(d, v)))
    return calls


def fwd_hopper_fp8_calls(arch: int) -> list[Call]:
    """Per Hopper FP8 head dim, each of the FP8 forward's AOT_FP8_VARIANTS (e4m3 inputs,
    ``attn_fwd``), with the V transposes they launch (dense and packed)."""
    from solattn.dispatch import hopper_unavailable

    if hopper_unavailable(arch):
        return []
    hf = mod("hopper_fwd")
    calls = []
    for d in hf._FP8_CONFIGS:
        for vname, flags in hf.AOT_FP8_VARIANTS.items():
            if d in hf.fp8_band_only_head_dims() and (flags.get("HAS_SOFTCAP")
                                                    or flags.get("HAS_LOWER")):
                continue
            flags = dict(flags)
            cfg = hf.hopper_fwd_config(d, flags.get("HAS_UPPER", False),
                                       flags.get("HAS_SOFTCAP", False), fp8=True,
                                       has_lower=flags.get("HAS_LOWER", False),
                                       varlen=flags.get("IS_VARLEN", False),
                                       seqlen_k=flags.pop("seqlen_k", None))
            prob = Problem(d, flags=flags, dtype=torch.float8_e4m3fn)

            def run(prob=prob, cfg=cfg):
                q, k, v, p = prob.tensors()
                hf.attn_fwd(q, k, v, p, return_lse=True, config=cfg)

            calls.append(Call(run, {"attn_fwd_fp8_kernel": "fwd_hopper_fp8",
                                    "fp8_v_transpose_kernel": "fwd_hopper_fp8_v",
                                    "fp8_v_transpose_varlen_kernel": "fwd_hopper_fp8_v"},
                              vname, d))
    return calls


def bwd_hopper_calls(arch: int) -> list[Call]:
    """Per Hopper backward head dim, each of its AOT_VARIANTS unsplit (dK/dV in the inputs'
    dtype) and split (a GQA group of 2 over two CTAs: fp32 partial dK/dV, the longest-first
    grid, and their reduce), through its ``attn_bwd``; the dQ convert per head dim, and the
    preprocess with a dLSE (d=128, dense and packed)."""
    from solattn.dispatch import hopper_unavailable

    if hopper_unavailable(arch):
        return []
    hb = mod("hopper_bwd")

    def run(prob, split, dlse=False):
        q, k, v, p = prob.tensors()
        cfg = dataclasses.replace(hb.config_of(prob.d, p), lpt=split)
        out = torch.empty_like(q)
        lse_shape = (q.shape[1], q.shape[0]) if p.varlen else (1, q.shape[2], q.shape[1])
        lse = torch.empty(lse_shape, dtype=torch.float32)
        hb.attn_bwd(torch.empty_like(out), q, k, v, out, lse, p, config=cfg,
                    dlse=torch.empty_like(lse) if dlse else None,
                    gqa_splits=p.group_size if split else 1)

    # (the deterministic batched call's preprocess also zeroes the turn counters)
    calls = [Call(lambda flags=flags: run(Problem(128, flags=flags), False, dlse=True),
                  {"bwd_preprocess_kernel": "bwd_hopper_preprocess"}, label, 128)
             for label, flags in (("dlse", {}), ("dlse varlen", dict(IS_VARLEN=True)),
                                  ("dlse turns", dict(DETERMINISTIC=True)))]
    for d in hb.SUPPORTED_HEAD_DIMS:
        calls += [Call(lambda d=d, varlen=varlen: run(Problem(d, flags=dict(IS_VARLEN=varlen)),
                                                      True),
                       {"bwd_dkdv_reduce_kernel": "bwd_hopper_reduce"}, "", d)
                  for varlen in (False, True)]
        calls.append(Call(lambda d=d: run(Problem(d), False),
                          {"bwd_dq_convert_kernel": "bwd_hopper_dq_convert"}, "", d))
        for split in (False, True):
            for vname, flags in hb.AOT_VARIANTS.items():
                if not hb.variant_covered(d, flags):
                    continue  # (covers(): the portable backward runs it)
                calls.append(Call(
                    lambda prob=Problem(d, flags=flags), split=split: run(prob, split),
                    {"attn_bwd_kernel": "bwd_hopper"}, vname, d,
                    accepted_spill=lambda name, d=d, v=vname: hb.accepted_spill(d, v)))
    return calls


def fwd_flex_hopper_calls(arch: int) -> list[Call]:
    """The Hopper flex forward per its AOT_VARIANTS (mods, key tile, consumer warpgroups) at
    its head dims, with the Gluon twins of the generated mods: the plan ``prepare`` builds for
    that tile (its compile, which the plan reads for spills, is where the launch is recorded)."""
    from solattn.dispatch import hopper_unavailable

    if hopper_unavailable(arch):
        return []
    hff = mod("hopper_flex_fwd")
    calls = []
    for vname, (score_name, mask_name, block_n, consumers) in hff.AOT_VARIANTS.items():
        for d in hff.SUPPORTED_HEAD_DIMS:
            def run(s=score_name, m=mask_name, d=d, block_n=block_n, consumers=consumers):
                q, k, v, fp = flex_problem(s, m, d)
                hff._make_plan(q, k, v, fp, hff.flex_config(d, block_n, consumers))

            calls.append(Call(run, {"attn_fwd_flex_kernel": "fwd_flex_hopper"}, vname, d,
                              stops_at_compile=True))
    return calls


def bwd_flex_hopper_calls(arch: int) -> list[Call]:
    """The Hopper flex backward per its AOT_VARIANTS at its head dims, dK/dV in bf16 (MHA: the
    TMA epilogue) and fp32 (GQA partials), with the Gluon twins of the generated mods: the
    plan ``prepare`` builds (its compile, which the plan reads for spills, is where the launch
    is recorded)."""
    from solattn.dispatch import hopper_unavailable

    if hopper_unavailable(arch):
        return []
    hfb = mod("hopper_flex_bwd")
    calls = []
    for vname, (score_name, mask_name) in hfb.AOT_VARIANTS.items():
        for d in hfb.SUPPORTED_HEAD_DIMS:
            for heads_kv in (_FLEX_HEADS[0], _FLEX_HEADS[1]):
                def run(s=score_name, m=mask_name, d=d, heads_kv=heads_kv):
                    q, k, v, fp = flex_problem(s, m, d, heads_kv=heads_kv)
                    hfb._make_plan(q, k, v, torch.empty_like(q), fp)

                calls.append(Call(run, {"attn_bwd_flex_kernel": "bwd_flex_hopper"}, vname, d,
                                  accepted_spill=lambda name, d=d, v=vname:
                                  hfb.accepted_spill(d, v), stops_at_compile=True))
    return calls


# Every family, in the order `solattn aot` prints them.
FAMILIES = (fwd_portable_calls, bwd_portable_calls, decode_calls, combine_calls,
            fwd_hopper_calls, fwd_hopper_fp8_calls, bwd_hopper_calls, fwd_flex_calls,
            bwd_flex_calls, fwd_flex_hopper_calls, bwd_flex_hopper_calls)


def calls(arch: int) -> list[Call]:
    """Every call `solattn aot` replays for ``sm_{arch}``."""
    return [call for family in FAMILIES for call in family(arch)]
