"""megaloop: a Megatron-style pretraining system for stable looped (Parcae) language models."""

__version__ = "0.1.0"
