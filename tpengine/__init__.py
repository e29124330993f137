"""tpengine: a tensor-parallel LLM inference engine."""
from tpengine.errors import WorkerFailedError
from tpengine.outputs import (ClassificationRequestOutput, CompletionOutput, EmbeddingRequestOutput, RequestOutput,
                              ScoringRequestOutput)
from tpengine.sampling_params import (BeamSearchParams, PoolingParams, RequestOutputKind, SamplingParams,
                                      StructuredOutputsParams)

__all__ = ["LLM", "BeamSearchParams", "ClassificationRequestOutput", "CompletionOutput", "EmbeddingRequestOutput",
           "PoolingParams", "RequestOutput", "RequestOutputKind", "SamplingParams", "ScoringRequestOutput",
           "StructuredOutputsParams", "WorkerFailedError"]


def __getattr__(name: str):
    # LLM pulls in torch and transformers: loaded on first use, so the ledger (tpengine.engine) imports light
    if name == "LLM":
        from tpengine.llm import LLM
        return LLM
    raise AttributeError(f"module 'tpengine' has no attribute {name!r}")
