"""Cached launches (solattn/launch.py): the fast path launches the same kernels as
``kernel[grid](...)`` with the same arguments, so results are bitwise identical.

GPU tests run each entry point twice on the same inputs, once inside
``launch.ordinary_launches()`` and once through the cached kernels, and compare bit for bit;
calls alternate dtypes, shapes and unaligned (16-byte) views in one process, so a plan key that
missed a specialization would launch a wrong kernel and differ. CPU tests cover the pure helpers
and the interpreter's fallback.
"""

from __future__ import annotations

import gc
import inspect
import weakref

import pytest
import torch
from oracle import DEVICE, DTYPES, ON_GPU, ON_SM90, randn
from torch import Tensor

from solattn import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache, launch
from solattn.dispatch import forced_backend
from solattn.launch import DescriptorCache, Launch, PlanCache, contiguous_strides

gpu = pytest.mark.gpu


# ---------------------------------------------------------------------------------------- CPU

@pytest.mark.parametrize("shape", [(1, 128, 8, 64), (0, 3, 1), (2, 0, 5), (1, 1, 1),
                                   (3, 1, 0, 2), (7,), ()])
def test_contiguous_strides_match_torch(shape):
    assert contiguous_strides(shape) == torch.empty(shape).stride()


def test_plan_cache_is_bounded():
    cache = PlanCache(size=3)
    for i in range(7):
        assert cache.put(i, str(i)) == str(i)
        assert len(cache) <= 3
    assert cache[6] == "6"


def test_descriptor_cache_keeps_no_tensor_alive():
    gluon_hopper = pytest.importorskip("triton.experimental.gluon.nvidia.hopper")
    from solattn.kernels.hopper.pipeline import smem_layout

    layout = smem_layout(torch.float16)
    made = []

    def make(base):
        made.append(base)
        return gluon_hopper.TensorDescriptor(base, [1, 8, 128, 64], [65536, 64, 512, 1],
                                             [1, 1, 64, 64], layout)

    cache = DescriptorCache(make, size=2)
    t = torch.zeros(1, 128, 8, 64, dtype=torch.float16)
    d1 = cache(t)
    assert cache(t) is d1 and len(made) == 1
    assert d1.base.data_ptr() == t.data_ptr() and d1.base.dtype == t.dtype
    ref = weakref.ref(t)
    del t
    gc.collect()
    assert ref() is None  # the descriptor holds the address, not the tensor
    for _ in range(3):  # new addresses past the bound empty the cache
        cache(torch.zeros(1, 128, 8, 64, dtype=torch.float16))
    assert len(cache._by_ptr) <= 2


def test_descriptor_cache_holds_a_models_layers():
    """A model calls a plan once per layer with that layer's tensors, the same addresses every
    step: the default cache keeps one role's addresses of a 256-layer model, so the second
    step finds every descriptor (the first step's objects, their launch encoding with them)."""
    made = []
    cache = DescriptorCache(lambda base: made.append(base) or object.__new__(launch._Base))
    ts = [torch.zeros(16, dtype=torch.float16) for _ in range(256)]
    first = [cache(t) for t in ts]
    assert len(made) == len(ts)
    assert all(cache(t) is d for t, d in zip(ts, first)) and len(made) == len(ts)


def test_descriptor_cache_copies_the_first_descriptor_for_new_addresses():
    """A new aligned address gets the first descriptor's validated fields with its own base
    (no second construction); what a descriptor holds besides its fields (the launch's
    encoding, :func:`launch._encoded`) is not copied; a misaligned address is built (and so
    validated) by ``make``."""
    gluon_hopper = pytest.importorskip("triton.experimental.gluon.nvidia.hopper")
    from solattn.kernels.hopper.pipeline import smem_layout

    layout = smem_layout(torch.float16)
    made = []

    def make(base):
        made.append(base.data_ptr())
        return gluon_hopper.TensorDescriptor(base, [1, 8, 128, 64], [65536, 64, 512, 1],
                                             [1, 1, 64, 64], layout)

    cache = DescriptorCache(make)
    a, b = (torch.zeros(1, 128, 8, 64, dtype=torch.float16) for _ in range(2))
    da = cache(a)
    da.__dict__["_solattn_encoded"] = ("meta", ["map of a"])
    db = cache(b)
    assert made == [a.data_ptr()] and type(db) is type(da) and db is not da
    assert db.base.data_ptr() == b.data_ptr() and db.base.dtype == b.dtype
    assert da.base.data_ptr() == a.data_ptr()  # the first one keeps its own base
    fresh = make(launch._Base(b.data_ptr(), b.dtype))
    for f in ("shape", "strides", "block_shape", "layout", "padding"):
        assert getattr(db, f) == getattr(fresh, f)
    assert "_solattn_encoded" not in db.__dict__
    made.clear()
    flat = torch.zeros(1 + 128 * 8 * 64, dtype=torch.float16)
    with pytest.raises(AssertionError):  # built by make, whose validation rejects it
        cache(flat[1:])
    assert made == [flat.data_ptr() + 2]


