"""Sequence layouts of ring attention: which global positions each rank holds.

A sequence of length ``S`` is cut into equal chunks and dealt to the ``W`` ranks of a process
group:

* ``"contiguous"``: ``W`` chunks, rank ``r`` holds chunk ``r``;
* ``"zigzag"``: ``2W`` chunks, rank ``r`` holds chunks ``r`` and ``2W - 1 - r`` (in that order),
  so that under a causal mask every rank has the same amount of work::

      W = 4, 8 chunks:   | 0 | 1 | 2 | 3 | 4 | 5 | 6 | 7 |
                           r0  r1  r2  r3  r3  r2  r1  r0

A rank's local tensor is the concatenation of its chunks; :class:`Segment` records where each one
sits in the global sequence and in the local tensor. The ring planner
(:mod:`solattn.distributed.plan`) works from these segments only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

LAYOUTS = ("contiguous", "zigzag")


@dataclass(frozen=True)
class Segment:
    """``length`` consecutive tokens at global position ``start`` and local offset ``local``."""

    start: int
    local: int
    length: int


def check_layout(layout) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"layout: expected one of {LAYOUTS}, got {layout!r}")
    return layout


def chunks_per_rank(layout: str) -> int:
    return 2 if layout == "zigzag" else 1


def local_segments(layout: str, rank: int, world: int, seqlen_local: int) -> tuple[Segment, ...]:
    """The global positions of rank ``rank``'s ``seqlen_local`` tokens, as segments in local order.

    ``seqlen_local`` must be a multiple of :func:`chunks_per_rank` (callers validate it).
    """
    if layout == "contiguous":
        return (Segment(rank * seqlen_local, 0, seqlen_local),)
    c = seqlen_local // 2
    return (Segment(rank * c, 0, c), Segment((2 * world - 1 - rank) * c, c, c))


def group_rank_world(group=None) -> tuple[int, int]:
    """``(rank, world size)`` in ``group``; without an initialized default group, ``(0, 1)``."""
    if group is None and not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError(f"group: expected a process group this rank ({dist.get_rank()}) belongs "
                         f"to, got one of ranks {dist.get_process_group_ranks(group)}")
    return rank, dist.get_world_size(group)


def _check_seq_dim(name: str, x, dim: int) -> int:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if not isinstance(dim, int) or not -x.dim() <= dim < x.dim():
        raise ValueError(f"dim: expected an int in [{-x.dim()}, {x.dim()}) for a {x.dim()}-D "
                         f"{name}, got {dim!r}")
    return dim % x.dim()


def shard_sequence(x: torch.Tensor, group=None, dim: int = 1, layout: str = "zigzag"):
    """This rank's shard of a full-sequence tensor, in the layout :func:`ring_attention` expects.

    Parameters
    ----------
    x : torch.Tensor
        The whole sequence, identical on every rank of ``group`` (e.g. ``(b, s, h, d)`` with
        ``dim=1``, or an LSE ``(b, h, s)`` with ``dim=2``).
    group : torch.distributed.ProcessGroup, optional
        The ring's process group (default: the world; without an initialized default group the
        world size is 1).
    dim : int
        The sequence dimension.
    layout : {"zigzag", "contiguous"}
        ``"contiguous"``: rank ``r`` gets chunk ``r`` of ``W``. ``"zigzag"``: ``2W`` chunks, rank
        ``r`` gets chunks ``r`` and ``2W - 1 - r`` concatenated (balances causal work).

    Returns
    -------
    torch.Tensor
        ``x``'s shard, ``x.size(dim) / W`` long on ``dim``: a view for ``"contiguous"``, a new
        tensor for ``"zigzag"``. Differentiable (``narrow`` / ``cat``). No communication.

    Raises
    ------
    ValueError
        ``x.size(dim)`` not divisible by the layout's chunk count (``W`` or ``2W``).
    """
    check_layout(layout)
    dim = _check_seq_dim("x", x, dim)
    rank, world = group_rank_world(group)
    n_chunks = world * chunks_per_rank(layout)
    if x.size(dim) % n_chunks:
        raise ValueError(
            f"x: expected the sequence length (x.shape[{dim}]) divisible by {n_chunks} "
            f"({chunks_per_rank(layout)} chunk(s) per rank x world size {world}, "
            f"layout={layout!r}), got {x.size(dim)}")
    local = x.size(dim) // world
    segs = local_segments(layout, rank, world, local)
    parts = [x.narrow(dim, s.start, s.length) for s in segs]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim)


def unshard_sequence(x_local: torch.Tensor, group=None, dim: int = 1, layout: str = "zigzag"):
    """The whole sequence from every rank's shard (an all-gather): inverse of
    :func:`shard_sequence`.

    Parameters
    ----------
    x_local : torch.Tensor
        This rank's shard (same shape on every rank), e.g. :func:`ring_attention`'s output
        ``(b, s_local, h, d)`` (``dim=1``) or its LSE ``(b, h, s_local)`` (``dim=2``).
    group, dim, layout
        As :func:`shard_sequence`.

    Returns
    -------
    torch.Tensor
        The full tensor, ``W * s_local`` long on ``dim``, on every rank. Not differentiable (an
        all-gather; the result carries no autograd history).
    """
    check_layout(layout)
    dim = _check_seq_dim("x_local", x_local, dim)
    rank, world = group_rank_world(group)
    if x_local.size(dim) % chunks_per_rank(layout):
        raise ValueError(
            f"x_local: expected the local sequence length (x_local.shape[{dim}]) divisible by "
            f"{chunks_per_rank(layout)} (layout={layout!r}), got {x_local.size(dim)}")
    x_local = x_local.detach().contiguous()
    if world == 1:
        return x_local.clone()
    shards = [torch.empty_like(x_local) for _ in range(world)]
    dist.all_gather(shards, x_local, group=group)
    local = x_local.size(dim)
    pieces = []
    for r, shard in enumerate(shards):
        for seg in local_segments(layout, r, world, local):
            pieces.append((seg.start, shard.narrow(dim, seg.local, seg.length)))
    pieces.sort(key=lambda p: p[0])
    return torch.cat([p for _, p in pieces], dim)
