"""The communication model of the time planner: ring collectives on an alpha-beta model of the links.

A ring collective over n ranks of a tensor of X bytes (the whole tensor: the gathered one for an all-gather, the
input of a reduce-scatter) runs n - 1 steps (reduce-scatter, all-gather) or 2 (n - 1) (all-reduce: a reduce-scatter
then an all-gather), each moving X / n bytes over every link of the ring at once and paying the link's latency:

    time = steps x (latency + X / n / bandwidth)

so the bytes each rank sends are (n - 1)/n X (reduce-scatter, all-gather) or 2 (n - 1)/n X (all-reduce), and a call
costs (n - 1) (or 2 (n - 1)) latencies however small its tensor: many small buckets are latency-bound. An all-to-all
(the bf16 gradient reduction: every rank sends each other rank its piece and sums what it receives itself) is not a
ring but a pairwise exchange of n - 1 rounds, each moving X / n bytes per rank: the same form with its own fitted
figures where a library gives them (Link.kinds).

Data-parallel buckets are the ones the trainer builds (megaloop/plan/dp_buckets.py); :func:`dp_traffic` runs them on
one communication stream in launch order, each going on the wire when it is ready, and reports what the training
thread waits for.

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

KINDS = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all")


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
    """Ring steps (all-to-all: exchange rounds) of one collective over n ranks."""
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


@dataclass(frozen=True)
class DpTraffic:
    """One step's data-parallel collectives on one rank: seconds of the gradient reduction (reduce-scatter under
    ZeRO-1, a bf16 all-to-all with bf16 reduction, else all-reduce) and of the parameter all-gather, the call count,
    and the seconds of each the training thread waits for (exposed)."""

    reduce_s: float
    gather_s: float
    calls: int
    reduce_exposed_s: float = 0.0
    gather_exposed_s: float = 0.0

    @property
    def exposed_s(self) -> float:
        return self.reduce_exposed_s + self.gather_exposed_s


def reduce_exposed(times: list[float], ready: list[float], backward_s: float) -> float:
    """Seconds the reduction runs past the end of a backward of `backward_s`: bucket k (in launch order) goes on
    the one communication stream at max(ready_k x backward_s, the end of bucket k-1)."""
    end = 0.0
    for t, r in zip(times, ready):
        end = max(end, r * backward_s) + t
    return max(0.0, end - backward_s)


def gather_exposed(times: list[float], need: list[float], forward_s: float, in_flight: int) -> float:
    """Seconds a forward of `forward_s` waits for the parameter all-gather (pipeline/param_gather.py), buckets in
    their launch order (by first use): the first `in_flight` are launched when the forward starts, each later one
    when the forward has waited for the bucket `in_flight` places before it; the forward stops at a bucket's first
    use (need x forward_s of its own work) until the bucket has arrived."""
    finished, comm_free, stall = [], 0.0, 0.0
    for k, (t, n) in enumerate(zip(times, need)):
        launch = finished[k - in_flight] if k >= in_flight else 0.0
        comm_free = max(comm_free, launch) + t
        reach = n * forward_s + stall
        stall += max(0.0, comm_free - reach)
        finished.append(max(reach, comm_free))
    return stall


def dp_traffic(buckets, dp: int, link: Link, wire: int, sharded: bool, bf16_reduce: bool, backward_s: float,
               forward_s: float, overlap_param_gather: bool, in_flight: int = 2) -> DpTraffic:
    """The data-parallel traffic of a rank's planned buckets (megaloop/plan/dp_buckets.py, in launch order) over
    dp ranks, `wire`-byte elements: ZeRO-1 (`sharded`) reduce-scatter (bf16 wire: the all-to-all the reducer
    runs) + all-gather, else all-reduce. Exposed: the reduction beyond the last backward (`backward_s`; 0: no
    overlap, all of it), the all-gather's waits in the next forward (`forward_s`) or all of it without overlap."""
    if dp <= 1 or not buckets:
        return DpTraffic(0.0, 0.0, 0)
    kind = ("all_to_all" if bf16_reduce else "reduce_scatter") if sharded else "all_reduce"
    times = [collective_time(kind, dp, b.elements * wire, link) for b in buckets]
    reduce_s = sum(times)
    exposed = reduce_exposed(times, [b.ready for b in buckets], backward_s)
    if not sharded:
        return DpTraffic(reduce_s, 0.0, len(buckets), exposed, 0.0)
    order = sorted(range(len(buckets)), key=lambda k: (buckets[k].need, k))
    gathers = [collective_time("all_gather", dp, buckets[k].elements * wire, link) for k in order]
    gathered = (gather_exposed(gathers, [buckets[k].need for k in order], forward_s, in_flight)
                if overlap_param_gather else sum(gathers))
    return DpTraffic(reduce_s, sum(gathers), 2 * len(buckets), exposed, gathered)
