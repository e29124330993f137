"""Quantized weights: the one form every checkpoint format is read into (weights.py), and the formats that read them
(formats/), registered in config.py's registries."""
from tpengine.quantization import formats  # noqa: F401 (importing any of the package registers every format)
