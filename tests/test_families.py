"""Each family's description names a model class that exists (the registry imports it only when a model is built)."""
import importlib

import pytest

from tpengine.families import FAMILIES


@pytest.mark.parametrize("model_type", [name for name, family in FAMILIES.items() if family.standalone])
def test_each_family_s_model_module_holds_the_class_named_as_its_architecture(model_type):
    family = FAMILIES[model_type]
    model_class = getattr(importlib.import_module(family.model_module), family.architecture, None)
    assert isinstance(model_class, type) and model_class.__name__ == family.architecture