def test_tensordesc_split_reads_tritons_wrapper():
    """Triton 3.6 wraps the C launch of a kernel taking tensor descriptors in a Python closure
    that encodes each descriptor on every launch; the split finds the C function and each
    descriptor's metadata in it, and refuses descriptors that are not the leading arguments."""
    driver = pytest.importorskip("triton.backends.nvidia.driver")
    if launch.triton_version() != (3, 6):
        pytest.skip("the tensor-descriptor wrapper read here is Triton 3.6's")
    meta = [dict(swizzle=3, elem_size=2, elem_type=1, block_size=[64, 64], fp4_padded=False)]
    c_launch = object()

    def c_fn(*args):
        return c_launch

    lead = {"d": "tensordesc<bf16[1, 1, 64, 64]>", "x": "*bf16", "n": "i32"}
    wrapper = driver.wrap_handle_tensordesc(c_fn, lead, meta)
    launcher, metas = launch._tensordesc_split(wrapper, 1)
    assert launcher is c_fn and metas == tuple(meta)
    assert launch._tensordesc_split(wrapper, 2) is None  # descriptor count disagrees
    second = driver.wrap_handle_tensordesc(c_fn, {"x": "*bf16", **lead}, meta)
    assert launch._tensordesc_split(second, 1) is None   # the descriptor is not first
    assert launch._tensordesc_split(c_fn, 1) is None     # a plain launcher


def test_cached_launch_encodes_each_descriptor_once(monkeypatch):
    """With a split launcher the cached launch hands the C function each descriptor's
    encoded arguments (Triton's ``make_tensordesc_arg``) in place of the descriptor, computed
    once per descriptor object."""
    driver = pytest.importorskip("triton.backends.nvidia.driver")
    from triton import knobs

    from solattn.kernels.triton.combine import combine_kernel

    encodes = []

    def encode(desc, meta):
        encodes.append(desc)
        return [f"map{desc.n}", meta["block_size"][0], 1]

    monkeypatch.setattr(driver, "make_tensordesc_arg", encode)

    class Desc:
        def __init__(self, n):
            self.n = n

    calls = []
    meta = {"block_size": [64]}
    params = inspect.signature(combine_kernel.fn).parameters
    scalars = tuple(range(len(params) - 8))
    la = Launch(combine_kernel, (3,), scalars, descriptors=1, HEAD_DIM=64, BLOCK_R=4,
                BLOCK_D=64, STORE_LSE=True, num_warps=4)
    la._compiled[0] = launch._Compiled(lambda *a: calls.append(a), 7, ("h",),
                                       la._tail(4), (meta,))
    monkeypatch.setattr(launch, "_runtime", (knobs, lambda: 0, lambda device: 99))
    d1, d2 = Desc(1), Desc(2)
    tensors = [torch.zeros(64, dtype=torch.float32) for _ in range(3)]
    for d in (d1, d1, d2):
        la(d, *tensors)
    assert encodes == [d1, d2]
    assert [c[:8] for c in calls] == [(3, 1, 1, 99, 7, "h", f"map{n}", 64) for n in (1, 1, 2)]
    assert all(c[9:12] == tuple(t.data_ptr() for t in tensors) for c in calls)


def test_shim_rejects_unknown_compiled_kernels():
    class NoLauncher:
        function = packed_metadata = None

    assert "run" in launch._shim_ok(NoLauncher())

    class OtherLauncher(NoLauncher):
        @staticmethod
        def run(grid, stream, *args):
            pass

    assert "launcher takes" in launch._shim_ok(OtherLauncher())


class CudaLauncher:
    """Stands in for Triton 3.6's launcher (the shim recognizes it by name): records what the
    cached path hands its C ``launch``."""

    global_scratch_size = profile_scratch_size = 0
    launch_cooperative_grid, launch_pdl = False, True

    def __init__(self):
        self.calls = []
        self.launch = lambda *args: self.calls.append(args)

    def __call__(self, gridX, gridY, gridZ, stream, function, *args):
        raise AssertionError("the cached path calls the C launch function directly")


def test_cached_launch_hands_pointers_as_ints(monkeypatch):
    """A cached launch calls the launcher's C function with what ``CudaLauncher.__call__``
    would (grid, stream, function, cooperative/PDL flags, no scratch, the packed metadata, no
    hooks), the tensors' addresses as ints, then the bound scalars and constexprs; a misaligned
    pointer takes the ordinary path, which compiles its own kernel."""
    from triton import knobs

    from solattn.kernels.triton.combine import combine_kernel

    class Compiled:
        run, function, packed_metadata = CudaLauncher(), 7, (4, 1, 0)

    params = inspect.signature(combine_kernel.fn).parameters
    scalars = tuple(range(len(params) - 8))
    la = Launch(combine_kernel, (3, 2), scalars, HEAD_DIM=64, BLOCK_R=4, BLOCK_D=64,
                STORE_LSE=True, num_warps=4)
    compiled = Compiled()
    monkeypatch.setattr(launch, "triton_version", lambda: (3, 6))
    monkeypatch.setattr(launch, "_runtime", (knobs, lambda: 0, lambda device: 99))
    la._compiled[0] = launch._compiled(compiled, la._tail(4))
    tensors = [torch.zeros(64, dtype=torch.float32) for _ in range(4)]
    la(*tensors)
    (args,) = compiled.run.calls
    assert args == (3, 2, 1, 99, 7, False, True, None, None, (4, 1, 0), None, None, None,
                    *(t.data_ptr() for t in tensors), *scalars, 64, 4, 64, True)
    assert all(type(a) is int for a in args[13:17])
    ordinary = []
    la.kernel = type("Spy", (), {"__getitem__": lambda self, grid: (
        lambda *a, **kw: ordinary.append(a))})()
    la(tensors[0][1:], *tensors[1:])  # 4-byte offset: not the cached specialization
    assert len(compiled.run.calls) == 1 and len(ordinary) == 1


