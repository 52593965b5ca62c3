"""Per-architecture tables: which config class each compute capability runs, what an unknown part
runs (and says under SOLATTN_DEBUG=1), and the Hopper-only kernels' errors on every other part."""
import pytest
import torch

from solattn.arch import ARCHS, arch_limits, known, unknown_arch_note
from solattn.configs import decode as decode_configs
from solattn.configs import portable as configs

SEEDS = (80, 86, 89, 100, 120)  # the seed documents' GPUs: A100, 3090, 4090, B200, 5090 / 5060


def test_limits_table():
    """The CUDA Programming Guide's opt-in shared memory a block, per seed architecture."""
    kb = {cc: a.smem_per_block // 1024 for cc, a in ARCHS.items()}
    assert kb == {80: 163, 86: 99, 89: 99, 90: 227, 100: 227, 120: 99}
    assert all(a.smem_per_block <= a.smem_per_sm for a in ARCHS.values())


@pytest.mark.parametrize("arch", [86, 89, 120])
def test_99kb_parts_run_their_own_tables(arch):
    assert configs.all_fwd_configs(arch) is configs._FWD_TABLE_SM86
    assert configs.all_bwd_configs(arch) == configs.all_bwd_configs(86)
    assert configs._bwd_table(arch, False) is configs._BWD_TABLE_SM86
    decode = dict(decode_configs._DECODE_TABLE_SM86)
    if arch == 120 and configs.triton_version() >= (3, 9):  # its ptxas spills the wide d=128
        decode.update(decode_configs._DECODE_SM120_TRITON_39)
    assert decode_configs._decode_table(arch) == decode


@pytest.mark.parametrize("arch", [86, 89, 120, 87])
def test_99kb_parts_flex_forward_two_stages(arch, monkeypatch):
    """The flex forward's gathered mods take 113 KB at d=64 with 3 stages: 2 on these parts
    (the interpreter's tiny config is bypassed to read the GPU's)."""
    monkeypatch.setattr(configs, "interpreting", lambda: False)
    assert configs.flex_fwd_config(arch, 64, 64).num_stages == 2
    sm80 = 2 if configs.triton_version() >= (3, 9) else 3  # (Triton 3.9: 2 everywhere)
    assert configs.flex_fwd_config(80, 64, 64).num_stages == sm80
    monkeypatch.setattr(configs, "triton_version", lambda: (3, 9))
    rows = 64 if arch == 120 else 128  # Triton 3.9's ptxas spills 128 rows on sm_120
    assert configs.flex_fwd_config(arch, 128, 128).block_m == rows


def test_sm80_and_sm90_tables_are_their_own():
    assert configs.all_fwd_configs(80) is configs._FWD_TABLE_SM80
    assert configs._bwd_table(80, True) is configs._BWD_TABLE_SM80_SCORES
    assert decode_configs._decode_table(90) is decode_configs._DECODE_TABLE_SM90
    assert configs._bwd_table(90, False) is configs._BWD_TABLE_SM90
    assert configs.all_fwd_configs(90)[(64, False)] == configs._FWD_TABLE_SM90[(64, False)]


@pytest.mark.parametrize("arch", [75, 87, 103, 121])
def test_unknown_part_runs_the_most_conservative_tables(arch):
    """A capability without a row gets the smallest limits (99 KB a block) and their tables."""
    assert not known(arch)
    assert arch_limits(arch).smem_per_block == min(a.smem_per_block for a in ARCHS.values())
    assert configs.all_fwd_configs(arch) is configs._FWD_TABLE_SM86
    assert configs._bwd_table(arch, False) is configs._BWD_TABLE_SM86
    assert f"sm_{arch}" in unknown_arch_note(arch)


def test_unknown_part_says_so_under_debug(monkeypatch, capsys):
    """dispatch.arch_of on a GPU of an unlisted capability (faked: no GPU here) prints which
    tables run under SOLATTN_DEBUG=1, and nothing for a listed one."""
    from solattn import device, dispatch

    monkeypatch.setenv("SOLATTN_DEBUG", "1")
    try:
        for cap, expect in (((8, 7), True), ((8, 6), False)):
            monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device, c=cap: c)
            device.compute_capability.cache_clear()
            device.device_arch.cache_clear()
            arch = dispatch.arch_of.__wrapped__(torch.device("cuda", 0))
            assert arch == cap[0] * 10 + cap[1]
            err = capsys.readouterr().err
            assert ("sm_87 is not in solattn.arch" in err) == expect, err
            assert ("most conservative tables" in err) == expect
    finally:  # (the faked capabilities must not stay cached for cuda:0)
        device.compute_capability.cache_clear()
        device.device_arch.cache_clear()


@pytest.mark.parametrize("arch", SEEDS)
def test_hopper_kernels_name_the_part(arch):
    """The Gluon forward and backward, asked for on another part, say which capability they
    need and which the device has; FP8 raises naming both."""
    from solattn.core import make_params
    from solattn.dispatch import BACKWARD, FORWARD, default_route
    from solattn.validation import check_fp8_arch

    q = torch.randn(1, 64, 2, 64, dtype=torch.float16)
    p = make_params(q, q)
    route, why = default_route(FORWARD, arch, q, q, q, p)
    assert route == "portable" and f"hopper: needs sm_90, device is sm_{arch}" in why, why
    lse = torch.zeros(1, 2, 64)
    route, why = default_route(BACKWARD, arch, None, q, q, q, q, lse, p)
    assert route == "portable" and f"hopper: needs sm_90, device is sm_{arch}" in why, why
    with pytest.raises(NotImplementedError, match=f"9.0.*sm_{arch}"):
        check_fp8_arch(torch.device("cuda:0"), arch // 10, arch % 10)


def test_seed_reference_rows():
    """`solattn bench` prints the seed's own row on a seed GPU: the 5060 Laptop's and the 5090's
    share sm_120 and are told apart by name; an H100 has none."""
    from solattn.bench.seeds import reference_lines

    laptop = reference_lines(120, "NVIDIA GeForce RTX 5060 Laptop GPU")
    assert "RTX 5060 Laptop" in laptop[0] and "51.14" in laptop[0]
    desktop = reference_lines(120, "NVIDIA GeForce RTX 5090")
    assert len(desktop) == 1 and "197.74" in desktop[0] and "209.5" in desktop[0]
    assert "34.04" in reference_lines(86, "NVIDIA GeForce RTX 3090")[0]
    assert reference_lines(90, "NVIDIA H100 80GB HBM3") == []
