"""(h) Stability at a deep loop: the RDM concatenation baseline, the additive injection and Parcae on k-hop, looped at
mu_rec 16 (truncated backprop through the last 8 laps), at the synth configs' learning rate and 8 times it.

The paper's claim: only Parcae (rho(A_bar) < 1 by construction) stays stable, where the unconstrained injections
(RDM's learned W_1, whose rho may exceed 1; the additive A = I, marginally stable) let the loop's state grow with
depth. At mu_rec 16 a non-contracting injection has sixteen laps to amplify its state in, four times (a)'s. Each
point logs per step the training loss, rho(A) and ||h_T|| (metrics.jsonl) and its loss spikes (train.on_spike=log).

Criterion: a run diverged when the trainer stopped it for non-finite gradients (train.max_consecutive_skips steps in
a row), or its final loss (the mean of the last tenth of its training losses) is not finite or is not below its
first step's loss (nothing learned); else it converged. Separately, the loop's state blew up when its largest
||h_T|| over training exceeds 100 times its first step's (the coda's norms can hide that from the loss).
"""
from __future__ import annotations

from megaloop.repro.studies import synth_common as sc
from megaloop.repro.studies.stability import Stability

MU_REC = 16
BASE_LR = 0.02  # the synth configs' optim.matrix_lr and adam_lr

STUDY = Stability(name="synth_stability", title="Stability at a deep loop on k-hop", config=sc.PARCAE,
                  loop=(f"model.mu_rec={MU_REC}", f"model.mu_bwd={MU_REC // 2}"), mu_rec=MU_REC, base_lr=BASE_LR,
                  multipliers=(1, 8), smoke_multipliers=(1, 8), steps=(150, 6),
                  sizing=lambda scale: sc.sized(scale), doc=__doc__)
