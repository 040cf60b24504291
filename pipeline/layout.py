"""The parallel layout: how the ranks of a job split into tensor- (tp), data- (dp) and pipeline-parallel (pp) groups.

Rank order is Megatron's: tp fastest, then dp, then pp, so

    rank = tp_rank + tp * (dp_rank + dp * pp_rank)

and the tp ranks of one model replica sit next to each other (on one node when tp <= GPUs per node). Everything a
parallel mechanism needs (its groups, the ranks in them, the device) lives in one :class:`ParallelLayout` object that
is passed to whoever needs it; nothing here keeps global state besides torch.distributed's default group.

Sizes are validated by :func:`validate_layout` BEFORE any process group exists, and a bad size fails with a message
listing the sizes that would work. A single-process job (world size 1) creates no process group at all.
"""
from __future__ import annotations

import functools
import gc
import importlib
import os
import socket
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import Mapping

import torch
import torch.distributed as dist

from pipeline.groups import GroupStats, create_groups


class LayoutError(ValueError):
    """A parallel layout that cannot work; the message says what to change."""


@dataclass(frozen=True)
class LaunchEnv:
    """Where this process sits in the job, read from torchrun's or Slurm's environment variables."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    launcher: str  # "torchrun" | "mpi" | "slurm" | "single"


def read_launch_env(environ: Mapping[str, str] | None = None) -> LaunchEnv:
    """torchrun (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT) first, then mpirun (Open MPI's OMPI_COMM_WORLD_*,
    MPICH's PMI_RANK/PMI_SIZE/MPI_LOCALRANKID; the rendezvous address comes from rank 0 through mpi4py unless
    MASTER_ADDR is set), then Slurm (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID), else a single process. MPI comes
    before Slurm because an mpirun inside a Slurm allocation inherits the batch step's SLURM_PROCID. Under Slurm
    MASTER_ADDR defaults to 127.0.0.1 (set it to the first node's address for multi-node jobs) and MASTER_PORT to
    29500."""
    env = os.environ if environ is None else environ
    addr = env.get("MASTER_ADDR", "127.0.0.1")
    port = int(env.get("MASTER_PORT", "29500"))
    if "RANK" in env and "WORLD_SIZE" in env:
        rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
        return LaunchEnv(rank, world, int(env.get("LOCAL_RANK", rank)), addr, port, "torchrun")
    mpi = _mpi_ranks(env)
    if mpi is not None:
        rank, world, local = mpi
        if "MASTER_ADDR" not in env and world > 1:
            addr, port = mpi_rendezvous(port)
        return LaunchEnv(rank, world, local, addr, port, "mpi")
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        rank, world = int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"])
        return LaunchEnv(rank, world, int(env.get("SLURM_LOCALID", 0)), addr, port, "slurm")
    return LaunchEnv(0, 1, 0, addr, port, "single")


def _mpi_ranks(env: Mapping[str, str]) -> tuple[int, int, int] | None:
    """(rank, world size, local rank) when started by mpirun (Open MPI or MPICH's Hydra), else None."""
    if "OMPI_COMM_WORLD_RANK" in env and "OMPI_COMM_WORLD_SIZE" in env:
        return (int(env["OMPI_COMM_WORLD_RANK"]), int(env["OMPI_COMM_WORLD_SIZE"]),
                int(env.get("OMPI_COMM_WORLD_LOCAL_RANK", 0)))
    if "PMI_RANK" in env and "PMI_SIZE" in env and "MPI_LOCALRANKID" in env:
        return int(env["PMI_RANK"]), int(env["PMI_SIZE"]), int(env["MPI_LOCALRANKID"])
    return None


@functools.lru_cache(maxsize=1)
def mpi_rendezvous(default_port: int) -> tuple[str, int]:
    """torch.distributed's rendezvous address under mpirun: rank 0's host address and a port free there, sent to
    every rank with one MPI broadcast (collective: every rank calls it once; the result is cached)."""
    try:
        from mpi4py import MPI
    except ImportError as err:  # pragma: no cover - mpi4py is pinned in requirements.txt
        raise LayoutError(f"started by mpirun but mpi4py cannot be imported ({err}): install mpi4py, or set "
                          "MASTER_ADDR and MASTER_PORT yourself") from None
    comm = MPI.COMM_WORLD
    found = None
    one_node = comm.Split_type(MPI.COMM_TYPE_SHARED).Get_size() == comm.Get_size()  # collective: every rank
    if comm.Get_rank() == 0:
        try:
            addr = "127.0.0.1" if one_node else socket.gethostbyname(socket.gethostname())
        except OSError:
            addr = "127.0.0.1"
        with socket.socket() as probe:
            probe.bind(("", 0))
            found = (addr, probe.getsockname()[1])
    return comm.bcast(found, root=0)


@dataclass(frozen=True)
class ModelDims:
    """The model sizes that tensor parallelism must divide (plain ints, so pipeline needs no model config)."""

    n_heads: int
    kv_heads: int
    vocab_size: int  # the (padded) vocabulary of the embedding and the tied head
    seq_len: int | None = None  # checked against tp when sequence parallelism is on


@dataclass(frozen=True)
class BatchDims:
    """Rows per optimizer step and per micro-batch (per data-parallel rank)."""

    global_batch: int
    micro_batch: int


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _valid_tp(world: int, pp: int, model: ModelDims | None, seq_parallel: bool) -> list[int]:
    """tp values that divide the world (with this pp) and every size tp has to split."""
    out = []
    for tp in _divisors(max(world // pp, 1)):
        if model is not None:
            needed = [model.n_heads, model.kv_heads, model.vocab_size]
            if seq_parallel and tp > 1 and model.seq_len:
                needed.append(model.seq_len)
            if any(n % tp for n in needed):
                continue
        out.append(tp)
    return out


def _check_model_split(tp: int, model: ModelDims, seq_parallel: bool, valid: list[int]) -> None:
    for label, size in (("n_heads", model.n_heads), ("kv heads", model.kv_heads),
                        ("padded vocabulary", model.vocab_size)):
        if size % tp:
            raise LayoutError(f"parallel.tp={tp} does not divide the model's {label} ({size}); tensor parallelism "
                              f"splits it evenly. tp values that work with this model and world size: {valid}")
    if seq_parallel and tp > 1 and model.seq_len and model.seq_len % tp:
        raise LayoutError(f"sequence parallelism splits model.seq_len={model.seq_len} over tp={tp}, which does not "
                          f"divide it; use one of tp {valid} or set parallel.sequence_parallel=false")


def _check_batch(dp: int, batch: BatchDims, world: int, tp: int, pp: int) -> None:
    rows_per_rank = batch.global_batch / dp
    if batch.global_batch % dp or (batch.global_batch // dp) % batch.micro_batch:
        working = [d for d in _divisors(world // (tp * pp)) if batch.global_batch % (d * batch.micro_batch) == 0]
        raise LayoutError(
            f"data parallelism over dp={dp} ranks gives {rows_per_rank:g} rows of the global batch "
            f"({batch.global_batch}) per rank, which is not a whole number of micro-batches of "
            f"{batch.micro_batch}; for this job set data.global_batch_size="
            f"{dp * batch.micro_batch * max(batch.global_batch // (dp * batch.micro_batch), 1)} (a multiple of "
            f"{dp * batch.micro_batch}); dp values that work: {working or 'none'} (on a job of tp x pp x dp "
            "processes)")


def validate_layout(world_size: int, tp: int = 1, pp: int = 1, dp: int | None = None,
                    model: ModelDims | None = None, batch: BatchDims | None = None,
                    sequence_parallel: bool | None = None) -> tuple[int, int, int]:
    """Check the sizes and return (tp, pp, dp). Touches no process group; raise LayoutError listing working sizes.

    dp defaults to world_size / (tp * pp). Checks: positive sizes; tp * pp divides the world; tp * pp * dp equals
    it; tp divides n_heads, kv heads, the padded vocabulary (and seq_len under sequence parallelism); the global
    batch splits into whole micro-batches on every dp rank."""
    for name, value in (("world size", world_size), ("tp", tp), ("pp", pp)):
        if value < 1:
            raise LayoutError(f"{name} must be >= 1, got {value}")
    seq_parallel = tp > 1 if sequence_parallel is None else sequence_parallel
    if world_size % (tp * pp):
        valid = [(t, p) for t in _divisors(world_size) for p in _divisors(world_size // t)]
        raise LayoutError(f"the world size {world_size} is not a multiple of tp x pp = {tp} x {pp}; (tp, pp) pairs "
                          f"that work: {valid}; valid tp for pp={pp}: {_valid_tp(world_size, pp, model, False)}")
    dp = world_size // (tp * pp) if dp is None else dp
    if tp * pp * dp != world_size:
        raise LayoutError(f"tp x pp x dp = {tp} x {pp} x {dp} = {tp * pp * dp} but the job has {world_size} "
                          f"processes; leave dp unset (it becomes {world_size // (tp * pp)}) or set it to that")
    if model is not None:
        _check_model_split(tp, model, seq_parallel, _valid_tp(world_size, pp, model, seq_parallel))
    if batch is not None:
        _check_batch(dp, batch, world_size, tp, pp)
    return tp, pp, dp


def rank_coords(rank: int, tp: int, dp: int) -> tuple[int, int, int]:
    """(tp_rank, dp_rank, pp_rank) of a global rank in Megatron's order (tp fastest, then dp, then pp)."""
    return rank % tp, (rank // tp) % dp, rank // (tp * dp)


def global_rank(tp_rank: int, dp_rank: int, pp_rank: int, tp: int, dp: int) -> int:
    return tp_rank + tp * (dp_rank + dp * pp_rank)


def group_ranks(tp: int, dp: int, pp: int) -> dict[str, list[list[int]]]:
    """Every group of each kind as lists of global ranks: {"tp": [...], "dp": [...], "pp": [...], "embed": [...]};
    an embed group joins the first and the last rank of a pp group (the two pipeline stages that hold the tied
    embedding; it exists when pp > 1)."""
    tp_groups = [[global_rank(t, d, p, tp, dp) for t in range(tp)] for p in range(pp) for d in range(dp)]
    dp_groups = [[global_rank(t, d, p, tp, dp) for d in range(dp)] for p in range(pp) for t in range(tp)]
    pp_groups = [[global_rank(t, d, p, tp, dp) for p in range(pp)] for d in range(dp) for t in range(tp)]
    return {"tp": tp_groups, "dp": dp_groups, "pp": pp_groups, "embed": [sorted({g[0], g[-1]}) for g in pp_groups]}


@dataclass
class ParallelLayout:
    """This rank's place in the (pp, dp, tp) grid, its process groups and its device.

    A group is None when its size is 1 (no communication is ever needed there); collectives in pipeline treat
    None as "nothing to do". `*_ranks` hold the global ranks of this rank's groups, in group-rank order."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    tp: int = 1
    dp: int = 1
    pp: int = 1
    sequence_parallel: bool = False
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    backend: str | None = None
    tp_group: dist.ProcessGroup | None = None
    dp_group: dist.ProcessGroup | None = None
    pp_group: dist.ProcessGroup | None = None
    embed_group: dist.ProcessGroup | None = None
    tp_ranks: tuple[int, ...] = (0,)
    dp_ranks: tuple[int, ...] = (0,)
    pp_ranks: tuple[int, ...] = (0,)
    embed_ranks: tuple[int, ...] = (0,)
    group_stats: GroupStats = field(default_factory=GroupStats)  # what creating the groups cost (pipeline.groups)

    @property
    def tp_rank(self) -> int:
        return rank_coords(self.rank, self.tp, self.dp)[0]

    def without_groups(self) -> "ParallelLayout":
        """The same rank facts with no process group handles (what a closed runtime keeps)."""
        return replace(self, tp_group=None, dp_group=None, pp_group=None, embed_group=None)

    @property
    def dp_rank(self) -> int:
        return rank_coords(self.rank, self.tp, self.dp)[1]

    @property
    def pp_rank(self) -> int:
        return rank_coords(self.rank, self.tp, self.dp)[2]

    @property
    def comm_device(self) -> torch.device:
        """Where the tensors of this layout's collectives live: the rank's GPU under NCCL (which takes no CPU
        tensors), the CPU under gloo (and without a backend)."""
        return self.device if self.backend == "nccl" else torch.device("cpu")

    def describe(self) -> str:
        return (f"rank {self.rank}/{self.world_size}: tp {self.tp_rank}/{self.tp} dp {self.dp_rank}/{self.dp} "
                f"pp {self.pp_rank}/{self.pp}, sequence_parallel={self.sequence_parallel}, device={self.device}, "
                f"backend={self.backend}")


def single_process_layout(device: str | torch.device = "cpu") -> ParallelLayout:
    """The layout of a one-process job: no process group."""
    return ParallelLayout(device=torch.device(device))


def choose_device(local_rank: int, device: str = "auto") -> torch.device:
    """cuda:<local_rank> when CUDA is there (or asked for), else cpu."""
    if device == "cpu" or (device == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise LayoutError("train.device=cuda but CUDA is not available on this machine; use auto or cpu")
    torch.cuda.set_device(local_rank % torch.cuda.device_count())
    return torch.device("cuda", local_rank % torch.cuda.device_count())


def choose_backend(device: torch.device, backend: str = "auto") -> str:
    """NCCL for CUDA devices, gloo for CPU, unless given."""
    if backend != "auto":
        if backend == "nccl" and device.type != "cuda":
            raise LayoutError("parallel.backend=nccl needs CUDA devices; on CPU use auto or gloo")
        return backend
    return "nccl" if device.type == "cuda" else "gloo"


def init_layout(tp: int = 1, pp: int = 1, dp: int | None = None, model: ModelDims | None = None,
                batch: BatchDims | None = None, sequence_parallel: bool | None = None, device: str = "auto",
                backend: str = "auto", environ: Mapping[str, str] | None = None,
                timeout_s: float = 1800.0, startup_timeout_s: float | None = None) -> ParallelLayout:
    """Validate the sizes for this job's world size, then (only if the world has more than one process) start
    torch.distributed (unless already started) and create every tp, dp and pp group. Returns this rank's layout.

    Every rank must call this with the same sizes (group creation is collective). When torch.distributed is already
    initialised its world is used, so several layouts can be built in turn inside one job (tests do).

    Timeouts. Every group (the world's too) starts with startup_timeout_s (default: timeout_s): start-up waits on
    the slowest rank's imports, build and restore. The trainer switches them to the step timeout, timeout_s, once
    the steps begin, and back to the start-up one around checkpoint saves (set_group_timeouts): one set of groups,
    whose timeout is changed per phase, rather than separate groups per phase, because a collective's timeout is
    the group's and the same groups carry both phases' traffic. On CUDA the rank's device is bound at
    init_process_group (device_id: NCCL creates the world's communicator now, on the right GPU), and one all-reduce
    per group warms every communicator up (NCCL creates them lazily, at the first collective): their cost and any
    failure come at start-up, under the start-up timeout, not in the first step."""
    launch = read_launch_env(environ)
    world = dist.get_world_size() if dist.is_initialized() else launch.world_size
    rank = dist.get_rank() if dist.is_initialized() else launch.rank
    tp, pp, dp = validate_layout(world, tp, pp, dp, model, batch, sequence_parallel)
    seq_parallel = (tp > 1) if sequence_parallel is None else bool(sequence_parallel and tp > 1)
    dev = choose_device(launch.local_rank, device)
    if world == 1:
        return ParallelLayout(device=dev, sequence_parallel=False)
    chosen_backend = choose_backend(dev, backend)
    startup = timedelta(seconds=timeout_s if startup_timeout_s is None else startup_timeout_s)
    if not dist.is_initialized():
        _import_dynamo_first()
        dist.init_process_group(chosen_backend, init_method=f"tcp://{launch.master_addr}:{launch.master_port}",
                                rank=rank, world_size=world, timeout=startup,
                                device_id=dev if dev.type == "cuda" else None)
    groups = _create_groups(rank, tp, dp, pp, startup)
    layout = ParallelLayout(rank=rank, world_size=world, local_rank=launch.local_rank, tp=tp, dp=dp, pp=pp,
                            sequence_parallel=seq_parallel, device=dev, backend=dist.get_backend(), **groups)
    warm_up_groups(layout)
    return layout


def layout_groups(layout: ParallelLayout) -> list:
    """The process groups of this rank, the world's first, in one order on every rank (tp, dp, pp, embed)."""
    kinds = [layout.tp_group, layout.dp_group, layout.pp_group, layout.embed_group]
    return [dist.group.WORLD] + [g for g in kinds if g is not None]


def warm_up_groups(layout: ParallelLayout) -> None:
    """One tiny all-reduce per group (every rank goes through the kinds in the same order, so no rank waits on a
    group whose other members are still warming another): NCCL creates a communicator at its first collective."""
    if not dist.is_initialized():
        return
    for group in layout_groups(layout):
        dist.all_reduce(torch.zeros(1, device=layout.comm_device), group=group)


def set_group_timeouts(layout: ParallelLayout, seconds: float) -> bool:
    """Give every group of the layout (the world's too) the timeout `seconds` (a phase change: start-up and saves,
    or steps; see init_layout). False where this torch cannot change a group's timeout (it then keeps its own)."""
    if not dist.is_initialized():
        return True
    setter = getattr(dist.distributed_c10d, "_set_pg_timeout", None)
    if setter is None:  # pragma: no cover - torch < 2.3
        return False
    for group in layout_groups(layout):
        setter(timedelta(seconds=seconds), group)
    return True


def _import_dynamo_first() -> None:
    """Import torch._dynamo before any process group exists. torch imports it lazily (the first meta-device or
    compiled op, e.g. build_model on "meta"); imported while groups exist, it keeps C++ references to them, so they
    outlive destroy_process_group and their gloo threads run into interpreter shutdown (see destroy_layout)."""
    importlib.import_module("torch._dynamo")


def _create_groups(rank: int, tp: int, dp: int, pp: int, timeout: timedelta | None = None) -> dict:
    """Every group of every kind (collective: all ranks create all groups in the same order; a kind's groups are
    disjoint, so NCCL splits them from the world's communicator at once: pipeline.groups), with `timeout` (without
    one torch gives a new group its backend's default, not the world's); keep this rank's. Size-1 groups are not
    created."""
    out: dict = {"group_stats": GroupStats()}
    for kind, size in (("tp", tp), ("dp", dp), ("pp", pp), ("embed", min(pp, 2))):
        groups = group_ranks(tp, dp, pp)[kind]
        mine = next((tuple(g) for g in groups if rank in g), (rank,))  # the middle stages have no embed group
        handle = None
        if size > 1:
            made, stats = create_groups([groups], rank, timeout)
            out["group_stats"].add(stats)
            handle = made.get(mine)
        out[f"{kind}_group"], out[f"{kind}_ranks"] = handle, mine
    return out


def destroy_layout(barrier: bool = True) -> None:
    """Tear torch.distributed down (end of a job or a test): wait for every rank (barrier), destroy the groups,
    then collect the garbage that still referenced them.

    A gloo group runs its collectives on C++ worker threads that live as long as the group object. If one of them
    drops the last reference to a tensor after the interpreter has begun to finalize, the process aborts (SIGABRT,
    "terminate called without an active exception"). So every group must be freed here, while Python is alive:
    callers drop their own references first (ParallelRuntime.close does, train() frees the model and optimizer)."""
    if dist.is_initialized():
        if barrier:
            dist.barrier()
        dist.destroy_process_group()
    gc.collect()
