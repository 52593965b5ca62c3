"""Point-to-point exchanges of the ring: send tensors ``offset`` ranks ahead, receive as many from
``offset`` ranks behind, asynchronously, into fresh buffers (the double buffer: the step computes
on the current K/V while the next one lands in the other).

On a GPU the ``batch_isend_irecv`` is issued from a side stream that first waits for the compute
stream (the tensors to send are ready), so kernels enqueued after it are not ordered behind the
transfer; :meth:`Pending.wait` orders the compute stream after the transfer (the host does not
block). On the CPU (gloo) the same calls are plain asynchronous sends/receives and ``wait``
blocks.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class Pending:
    """An exchange in flight: ``wait()`` returns the received tensors."""

    def __init__(self, works, received, sent):
        self._works, self._received = works, received
        self._sent = sent  # kept alive until the transfer is known to be complete

    def wait(self) -> list[torch.Tensor]:
        for work in self._works:
            work.wait()
        self._works, self._sent = [], None
        return self._received


class Ring:
    """The ring of one process group: rank ``r`` sends to ``r + 1`` and receives from ``r - 1``."""

    def __init__(self, group, rank: int, world: int):
        self.group, self.rank, self.world = group, rank, world
        self._stream = None

    def _global(self, group_rank: int) -> int:
        # P2POp takes global ranks (its ``group_peer`` needs torch >= 2.6).
        if self.group is None:
            return group_rank
        return dist.get_global_rank(self.group, group_rank)

    def exchange(self, tensors: list[torch.Tensor], offset: int = 1) -> Pending:
        """Send ``tensors`` (contiguous) to rank ``r + offset``, receive the same shapes from
        ``r - offset``. ``offset = 0 (mod world)`` keeps the tensors (no communication)."""
        if offset % self.world == 0:
            return Pending([], list(tensors), None)
        dst = self._global((self.rank + offset) % self.world)
        src = self._global((self.rank - offset) % self.world)
        received = [torch.empty_like(t) for t in tensors]
        ops = [dist.P2POp(dist.isend, t, dst, self.group) for t in tensors]
        ops += [dist.P2POp(dist.irecv, t, src, self.group) for t in received]
        if tensors[0].is_cuda:
            if self._stream is None:
                self._stream = torch.cuda.Stream(tensors[0].device)
            self._stream.wait_stream(torch.cuda.current_stream(tensors[0].device))
            with torch.cuda.stream(self._stream):
                works = dist.batch_isend_irecv(ops)
        else:
            works = dist.batch_isend_irecv(ops)
        return Pending(works, received, list(tensors))
