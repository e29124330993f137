"""Prometheus metrics under vLLM's names with the prefix `tpengine:`: the engine's state recorded on its thread,
requests' outputs on the event loop."""
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from tpengine.outputs import NO_TOKEN, EmbeddingRequestOutput, RequestOutput

CONTENT_TYPE = CONTENT_TYPE_LATEST

# vLLM's buckets, so its dashboards read these the same way
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
               20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
               240.0, 480.0, 960.0, 1920.0, 7680.0)


@dataclass
class RequestTimes:
    arrival: float
    streamed: bool          # a streamed request reports each step's new tokens (delta outputs); others once, at the end
    last_token: float = 0.0
    seen: bool = False
    num_generated: int = 0  # tokens over all of the request's completions so far


class Metrics:
    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()

        def make(kind, name, documentation, **kwargs):
            metric = kind(f"tpengine:{name}", documentation, ["model_name"], registry=self.registry, **kwargs)
            return metric.labels(model_name)

        self.num_requests_running = make(Gauge, "num_requests_running", "Completions being decoded.")
        self.num_requests_waiting = make(Gauge, "num_requests_waiting", "Completions waiting to be scheduled.")
        self.kv_cache_usage_perc = make(Gauge, "kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0-1).")
        self.prefix_cache_queries = make(Counter, "prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_cache_hits = make(Counter, "prefix_cache_hits", "Prompt tokens served from the prefix cache.")
        self.prompt_tokens = make(Counter, "prompt_tokens", "Prompt tokens of requests (prefix-cache hits included).")
        self.generation_tokens = make(Counter, "generation_tokens", "Generated tokens.")
        self.num_preemptions = make(Counter, "num_preemptions", "Sequences preempted (their KV recomputed later).")
        # prompt logprobs kept beside the prefix cache (engine/prompt_logprob_cache.py): bounded by the KV cache's blocks
        self.prompt_logprob_cache_blocks = make(Gauge, "prompt_logprob_cache_blocks",
                                                "Prompt blocks whose logprobs are kept (at most the KV cache's).")
        self.prompt_logprob_cache_positions = make(Gauge, "prompt_logprob_cache_positions",
                                                   "Prompt positions whose logprob and top alternatives are kept.")
        request_success = Counter("tpengine:request_success", "Finished completions by finish reason.",
                                  ["model_name", "finished_reason"], registry=self.registry)
        self.request_success = {reason: request_success.labels(model_name, reason)
                                for reason in ("stop", "length", "abort", NO_TOKEN)}
        self.time_to_first_token = make(Histogram, "time_to_first_token_seconds",
                                        "Arrival to first generated token (streamed requests).", buckets=TTFT_BUCKETS)
        self.inter_token_latency = make(Histogram, "inter_token_latency_seconds",
                                        "Time between a streamed request's consecutive outputs.", buckets=ITL_BUCKETS)
        self.e2e_request_latency = make(Histogram, "e2e_request_latency_seconds",
                                        "Arrival to the last token.", buckets=E2E_BUCKETS)
        self._num_preemptions_seen = self._generation_tokens_seen = 0
        # speculative decoding (vLLM's spec_decode_*), made once the engine reports its counters
        self._spec_decode: dict | None = None
        self._spec_decode_seen: dict | None = None
        self._model_name = model_name

    def _spec_decode_counters(self, num_positions: int) -> dict:
        def make(name, documentation):
            return Counter(f"tpengine:{name}", documentation, ["model_name"],
                           registry=self.registry).labels(self._model_name)
        per_pos = Counter("tpengine:spec_decode_num_accepted_tokens_per_pos",
                          "Accepted draft tokens by their position in a verify row.", ["model_name", "position"],
                          registry=self.registry)
        return dict(num_drafts=make("spec_decode_num_drafts", "Verify rows with draft tokens."),
                    num_draft_tokens=make("spec_decode_num_draft_tokens", "Draft tokens proposed and verified."),
                    num_accepted_tokens=make("spec_decode_num_accepted_tokens", "Draft tokens accepted."),
                    num_accepted_tokens_per_pos=[per_pos.labels(self._model_name, str(i))
                                                 for i in range(num_positions)])

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

    # --- recorded by the engine thread ------------------------------------------------------------

    def record_engine_state(self, engine) -> None:
        self.num_requests_running.set(engine.num_requests_running)
        self.num_requests_waiting.set(engine.num_requests_waiting)
        self.kv_cache_usage_perc.set(engine.kv_cache_usage)
        kept = engine.prompt_logprob_cache
        self.prompt_logprob_cache_blocks.set(len(kept.blocks))
        self.prompt_logprob_cache_positions.set(kept.num_entries)
        # the engine counts these itself, whether or not a request reports every step
        for counter, total, seen in ((self.num_preemptions, engine.num_preemptions, "_num_preemptions_seen"),
                                     (self.generation_tokens, engine.generation_tokens_total,
                                      "_generation_tokens_seen")):
            if total != getattr(self, seen):
                counter.inc(total - getattr(self, seen))
                setattr(self, seen, total)
        stats = engine.spec_decode_stats
        if stats is not None:
            self._record_spec_decode(stats)

    def _record_spec_decode(self, stats: dict) -> None:
        if self._spec_decode is None:
            self._spec_decode = self._spec_decode_counters(len(stats["num_accepted_tokens_per_pos"]))
            self._spec_decode_seen = dict(stats, num_accepted_tokens_per_pos=[0] * len(
                stats["num_accepted_tokens_per_pos"]), num_drafts=0, num_draft_tokens=0, num_accepted_tokens=0)
        seen = self._spec_decode_seen
        for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
            if stats[name] != seen[name]:
                self._spec_decode[name].inc(stats[name] - seen[name])
        for counter, total, before in zip(self._spec_decode["num_accepted_tokens_per_pos"],
                                          stats["num_accepted_tokens_per_pos"], seen["num_accepted_tokens_per_pos"]):
            if total != before:
                counter.inc(total - before)
        self._spec_decode_seen = stats

    def record_output(self, output: RequestOutput | EmbeddingRequestOutput, times: RequestTimes, now: float) -> None:
        if isinstance(output, EmbeddingRequestOutput):
            self._record_embedding(output, times, now)
            return
        if not times.seen:  # as vLLM counts them: the whole prompt, cached part included, once
            times.seen = True
            num_prompt_tokens = len(output.prompt_token_ids)
            self.prompt_tokens.inc(num_prompt_tokens)
            self.prefix_cache_queries.inc(num_prompt_tokens)
            self.prefix_cache_hits.inc(output.num_cached_tokens)
        if times.streamed:
            num_new = sum(len(completion.token_ids) for completion in output.outputs)
            if num_new:
                if times.num_generated == 0:
                    self.time_to_first_token.observe(now - times.arrival)
                else:
                    self.inter_token_latency.observe(now - times.last_token)
                times.num_generated += num_new
                times.last_token = now
        if times.streamed or output.finished:
            self.record_finished(output)
        if output.finished:
            self.e2e_request_latency.observe(now - times.arrival)

    def _record_embedding(self, output: EmbeddingRequestOutput, times: RequestTimes, now: float) -> None:
        """An embedding's one output: its prompt tokens, its latency, and how it ended ("stop", as vLLM counts a
        pooled request; "abort" without a vector). Not the prefix cache's counts: the output does not say its hits."""
        self.prompt_tokens.inc(len(output.prompt_token_ids))
        self.request_success["stop" if output.outputs.embedding else "abort"].inc()
        self.e2e_request_latency.observe(now - times.arrival)

    def record_finished(self, output: RequestOutput | EmbeddingRequestOutput) -> None:
        """Count the completions that end in output: a final one ends them all; in a stream's delta
        outputs each completion's end comes once, in the output that holds it."""
        if isinstance(output, EmbeddingRequestOutput):  # only an aborted submission's comes here
            self.request_success["abort"].inc()
            return
        for completion in output.outputs:
            if completion.finish_reason is not None or output.finished:
                self.request_success[completion.finish_reason or "abort"].inc()
