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
from oracle import DEVICE, DTYPES, ON_GPU, randn

from solattn import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache, launch
from solattn.backends import forced_backend
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
    from solattn.kernels.hopper.forward import _smem_layout

    layout = _smem_layout(torch.float16)
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


def test_shim_rejects_unknown_compiled_kernels():
    class NoLauncher:
        function = packed_metadata = None

    assert "run" in launch._shim_ok(NoLauncher())

    class OtherLauncher(NoLauncher):
        @staticmethod
        def run(grid, stream, *args):
            pass

    assert "launcher takes" in launch._shim_ok(OtherLauncher())


@pytest.mark.skipif(ON_GPU, reason="the interpreter's fallback")
def test_interpreter_takes_the_ordinary_path():
    q = randn(1, 17, 2, 16)
    out = flash_attn_func(q, q, q, causal=True)
    assert launch.fast_path_status().startswith("Triton's interpreter")
    with launch.ordinary_launches():
        assert torch.equal(out, flash_attn_func(q, q, q, causal=True))


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
    if backend == "hopper" and torch.cuda.get_device_capability() != (9, 0):
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
def test_backward_identical(deterministic):
    for dtype in DTYPES:
        q, k, v = (randn(2, 77, 4, 64, dtype=dtype, requires_grad=True) for _ in range(3))
        do = randn(2, 77, 4, 64, dtype=dtype)

        def grads():
            q.grad = k.grad = v.grad = None
            flash_attn_func(q, k, v, causal=True, deterministic=deterministic).backward(do)
            return q.grad, k.grad, v.grad

        ref, got = _both(grads)
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
            k_cache = randn(64, 256, h_kv, d, dtype=dtype)
            table = torch.randperm(64, device=DEVICE, dtype=torch.int32)[:32].view(2, 16)
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
