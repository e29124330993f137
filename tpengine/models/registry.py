"""Which model class serves a checkpoint: keyed on config.json's architectures[0], as transformers names it.

The supported architectures are data in tpengine/families.py, so rank 0 checks a config without torch;
a family's model module is imported only when a model is built.
"""
import importlib

from tpengine.families import FAMILIES, causal_architecture
from tpengine.hf_config import HFConfig, architecture_of

FAMILY_OF_ARCHITECTURE = {family.architecture: family for family in FAMILIES.values()}


def model_class(config: HFConfig):
    """The class named as the checkpoint's architecture, from its family's model module (a classifier's: its causal
    LM's class, which builds a classifier head for such a config)."""
    family = FAMILY_OF_ARCHITECTURE[causal_architecture(architecture_of(config.architectures))]
    return getattr(importlib.import_module(family.model_module), family.architecture)
