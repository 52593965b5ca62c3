"""``solattn.kernels.hopper.compat.bundle``: a bundle's fields join the cache key of the kernels
that build it (Triton hashes an aggregate through its constructor, which is generated and the
same for every bundle), so a changed field type or order compiles anew instead of reusing the
binaries compiled before the change."""

import importlib.util
import sys
import textwrap

import pytest

pytest.importorskip("triton.experimental.gluon")

MODULE = '''
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from solattn.kernels.hopper.compat import Value, bundle


@bundle
class Pair:
    a: gl.tensor
    b: {b_type}


@gluon.jit
def kernel(x, y):
    p = Pair(x, y)
'''


def _key(tmp_path, b_type: str, name: str = "bundle_key") -> str:
    (tmp_path / b_type).mkdir(exist_ok=True)
    path = tmp_path / b_type / f"{name}.py"
    path.write_text(textwrap.dedent(MODULE.format(b_type=b_type)))
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    try:
        spec.loader.exec_module(mod)
        return mod.kernel.cache_key
    finally:
        del sys.modules[name]


def test_field_type_changes_the_kernel_key(tmp_path):
    tensor = _key(tmp_path, "gl.tensor")
    assert _key(tmp_path, "gl.tensor") == tensor  # the same source: the same key
    assert _key(tmp_path, "Value") != tensor
