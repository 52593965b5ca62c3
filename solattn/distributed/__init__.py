"""Ring attention (context parallelism) over ``torch.distributed``.

::

    from solattn.distributed import ring_attention, shard_sequence, unshard_sequence

    q_local = shard_sequence(q, dim=1)                  # this rank's chunks (zigzag layout)
    out_local = ring_attention(q_local, k_local, v_local, causal=True)
    out = unshard_sequence(out_local, dim=1)            # the whole sequence, on every rank

``ring_profile()`` records per-step compute / wait timings (exposed communication).
"""

from solattn.distributed.layout import LAYOUTS, shard_sequence, unshard_sequence
from solattn.distributed.profile import RingProfile, ring_profile
from solattn.distributed.ring import ring_attention

__all__ = ["LAYOUTS", "RingProfile", "ring_attention", "ring_profile", "shard_sequence",
           "unshard_sequence"]
