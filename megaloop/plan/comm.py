"""The communication model of the time planner: ring collectives on an alpha-beta model of the links.

A ring collective over n ranks of a tensor of X bytes (the whole tensor: the gathered one for an all-gather, the
input of a reduce-scatter) runs n - 1 steps (reduce-scatter, all-gather) or 2 (n - 1) (all-reduce: a reduce-scatter
then an all-gather), each moving X / n bytes over every link of the ring at once and paying the link's latency:

    time = steps x (latency + X / n / bandwidth)

so the bytes each rank sends are (n - 1)/n X (reduce-scatter, all-gather) or 2 (n - 1)/n X (all-reduce), and a call
costs (n - 1) (or 2 (n - 1)) latencies however small its tensor: many small buckets are latency-bound.

Links. A group whose ranks all sit on one node runs over the intra-node link (NVLink on an H100 SXM node: ~450 GB/s
per direction of bus bandwidth). A group spanning nodes is limited by the inter-node link: each GPU has its own NIC
(InfiniBand, 8 x 400 Gb/s per node: ~50 GB/s per GPU), and NCCL runs one ring per NIC, so a group with g ranks on
each node moves data across nodes at g x the per-GPU figure (the NICs of a node are shared by the groups that run
at once, one NIC per GPU), never faster than the intra-node link. A step of a ring that crosses nodes pays the
inter-node latency. Rank order is Megatron's (tp fastest, then dp, then pp), so a group of ranks `stride` apart
holds min(n, G / stride) ranks per node when stride < G (G: GPUs per node), and one per node otherwise.
"""
from __future__ import annotations

from dataclasses import dataclass

GB = 1e9

KINDS = ("all_reduce", "reduce_scatter", "all_gather")


@dataclass(frozen=True)
class Link:
    """Bus bandwidth per rank and direction (bytes/s) and the latency of one ring step (s).

    `kinds` overrides them per collective, as (kind, bandwidth, latency) triples fitted to measured calls: a
    library whose collectives are not bandwidth-optimal rings (gloo's reduce-scatter costs about an all-reduce)
    is described in the same steps x (latency + X / n / bandwidth) form with its own figures per kind."""

    bandwidth: float
    latency: float
    kinds: tuple[tuple[str, float, float], ...] = ()

    def __post_init__(self):
        for _, bandwidth, latency in ((None, self.bandwidth, self.latency), *self.kinds):
            if not bandwidth > 0 or latency < 0:
                raise ValueError(f"a link needs bandwidth > 0 and latency >= 0, got {self}")
        unknown = [k for k, _, _ in self.kinds if k not in KINDS]
        if unknown:
            raise ValueError(f"unknown collective(s) {unknown} in a link: one of {', '.join(KINDS)}")

    def for_kind(self, kind: str) -> "Link":
        """The plain (bandwidth, latency) link one collective of `kind` runs on."""
        for k, bandwidth, latency in self.kinds:
            if k == kind:
                return Link(bandwidth, latency)
        return Link(self.bandwidth, self.latency)


