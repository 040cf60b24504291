"""The ring-pipeline executor runs a toy looped model at pp 1, 2 and 4 exactly as one process does (fp64, 1e-12):
per-micro-batch losses and every parameter's gradient, for micro-batches of different lap counts, row counts and
kept laps (truncated backprop), also under a ragged loop whose messages shrink from lap to lap. Stored tensor groups
per rank equal the simulator's stored units, and at pp 2 and 4 autograd-saved bytes per rank do not grow with the
number of laps without autograd (4, 16, 64 laps). A Recv out of its channel's order or of the wrong shape, and one
whose message never comes, fail with an error naming the Recv instead of hanging.

The toy: e = tanh(prelude(embedding(ids))); h_0 fixed noise; each lap h = core(a * h + B e) with the core's LAYERS
Linear+tanh layers (shared by all laps) split into pp consecutive segments; loss = cross-entropy(head(h)) / m.
"""
from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist
from torch import nn

from pipeline.ring import MicroBatch, ring_schedule, simulate
from pipeline.ring.actions import Recv, Send
from pipeline.ring.channels import ring_channels
from pipeline.ring.execute import RingExecutor
from tests.pipeline.shared_posting import SharedPostingExecutor, shared_channels
from tests.pipeline.spawn import spawn

VOCAB, WIDTH, SEQ, LAYERS = 11, 6, 3, 4
SPECS = [MicroBatch(3, 2), MicroBatch(5, 1), MicroBatch(2, 2), MicroBatch(4, 3), MicroBatch(1, 1)]
TOL = 1e-12
LAP_COUNTS = (4, 16, 64)


class ToyLoop(nn.Module):
    def __init__(self, width: int = WIDTH, layers: int = LAYERS, vocab: int = VOCAB):
        super().__init__()
        torch.manual_seed(0)
        self.embedding = nn.Embedding(vocab, width)
        self.prelude = nn.Linear(width, width)
        self.a = nn.Parameter(torch.rand(width))
        self.inject = nn.Linear(width, width, bias=False)
        self.core = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))
        self.head = nn.Linear(width, vocab)

    def embed(self, ids):
        return torch.tanh(self.prelude(self.embedding(ids)))

    def layers(self, h, first: int, last: int):
        for layer in self.core[first:last]:
            h = torch.tanh(layer(h))
        return h


def batch(mb: int, seq: int = SEQ, vocab: int = VOCAB, width: int = WIDTH, rows: int | None = None):
    """Micro-batch mb's ids, labels and h_0; row counts differ between micro-batches."""
    g = torch.Generator().manual_seed(100 + mb)
    rows = 1 + mb % 3 if rows is None else rows
    ids = torch.randint(vocab, (rows, seq), generator=g)
    labels = torch.randint(vocab, (rows, seq), generator=g)
    h0 = torch.randn(rows, seq, width, generator=g, dtype=torch.float64)
    return ids, labels, h0


class ToyProgram:
    """ring rank `stage` of `pp`: core layers [stage * LAYERS / pp, (stage + 1) * LAYERS / pp)."""

    def __init__(self, model: ToyLoop, stage: int, pp: int, m: int, batches):
        self.model, self.m, self.batches = model, m, batches
        per = len(model.core) // pp
        self.first, self.last = stage * per, (stage + 1) * per

    def embed(self, mb):
        ids, _, h0 = self.batches[mb]
        return self.model.embed(ids), h0

    def lap_segment(self, mb, lap, h, e):
        if e is not None:
            h = self.model.a * h + self.model.inject(e)
        return self.model.layers(h, self.first, self.last)

    def loss(self, mb, h):
        _, labels, _ = self.batches[mb]
        logits = self.model.head(h)
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)) / self.m

    def message_shape(self, mb, lap):
        return tuple(self.batches[mb][2].shape)


