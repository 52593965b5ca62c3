"""Kernel configurations: frozen dataclasses chosen by pure functions of (arch, head dim, ...),
one module per kernel family, each table with the measurements that justify it:

- :mod:`solattn.configs.portable`: the portable forward (dense, flex, dropout) and backward;
- :mod:`solattn.configs.decode`: the split-KV decode kernels, the combine kernel and the
  ``num_splits`` / small-q heuristics;
- :mod:`solattn.configs.hopper_forward`, :mod:`solattn.configs.hopper_backward`: the Hopper
  (Gluon) kernels' tiles, accepted spills and schedule thresholds (imported by module path).

The names other modules import (``from solattn.configs import fwd_config``) are re-exported here;
a test that overrides a module's private table patches that module.
"""

from solattn.configs.decode import (
    DecodeConfig,
    all_decode_configs,
    combine_num_warps,
    decode_block_m,
    decode_config,
    decode_num_splits,
    small_q_decode,
)
from solattn.configs.portable import (
    BwdConfig,
    FwdConfig,
    all_bwd_configs,
    all_fwd_configs,
    bwd_config,
    dropout_fwd_config,
    flex_fwd_config,
    fwd_config,
    padded_head_dim,
)
from solattn.device import triton_version

__all__ = [
    "BwdConfig", "DecodeConfig", "FwdConfig", "all_bwd_configs", "all_decode_configs",
    "all_fwd_configs", "bwd_config", "combine_num_warps", "decode_block_m", "decode_config",
    "decode_num_splits", "dropout_fwd_config", "flex_fwd_config", "fwd_config",
    "padded_head_dim", "small_q_decode", "triton_version",
]
