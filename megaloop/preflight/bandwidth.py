"""Bus bandwidth of a collective over a process group, in nccl-tests' convention (busbw = algbw x factor: 2(n-1)/n
for all-reduce, (n-1)/n for reduce-scatter and all-gather, 1 for a point-to-point exchange), so the figures compare
with `all_reduce_perf` and with the link's rate; and the nominal rates of the links a group runs over.

The expected figure is the link's nominal one-direction rate per GPU: NVLink within a node, the GPU's InfiniBand
NIC across nodes (one NIC per GPU, as on DGX / HGX nodes). A healthy cluster measures roughly 70-90% of it at large
messages; a few percent says NCCL fell back to PCIe or TCP sockets (check NCCL_DEBUG=INFO's transport lines)."""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

# GB/s per GPU, one direction: (NVLink, InfiniBand NIC)
LINK_RATES = {
    "H100": (450.0, 50.0),  # NVLink 4 (18 links), NDR 400 Gb/s
    "H200": (450.0, 50.0),
    "H800": (200.0, 50.0),
    "A100": (300.0, 25.0),  # NVLink 3 (12 links), HDR 200 Gb/s
    "B200": (900.0, 50.0),  # NVLink 5, NDR 400 Gb/s
}
FACTORS = {"all_reduce": lambda n: 2 * (n - 1) / n, "reduce_scatter": lambda n: (n - 1) / n,
           "all_gather": lambda n: (n - 1) / n, "sendrecv": lambda n: 1.0}


def expected_rate(device: torch.device, spans_nodes: bool) -> tuple[float | None, str]:
    """(the nominal GB/s, "nvlink" or "ib") for a group on this GPU model; (None, "loopback") on CPU, (None, link)
    for a GPU missing from LINK_RATES."""
    if device.type != "cuda":
        return None, "loopback"
    link = "ib" if spans_nodes else "nvlink"
    name = torch.cuda.get_device_name(device)
    for model, rates in LINK_RATES.items():
        if model in name:
            return rates[1 if spans_nodes else 0], link
    return None, link


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _collective(kind: str, group, numel: int, device: torch.device, dtype: torch.dtype):
    """A callable running one `kind` over `group` on buffers of `numel` elements (all_gather: numel in total)."""
    n = dist.get_world_size(group)
    numel -= numel % n
    full = torch.ones(numel, device=device, dtype=dtype)
    part = torch.ones(numel // n, device=device, dtype=dtype)
    if kind == "all_reduce":
        return lambda: dist.all_reduce(full, group=group), full.numel()
    if kind == "reduce_scatter":
        return lambda: dist.reduce_scatter_single(part, full, group=group), full.numel()
    if kind == "all_gather":
        return lambda: dist.all_gather_single(full, part, group=group), full.numel()
    raise ValueError(f"unknown collective {kind!r}")


def bus_bandwidth(kind: str, group, numel: int, device: torch.device, dtype=torch.float32, iters: int = 3) -> float:
    """GB/s of `kind` over `group` (every rank of the group calls this), the slowest rank's time over `iters` calls
    after one warm-up."""
    run, count = _collective(kind, group, numel, device, dtype)
    size = count * torch.finfo(dtype).bits // 8
    return size / _slowest_seconds(run, group, device, iters) / 1e9 * FACTORS[kind](dist.get_world_size(group))


def sendrecv_bandwidth(group, numel: int, device: torch.device, dtype=torch.float32, iters: int = 3) -> float:
    """GB/s one direction of a two-rank group exchanging `numel`-element messages (each rank sends one and receives
    one in the same batch_isend_irecv, as a pipeline's paired send/receive does)."""
    ranks = dist.get_process_group_ranks(group)
    if len(ranks) != 2:
        raise ValueError(f"sendrecv_bandwidth needs a group of two ranks, got {ranks}")
    peer = ranks[1 - ranks.index(dist.get_rank())]
    out, into = torch.ones(numel, device=device, dtype=dtype), torch.empty(numel, device=device, dtype=dtype)

    def run():
        for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, out, peer, group),
                                            dist.P2POp(dist.irecv, into, peer, group)]):
            work.wait()

    return numel * torch.finfo(dtype).bits // 8 / _slowest_seconds(run, group, device, iters) / 1e9


def _slowest_seconds(run, group, device: torch.device, iters: int) -> float:
    """Seconds per call of `run` (one warm-up, then `iters` timed calls), the slowest rank of `group`'s."""
    run()
    _sync(device)
    start = time.perf_counter()
    for _ in range(iters):
        run()
    _sync(device)
    elapsed = torch.tensor([(time.perf_counter() - start) / iters], device=device, dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=group)
    return float(elapsed)
