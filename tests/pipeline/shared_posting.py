"""A test double: the ring executor's earlier posting, every message on the pipeline's one group and each run of
Sends and Recvs posted as one batch. Under rendezvous semantics (NCCL's; emulated on gloo) it hangs once a message
outgrows the transport's buffers, which is why the production executor (pipeline/ring/execute.py) gives every
direction of every neighbouring pair its own group; tests/pipeline/test_ring_execute.py shows the hang."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from pipeline.ring.actions import Action, Recv, Send
from pipeline.ring.channels import emulates
from pipeline.ring.execute import RingExecutor
from pipeline.ring.rendezvous import EAGER_BYTES, RendezvousP2P


@dataclass
class SharedChannels:
    """Channels that all travel on one group (the pipeline's): what RingExecutor reads of RingChannels."""

    ranks: tuple[int, ...]
    position: int
    shared: dist.ProcessGroup
    post: Callable = dist.batch_isend_irecv

    def group(self, src: int, dst: int) -> dist.ProcessGroup:
        return self.shared

    def close(self) -> None:
        if isinstance(self.post, RendezvousP2P):
            self.post.close()


def shared_channels(ranks: Sequence[int], rank: int, semantics: str = "auto", timeout_s: float = 600.0,
                    eager_bytes: int = EAGER_BYTES) -> SharedChannels:
    """The pipeline `ranks` (the world) on the world's group, with the rendezvous emulation where asked on gloo."""
    channels = SharedChannels(tuple(ranks), list(ranks).index(rank), dist.group.WORLD)
    if emulates(semantics, dist.get_backend()):
        channels.post = RendezvousP2P(eager_bytes, timeout_s)
    return channels


class SharedPostingExecutor(RingExecutor):
    """RingExecutor with the earlier posting (see the module docstring)."""

    def _communicate(self, batch: Sequence[Action]) -> None:
        """The whole run in one batch on the pipeline's group, waiting for the receives (and, where the batch has
        one Work, its sends)."""
        kept: list[torch.Tensor] = []
        ops = [op for action in batch if isinstance(action, Send) for op in self._send_ops(action, kept)]
        recvs = [action for action in batch if isinstance(action, Recv)]
        if self.check_messages:  # sends in flight first, then each receive's header checked before its payload
            self._post_shared(ops, kept, batch)
            for action in recvs:
                posted = time.perf_counter()
                self._post_shared([self._recv_op(action, check=True)], [], batch)
                self.result.recvs.append((action.message, posted, time.perf_counter()))
            return
        posted = time.perf_counter()
        self._post_shared(ops + [self._recv_op(action) for action in recvs], kept, batch)
        self.result.recvs += [(action.message, posted, time.perf_counter()) for action in recvs]

    def _post_shared(self, ops: list[dist.P2POp], kept: list[torch.Tensor], batch: Sequence[Action]) -> None:
        if not ops:
            return
        start = time.perf_counter()
        works = self.channels.post(ops)
        if len(works) == len(ops):  # one work per op (gloo): wait for the receives only, sends stay in flight
            self.sends.append(([w for w, op in zip(works, ops) if op.op is dist.isend], kept))
            works = [w for w, op in zip(works, ops) if op.op is dist.irecv]
        else:  # one work for the whole batch (NCCL, or its emulation)
            self.sends.append(([], kept))
        self._wait_all(works, batch, start)

