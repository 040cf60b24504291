"""The three looped models the stability and throughput studies compare, as overrides of configs/parcae-tiny.yaml
(resized per scale by megaloop.repro.sizes): the RDM/Huginn concatenation baseline, the additive injection and Parcae's
diagonal (negative-definite, discretised) injection; and the paper's learning rate for a model of this size."""
from __future__ import annotations

CONFIG = "configs/parcae-tiny.yaml"
VARIANTS = {
    "rdm": ("model.arch=rdm", "model.injection=concat", "model.block=sandwich", "model.use_C=false"),
    "additive": ("model.injection=additive",),
    "parcae": ("model.injection=diagonal",),
}
LABELS = {"rdm": "RDM (concat)", "additive": "additive", "parcae": "Parcae (diagonal)"}
# the reference trains <= 370M parameters at lr 8e-3 (Muon and AdamW alike) and 770M/1.3B at 6e-3; Muon further
# scales each matrix's step by sqrt(max(1, rows/cols)) itself (megaloop.optim.muon), so one lr per size is the recipe
PAPER_LR_SMALL = 8e-3


def lr_overrides(lr: float) -> tuple[str, ...]:
    return (f"optim.matrix_lr={lr:g}", f"optim.adam_lr={lr:g}")
