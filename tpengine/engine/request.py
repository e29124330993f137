"""One request on rank 0: its n completions (Sequences), their text, logprobs, and what step() reports."""
from tpengine.engine.detokenizer import Detokenizer, IncrementalText
from tpengine.engine.sequence import Sequence
from tpengine.engine.stop_strings import StopStrings
from tpengine.outputs import CompletionOutput, RequestOutput, completion_snapshot
from tpengine.sampling_params import RequestOutputKind, SamplingParams


class Request:
    __slots__ = ("request_id", "prompt", "prompt_token_ids", "params", "seqs", "stream", "delta", "per_step",
                 "detokenizer", "texts", "num_decoded", "logprobs", "cumulative_logprobs", "num_unfinished",
                 "num_reported_tokens", "num_reported_chars", "reported_finished", "grammar", "plain_stream")

    def __init__(self, request_id: int, prompt, prompt_token_ids: list[int], params: SamplingParams,
                 seqs: list[Sequence], detokenizer: Detokenizer | None, stream: bool):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.seqs = seqs
        # report every step it gets a token, or only when finished; a reported output holds everything so
        # far, or (delta) only what is new since the last one
        self.stream = stream and params.output_kind != RequestOutputKind.FINAL_ONLY
        self.delta = self.stream and params.output_kind == RequestOutputKind.DELTA
        self.detokenizer = detokenizer
        # Text is grown every step only where someone reads it before the end: a stream or stop strings.
        stream = self.stream
        self.per_step = stream or bool(params.stop) or params.logprobs is not None
        track_text = detokenizer is not None and (stream or bool(params.stop))
        stops = StopStrings(params.stop) if track_text and params.stop else None   # shared by the completions
        self.texts = [IncrementalText(detokenizer, params, prompt_token_ids, stops) if track_text else None
                      for _ in seqs]
        self.num_decoded = [len(prompt_token_ids)] * len(seqs)   # per completion: tokens already in its text
        self.logprobs = None if params.logprobs is None else [[] for _ in seqs]
        self.cumulative_logprobs = [0.0] * len(seqs)
        self.num_unfinished = len(seqs)
        # delta outputs: per completion, the tokens (an index into its token list) and characters already
        # reported, and whether its end was
        self.num_reported_tokens = [len(prompt_token_ids)] * len(seqs)
        self.num_reported_chars = [0] * len(seqs)
        self.reported_finished = [False] * len(seqs)
        self.grammar = None  # structured outputs: its grammar's compilation (a Future), set by the engine
        # a stream of one completion with no stop strings or logprobs (a server's usual request): each step
        # makes its output in one pass (stream_step)
        self.plain_stream = self.stream and len(seqs) == 1 and not params.stop and params.logprobs is None

    @property
    def finished(self) -> bool:
        return self.num_unfinished == 0

    def on_token(self, seq: Sequence, logprobs: dict[int, float] | None) -> tuple[str, int] | None:
        """seq got a token this step, or several (a verify row's; it may have finished with them); returns a
        stop string its text now contains and how many tokens of seq reach the one that completed it: a
        sequence that got several ends there, as it would have one token a step."""
        if self.logprobs is not None and logprobs is not None:
            self.logprobs[seq.index].append(logprobs)
            self.cumulative_logprobs[seq.index] += logprobs[seq.last_token]
        index = seq.index
        text = self.texts[index]
        if text is None:
            return None
        end = seq.num_tokens if seq.finish_reason is None else self._text_end(seq)
        start = self.num_decoded[index]
        if text.stop is None or end - start <= 1:
            self.num_decoded[index] = end
            stop = text.append(seq.token_ids, start, end, seq.num_tokens - seq.num_prompt_tokens >= seq.min_tokens)
            return None if stop is None else (stop, seq.num_tokens)
        for num_tokens in range(start + 1, end + 1):  # one token at a time, as without speculation
            self.num_decoded[index] = num_tokens
            stop = text.append(seq.token_ids, num_tokens - 1, num_tokens,
                               num_tokens - seq.num_prompt_tokens >= seq.min_tokens)
            if stop is not None:
                return stop, num_tokens
        return None

    def stream_step(self, seq: Sequence) -> RequestOutput:
        """A plain stream's output for a step in which its one completion got tokens and runs on: on_token and
        output() in one pass, as they would make it."""
        num_tokens = seq.num_tokens
        text = self.texts[0]
        if text is not None:
            text.append(seq.token_ids, self.num_decoded[0], num_tokens)
            self.num_decoded[0] = num_tokens
            text_so_far = text.text
        else:
            text_so_far = None
        if self.delta:
            start = self.num_reported_tokens[0]
            self.num_reported_tokens[0] = num_tokens
            if text is not None:  # with no stop strings nothing reads it again: keep only what is not reported
                text.text = ""  # (num_reported_chars stays 0: the last output, _delta's, reports what is left)
        else:
            start = seq.num_prompt_tokens
        completion = completion_snapshot(0, text_so_far, seq.token_ids, start, num_tokens, None, None)
        num_cached = seq.num_prompt_cached_tokens
        return RequestOutput(request_id=self.request_id, prompt=self.prompt, prompt_token_ids=self.prompt_token_ids,
                             outputs=[completion], finished=False,
                             num_cached_tokens=num_cached if num_cached > 0 else 0)

    def on_finish(self, seq: Sequence) -> None:
        """seq finished (by any reason): complete its text."""
        self.num_unfinished -= 1
        if self.detokenizer is None or isinstance(seq.stop_reason, str):
            return  # no text, or a stop string already cut it
        text = self.texts[seq.index]
        if text is None:  # a final-only request without stop strings: its text is made once, here
            text = self.texts[seq.index] = IncrementalText(self.detokenizer, self.params, self.prompt_token_ids)
        end = self._text_end(seq)
        text.append(seq.token_ids, self.num_decoded[seq.index], end, match_stop=False)
        self.num_decoded[seq.index] = end
        text.finish()

    def _text_end(self, seq: Sequence) -> int:
        # A stop token ends the text before it (vLLM), unless the stop is asked for in the output.
        if seq.finish_reason == "stop" and not isinstance(seq.stop_reason, str) and \
                not self.params.include_stop_str_in_output:
            return seq.num_tokens - 1
        return seq.num_tokens

    def output(self) -> RequestOutput:
        """Everything so far (cumulative), or what is new since the last output (delta: only the completions
        with something new); a running completion's text holds back a possible stop-string start."""
        seqs, texts = self.seqs, self.texts
        if len(seqs) == 1:  # built per streamed request per step: the common case without a loop
            completion = self._delta(seqs[0], texts[0]) if self.delta else self._completion(seqs[0], texts[0])
            completions = [completion] if completion is not None else []
        elif self.delta:
            completions = [c for c in map(self._delta, seqs, texts) if c is not None]
        else:
            completions = [self._completion(seq, text) for seq, text in zip(seqs, texts)]
        num_cached = seqs[0].num_prompt_cached_tokens
        return RequestOutput(request_id=self.request_id, prompt=self.prompt, prompt_token_ids=self.prompt_token_ids,
                             outputs=completions, finished=self.num_unfinished == 0,
                             num_cached_tokens=num_cached if num_cached > 0 else 0)

    def _completion(self, seq: Sequence, text: IncrementalText | None) -> CompletionOutput:
        if text is None:
            text_so_far = None if self.detokenizer is None else ""
        else:
            text_so_far = text.visible_text if seq.finish_reason is None else text.text
        if self.logprobs is None:
            return completion_snapshot(seq.index, text_so_far, seq.token_ids, seq.num_prompt_tokens, seq.num_tokens,
                                       seq.finish_reason, seq.stop_reason)
        return completion_snapshot(seq.index, text_so_far, seq.token_ids, seq.num_prompt_tokens, seq.num_tokens,
                                   seq.finish_reason, seq.stop_reason, self.logprobs[seq.index],
                                   self.cumulative_logprobs[seq.index])

    def _delta(self, seq: Sequence, text: IncrementalText | None) -> CompletionOutput | None:
        """What is new of one completion since its last output (None: nothing): its new tokens, the text they
        made visible, and its end once, when it comes. Costs what is new, not what came before."""
        i, num_tokens = seq.index, seq.num_tokens
        finished = seq.finish_reason is not None
        if text is None:
            new_text = None if self.detokenizer is None else ""
        else:
            full = text.text
            end = len(full) if finished or text.stop is None else len(full) - text.stop.num_held_back
            reported = self.num_reported_chars[i]
            if end > reported:  # the visible text only grows: each visible text is a prefix of the final one
                new_text = full[reported:end]
                self.num_reported_chars[i] = end
            else:
                new_text = ""
        start = self.num_reported_tokens[i]
        if start == num_tokens and not new_text and (not finished or self.reported_finished[i]):
            return None
        self.num_reported_tokens[i] = num_tokens
        if finished:
            self.reported_finished[i] = True
        if self.logprobs is None:
            return completion_snapshot(i, new_text, seq.token_ids, start, num_tokens, seq.finish_reason,
                                       seq.stop_reason)
        return completion_snapshot(i, new_text, seq.token_ids, start, num_tokens, seq.finish_reason,
                                   seq.stop_reason, self.logprobs[i], self.cumulative_logprobs[i],
                                   logprob_start=start - seq.num_prompt_tokens)