def test_cached_launch_checks_tuple_arguments(monkeypatch):
    """Tuple arguments (a flex call's BlockMask lists and captured tensors, new each call) go to
    the launcher as they are while their specialization -- tensor dtypes and 16-byte alignment,
    ints equal to 1 or multiples of 16 -- is the compiled kernel's; any other takes the
    ordinary path."""
    import dataclasses

    from triton import knobs

    from solattn.kernels.triton.combine import combine_kernel

    class Compiled:
        run, function, packed_metadata = CudaLauncher(), 7, (4, 1, 0)

    params = inspect.signature(combine_kernel.fn).parameters
    scalars = tuple(range(len(params) - 8))
    la = Launch(combine_kernel, (3, 2), scalars, tuples=1, HEAD_DIM=64, BLOCK_R=4, BLOCK_D=64,
                STORE_LSE=True, num_warps=4)
    monkeypatch.setattr(launch, "triton_version", lambda: (3, 6))
    monkeypatch.setattr(launch, "_runtime", (knobs, lambda: 0, lambda device: 99))
    tensors = [torch.zeros(64, dtype=torch.float32) for _ in range(4)]
    compiled = Compiled()
    la._compiled[0] = dataclasses.replace(launch._compiled(compiled, la._tail(4)),
                                          tuple_spec=launch._tuple_spec([(tensors[3], 1, 32)]))
    other = torch.zeros(64, dtype=torch.float32)
    tup = (other, 1, 48)
    la(*tensors[:3], tup)  # another tensor, the same specialization
    (args,) = compiled.run.calls
    assert args[13:17] == (*(t.data_ptr() for t in tensors[:3]), (other, 1, 48))
    # the very tuple that matched is not checked again (a BlockMask's lists, built once)
    checked = []
    spec = launch._tuple_spec
    monkeypatch.setattr(launch, "_tuple_spec", lambda t: checked.append(t) or spec(t))
    la(*tensors[:3], tup)
    la(*tensors[:3], (other, 1, 48))  # an equal tuple, another object: checked
    assert len(compiled.run.calls) == 3 and len(checked) == 1
    monkeypatch.setattr(launch, "_tuple_spec", spec)
    ordinary = []
    la.kernel = type("Spy", (), {"__getitem__": lambda self, grid: (
        lambda *a, **kw: ordinary.append(a))})()
    for wrong in ((other, 2, 48), (other, 1, 40), (other[1:], 1, 48), (other.half(), 1, 48)):
        la(*tensors[:3], wrong)
    assert len(compiled.run.calls) == 3 and len(ordinary) == 4
    # a kernel compiled for another specialization replaces the cached one: the tuple that
    # matched the old kernel is checked again (and fails here)
    la._compiled[0] = dataclasses.replace(la._compiled[0],
                                          tuple_spec=launch._tuple_spec([(other.half(), 1, 48)]))
    la(*tensors[:3], tup)
    assert len(compiled.run.calls) == 3 and len(ordinary) == 5
    assert launch._tuple_spec([(True, 2**40, 1.0, (3,))]) == (
        True, (False, True, False), float, ((False, False, True),))


def test_cached_launch_keeps_other_launchers():
    """Launchers the shim was not read against (another class, scratch memory) are called as
    ``JITFunction.run`` calls them."""
    class Other:
        function, packed_metadata = 7, (4, 1, 0)

        def run(self, gridX, gridY, gridZ, stream, function, *args):
            pass

    c = launch._compiled(Other(), (1,))
    assert c.head == ((4, 1, 0), None, None, None) and c.tail == (1,)
    scratch = type("Scratch", (), {"function": 7, "packed_metadata": (4, 1, 0),
                                   "run": CudaLauncher()})()
    scratch.run.global_scratch_size = 256
    assert launch._compiled(scratch, ()).launch is scratch.run


def test_kvcache_call_key_separates_calls(monkeypatch):
    """The cached-validation key of a decode call: equal for calls with equal metadata, apart
    for any difference in a tensor's dtype, shape, strides or presence (k given and v not vs.
    the reverse), a scalar's type, or a non-CUDA / subclassed tensor (None: always validated).
    """
    from solattn.kvcache import _call_key

    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    cache = torch.zeros(1, 32, 2, 16, dtype=torch.float16)
    q = torch.zeros(1, 1, 4, 16, dtype=torch.float16)
    new = torch.zeros(1, 1, 2, 16, dtype=torch.float16)
    lens = torch.zeros(1, dtype=torch.int32)

    def key(q=q, k_cache=cache, v_cache=cache, k=new, v=new, lens=lens, scale=None,
            window=(-1, -1), softcap=0.0, alibi=None, splits=0, causal=True):
        return _call_key(q, k_cache, v_cache, k, v, None, None, lens, None, None, None, scale,
                         window, softcap, alibi, splits, causal)

    base = key()
    assert base == key(q=q.clone(), k_cache=cache.clone(), k=new.clone(), lens=lens.clone())
    assert hash(base) == hash(key(q=q.clone()))
    variants = [key(k=None), key(v=None), key(lens=None), key(q=q.half().float()),
                key(k_cache=cache.transpose(1, 2).contiguous().transpose(1, 2)),
                key(v_cache=cache[:, :16]), key(k=new.to(torch.bfloat16)),
                key(lens=lens.to(torch.int64)), key(scale=1.0), key(softcap=0),
                key(window=(4, 0)), key(splits=2), key(causal=False), key(alibi=lens.float())]
    assert len({base, *variants}) == len(variants) + 1
    assert key(k=None, v=new) != key(k=new, v=None)
    assert key(window=(-1.0, -1)) is None and key(window=[-1, -1]) is None
    assert key(q=torch.nn.Parameter(q)) is None and key(lens=[0]) is None
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: self is not lens))
    assert key() is None


