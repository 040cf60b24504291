"""The communication paths checked against formulas: the ring pipeline carrying parcae-1_3b-sized messages, and the
ZeRO-1 reduce-scatter / all-gather of the gradient buffer."""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from megaloop.preflight.bandwidth import bus_bandwidth, expected_rate, sendrecv_bandwidth
from megaloop.preflight.context import Context
from megaloop.preflight.report import PathResult

# parcae-1_3b (configs/parcae-1_3b.yaml): d_model 1536, seq_len 2048; 2 rows: 25.2 MB per fp32 message
ROWS, SEQ, WIDTH = 2, 2048, 1536
LAPS = 2
W0, W1, C = 0.5, 0.8, 1.0  # stage 0's and stage 1's lap weight, the embedding's scale
RING_TOL = 1e-4  # fp32 dot products over 6.3M elements


class ScaledRing:
    """A StageProgram of two stages whose laps are scalings: lap = h <- w0 (h + e) on stage 0, h <- w1 h on stage 1,
    e = c x_mb, h_0 = 0, loss = <h, pattern> / micro-batches. After L laps h = c (a + ... + a^L) x_mb with
    a = w0 w1, so every loss and gradient has a closed form (`expected`); a message altered on its way breaks it."""

    def __init__(self, stage: int, device: torch.device, micro_batches: int, fault: bool = False):
        self.stage, self.device, self.fault, self.micro_batches = stage, device, fault, micro_batches
        self.weight = torch.nn.Parameter(torch.tensor(W0 if stage == 0 else W1, device=device))
        self.scale = torch.nn.Parameter(torch.tensor(C, device=device))
        self.pattern = pattern(device)
        self.inputs = [inputs(mb, device) for mb in range(micro_batches)] if stage == 0 else []

    def message_shape(self, mb: int, lap: int) -> tuple[int, ...]:
        return (ROWS, SEQ, WIDTH)

    def embed(self, mb: int):
        return self.scale * self.inputs[mb], torch.zeros(ROWS, SEQ, WIDTH, device=self.device)

    def lap_segment(self, mb: int, lap: int, h, e):
        out = self.weight * (h + e) if self.stage == 0 else self.weight * h
        return out + 1e-3 if self.fault and lap == 0 else out

    def loss(self, mb: int, h):
        return (h * self.pattern).sum() / self.micro_batches


def pattern(device) -> torch.Tensor:
    """Position-dependent weights in [0.5, 1.5] (positive: the loss's fp32 sum has no cancellation)."""
    return torch.linspace(0.5, 1.5, ROWS * SEQ * WIDTH, device=device).reshape(ROWS, SEQ, WIDTH)


def inputs(mb: int, device) -> torch.Tensor:
    """x_mb: position- and micro-batch-dependent values in [0, 1)."""
    idx = torch.arange(ROWS * SEQ * WIDTH, device=device, dtype=torch.float64)
    return torch.frac(idx * 0.6180339887 + 0.1 * mb).float().reshape(ROWS, SEQ, WIDTH)


def micro_batches(device) -> int:
    """4 on GPU; 2 on CPU, where each 25 MB message costs milliseconds of copies through gloo's TCP loopback (still
    two micro-batches in flight, so sends and receives of different micro-batches interleave)."""
    return 4 if device.type == "cuda" else 2


def expected(device, n: int) -> dict[str, float]:
    """Losses and gradients of ScaledRing (float64): loss_mb = c S_mb (a + a^2) / n with S_mb = <x_mb, pattern>."""
    a = W0 * W1
    weights = pattern(device).double()
    s = [float((inputs(mb, device).double() * weights).sum()) / n for mb in range(n)]
    total = sum(s)
    return {"losses": [C * x * (a + a * a) for x in s], "scale": total * (a + a * a),
            "w0": C * total * (1 + 2 * a) * W1, "w1": C * total * (1 + 2 * a) * W0}


