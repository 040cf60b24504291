"""One reader per data-parallel replica: the rows of a replica's batch are read by one rank and broadcast to the
others.

Every tensor-parallel rank of a replica computes on the same rows, and so does every pipeline stage (the first
embeds their inputs, the last scores their labels). Instead of each of the tp x pp ranks reading them from the
shards, the replica's rank at tp rank 0 and pipeline stage 0 reads; the token ids then travel over the groups that
exist already: first over the pipeline group of the tp-rank-0 ranks (stage 0 to every stage), then over each
stage's tensor-parallel group (tp rank 0 to the others). A batch is a few rows of int64 ids (32 KB for two rows of
2049 tokens), so this is cheap, and every rank ends with exactly the tensor the reader read. Which rows a replica
takes stays a pure function of (seed, step, global sample index) on every rank (the loader's order and `select`);
only the reading is shared.

Under NCCL the ids are broadcast on the rank's device and the batch's tokens stay there (the step indexes them on
the device); under gloo they are broadcast in place in host memory. The broadcasts run on the calling thread (the
training loop's), never on a prefetch thread, so they are ordered like every other collective of these groups.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


class ReplicaReader:
    """This rank's part in reading a replica's rows once: `reads` (this rank reads from the shards) and `share`."""

    def __init__(self, layout):
        self.layout = layout
        self.reads = layout.tp_rank == 0 and layout.pp_rank == 0
        self.device = layout.comm_device

    @property
    def shares(self) -> bool:
        """Whether any rank of the replica other than this one needs the rows (tp > 1 or pp > 1)."""
        return self.layout.tp > 1 or self.layout.pp > 1

    def share(self, tokens: torch.Tensor) -> torch.Tensor:
        """The reader's `tokens` on every rank of the replica (on the reader, its own; elsewhere `tokens` gives only
        the shape). Collective over the replica's pipeline group (tp rank 0) and tensor-parallel group."""
        if not self.shares:
            return tokens
        layout = self.layout
        buffer = tokens if tokens.device == self.device else (
            tokens.to(self.device, non_blocking=True) if self.reads
            else torch.empty(tokens.shape, dtype=tokens.dtype, device=self.device))
        if layout.pp > 1 and layout.tp_rank == 0:
            dist.broadcast(buffer, src=layout.pp_ranks[0], group=layout.pp_group)
        if layout.tp > 1:
            dist.broadcast(buffer, src=layout.tp_ranks[0], group=layout.tp_group)
        return buffer

    def close(self) -> None:
        """Drop the layout (it holds the process groups, which the runtime frees at the end of the job)."""
        self.layout = None