@pytest.mark.skipif(ON_GPU, reason="the interpreter's fallback")
def test_interpreter_takes_the_ordinary_path():
    q = randn(1, 17, 2, 16)
    out = flash_attn_func(q, q, q, causal=True)
    assert launch.fast_path_status().startswith("Triton's interpreter")
    with launch.ordinary_launches():
        assert torch.equal(out, flash_attn_func(q, q, q, causal=True))


_FIRST_DTYPES: dict[int, tuple] = {}  # id(Launch) -> (the Launch, its first call's dtypes)


def _recorded(monkeypatch, fn) -> list:
    """Every cached launch ``fn()`` makes (kernel, grid, scalar arguments, constexprs and
    options, and the tensors' dtypes at the plan's first launch: all the kernel a plan caches is
    specialized for but alignment), without running a kernel (outputs are left unwritten)."""
    records = []

    def record(self, *tensors):
        dtypes = tuple(t.dtype for t in tensors[self.descriptors:])
        _, first = _FIRST_DTYPES.setdefault(id(self), (self, dtypes))  # (keeps the id unique)
        records.append((self.kernel, self.grid, self.args, sorted(self.kwargs.items()),
                        self.descriptors, first))

    with monkeypatch.context() as m:
        m.setattr(Launch, "__call__", record)
        fn()
    return records


def _assert_no_stale_plans(monkeypatch, calls):
    """Each of ``calls`` (one launcher on inputs of the same shapes, with parameters that change
    what its plans bake in) launches, after the others filled the plan caches, exactly what it
    launches from empty caches; and no two of them launch the same."""
    fresh = []
    for fn in calls:
        launch.clear_plans()
        _FIRST_DTYPES.clear()
        fresh.append(_recorded(monkeypatch, fn))
    for i in range(len(fresh)):
        for j in range(i):
            assert fresh[i] != fresh[j], f"calls {j} and {i} launch the same plan"
    try:
        for order in (list(range(len(calls))), list(reversed(range(len(calls))))):
            _FIRST_DTYPES.clear()
            launch.clear_plans()
            for i in order * 2:  # the second round finds every plan cached
                assert _recorded(monkeypatch, calls[i]) == fresh[i], f"call {i}: stale plan"
    finally:
        launch.clear_plans()


def test_launch_key_covers_every_baked_parameter():
    """AttnParams.launch_key differs where a launch plan would differ."""
    from solattn.dropout import draw_seed
    from solattn.params import AttnParams

    table = torch.zeros(2, 8, dtype=torch.int32)
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    used = torch.tensor([3, 4], dtype=torch.int32)
    variants = [
        dict(),
        dict(dropout_p=0.1, dropout_seed=draw_seed(torch.device("cpu"))),
        dict(dropout_p=0.2, dropout_seed=draw_seed(torch.device("cpu"))),
        dict(out_dtype=torch.float32),
        dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=4, max_seqlen_k=4),
        dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=4, max_seqlen_k=4, seqused_k=used),
        dict(cu_seqlens_q=cu, max_seqlen_q=4, max_seqlen_k=64, seqused_k=used,
             block_table=table),
        dict(cu_seqlens_q=cu, max_seqlen_q=4, max_seqlen_k=64, seqused_k=used,
             block_table=table[:, :4]),                       # another shape
        dict(cu_seqlens_q=cu, max_seqlen_q=4, max_seqlen_k=64, seqused_k=used,
             block_table=torch.zeros(2, 16, dtype=torch.int32)[:, :8]),  # another row stride
    ]
    keys = [AttnParams(scale=0.125, **kw).launch_key for kw in variants]
    assert len(set(keys)) == len(keys)
    # The seed's value is the call's, not the plan's: two draws share a key.
    again = AttnParams(scale=0.125, dropout_p=0.1, dropout_seed=draw_seed(torch.device("cpu")))
    assert again.launch_key == keys[1]


def test_forward_plans_follow_dropout_out_dtype_and_seqused(monkeypatch):
    from solattn.core import make_params
    from solattn.kernels.triton.forward import attn_fwd

    q, k, v = randn(1, 33, 2, 16), randn(1, 40, 2, 16), randn(1, 40, 2, 16)
    used = torch.tensor([21], dtype=torch.int32, device=q.device)
    calls = [lambda kw=kw: attn_fwd(q, k, v, make_params(q, k, causal=True, **kw))
             for kw in (dict(), dict(dropout_p=0.1), dict(dropout_p=0.25),
                        dict(out_dtype=torch.float32), dict(seqused_k=used))]
    _assert_no_stale_plans(monkeypatch, calls)


