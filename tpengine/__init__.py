"""tpengine: a tensor-parallel LLM inference engine."""
from tpengine.llm import LLM
from tpengine.outputs import RequestOutput
from tpengine.runner.multiproc_executor import WorkerFailedError
from tpengine.sampling_params import SamplingParams

__all__ = ["LLM", "RequestOutput", "SamplingParams", "WorkerFailedError"]
