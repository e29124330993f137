"""/metrics: vLLM's names under tpengine:, parsed by prometheus_client, moving by exact counts."""
import asyncio
import json
from contextlib import contextmanager
from types import SimpleNamespace

from prometheus_client.parser import text_string_to_metric_families

from tests.entrypoints.conftest import BLOCK_SIZE, running_server
from tpengine.engine.prompt_logprob_cache import PromptLogprobCache
from tpengine.entrypoints.metrics import Metrics

NAMES = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prefix_cache_queries",
         "prefix_cache_hits", "prompt_tokens", "generation_tokens", "request_success", "num_preemptions",
         "time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds",
         "prompt_logprob_cache_blocks", "prompt_logprob_cache_positions")
COUNTERS = ("tpengine:prompt_tokens_total", "tpengine:generation_tokens_total", "tpengine:prefix_cache_queries_total",
            "tpengine:prefix_cache_hits_total", "tpengine:time_to_first_token_seconds_count",
            "tpengine:inter_token_latency_seconds_count", "tpengine:e2e_request_latency_seconds_count")


def read_counters(server) -> dict[str, float]:
    values = {name: server.metric(name, model_name="tiny") for name in COUNTERS}
    for reason in ("stop", "length", "abort"):
        values[reason] = server.metric("tpengine:request_success_total", model_name="tiny", finished_reason=reason)
    return values


def test_metrics_parse_and_carry_vllms_names(server, client):
    client.completions.create(model="tiny", prompt="warm", max_tokens=2)
    status, text = server.request("GET", "/metrics")
    assert status == 200
    families = {family.name: family.type for family in text_string_to_metric_families(text)}
    for name in NAMES:
        assert f"tpengine:{name}" in families, name
    assert families["tpengine:time_to_first_token_seconds"] == "histogram"
    assert families["tpengine:num_requests_running"] == "gauge"
    assert families["tpengine:generation_tokens"] == "counter"


def test_counters_move_by_exact_token_counts(server, client):
    prompt = list(range(60, 60 + BLOCK_SIZE + 5))
    before = read_counters(server)
    kwargs = dict(model="tiny", prompt=prompt, max_tokens=7, temperature=0.0, extra_body={"ignore_eos": True})
    client.completions.create(**kwargs)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    after = read_counters(server)
    delta = {name: after[name] - before[name] for name in after}
    assert delta["tpengine:prompt_tokens_total"] == 2 * len(prompt)
    assert delta["tpengine:generation_tokens_total"] == 2 * 7
    assert delta["tpengine:prefix_cache_queries_total"] == 2 * len(prompt)
    cached = chunks[-1].usage.prompt_tokens_details.cached_tokens
    assert delta["tpengine:prefix_cache_hits_total"] == cached == len(prompt) - 1  # the first run hit nothing
    # token timings come from the streamed request, which the engine reports every step
    assert delta["tpengine:time_to_first_token_seconds_count"] == 1
    assert delta["tpengine:inter_token_latency_seconds_count"] == 6  # one per token after the first
    assert delta["tpengine:e2e_request_latency_seconds_count"] == 2
    assert (delta["length"], delta["stop"], delta["abort"]) == (2, 0, 0)


def test_kept_prompt_logprobs_are_reported(server, client):
    """Scoring a prompt keeps its whole blocks' logprobs beside the prefix cache: the gauges count them."""
    before = server.metric("tpengine:prompt_logprob_cache_blocks", model_name="tiny")
    prompt = [200 + 7 * i % 100 for i in range(2 * BLOCK_SIZE + 3)]
    client.completions.create(model="tiny", prompt=prompt, max_tokens=0, echo=True, logprobs=1)
    blocks = server.metric("tpengine:prompt_logprob_cache_blocks", model_name="tiny")
    assert blocks == before + 2
    assert server.metric("tpengine:prompt_logprob_cache_positions", model_name="tiny") == blocks * BLOCK_SIZE