def test_forward_plans_follow_paging(monkeypatch):
    """Paged varlen: the page size (k's pool shape), the block table's shape and row stride
    and paged vs contiguous are all in the plan's key."""
    from solattn.core import make_params
    from solattn.kernels.triton.forward import attn_fwd

    h, d, total = 2, 16, 24
    q = randn(total, h, d)
    cu = torch.tensor([0, 10, total], dtype=torch.int32, device=q.device)
    used = torch.tensor([30, 17], dtype=torch.int32, device=q.device)
    contiguous = randn(total, h, d)

    def paged(page, pages_per_seq, table_cols=None):
        pool = randn(2 * pages_per_seq, page, h, d)
        cols = table_cols or pages_per_seq
        table = torch.zeros(2, cols, dtype=torch.int32, device=q.device)[:, :pages_per_seq]
        table.copy_(torch.arange(2 * pages_per_seq, dtype=torch.int32,
                                 device=q.device).view(2, pages_per_seq))
        return lambda: attn_fwd(q, pool, pool, make_params(
            q, pool, cu_seqlens_q=cu, max_seqlen_q=14, max_seqlen_k=page * pages_per_seq,
            seqused_k=used, block_table=table))

    calls = [
        lambda: attn_fwd(q, contiguous, contiguous, make_params(
            q, contiguous, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=14, max_seqlen_k=14)),
        paged(16, 2),       # pages that hold whole key tiles
        paged(8, 4),        # smaller pages: a page number per key row
        paged(8, 4, 6),     # the same with another block-table row stride
    ]
    _assert_no_stale_plans(monkeypatch, calls)


def test_backward_plans_follow_dropout_and_seqused(monkeypatch):
    from solattn.core import make_params
    from solattn.kernels.triton.backward import attn_bwd

    q, k, v = randn(1, 33, 2, 16), randn(1, 40, 2, 16), randn(1, 40, 2, 16)
    out, do = randn(1, 33, 2, 16), randn(1, 33, 2, 16)
    lse = torch.zeros(1, 2, 33, dtype=torch.float32, device=q.device)
    used = torch.tensor([21], dtype=torch.int32, device=q.device)
    calls = [lambda kw=kw: attn_bwd(do, q, k, v, out, lse, make_params(q, k, causal=True, **kw))
             for kw in (dict(), dict(dropout_p=0.1), dict(dropout_p=0.25),
                        dict(seqused_k=used))]
    _assert_no_stale_plans(monkeypatch, calls)


def test_hopper_plans_follow_out_dtype_and_consumers(monkeypatch):
    """The Hopper forward's plans (built on the CPU, nothing launched): float32 output
    (register epilogue, q's descriptor in o_desc's place) and the one-consumer config."""
    pytest.importorskip("triton.experimental.gluon.nvidia.hopper")
    import dataclasses

    from solattn.core import make_params
    from solattn.kernels.hopper import forward_plan as hopper

    q = torch.zeros(1, 200, 2, 64, dtype=torch.float16)
    one_consumer = dataclasses.replace(hopper.hopper_fwd_config(64, False, False), consumers=1)
    calls = [lambda kw=kw, cfg=cfg: hopper.attn_fwd(q, q, q, make_params(q, q, **kw),
                                                    config=cfg)
             for kw, cfg in ((dict(), None), (dict(out_dtype=torch.float32), None),
                             (dict(), one_consumer))]
    _assert_no_stale_plans(monkeypatch, calls)
    (rec,) = _recorded(monkeypatch, calls[1])
    assert dict(rec[3])["REGISTER_EPILOGUE"]


def test_cached_batched_params_draw_a_seed_per_call(monkeypatch):
    """flash_attn_func's cached AttnParams (CUDA calls) carry a fresh dropout seed each call."""
    from solattn import interface

    q = randn(1, 8, 2, 16)
    monkeypatch.setattr(Tensor, "is_cuda", property(lambda self: True))
    first = interface._batched_params(q, q, q, 0.1, None, False, (-1, -1), 0.0, None, False)
    second = interface._batched_params(q, q, q, 0.1, None, False, (-1, -1), 0.0, None, False)
    assert second.launch_key == first.launch_key and second.dropout_p == 0.1
    assert second.dropout_seed is not first.dropout_seed
    third = interface._batched_params(q, q, q, 0.2, None, False, (-1, -1), 0.0, None, False)
    assert third.dropout_p == 0.2
    plain = interface._batched_params(q, q, q, 0.0, None, False, (-1, -1), 0.0, None, False)
    assert plain.dropout_seed is None and not plain.has_dropout


