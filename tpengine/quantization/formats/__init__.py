"""Checkpoint formats, one module each; importing one registers it in config.py's registries (by quant_method, and
by the storage layouts it reads). Their order is the order an unsupported method's error lists them in."""
from tpengine.quantization.formats import compressed_tensors, fp8, gptq, awq, mxfp4  # noqa: F401
