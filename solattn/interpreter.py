"""bf16 under Triton's CPU interpreter (``TRITON_INTERPRET=1``): computed in float32.

Triton's interpreter (3.6 and 3.9 measured) returns wrong values for bfloat16 kernels --
outputs around 1e9, no error. So that the documented CPU path never returns garbage, every
kernel launch the interpreter runs gets float32 twins of its bfloat16 tensor arguments: each
bf16 storage an argument views is copied once into a float32 buffer, the argument becomes the
same view (size, strides, offset) of that buffer, the kernel runs on float32 data (its pointer
types follow the arguments), and afterwards every twin is rounded back into its bf16 storage
(round-to-nearest-even, as a kernel's ``.to(tl.bfloat16)`` store rounds). Inputs round-trip
unchanged; outputs hold the float32 results rounded once. The arithmetic is then float32's (no
bf16 rounding of P before ``P @ V``): at least as accurate as the GPU kernels, and autograd is
untouched (the swap happens inside each launch).

Cost: one float32 copy of each bf16 storage a launch touches and one copy back, small next to
the interpreter's own cost. :func:`install` hooks the interpreter's argument staging
(``GridExecutor._init_args_hst`` / ``_restore_args_dev``); where a Triton version lacks those
hooks, :data:`BF16_OK` stays False and :func:`solattn.validation.check_dtypes` raises
``NotImplementedError`` for bf16 under the interpreter instead, before any launch.
"""

from __future__ import annotations

import os

import torch

BF16_OK = False  # bf16 kernels compute correctly under the interpreter (install() succeeded)


def _upcast(arg, twins: dict):
    """``arg`` with every bf16 tensor in it (tuples included) replaced by its float32 twin."""
    if isinstance(arg, tuple) and type(arg) is tuple:
        return tuple(_upcast(a, twins) for a in arg)
    if isinstance(arg, torch.Tensor) and arg.dtype == torch.bfloat16:
        storage = arg.untyped_storage()
        pair = twins.get(storage.data_ptr())
        if pair is None:
            whole = arg.new_empty(0).set_(storage)  # the whole storage, 1-D bf16
            pair = twins[storage.data_ptr()] = (whole, whole.float())
        return pair[1].as_strided(arg.size(), arg.stride(), arg.storage_offset())
    return arg


def install() -> bool:
    """Hook the interpreter's argument staging (once); returns :data:`BF16_OK`."""
    global BF16_OK
    # (solattn.device.interpreting's test; configs imports the kernels package, which imports
    # this module)
    if BF16_OK or os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        return BF16_OK
    try:
        from triton.runtime.interpreter import GridExecutor
        init, restore = GridExecutor._init_args_hst, GridExecutor._restore_args_dev
    except (ImportError, AttributeError):
        return False

    def init_args(self, args_dev, kwargs):
        args_hst, kwargs_hst = init(self, args_dev, kwargs)
        twins: dict = {}
        args32 = [_upcast(a, twins) for a in args_hst]
        kwargs32 = {k: _upcast(v, twins) for k, v in kwargs_hst.items()}
        if not twins:
            return args_hst, kwargs_hst
        self._solattn_bf16 = (args_hst, kwargs_hst, tuple(twins.values()))
        return args32, kwargs32

    def restore_args(self, args_dev, args_hst, kwargs, kwargs_hst):
        saved = self.__dict__.pop("_solattn_bf16", None)
        if saved is not None:
            args_hst, kwargs_hst, twins = saved
            for whole, whole32 in twins:
                whole.copy_(whole32)
        return restore(self, args_dev, args_hst, kwargs, kwargs_hst)

    GridExecutor._init_args_hst = init_args
    GridExecutor._restore_args_dev = restore_args
    BF16_OK = True
    return True


install()