class RaggedProgram(ToyProgram):
    """The toy under a ragged loop: lap l of a micro-batch runs its first max(1, 3 - l) rows (stage 0 takes that
    prefix of the previous lap's state and of e), and the loss covers the rows of its last lap; messages shrink
    from lap to lap, so a gradient sent back to the previous lap has that lap's (larger) shape."""

    def active(self, lap):
        return max(1, self.batches[0][2].shape[0] - lap)

    def lap_segment(self, mb, lap, h, e):
        if e is not None:
            rows = self.active(lap)
            h, e = h[:rows], e[:rows]
        return super().lap_segment(mb, lap, h, e)

    def loss(self, mb, h):
        labels = self.batches[mb][1][:h.shape[0]]
        logits = self.model.head(h)
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)) / self.m

    def message_shape(self, mb, lap):
        return (self.active(lap),) + tuple(self.batches[mb][2].shape[1:])


def batches_for(program, n: int) -> list:
    """Ragged micro-batches all have 3 rows (they shrink with the laps), the others 1 + mb % 3."""
    return [batch(mb, rows=3 if program is RaggedProgram else None) for mb in range(n)]


def reference(specs, program=ToyProgram):
    """One process, a plain Python loop: losses and gradients."""
    model = ToyLoop().double()
    program = program(model, 0, 1, len(specs), batches_for(program, len(specs)))
    losses = []
    for mb, spec in enumerate(specs):
        e, h = program.embed(mb)
        for lap in range(spec.laps):
            if lap < spec.first_grad_lap:
                with torch.no_grad():
                    h = program.lap_segment(mb, lap, h, e)
            else:
                h = program.lap_segment(mb, lap, h.detach() if lap == spec.first_grad_lap else h, e)
        loss = program.loss(mb, h)
        loss.backward()
        losses.append(loss.detach())
    return torch.stack(losses), {n: p.grad for n, p in model.named_parameters()}


def run_rank(rank, pp, specs, channels, check_messages=False, actions=None, program=ToyProgram,
             executor_class=RingExecutor):
    model = ToyLoop().double()
    program = program(model, rank, pp, len(specs), batches_for(program, len(specs)))
    actions = ring_schedule(specs, pp, max_in_flight=2)[rank] if actions is None else actions
    executor = executor_class(program, dtype=torch.float64, check_messages=check_messages, channels=channels)
    result = executor.run(actions, specs)
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return result, grads


def memory_specs(laps: int) -> list[MicroBatch]:
    """Three micro-batches of `laps` laps, the last 2 with autograd."""
    return [MicroBatch(laps, 2)] * 3


def worker(rank, world, out):
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    channels = ring_channels([list(range(world))], rank, "rendezvous", timeout_s=60)  # sends wait for receives
    result, grads = run_rank(rank, world, SPECS, channels, check_messages=True)
    ragged, ragged_grads = run_rank(rank, world, SPECS, channels, program=RaggedProgram)
    memory = {}
    for n in LAP_COUNTS:
        got, _ = run_rank(rank, world, memory_specs(n), channels)
        memory[n] = (got.peak_stored, got.peak_saved_bytes)
    channels.close()
    torch.save({"losses": result.losses, "grads": grads, "memory": memory, "ragged": ragged.losses,
                "ragged_grads": ragged_grads}, f"{out}.{rank}")


@pytest.mark.multiproc
@pytest.mark.parametrize("pp", [1, 2, 4])
def test_executor_equals_single_process(pp, tmp_path):
    out = str(tmp_path / "ring")
    spawn(worker, pp, out)
    parts = [torch.load(f"{out}.{rank}") for rank in range(pp)]
    for program, losses, grads in ((ToyProgram, "losses", "grads"), (RaggedProgram, "ragged", "ragged_grads")):
        ref_losses, ref_grads = reference(SPECS, program)
        got = torch.stack([parts[-1][losses][mb] for mb in range(len(SPECS))])
        loss_err = float((got - ref_losses).abs().max())
        owners = {n: [r for r, part in enumerate(parts) if n in part[grads]] for n in ref_grads}
        assert all(len(o) == 1 for o in owners.values()), f"each parameter's gradient on exactly one rank: {owners}"
        grad_err = max(float((parts[o[0]][grads][n] - ref_grads[n]).abs().max()) for n, o in owners.items())
        print(f"pp={pp} {program.__name__}: max |loss - reference| {loss_err:.1e}, max |grad - reference| "
              f"{grad_err:.1e} (losses {[round(float(v), 4) for v in ref_losses]})")
        assert loss_err <= TOL and grad_err <= TOL
    simulated = {n: simulate(ring_schedule(memory_specs(n), pp, max_in_flight=2), memory_specs(n)).peak_stored
                 for n in LAP_COUNTS}
    for rank, part in enumerate(parts):
        mem = part["memory"]
        print(f"pp={pp} rank {rank}: laps -> (peak stored groups, simulated units, peak autograd-saved bytes): "
              f"{ {n: (m[0], simulated[n][rank], m[1]) for n, m in mem.items()} }")
        assert all(mem[n][0] == simulated[n][rank] for n in LAP_COUNTS), "stored groups differ from the simulator"
        saved = [m[1] for m in mem.values()]
        if pp > 1:  # on one rank the planner keeps more micro-batches open when their chains are longer
            assert max(saved) <= 1.1 * min(saved), "autograd-saved bytes grow with the laps without autograd"


