"""Where a reasoning model's answer starts: one rule, followed by the engine's grammar (structured outputs constrain
the answer) and by the server's --reasoning-parser (the thinking apart as reasoning_content), qwen3 and deepseek_r1
alike.

The thinking is open at the start of a completion when the prompt's last reasoning tag is <think> (a chat template
that opens it, as DeepSeek-R1's does), or, in a chat reply (/v1/chat/completions, LLM.chat: SamplingParams'
may_open_thinking), when the completion's first token is <think> (Qwen3 opens its own). Anything else is answer
from its first token: a prompt that closed the thinking (Qwen3's template with thinking off writes an empty
<think></think>), a reply that does not open it, and the completion of a raw prompt (/v1/completions,
LLM.generate), whose constraints hold from its first token. Open thinking ends at </think>; a completion cut
before then has no answer.
"""
THINK_START, THINK_END = "<think>", "</think>"


def thinking_open_after(prompt_token_ids, think_start: int, think_end: int) -> bool:
    """Whether the prompt leaves the thinking open: its last reasoning tag is <think>."""
    for token_id in reversed(prompt_token_ids):
        if token_id == think_end:
            return False
        if token_id == think_start:
            return True
    return False