def test_forward_selection_follows_dropout_paging_and_seqused(monkeypatch):
    """The cached forward selection (solattn.dispatch) keys what the Hopper forward declines."""
    pytest.importorskip("triton.experimental.gluon.nvidia.hopper")
    from solattn import dispatch
    from solattn.core import make_params

    monkeypatch.setattr(dispatch, "hopper_unavailable", lambda arch, device=None: "")
    monkeypatch.setattr(dispatch, "_DECISIONS", launch.PlanCache())  # (no decision of the CPU)
    select = (lambda q, v, p: dispatch.selected(dispatch.FORWARD, q, v, v, p))
    launch.clear_plans()
    q = torch.zeros(1, 64, 2, 128, dtype=torch.float16)
    wide = torch.zeros(1, 64, 2, 256, dtype=torch.float16)  # (dropout: not with ALiBi at 256)
    packed = torch.zeros(64, 2, 128, dtype=torch.float16)
    cu = torch.tensor([0, 64], dtype=torch.int32)
    table = torch.zeros(1, 4, dtype=torch.int32)
    pool = torch.zeros(4, 16, 2, 128, dtype=torch.float16)
    varlen = dict(cu_seqlens_q=cu, max_seqlen_q=64, max_seqlen_k=64)
    try:
        for _ in range(2):  # the second round reads the cached decisions
            assert select(q, q, make_params(q, q)) == "hopper"
            assert select(q, q, make_params(q, q, dropout_p=0.1)) == "hopper"
            assert select(wide, wide, make_params(wide, wide, dropout_p=0.1)) == "hopper"
            assert select(wide, wide, make_params(wide, wide, dropout_p=0.1,
                                                  alibi_slopes=torch.ones(2))) == "portable"
            assert select(packed, packed, make_params(
                packed, packed, cu_seqlens_k=cu, **varlen)) == "hopper"
            assert select(packed, pool, make_params(
                packed, pool, block_table=table, **varlen)) == "portable"
            assert select(packed, packed, make_params(
                packed, packed, cu_seqlens_k=cu, seqused_k=cu[1:], **varlen)) == "portable"
    finally:
        launch.clear_plans()


def test_warmup_targeting_takes_the_ordinary_path():
    """``solattn warmup``'s stand-in driver and JIT cache hook: no cached kernel there."""
    from solattn import warmup

    assert not launch._disabled
    with warmup.targeting(90, hook=lambda **kw: True):
        assert launch._disabled
    assert not launch._disabled


# ---------------------------------------------------------------------------------------- GPU

def _both(fn):
    """``fn()`` through ordinary launches, then twice through the cache (first call fills it)."""
    with launch.ordinary_launches():
        ref = fn()
    fn()
    return ref, fn()


def _assert_identical(ref, got):
    ref, got = (ref,) if torch.is_tensor(ref) else ref, (got,) if torch.is_tensor(got) else got
    for a, b in zip(ref, got, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a, b), f"max diff {(a.float() - b.float()).abs().max().item()}"


def _unaligned(t):
    """A copy of ``t`` whose data starts 2 bytes past a 16-byte boundary (same strides)."""
    buf = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
    view = buf[1:].view(t.shape)
    view.copy_(t)
    assert view.data_ptr() % 16 != 0
    return view


@gpu
def test_fast_path_is_on():
    q = randn(1, 64, 2, 64, dtype=torch.bfloat16)
    flash_attn_func(q, q, q)
    assert launch.fast_path_status() == "on"


@gpu
@pytest.mark.parametrize("backend", ["hopper", "portable"])
@pytest.mark.parametrize("causal", [False, True])
def test_forward_identical(backend, causal):
    if backend == "hopper" and not ON_SM90:
        pytest.skip("the Hopper kernel needs sm_90")
    with forced_backend(backend):
        for dtype in DTYPES:  # alternate dtypes and shapes in one process
            for shape in ((1, 128, 8, 64), (2, 77, 4, 128)):
                q, k, v = (randn(*shape, dtype=dtype) for _ in range(3))
                ref, got = _both(lambda: flash_attn_func(q, k, v, causal=causal,
                                                         return_lse=True))
                _assert_identical(ref, got)
            if backend == "portable":  # unaligned pointers take the ordinary path
                qu = _unaligned(q)
                ref, got = _both(lambda: flash_attn_func(qu, k, v, causal=causal))
                _assert_identical(ref, got)


@gpu
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("h_kv", [4, 2], ids=["mha", "gqa"])
def test_backward_identical(deterministic, h_kv):
    """Cached launches of the backward (on sm_90 the Hopper backward's plan; GQA: its group
    split over CTAs) give the ordinary launches' gradients bitwise (one key block: one dQ
    atomic per element, no order to vary)."""
    for dtype in DTYPES:
        q = randn(2, 77, 4, 64, dtype=dtype, requires_grad=True)
        k, v = (randn(2, 77, h_kv, 64, dtype=dtype, requires_grad=True) for _ in range(2))
        do = randn(2, 77, 4, 64, dtype=dtype)

        def grads():
            q.grad = k.grad = v.grad = None
            flash_attn_func(q, k, v, causal=True, deterministic=deterministic).backward(do)
            return q.grad, k.grad, v.grad

        ref, got = _both(grads)
        _assert_identical(ref, got)


@gpu
@pytest.mark.parametrize("backend", ["hopper", "portable"])
def test_float32_output_identical(backend):
    """AttnParams.out_dtype float32 (ring attention's partials): portable store, Hopper register
    epilogue with q's descriptor in o_desc's place; alternating with q-dtype outputs."""
    from solattn.core import attn_forward, make_params

    if backend == "hopper" and not ON_SM90:
        pytest.skip("the Hopper kernel needs sm_90")
    q, k, v = (randn(2, 77, 4, 128, dtype=torch.bfloat16) for _ in range(3))
    for out_dtype in (None, torch.float32, None):
        p = make_params(q, k, causal=True, out_dtype=out_dtype)
        ref, got = _both(lambda p=p: attn_forward(q, k, v, p, backend=backend))
        assert ref[0].dtype == (out_dtype or q.dtype)
        _assert_identical(ref, got)