class WrongShape(ToyProgram):
    def message_shape(self, mb, lap):
        rows, *rest = super().message_shape(mb, lap)
        return (rows + 1, *rest)


def bad_worker(rank, world, mode, out):
    """mode 'order': rank 1's first two Recvs swapped; 'shape': rank 1's message_shape one row too many (both with
    checked messages); 'missing': rank 0 leaves out its last Send (unchecked; the process group's timeout);
    'shared': the earlier posting (every message on one group, a run of Sends and Recvs in one batch), which hangs
    under rendezvous semantics until the process group's timeout. All under rendezvous semantics."""
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=5))
    if mode == "shared":
        channels = shared_channels(list(range(world)), rank, "rendezvous", timeout_s=5)
    else:
        channels = ring_channels([list(range(world))], rank, "rendezvous", timeout_s=5)
    specs = SPECS if mode == "shared" else [MicroBatch(2, 1), MicroBatch(3, 1)]  # SPECS: simulate(p2p="shared") hangs
    actions = list(ring_schedule(specs, world, max_in_flight=2)[rank])
    if mode == "order" and rank == 1:
        at = [i for i, a in enumerate(actions) if isinstance(a, Recv)][:2]
        actions[at[0]], actions[at[1]] = actions[at[1]], actions[at[0]]
    if mode == "missing" and rank == 0:
        actions.remove([a for a in actions if isinstance(a, Send)][-1])
    program = WrongShape if mode == "shape" and rank == 1 else ToyProgram
    try:
        run_rank(rank, world, specs, channels, check_messages=mode not in ("missing", "shared"), actions=actions,
                 program=program, executor_class=SharedPostingExecutor if mode == "shared" else RingExecutor)
    except Exception as err:  # noqa: BLE001  (the message is what the test checks)
        torch.save(f"{type(err).__name__}: {err}", f"{out}.{rank}")
        return
    finally:
        channels.close()
    torch.save("finished", f"{out}.{rank}")


@pytest.mark.multiproc
@pytest.mark.parametrize("mode", ["order", "shape", "missing", "shared"])
def test_mismatched_recv_fails_clearly(mode, tmp_path):
    out = str(tmp_path / "bad")
    spawn(bad_worker, 2, mode, out)
    message = torch.load(f"{out}.1")
    print(mode, "->", message)
    if mode == "shared":  # the earlier posting hangs under rendezvous semantics until the timeout ends it
        messages = [torch.load(f"{out}.{r}") for r in range(2)]
        assert all(m.startswith(f"ExecutionError: rank {r}: point-to-point batch [") for r, m in enumerate(messages))
        assert any("Timed out waiting 5000ms" in m for m in messages), messages
        return
    assert message.startswith("ExecutionError: rank 1:") and "Recv(" in message, message
    if mode == "order":
        assert "do not follow rank 0's Send order" in message
    if mode == "shape":
        assert "of shape (3, 3, 6) but rank 0 sent" in message and "of shape (2, 3, 6)" in message
    if mode == "missing":
        assert "point-to-point batch [Recv(" in message and "never sends" in message
