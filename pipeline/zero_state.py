"""ZeRO-1 AdamW moments in checkpoints, written and read by the data-parallel rank that updates them.

Data-parallel rank r updates the AdamW elements in chunk r of the flat buffer (:mod:`pipeline.grad_buffer`): for
each parameter a contiguous range [lo, hi) of its (tensor-parallel shard's) flattened elements, whose ends fall
anywhere, mid-row included. A checkpoint stores each moment as one array of the parameter's global shape (layout-free,
as every array). Its zarr chunks are blocks of `k` rows along dim 0 of a tensor-parallel region
(:func:`pipeline.state_regions.block_rows`: a few MiB each), so that:

* save: the block whose first element rank r owns is written by rank r. The blocks inside r's range are views of
  its moments (no copy). A range end that cuts a block leaves a fragment with the neighbouring owner, who sends it
  point-to-point to the block's writer: per rank at most one fragment out (its first, partial block) and the
  fragments completing its last block in, all in one ``batch_isend_irecv`` (each send paired with its receive in
  the same batch, so it completes under NCCL too). Owners' blocks never share a chunk file (zarr loses concurrent
  writes inside one chunk), and no rank ever holds more than its own moments plus a block per cut parameter.
* load: rank r reads the rows covering its range (the blocks it wrote plus at most one partial block at each end),
  from whatever chunk grid the saving job used; any dp size loads any other's checkpoint.

Every rank computes every owner's range from the buffer's layout alone (the same on all ranks), so nothing about
the ranges is communicated.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from pipeline.state_regions import RowBlock, block_rows, shard_rows


@dataclass(frozen=True)
class _Param:
    """One AdamW parameter's geometry: its flat group, offset there, shard shape and rows, block size in
    elements, and every dp rank's [lo, hi) of its flattened elements."""

    group: object
    name: str
    offset: int
    shape: tuple[int, ...]
    numel: int
    inner: int
    block: int  # elements per block (rows per block x elements per row)
    ranges: tuple[tuple[int, int, int], ...]  # (dp rank, lo, hi), ascending

    def owner_of(self, element: int) -> int:
        return next(r for r, lo, hi in self.ranges if lo <= element < hi)

    def own(self, rank: int) -> tuple[int, int] | None:
        return next(((lo, hi) for r, lo, hi in self.ranges if r == rank), None)


def params_of(opt, spec_of=None) -> list[_Param]:
    """The geometry of every AdamW parameter of `opt` (a ZeroAdamW), in a fixed order (the same on every rank)."""
    out = []
    for group, mine in opt.adamw_params():
        for i, p in mine:
            name, off, n = opt.names[id(p)], group.offsets[i], p.numel()
            ranges = []
            for r in range(group.dp):
                lo, hi = max(off, r * group.chunk_len), min(off + n, (r + 1) * group.chunk_len)
                if lo < hi:
                    ranges.append((r, lo - off, hi - off))
            shape = tuple(p.shape)
            _, inner = shard_rows(shape)
            k = block_rows(shape, spec_of(name) if spec_of else None, p.element_size())
            out.append(_Param(group, name, off, shape, n, inner, k * inner, tuple(ranges)))
    return out


def _moments(opt, q: _Param, lo: int, hi: int) -> list[torch.Tensor]:
    """This rank's moments over elements [lo, hi) of parameter q (views)."""
    return [opt.run_state(q.group, q.offset + lo, q.offset + hi, m) for m in opt.MOMENTS]


@torch.no_grad()
def owner_blocks(opt, prefix: str, spec_of=None) -> list[tuple]:
    """Entries (f"{prefix}/{moment}/{name}", name, block, RowBlock) of every block this rank writes; collective
    over the data-parallel group (the fragment exchange), every dp rank calls it."""
    me, group = opt.buffer.rank, opt.dp_group
    entries, ops, pending = [], [], []
    for q in params_of(opt, spec_of):
        own = q.own(me)
        if own is None:
            continue
        lo, hi = own
        first = lo // q.block
        if lo % q.block:  # my first block starts in another rank's range: send it my part
            end = min(hi, (first + 1) * q.block)
            data = torch.cat([m.reshape(-1) for m in _moments(opt, q, lo, end)])
            ops.append(dist.P2POp(dist.isend, data, dist.get_global_rank(group, q.owner_of(first * q.block)), group))
            first += 1
        for j in range(first, -(-hi // q.block)):
            a, b = j * q.block, (j + 1) * q.block
            rows = RowBlock(a // q.inner, b // q.inner, q.shape)
            block_shape = (b // q.inner - a // q.inner,) + q.shape[1:] if q.shape else ()
            if b <= hi:  # whole block in my range: views, no copy
                blocks = [m.view(block_shape) for m in _moments(opt, q, a, b)]
            else:
                blocks = [torch.empty(q.block, dtype=m.dtype, device=m.device) for m in _moments(opt, q, a, hi)]
                for dst, src in zip(blocks, _moments(opt, q, a, hi)):
                    dst[:hi - a].copy_(src)
                for r, rlo, rhi in q.ranges:  # the owners of the rest, ascending
                    if r == me or rhi <= hi or rlo >= b:
                        continue
                    s, e = max(rlo, hi), min(rhi, b)
                    buf = torch.empty(2 * (e - s), dtype=blocks[0].dtype, device=blocks[0].device)
                    ops.append(dist.P2POp(dist.irecv, buf, dist.get_global_rank(group, r), group))
                    pending.append((blocks, s - a, e - a, buf))
                blocks = [t.view(block_shape) for t in blocks]
            entries += [(f"{prefix}/{m}/{q.name}", q.name, t, rows) for m, t in zip(opt.MOMENTS, blocks)]
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    for blocks, s, e, buf in pending:
        for t, part in zip(blocks, buf.chunk(2)):
            t.view(-1)[s:e].copy_(part)
    return entries


@torch.no_grad()
def load_owned(opt, read_rows, prefix: str) -> list[dict]:
    """{moment: tensor} of each of `opt`'s runs (opt.masters order), read row range by row range:
    read_rows(array, name, start, stop) returns rows [start, stop) of this rank's shard of that array."""
    me = opt.buffer.rank
    runs = [{m: torch.empty(b - a, dtype=master.dtype, device=master.device) for m in opt.MOMENTS}
            for _, a, b, master in opt.masters]
    for q in params_of(opt):
        own = q.own(me)
        if own is None:
            continue
        lo, hi = own
        start, stop = lo // q.inner, -(-hi // q.inner)
        index, (_, a, _, _) = next((i, run) for i, run in enumerate(opt.masters)
                                   if run[0] is q.group and run[1] <= q.offset + lo < run[2])
        for m in opt.MOMENTS:
            value = read_rows(f"{prefix}/{m}/{q.name}", q.name, start, stop)
            if value is None:
                raise KeyError(f"the checkpoint has no {prefix}/{m}/{q.name} although it records AdamW steps for "
                               f"{q.name!r}; it is damaged: load an older one")
            flat = value.reshape(-1)[lo - start * q.inner:hi - start * q.inner]
            runs[index][m][q.offset + lo - a:q.offset + hi - a].copy_(flat)
    return runs