@gpu
def test_hopper_one_consumer_identical():
    """The ladder's one-consumer-warpgroup config next to the shipping two-consumer one."""
    import dataclasses

    if not ON_SM90:
        pytest.skip("the Hopper kernel needs sm_90")
    from solattn.core import make_params
    from solattn.kernels.hopper import forward_plan as hopper

    q, k, v = (randn(2, 300, 4, 128, dtype=torch.float16) for _ in range(3))
    p = make_params(q, k, causal=True)
    two = hopper.hopper_fwd_config(128, True, False)
    for cfg in (two, dataclasses.replace(two, consumers=1), two):
        ref, got = _both(lambda cfg=cfg: hopper.attn_fwd(q, k, v, p, config=cfg))
        _assert_identical(ref, got)


@gpu
@pytest.mark.parametrize("dropout_p", [0.1, 0.3])
def test_dropout_identical(dropout_p):
    """Dropout (same seed each call): forward and backward, after a call without dropout and
    one with the other probability filled the plans of the same shapes."""
    q, k, v = (randn(2, 77, 4, 64, dtype=torch.float16, requires_grad=True) for _ in range(3))
    do = randn(2, 77, 4, 64, dtype=torch.float16)
    for p_drop in (0.0, 0.5 - dropout_p, dropout_p):
        def step(p_drop=p_drop):
            torch.manual_seed(1)
            q.grad = k.grad = v.grad = None
            out = flash_attn_func(q, k, v, p_drop, causal=True)
            out.backward(do)
            return out, q.grad, k.grad, v.grad

        ref, got = _both(step)
        _assert_identical(ref, got)


