"""Hugging Face interop: ``export-hf`` writes a folder that transformers, lm-eval and the Hub load as they are
(trust_remote_code, with the modeling code of this package copied in), ``import-hf`` reads it back.

The modeling files (configuration_megaloop.py, modeling_megaloop.py) import only torch and transformers; nothing
here imports transformers unless a folder is imported (to build the model it checks the weights against).
"""
from .export import export_hf, write_hf_folder
from .importing import import_hf

__all__ = ["export_hf", "import_hf", "write_hf_folder"]
