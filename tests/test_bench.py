"""The benchmark CLI's pieces that run without a GPU: FLOP counting, the table, the CPU path."""

from __future__ import annotations

import pytest
from oracle import ON_GPU

from solattn.bench.cli import print_table, verify_in_interpreter
from solattn.bench.core import Shape, attn_flops


def test_flops_convention():
    s = Shape(1, 8, 4096, 8192, 128)
    assert attn_flops(s) == 4 * 1 * 8 * 4096 * 8192 * 128
    assert attn_flops(Shape(1, 8, 4096, 8192, 128, causal=True)) == attn_flops(s) / 2
    assert attn_flops(s, backward=True) == 2.5 * attn_flops(s)
    # d_v != d: two matmuls of different widths, 2*(d + d_v) per score
    assert attn_flops(Shape(1, 1, 10, 10, 192, d_v=128)) == 2 * 100 * (192 + 128)


def test_table_ratios(capsys):
    rows = [{"shape": "B1 H8 L4096 D128", "kind": "fwd", "solattn-hopper": 660.0,
             "solattn-portable": 500.0, "cudnn": 600.0, "fa2": None}]
    print_table(rows, ["solattn-hopper", "solattn-portable", "cudnn", "fa2"], sol=800.0)
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line == "| B1 H8 L4096 D128 fwd | 660 | 500 | 600 | - | 82% | 1.10x |"


@pytest.mark.skipif(ON_GPU, reason="the GPU path runs in scripts/gpu_check.sh")
def test_cpu_run_verifies_in_the_interpreter(capsys):
    assert verify_in_interpreter() == 0
    out = capsys.readouterr().out
    assert "verification passed" in out and "Timings need a CUDA GPU" in out
