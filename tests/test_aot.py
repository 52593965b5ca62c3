"""The AOT spill gate's SASS reading (no GPU, no compiler: synthetic cuobjdump text)."""
from solattn.kernels.sass import hot_local_accesses


def _sass(*lines):
    return "\n".join(f"        /*{addr:04x}*/                   {text} ;" for addr, text in lines)


def test_spill_outside_loops_is_cold():
    sass = _sass((0x10, "STL [R1], R2"), (0x20, "HGMMA.64x32x16.F32.BF16 R152, gdesc[UR16]"),
                 (0x30, "@!P5 BRA 0x20"), (0x40, "LDL R194, [R1]"), (0x50, "EXIT"))
    assert hot_local_accesses(sass) == 0


def test_spill_in_innermost_loop_is_hot():
    sass = _sass((0x10, "STL [R1], R2"), (0x20, "LDL R3, [R1]"), (0x30, "@P0 BRA 0x20"),
                 (0x40, "EXIT"))
    assert hot_local_accesses(sass) == 1


def test_only_innermost_loops_count():
    # outer loop 0x10..0x80 holds an inner loop 0x30..0x50 and a reload between the two
    sass = _sass((0x10, "IADD3 R0, R0, 0x1, RZ"), (0x20, "LDL R5, [R1+0x4]"),
                 (0x30, "STL [R1+0x8], R6"), (0x40, "LDL R6, [R1+0x8]"),
                 (0x50, "@!P2 BRA `(.L_x_3) 0x30"), (0x60, "LDL R7, [R1]"),
                 (0x80, "@P4 BRA 0x10"), (0x90, "EXIT"))
    assert hot_local_accesses(sass) == 2


def test_forward_branches_are_not_loops():
    sass = _sass((0x10, "@P0 BRA 0x40"), (0x20, "LDL R1, [R1]"), (0x40, "EXIT"))
    assert hot_local_accesses(sass) == 0


def test_accepted_spill_is_reported_not_failed():
    """A spill listed as measured and accepted by its config passes, with the reason in the
    line; the same spill without the listing fails (Gluon: any spill)."""
    from solattn.aot import AotResult, AotSpec

    def result(accepted):
        spec = AotSpec(name="fwd_hopper", config="d256", fn=None, signature={}, constexprs={},
                       gluon=True, accepted_spill=accepted)
        return AotResult(spec, 90, True, registers=168, spill_bytes=32, hot_spills=1,
                         sass_ops={"HGMMA": 1, "LDL/STL": 3})

    assert result("").failed and result("").line().startswith("SPILL")
    kept = result("measured: spill-free config 0.69x")
    assert not kept.failed
    assert kept.line().startswith("kept") and "spill accepted: measured" in kept.line()


def test_flex_hopper_specs():
    """`solattn aot --arch 90` builds the Hopper flex forward for each mod it lists at head dims
    64 and 128, with the mods' Gluon twins (the compile and spill gate itself is `solattn aot`,
    which CI runs: the interpreter these tests run under cannot compile)."""
    from solattn.aot import fwd_flex_hopper_specs
    from solattn.kernels.hopper.flex_forward import AOT_VARIANTS

    specs = fwd_flex_hopper_specs(90)
    assert fwd_flex_hopper_specs(80) == []
    assert len(specs) == 2 * len(AOT_VARIANTS)
    assert all(s.gluon and s.constexprs["SPARSE_N"] == 128 for s in specs)
    assert {s.constexprs["HEAD_DIM"] for s in specs} == {64, 128}
    alibi = next(s for s in specs if "alibi" in s.config)
    assert alibi.constexprs["SCORE_MOD"].__name__.endswith("_gl")
    assert alibi.constexprs["MASK_MOD"].__name__.endswith("_gl")