def test_a_dropped_stream_is_aborted_and_frees_its_blocks(server, client):
    before = read_counters(server)
    stream = client.completions.create(model="tiny", prompt="drop me", max_tokens=400, temperature=0.0, stream=True,
                                       extra_body={"ignore_eos": True})
    for _, _chunk in zip(range(3), stream):
        pass
    assert server.metric("tpengine:num_requests_running", model_name="tiny") == 1
    assert server.metric("tpengine:kv_cache_usage_perc", model_name="tiny") > 0
    stream.close()
    server.wait_for_metric("tpengine:num_requests_running", 0.0, model_name="tiny")
    assert server.metric("tpengine:kv_cache_usage_perc", model_name="tiny") == 0
    after = read_counters(server)
    assert after["abort"] - before["abort"] == 1
    assert after["tpengine:generation_tokens_total"] - before["tpengine:generation_tokens_total"] < 400


def test_a_cancelled_non_streamed_call_is_aborted(server, async_client):
    before = read_counters(server)

    async def start_then_cancel():
        call = asyncio.ensure_future(async_client.completions.create(
            model="tiny", prompt="cancel me", max_tokens=480, temperature=0.0, extra_body={"ignore_eos": True}))
        while server.metric("tpengine:num_requests_running", model_name="tiny") == 0:
            await asyncio.sleep(0.02)
        call.cancel()

    asyncio.run(start_then_cancel())
    server.wait_for_metric("tpengine:num_requests_running", 0.0, model_name="tiny")
    assert read_counters(server)["abort"] - before["abort"] == 1


def test_speculative_decoding_counters_carry_vllms_names_and_move_by_the_engines_counts():
    metrics = Metrics("tiny")

    def engine(drafts, draft_tokens, accepted, per_pos):
        return SimpleNamespace(num_requests_running=0, num_requests_waiting=0, kv_cache_usage=0.0,
                               num_preemptions=0, generation_tokens_total=0, prompt_logprob_cache=PromptLogprobCache(0),
                               spec_decode_stats=dict(num_drafts=drafts, num_draft_tokens=draft_tokens,
                                                      num_accepted_tokens=accepted,
                                                      num_accepted_tokens_per_pos=per_pos))

    metrics.record_engine_state(engine(2, 6, 3, [2, 1, 0]))
    metrics.record_engine_state(engine(5, 14, 7, [4, 2, 1]))
    samples = {(s.name, s.labels.get("position")): s.value
               for family in text_string_to_metric_families(metrics.exposition().decode())
               for s in family.samples if s.name.endswith("_total")}
    assert samples[("tpengine:spec_decode_num_drafts_total", None)] == 5
    assert samples[("tpengine:spec_decode_num_draft_tokens_total", None)] == 14
    assert samples[("tpengine:spec_decode_num_accepted_tokens_total", None)] == 7
    assert [samples[("tpengine:spec_decode_num_accepted_tokens_per_pos_total", str(i))] for i in range(3)] == [4, 2, 1]


def test_a_server_with_a_draft_model_streams_the_tokens_it_writes_without_and_counts_its_drafts(server, tied_model):
    """`serve --speculative-config` with a draft model (the model itself: its drafts are mostly right): a
    completion, streamed and not, is the one the suite's server writes without speculation; /metrics counts."""
    body = {"model": "tiny", "prompt": "abcabcabcabc", "max_tokens": 24, "temperature": 0.0}
    status, expected = server.request("POST", "/v1/completions", body)
    assert status == 200
    spec = json.dumps({"model": tied_model, "num_speculative_tokens": 3, "adaptive": False})
    with contextmanager(running_server)(tied_model, "--speculative-config", spec) as speculating:
        status, got = speculating.request("POST", "/v1/completions", body)
        assert status == 200 and got["choices"][0]["text"] == expected["choices"][0]["text"]
        status, stream = speculating.request("POST", "/v1/completions", {**body, "stream": True})
        chunks = [json.loads(line[len("data: "):]) for line in stream.splitlines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
        assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == expected["choices"][0]["text"]
        drafts = speculating.metric("tpengine:spec_decode_num_draft_tokens_total", model_name="tiny")
        accepted = speculating.metric("tpengine:spec_decode_num_accepted_tokens_total", model_name="tiny")
        assert 0 < accepted <= drafts
