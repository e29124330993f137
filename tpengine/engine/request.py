"""One request on rank 0: its n completions (Sequences), their text, logprobs, and what step() reports."""
from tpengine.engine.detokenizer import Detokenizer, IncrementalText
from tpengine.engine.sequence import Sequence
from tpengine.engine.stop_strings import StopStrings
from tpengine.outputs import (CompletionOutput, EmbeddingOutput, EmbeddingRequestOutput, RequestOutput,
                              completion_snapshot, merge_deltas)
from tpengine.sampling_params import RequestOutputKind, SamplingParams


class Request:
    __slots__ = ("request_id", "prompt", "prompt_token_ids", "params", "seqs", "stream", "delta", "per_step",
                 "detokenizer", "texts", "num_decoded", "logprobs", "cumulative_logprobs", "num_unfinished",
                 "num_reported_tokens", "num_reported_chars", "reported_finished", "grammar", "plain_stream",
                 "scored_prompt")

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
        # a stream of one completion with no stop strings or logprobs (a server's usual request): the engine only
        # notes how many tokens it has each step (report, build); its text and output are made when built
        self.plain_stream = self.stream and len(seqs) == 1 and not params.stop and params.logprobs is None
        # prompt logprobs: each prompt position's entry as it is scored (None: not yet; the first never is)
        self.scored_prompt = None if params.prompt_logprobs is None else [None] * len(prompt_token_ids)

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

    def report(self):
        """What reports this request's output now: the output itself, or (a plain stream) None, which build() turns
        into it later, its text included, in the order of the request's reports."""
        return None if self.plain_stream else self.output()

    def build(self, item) -> RequestOutput:
        """The output a report stands for: a built one as it is; for a plain stream, the number of tokens its
        completion had (it ran on) or None (its last output). A plain stream's text is grown only here, so its
        reports may be built on another thread than the engine's, while later steps run, if in order."""
        if item.__class__ is int:
            return self._stream_output(item)
        if item is None:
            self._complete_text(self.seqs[0])
            return self.output()
        return item

    def _stream_output(self, num_tokens: int) -> RequestOutput:
        # a plain stream's completion ran on with num_tokens tokens: read nothing of it that changes after the step
        seq = self.seqs[0]
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
        """seq finished (by any reason): complete its text (a plain stream's: when its last report is built)."""
        self.num_unfinished -= 1
        if not self.plain_stream:
            self._complete_text(seq)

    def _complete_text(self, seq: Sequence) -> None:
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
        # A stop token ends the text before it (vLLM), unless the stop is asked for in the output; a grammar may
        # end a completion on a token of its text (engine: _advance_grammars)
        if seq.finish_reason == "stop" and not isinstance(seq.stop_reason, str) and \
                not self.params.include_stop_str_in_output and seq.last_token in seq.eos_and_stop_token_ids:
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
                             num_cached_tokens=num_cached if num_cached > 0 else 0,
                             prompt_logprobs=self._prompt_logprobs())

    def _prompt_logprobs(self) -> list[dict[int, float] | None] | None:
        """Each prompt token's entry as the request asked for it (its token, then its top prompt_logprobs), once
        every position is scored; None before (or unasked)."""
        scored, k = self.scored_prompt, self.params.prompt_logprobs
        if scored is None or None in scored[1:]:
            return None
        return [None] + [{token: logprob, **dict(zip(top_ids[:k], top_logprobs[:k]))}
                         for token, logprob, top_ids, top_logprobs in scored[1:]]

    def add_prompt_logprobs(self, first: int, entries: list) -> None:
        """Entries of positions first, first + 1, ... (runner/prompt_logprobs.py)."""
        self.scored_prompt[first:first + len(entries)] = entries

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


# an embedding request's sequence samples nothing: its prompt, computed to the end, is all it runs
POOLED = SamplingParams(max_tokens=1, output_kind=RequestOutputKind.FINAL_ONLY)


class PoolingRequest(Request):
    """An embedding request: one sequence whose prompt runs to its end, then one output with its pooled vector."""
    __slots__ = ("embedding",)

    def __init__(self, *args):
        super().__init__(*args)
        self.embedding: list[float] | None = None  # rank 0's pooled vector, set when its prompt has run

    def on_finish(self, seq: Sequence) -> None:
        self.num_unfinished -= 1  # no text to complete

    def output(self) -> EmbeddingRequestOutput:
        return EmbeddingRequestOutput(request_id=self.request_id, prompt=self.prompt,
                                      prompt_token_ids=self.prompt_token_ids,
                                      outputs=EmbeddingOutput(self.embedding or []), finished=self.finished)


class StepReports:
    """The outputs a step hands out (with those held for it: aborts', generate()'s for others' requests), not yet
    built: build() makes them. Made on the engine's thread; built on any one thread, steps in the order they ran
    (a server's event loop builds them while its engine thread runs the next step)."""

    __slots__ = ("items", "unique")

    def __init__(self, items: list[tuple[Request, object]], unique: bool):
        self.items = items      # (request, Request.report()'s value), in the order they were made
        self.unique = unique    # no request twice (one step's own)

    def __len__(self) -> int:
        return len(self.items)

    def build(self) -> list[RequestOutput]:
        """One RequestOutput per request: a request reported more than once gets its newest (cumulative) or
        all of them joined (delta)."""
        if self.unique:
            return [request.build(item) for request, item in self.items]
        outputs: dict[int, RequestOutput] = {}
        for request, item in self.items:
            output = request.build(item)  # each one, in order: a plain stream's text grows as they are built
            older = outputs.get(request.request_id)
            outputs[request.request_id] = output if older is None or not request.delta else merge_deltas(older, output)
        return list(outputs.values())
