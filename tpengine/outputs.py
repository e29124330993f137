"""What step() and generate() hand back, with vLLM's names: one RequestOutput per request, one
CompletionOutput per sample of it. Structs: cheap to build every step, and msgspec can encode them."""
import msgspec


class CompletionOutput(msgspec.Struct, kw_only=True):
    index: int                          # which of the request's n completions
    text: str | None                    # None when the model folder has no tokenizer
    token_ids: list[int]
    finish_reason: str | None           # "stop", "length", "abort"; None while running
    stop_reason: int | str | None = None    # the stop string or stop token id that ended it; None for EOS/length
    logprobs: list[dict[int, float]] | None = None  # per token: token id -> log-probability, if asked
    cumulative_logprob: float | None = None         # sum of the sampled tokens' log-probabilities, if asked

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class RequestOutput(msgspec.Struct, kw_only=True):
    request_id: int
    prompt: str | list[int] | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int              # prompt tokens served from the prefix cache

    # Shortcuts to the first completion (what a request with n=1 has).
    @property
    def text(self) -> str | None:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason
