"""tpengine: a tensor-parallel LLM inference engine."""
from tpengine.llm import LLM
from tpengine.outputs import RequestOutput
from tpengine.sampling_params import SamplingParams

__all__ = ["LLM", "RequestOutput", "SamplingParams"]
