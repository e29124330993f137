"""Mixed steps: running requests decode in every step while prompts are chunked next to them, and greedy
tokens still equal transformers' (tp 1 and 2, block 16 and 256, prefix hits, preemption mid-step)."""
import pytest

from tests.conftest import TP_MODEL, hf_greedy, random_prompts
from tpengine import LLM, SamplingParams

VOCAB = TP_MODEL["vocab_size"]


class StepLog:
    """What each scheduled step held, read off the plans the engine's own scheduler returned."""

    def __init__(self, llm):
        self.steps = []  # (decode rows, prefill rows, partial chunks, preemptions during scheduling)
        scheduler, = llm.scheduler.schedulers
        schedule = scheduler.schedule

        def logged_schedule():
            before = scheduler.num_preemptions
            plan = schedule()
            chunks = plan.message.prefill
            partial = sum(1 for chunk in chunks if not chunk.sampled)
            self.steps.append((plan.num_decode, len(chunks), partial, scheduler.num_preemptions - before))
            return plan
        scheduler.schedule = logged_schedule

    @property
    def mixed_steps(self):
        return [s for s in self.steps if s[0] and s[1]]


def run_arrivals(llm, arrivals: list[tuple[int, list[int]]], params: SamplingParams) -> list[list[int]]:
    """Add each (step, prompt) when the engine reaches that step; run to the end; tokens in arrival order."""
    ids, tokens, step = [], {}, 0
    pending = sorted(arrivals, key=lambda a: a[0])
    while pending or llm.has_unfinished_requests():
        while pending and pending[0][0] <= step:
            ids.append(llm.add_request(pending.pop(0)[1], params, stream=False))
        for output in llm.step():
            if output.finished:
                tokens[output.request_id] = output.token_ids
        step += 1
    return [tokens[i] for i in ids]


def workload(block_size: int) -> list[tuple[int, list[int]]]:
    """Short and long prompts arriving over time; later ones repeat earlier prompts' heads (prefix hits)."""
    b = block_size
    heads = random_prompts(b, [2 * b + 9, b - 3], VOCAB)
    tails = random_prompts(b + 1, [5, 7, 3, b // 2, 2, 4], VOCAB)
    return [(0, heads[1]), (0, random_prompts(3, [b - 1], VOCAB)[0]), (2, heads[0]),
            (4, heads[1][:b - 5] + tails[0]), (6, random_prompts(5, [b + 3], VOCAB)[0]),
            (9, heads[0][:b + 4] + tails[1]), (12, heads[0] + tails[2]), (15, heads[1] + tails[3]),
            (20, tails[4]), (24, heads[0][:2 * b] + tails[5])]


@pytest.mark.parametrize("block_size,budget,num_blocks", [(16, 20, 8), (256, 300, 5)])
def test_mixed_steps_with_chunks_prefix_hits_and_preemption_match_transformers(tiny_model, block_size, budget,
                                                                              num_blocks):
    params = SamplingParams(temperature=0.0, max_tokens=block_size // 2 + 4, ignore_eos=True)
    arrivals = workload(block_size)
    with LLM(tiny_model, kvcache_block_size=block_size, max_num_batched_tokens=budget,
             num_kvcache_blocks=num_blocks) as llm:
        log = StepLog(llm)
        outputs = run_arrivals(llm, arrivals, params)
        assert llm.prefix_cache_hits > 0
    assert outputs == hf_greedy(tiny_model, [p for _, p in arrivals], params.max_tokens)
    mixed = log.mixed_steps
    assert any(partial for _, _, partial, _ in mixed), "no prompt was chunked next to decodes"
    assert any(preempted for _, _, _, preempted in mixed), "no preemption in a mixed step"


@pytest.mark.parametrize("block_size,budget,num_blocks", [(16, 20, 8), (256, 300, 5)])
def test_mixed_steps_match_transformers_at_tp_2(tiny_model, block_size, budget, num_blocks):
    params = SamplingParams(temperature=0.0, max_tokens=block_size // 2 + 4, ignore_eos=True)
    arrivals = workload(block_size)
    with LLM(tiny_model, tensor_parallel_size=2, kvcache_block_size=block_size, max_num_batched_tokens=budget,
             num_kvcache_blocks=num_blocks) as llm:
        log = StepLog(llm)
        outputs = run_arrivals(llm, arrivals, params)
    assert outputs == hf_greedy(tiny_model, [p for _, p in arrivals], params.max_tokens)
    assert any(partial for _, _, partial, _ in log.mixed_steps)
    assert any(preempted for _, _, _, preempted in log.mixed_steps)


@pytest.mark.parametrize("policy", ["mixed", "prefill_first"])
def test_running_requests_gain_one_token_every_step_while_a_long_prompt_is_chunked(tiny_model, policy):
    # budget 16, three requests decoding: the 200-token prompt takes 13 tokens a step under "mixed";
    # under "prefill_first" it takes the whole budget and the others stall until it is done
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    short = random_prompts(21, [5, 9, 3], VOCAB)
    long = random_prompts(22, [200], VOCAB)[0]
    with LLM(tiny_model, kvcache_block_size=16, max_num_batched_tokens=16, scheduling_policy=policy) as llm:
        ids = [llm.add_request(p, params) for p in short]
        while len(llm.scheduler.running) < 3:
            llm.step()
        running = list(llm.scheduler.running)
        long_id = llm.add_request(long, params)
        long_seq = llm.scheduler.waiting[-1]
        stalled_steps = chunk_steps = 0
        while long_seq.num_cached_tokens < len(long):
            before = [seq.num_tokens for seq in running]
            cached = long_seq.num_cached_tokens
            llm.step()
            gained = [seq.num_tokens - n for seq, n in zip(running, before)]
            chunk_steps += 1
            if policy == "mixed":
                assert gained == [1, 1, 1]
                assert long_seq.num_cached_tokens - cached == min(13, len(long) - cached)
            else:
                stalled_steps += gained == [0, 0, 0]
        outputs = {}
        while llm.has_unfinished_requests():
            for output in llm.step():
                outputs[output.request_id] = output.token_ids
    if policy == "mixed":
        assert chunk_steps == -(-len(long) // 13)
    else:
        assert stalled_steps == chunk_steps == -(-len(long) // 16)
    assert [outputs[i] for i in [*ids, long_id]] == hf_greedy(tiny_model, [*short, long], params.max_tokens)


def test_a_plan_keeps_its_token_counts_after_the_step_ran(tiny_model):
    # the plan is a value: postprocess resets each sequence's num_scheduled_tokens, the plan's counts stay
    # (generate's progress bar reads them after the step; it showed "prefill 0 tok/s" when they did not)
    plans = []
    with LLM(tiny_model, kvcache_block_size=16, max_num_batched_tokens=20) as llm:
        scheduler, = llm.scheduler.schedulers
        schedule = scheduler.schedule

        def recording_schedule():
            plan = schedule()
            rows = scheduler.scheduled
            plans.append((plan, plan.num_decode, sum(seq.num_scheduled_tokens for seq in rows[plan.num_decode:])))
            return plan
        scheduler.schedule = recording_schedule
        llm.generate(random_prompts(31, [30, 7], VOCAB), SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    assert sum(num_prefill for _, _, num_prefill in plans) == 37
    for plan, num_decode, num_prefill in plans:
        assert (plan.num_prefill_tokens, plan.num_tokens) == (num_prefill, num_decode + num_prefill)
