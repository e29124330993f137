from tpengine.engine.llm_engine import LLMEngine


class LLM(LLMEngine):
    """`LLM(model, tensor_parallel_size=..., ...)`; `llm.generate(prompts, sampling_params)`."""
