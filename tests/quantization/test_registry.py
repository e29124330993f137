"""Each checkpoint format is a module of quantization/formats that registers its quant_method (and its layouts)."""
from tpengine.quantization.config import FORMATS, QuantizationConfig


def test_every_format_registers_its_quant_method_in_the_order_errors_list_them():
    assert list(FORMATS) == ["compressed-tensors", "fp8", "gptq", "awq", "mxfp4"]


def test_a_registered_format_reads_the_configs_of_its_quant_method(monkeypatch):
    monkeypatch.setitem(FORMATS, "toy", lambda d: ("toy", d["bits"]))
    assert QuantizationConfig.from_hf({"quant_method": "toy", "bits": 3}) == ("toy", 3)