@dataclass(frozen=True)
class Cluster:
    """The job's machines: GPUs per node, the intra-node link, and the inter-node link of ONE GPU's NIC."""

    gpus_per_node: int
    intra: Link
    inter: Link

    def group_link(self, n: int, stride: int) -> Link:
        """The link a group of n ranks `stride` apart runs its rings over (see the module docstring)."""
        if n <= 1:
            return self.intra
        per_node = max(1, min(n, self.gpus_per_node // stride)) if stride < self.gpus_per_node else 1
        if per_node >= n:  # the whole group on one node
            return self.intra
        bandwidth = min(self.intra.bandwidth, per_node * self.inter.bandwidth)
        return Link(bandwidth, max(self.intra.latency, self.inter.latency))


def h100_cluster(gpus_per_node: int = 8, nvlink_gbps: float = 450.0, nvlink_latency_us: float = 1.0,
                 ib_gbps: float = 50.0, ib_latency_us: float = 5.0) -> Cluster:
    """H100 SXM nodes: NVLink 4 (~450 GB/s bus bandwidth per direction), one 400 Gb/s InfiniBand NIC per GPU
    (~50 GB/s); latencies per ring step of the order NCCL's own tuning model uses (~1 us NVLink, ~5 us network)."""
    return Cluster(gpus_per_node, Link(nvlink_gbps * GB, nvlink_latency_us * 1e-6),
                   Link(ib_gbps * GB, ib_latency_us * 1e-6))


def ring_steps(kind: str, n: int) -> int:
    """Ring steps of one collective over n ranks."""
    if kind not in KINDS:
        raise ValueError(f"unknown collective {kind!r}: one of {', '.join(KINDS)}")
    return (2 if kind == "all_reduce" else 1) * (n - 1)


def wire_bytes(kind: str, n: int, size: float) -> float:
    """Bytes each rank sends in a ring collective of a `size`-byte tensor: (n-1)/n size, all-reduce 2 (n-1)/n."""
    return ring_steps(kind, n) * size / n


def collective_time(kind: str, n: int, size: float, link: Link, calls: int = 1) -> float:
    """Seconds of `calls` ring collectives of a `size`-byte tensor each over n ranks on `link` (0 when n = 1)."""
    if n <= 1 or calls == 0:
        return 0.0
    link = link.for_kind(kind)
    return calls * ring_steps(kind, n) * (link.latency + size / n / link.bandwidth)


def p2p_time(size: float, link: Link) -> float:
    """One point-to-point message of `size` bytes."""
    return link.latency + size / link.bandwidth


# ---- data-parallel buckets ------------------------------------------------------------------------------------
FIXED_BUCKET_BYTES = 25 * 2 ** 20  # the reducer's old fixed bucket: 25 MiB of gradient over all dp chunks
SCALED_BUCKET_MIN = 40_000_000  # elements (Megatron's max(40M, 1M x dp))
SCALED_BUCKET_PER_DP = 1_000_000


@dataclass(frozen=True)
class DpComm:
    """How the data-parallel traffic of one step is issued and overlapped.

    buckets: "fixed" (25 MiB of gradient per bucket) | "scaled" (max(40M, 1M x dp) elements);
    overlap_param_gather: the ZeRO-1 parameter all-gather runs behind the next forward (else after the optimizer,
    fully exposed)."""

    buckets: str = "scaled"
    overlap_param_gather: bool = True

    def __post_init__(self):
        if self.buckets not in ("fixed", "scaled"):
            raise ValueError(f"buckets {self.buckets!r}: fixed | scaled")

    def bucket_elements(self, dp: int, grad_bytes: int) -> int:
        if self.buckets == "fixed":
            return max(1, FIXED_BUCKET_BYTES // grad_bytes)
        return max(SCALED_BUCKET_MIN, SCALED_BUCKET_PER_DP * dp)


BEFORE = DpComm("fixed", False)
AFTER = DpComm("scaled", True)


def bucket_sizes(n_elements: int, bucket_elements: int) -> list[int]:
    """Elements of each bucket of a flat buffer of n_elements (the last one holds the rest)."""
    full, rest = divmod(n_elements, bucket_elements)
    return [bucket_elements] * full + ([rest] if rest else [])


@dataclass(frozen=True)
class DpTraffic:
    """One step's data-parallel collectives on one rank: total and last-bucket seconds of the gradient reduction
    (reduce-scatter under ZeRO-1, else all-reduce) and of the parameter all-gather, and the call counts."""

    reduce_s: float
    reduce_last_s: float
    gather_s: float
    gather_first_s: float
    calls: int

    def exposed(self, backward_window: float, forward_window: float, overlap_param_gather: bool) -> float:
        """Exposed seconds: the reduction runs behind the last backward (`backward_window` s) except its last
        bucket; the all-gather behind the next forward except its first bucket, or all of it without overlap."""
        reduce = max(self.reduce_s - backward_window, self.reduce_last_s) if self.reduce_s else 0.0
        if not overlap_param_gather:
            return reduce + self.gather_s
        gather = max(self.gather_s - forward_window, self.gather_first_s) if self.gather_s else 0.0
        return reduce + gather


def dp_traffic(n_elements: int, dp: int, link: Link, comm: DpComm, grad_bytes: int, wire: int,
               sharded: bool) -> DpTraffic:
    """The data-parallel traffic of a rank holding n_elements gradient elements of `grad_bytes` each, sent as
    `wire`-byte elements over dp ranks; `sharded` (ZeRO-1): reduce-scatter + all-gather, else all-reduce."""
    if dp <= 1 or n_elements == 0:
        return DpTraffic(0.0, 0.0, 0.0, 0.0, 0)
    sizes = bucket_sizes(n_elements, comm.bucket_elements(dp, grad_bytes))
    kind = "reduce_scatter" if sharded else "all_reduce"
    times = [collective_time(kind, dp, s * wire, link) for s in sizes]
    gathers = [collective_time("all_gather", dp, s * wire, link) for s in sizes] if sharded else [0.0]
    return DpTraffic(sum(times), times[-1], sum(gathers), gathers[0], len(sizes) * (2 if sharded else 1))