def ring_1p3b_messages(ctx: Context) -> PathResult:
    """pp2 (x dp world/2): one step of the ring schedule over RingExecutor with 25 MB messages; losses and
    gradients against their closed form, and the paired send/receive bandwidth of the stage pair."""
    from pipeline.layout import group_ranks, init_layout
    from pipeline.ring import MicroBatch, ring_schedule
    from pipeline.ring.channels import ring_channels
    from pipeline.ring.execute import RingExecutor

    start = time.perf_counter()
    layout = init_layout(pp=2, device=ctx.device.type)
    n = micro_batches(ctx.device)
    program = ScaledRing(layout.pp_rank, ctx.device, n, fault=ctx.faulty("pp2_1p3b_messages") and layout.pp_rank == 1)
    specs = [MicroBatch(LAPS, LAPS)] * n
    actions = ring_schedule(specs, 2, max_in_flight=2)[layout.pp_rank]
    # NCCL's semantics on every backend: a send completes only when its receive does (the deadlock a 1.3B-sized
    # message meets on a cluster shows here on CPU too)
    channels = ring_channels(group_ranks(layout.tp, layout.dp, layout.pp)["pp"], layout.rank, "rendezvous")
    result = RingExecutor(program, device=ctx.device, channels=channels).run(actions, specs)
    want = expected(ctx.device, n)
    errs = {"w0" if layout.pp_rank == 0 else "w1": program.weight.grad}
    if layout.pp_rank == 0:
        errs["scale"] = program.scale.grad
    else:
        errs["losses"] = torch.stack([result.losses[mb] for mb in range(n)])
    worst = max(float((torch.as_tensor(want[k], dtype=torch.float64) - v.detach().double().cpu()).abs().max()
                      / max(abs(x) for x in torch.as_tensor(want[k]).reshape(-1).tolist())) for k, v in errs.items())
    worst_all = torch.tensor([worst], dtype=torch.float64, device=ctx.device)
    dist.all_reduce(worst_all, op=dist.ReduceOp.MAX)
    worst = float(worst_all)
    bw = sendrecv_bandwidth(layout.pp_group, ROWS * SEQ * WIDTH, ctx.device, iters=5 if ctx.on_gpu else 1)
    expected_bw, link = expected_rate(ctx.device, ctx.spans_nodes(layout.pp_ranks))
    mb_bytes = ROWS * SEQ * WIDTH * 4 / 1e6
    detail = (f"pp2 x dp{layout.dp}: {n} micro-batches x {LAPS} laps of {mb_bytes:.1f} MB messages, "
              f"losses and gradients against their closed form: worst rel err {worst:.1e} (tol {RING_TOL:.0e}); "
              f"paired send/recv over the stage pair")
    return PathResult("pp2_1p3b_messages", worst <= RING_TOL, detail, time.perf_counter() - start, bw, expected_bw,
                      link)


def _shard_values(rank: int, length: int, device) -> torch.Tensor:
    """g(r, j) = (31 r + j) mod 200: integers exact in fp32 and bf16."""
    return ((31 * rank + torch.arange(length, device=device)) % 200).float()


def _zero_check(ctx: Context, dtype: torch.dtype, numel: int) -> list[str]:
    """Reduce-scatter of x_r[i] = (r mod 2 + 1) 2^(i mod 4) (the exact sum is (n + n // 2) 2^(i mod 4), exact in
    bf16 up to 128 ranks) and all-gather of g(r, j); the problems found on this rank."""
    n, rank, dev = ctx.world, ctx.rank, ctx.device
    numel -= numel % n
    chunk = numel // n
    powers = 2.0 ** (torch.arange(numel, device=dev) % 4)
    full = ((rank % 2 + 1) * powers).to(dtype)
    if ctx.faulty("zero1") and rank == n - 1:
        full[rank * chunk] += 1
    part = torch.empty(chunk, device=dev, dtype=dtype)
    dist.reduce_scatter_single(part, full)
    want = ((n + n // 2) * powers[rank * chunk:(rank + 1) * chunk]).to(dtype)
    bad = [] if torch.equal(part, want) else [f"{dtype} reduce-scatter chunk {rank}: "
                                              f"{int((part != want).sum())} wrong elements"]
    gathered = torch.empty(numel, device=dev, dtype=dtype)
    dist.all_gather_single(gathered, _shard_values(rank, chunk, dev).to(dtype))
    want_all = torch.cat([_shard_values(r, chunk, dev) for r in range(n)]).to(dtype)
    if not torch.equal(gathered, want_all):
        bad.append(f"{dtype} all-gather on rank {rank}: {int((gathered != want_all).sum())} wrong elements")
    return bad


def zero1_collectives(ctx: Context) -> PathResult:
    """The gradient buffer's reduce-scatter and the parameters' all-gather over dp = world, in fp32 and bf16
    (parallel.grad_reduce_dtype), every element against its formula; bandwidth of both at bucket size."""
    start = time.perf_counter()
    numel = (16 << 20) if ctx.on_gpu else (256 << 10)
    mine = [p for dtype in (torch.float32, torch.bfloat16) for p in _zero_check(ctx, dtype, numel)]
    found = [None] * ctx.world
    dist.all_gather_object(found, mine)
    problems = [p for ps in found for p in ps]
    rs = bus_bandwidth("reduce_scatter", None, numel, ctx.device)
    ag = bus_bandwidth("all_gather", None, numel, ctx.device)
    expected_bw, link = expected_rate(ctx.device, ctx.spans_nodes(range(ctx.world)))
    detail = (f"dp{ctx.world}, {numel * 4 / 2**20:.0f} MiB fp32 + bf16 buffers: "
              + (f"{len(problems)} problems, first: {problems[0]}" if problems else "every element as its formula")
              + f"; reduce-scatter {rs:.3g} GB/s, all-gather {ag:.3g} GB/s")
    return PathResult("zero1", not problems, detail, time.perf_counter() - start, min(rs, ag), expected_bw, link)
