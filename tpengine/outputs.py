from dataclasses import dataclass


@dataclass
class RequestOutput:
    request_id: int
    prompt: str | list[int]
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str | None          # None when the model folder has no tokenizer
    finish_reason: str        # "stop" (EOS or a stop token), "length" (max_tokens or max_model_len), "abort"
    num_cached_tokens: int    # prompt tokens served from the prefix cache
