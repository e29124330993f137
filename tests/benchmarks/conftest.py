import pytest

from tpengine.bench.models import QUICK_MODEL, write_model


@pytest.fixture(scope="session")
def quick_model(tmp_path_factory) -> str:
    """The model a --quick run writes, written once: the scripts' runs take it as --model (test_bench's writes its
    own, so writing stays tested) and skip seconds of transformers' import and save each."""
    return write_model("cpu", str(tmp_path_factory.mktemp("quick_model")), QUICK_MODEL)
