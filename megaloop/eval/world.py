"""Data parallelism over examples for eval: every process holds the whole model and scores a share of the batches.

Batches are formed from the whole request list the same way whatever the process count, and process r scores
batches r, r + P, r + 2P, ...; the results are gathered back into request order. So a number never depends on how
many processes computed it (each batch is the same computation on the same rows).
"""
from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass
class World:
    rank: int = 0
    size: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def mine(self, n_batches: int) -> range:
        return range(self.rank, n_batches, self.size)

    def gather(self, results: dict) -> dict:
        """Merge {index: value} maps of every process (a no-op on one process)."""
        if self.size == 1:
            return results
        import torch.distributed as dist

        parts: list = [None] * self.size
        dist.all_gather_object(parts, results)
        merged: dict = {}
        for part in parts:
            merged.update(part)
        return merged


def init_world() -> World:
    """World of the launcher (torchrun sets WORLD_SIZE/RANK): a gloo group for the gathers; one process otherwise."""
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size == 1:
        return World()
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    return World(dist.get_rank(), dist.get_world_size())


def close_world(world: World) -> None:
    if world.size > 1:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
