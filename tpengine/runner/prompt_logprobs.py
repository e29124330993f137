"""Prompt logprobs: each prompt position's log-probability of its token given the tokens before it, and the likeliest
alternatives, from the logits of the row before it (every rank takes part in the LM head's gather; rank 0 gets the
entries). A chunk's last row scores the token after it (its next_token), unless the chunk ends the prompt."""
import torch

from tpengine.attention.metadata import AttentionMetadata
from tpengine.distributed.messages import PrefillChunk
from tpengine.sampling_params import MAX_LOGPROBS

# One position: (its token, that token's logprob, the MAX_LOGPROBS likeliest tokens, their logprobs)
PromptLogprob = tuple[int, float, tuple[int, ...], tuple[float, ...]]


def prompt_logprob_rows(chunks: list[PrefillChunk], meta: AttentionMetadata) -> tuple[list[int], list[int]]:
    """The rows whose logits score a prompt token, in order, and the token each scores."""
    rows, targets = [], []
    start = meta.num_decode_tokens
    for chunk, length in zip(chunks, meta.seqlens_q):
        if chunk.prompt_logprobs:
            scored = chunk.token_ids[1:] + ([chunk.next_token] if chunk.next_token >= 0 else [])
            rows += range(start, start + len(scored))
            targets += scored
        start += length
    return rows, targets


def compute_prompt_logprobs(model, chunks: list[PrefillChunk], meta: AttentionMetadata,
                            hidden_states: torch.Tensor) -> dict[int, tuple[int, list[PromptLogprob]]] | None:
    """Every rank calls it (the LM head gathers to rank 0); rank 0 gets, by sequence, the first position its chunk
    scores and each scored position's entry. Other ranks get None."""
    rows, targets = prompt_logprob_rows(chunks, meta)
    logits = model.compute_logits(hidden_states[torch.tensor(rows, device=hidden_states.device)]) if rows else None
    if logits is None:
        return None if rows else {}
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    target_logprobs = logprobs.gather(1, torch.tensor(targets, device=logprobs.device).unsqueeze(1)).squeeze(1)
    top = logprobs.topk(min(MAX_LOGPROBS, logprobs.size(1)), dim=-1)
    top_ids, top_logprobs, target_logprobs = top.indices.tolist(), top.values.tolist(), target_logprobs.tolist()
    entries, row = {}, 0
    for chunk in chunks:
        if not chunk.prompt_logprobs:
            continue
        count = len(chunk.token_ids) - 1 + (chunk.next_token >= 0)
        entries[chunk.seq_id] = (chunk.num_cached_tokens + 1, [
            (targets[i], target_logprobs[i], tuple(top_ids[i]), tuple(top_logprobs[i])) for i in range(row, row + count)])
        row += count
    return entries