@gpu
@pytest.mark.parametrize("page_size", [8, 64, 256])
def test_paged_varlen_identical(page_size):
    """Paged varlen (block_table, seqused_k), page sizes of both paging modes, next to the
    contiguous varlen call of the same q."""
    lens_q, lens_k = [5, 130, 64], [300, 130, 777]
    h, h_kv, d = 4, 2, 128
    cu_q = torch.tensor([0, 5, 135, 199], dtype=torch.int32, device=DEVICE)
    q = randn(sum(lens_q), h, d, dtype=torch.bfloat16)
    pages = [-(-n // page_size) for n in lens_k]
    k_cache = randn(sum(pages) + 3, page_size, h_kv, d, dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    perm = torch.randperm(k_cache.shape[0], device=DEVICE, dtype=torch.int32)
    table = torch.zeros(len(lens_k), max(pages), dtype=torch.int32, device=DEVICE)
    start = 0
    for b, n in enumerate(pages):
        table[b, :n] = perm[start:start + n]
        start += n
    used = torch.tensor(lens_k, dtype=torch.int32, device=DEVICE)
    kc = k_cache.flatten(0, 1)[:sum(lens_q)]
    cu_k = cu_q
    ref, got = _both(lambda: flash_attn_varlen_func(q, kc, kc, cu_q, cu_k, 130, 130,
                                                    causal=True, return_lse=True))
    _assert_identical(ref, got)
    ref, got = _both(lambda: flash_attn_varlen_func(
        q, k_cache, v_cache, cu_q, None, 130, max(lens_k), causal=True, return_lse=True,
        block_table=table, seqused_k=used))
    _assert_identical(ref, got)


@gpu
def test_varlen_identical():
    cu = torch.tensor([0, 5, 77, 200], dtype=torch.int32, device=DEVICE)
    q, k, v = (randn(200, 4, 128, dtype=torch.bfloat16) for _ in range(3))
    ref, got = _both(lambda: flash_attn_varlen_func(q, k, v, cu, cu, 123, 123, causal=True))
    _assert_identical(ref, got)


@gpu
@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("num_splits", [0, 1])
def test_kvcache_identical(paged, num_splits):
    for dtype in DTYPES:
        h_kv, d = 8, 128
        if paged:
            # 32 pages of 256 per sequence: room for the key appended at position 4096 (a
            # table one page short sends it into the next row's page: undefined behaviour)
            k_cache = randn(64, 256, h_kv, d, dtype=dtype)
            table = torch.randperm(64, device=DEVICE, dtype=torch.int32).view(2, 32)
        else:
            k_cache = randn(2, 8192, h_kv, d, dtype=dtype)
            table = None
        v_cache = torch.randn_like(k_cache)
        q = randn(2, 1, 32, d, dtype=dtype)
        kn, vn = randn(2, 1, h_kv, d, dtype=dtype), randn(2, 1, h_kv, d, dtype=dtype)
        lens = torch.tensor([4096, 1000], dtype=torch.int32, device=DEVICE)
        caches = []

        def step():
            kc, vc = k_cache.clone(), v_cache.clone()
            caches.append((kc, vc))
            return flash_attn_with_kvcache(q, kc, vc, k=kn, v=vn, cache_seqlens=lens,
                                           block_table=table, causal=True,
                                           num_splits=num_splits, return_lse=True)

        ref, got = _both(step)
        _assert_identical(ref, got)
        _assert_identical(caches[0], caches[-1])  # the appended tokens


@gpu
def test_kvcache_rotary_identical():
    dtype = torch.bfloat16
    k_cache = randn(1, 4096, 8, 128, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    q, kn, vn = randn(1, 3, 32, 128, dtype=dtype), randn(1, 3, 8, 128), randn(1, 3, 8, 128)
    kn, vn = kn.to(dtype), vn.to(dtype)
    cos, sin = randn(4096, 32, dtype=dtype), randn(4096, 32, dtype=dtype)
    lens = torch.tensor([2000], dtype=torch.int32, device=DEVICE)

    def step():
        return flash_attn_with_kvcache(q, k_cache.clone(), v_cache.clone(), k=kn, v=vn,
                                       rotary_cos=cos, rotary_sin=sin, cache_seqlens=lens,
                                       causal=True)

    ref, got = _both(step)
    _assert_identical(ref, got)


@gpu
def test_shim_fallback(monkeypatch):
    """With the shim off (as on an unknown Triton), calls take the ordinary path."""
    q = randn(1, 128, 8, 64, dtype=torch.bfloat16)
    ref = flash_attn_func(q, q, q, causal=True)
    monkeypatch.setattr(launch, "_runtime", None)
    monkeypatch.setattr(launch, "_unsupported", "test: shim off")
    assert launch.fast_path_status() == "test: shim off"
    _assert_identical(ref, flash_attn_func(q, q, q, causal=True))


@gpu
def test_cached_validation_still_rejects():
    q = randn(1, 16, 2, 64, dtype=torch.bfloat16)
    flash_attn_func(q, q, q, window_size=(-1, -1))  # cached as valid
    with pytest.raises(TypeError, match="window_size"):
        flash_attn_func(q, q, q, window_size=(-1.0, -1))
    k_cache = randn(1, 64, 2, 64, dtype=torch.bfloat16)
    lens = torch.tensor([10], dtype=torch.int32, device=DEVICE)
    flash_attn_with_kvcache(q[:, :1], k_cache, k_cache, cache_seqlens=lens)
    with pytest.raises(TypeError, match="window_size"):
        flash_attn_with_kvcache(q[:, :1], k_cache, k_cache, cache_seqlens=lens,
                                window_size=(-1.0, -1))
    with pytest.raises(ValueError, match="num_splits"):
        flash_attn_with_kvcache(q[:, :1], k_cache, k_cache, cache_seqlens=lens, num_splits=True)


@gpu
def test_kvcache_cached_plans_follow_the_arguments():
    """Eager decode calls skip validation through plans cached by their arguments: calls that
    alternate causal / not (as True, False and 1), a window, softcap and return_lse on one cache
    each give what the separate launches give for the same arguments."""
    from solattn.kvcache import separate_launches

    dtype = torch.bfloat16
    k_cache = randn(1, 4096, 8, 128, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    q = randn(1, 2, 32, 128, dtype=dtype)
    lens = torch.tensor([40], dtype=torch.int32, device=DEVICE)
    variants = (dict(causal=True), dict(causal=False), dict(causal=1, window_size=(8, 0)),
                dict(softcap=5.0), dict(causal=True, num_splits=3))
    for _ in range(2):  # the second round runs every variant from its cached plan
        for kw in variants:
            got = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens,
                                          return_lse=True, **kw)
            with separate_launches():
                ref = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens,
                                              return_lse=True, **kw)
            torch.testing.assert_close(got[0], ref[0], atol=1e-2, rtol=0, msg=str(kw))
            torch.testing.assert_close(got[1], ref[1], atol=1e-4, rtol=0, msg=str(kw))
            out = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, **kw)
            torch.testing.assert_close(out, ref[0], atol=1e-2, rtol=0, msg=str(kw))


def test_launch_tail_follows_the_signature():
    """The arguments a cached launch appends after the tensors: positional scalars, then every
    remaining parameter by name or default, in the kernel's order (as JITFunction.run binds)."""
    from solattn.kernels.triton.combine import combine_kernel

    params = inspect.signature(combine_kernel.fn).parameters
    n_tensors, n_scalars = 4, len(params) - 4 - 4  # 4 pointers ... 4 constexprs
    scalars = tuple(range(n_scalars))
    la = Launch(combine_kernel, (1,), scalars, HEAD_DIM=64, BLOCK_R=4, BLOCK_D=64,
                STORE_LSE=True, num_warps=4)
    assert la.grid == (1, 1, 1)
    assert la._tail(n_tensors) == (*scalars, 64, 4, 64, True)


def test_relaxed_capture_mode_sets_and_restores(monkeypatch):
    """``launch.relaxed_capture_mode`` exchanges this thread's capture mode for relaxed on entry
    and puts the previous one back on exit, even when the block raises (a stand-in for
    libcuda's ``cuThreadExchangeStreamCaptureMode``, which swaps the value it is given); with
    no libcuda it does nothing. (On the GPU: test_flex.py's
    test_hopper_flex_backward_prefetch_beside_a_capture.)"""
    import ctypes

    class FakeDriver:
        mode = 0  # global, the driver's default
        calls: list = []

        def cuThreadExchangeStreamCaptureMode(self, ref):
            value = ctypes.cast(ref, ctypes.POINTER(ctypes.c_int)).contents
            self.calls.append(value.value)
            FakeDriver.mode, value.value = value.value, FakeDriver.mode
            return 0

    monkeypatch.setattr(launch, "_driver_lib", [FakeDriver()])
    with launch.relaxed_capture_mode():
        assert FakeDriver.mode == launch._CAPTURE_MODE_RELAXED
    assert FakeDriver.mode == 0 and FakeDriver.calls == [launch._CAPTURE_MODE_RELAXED, 0]
    with pytest.raises(RuntimeError, match="inside"):
        with launch.relaxed_capture_mode():
            raise RuntimeError("inside")
    assert FakeDriver.mode == 0
    monkeypatch.setattr(launch, "_driver_lib", [None])
    with launch.relaxed_capture_mode():
        pass
