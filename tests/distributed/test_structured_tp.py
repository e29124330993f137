"""Structured outputs at tp=2: every output matches its grammar (each rank samples its own slice of the vocabulary,
reading the constrained rows' token masks from the step message: no gather of the logits), and unconstrained
requests beside them get the tokens they get alone."""
from tests.conftest import random_prompts
from tests.structured.test_structured_outputs import check_all, constraints
from tpengine import LLM, SamplingParams


def test_constrained_and_free_requests_side_by_side_at_tp_2(tied_model):
    cases = list(constraints())
    free_prompts = random_prompts(9, [7, 21], 250)
    free = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
            SamplingParams(temperature=1.0, seed=5, max_tokens=12, ignore_eos=True)]
    with LLM(tied_model, tensor_parallel_size=2, kvcache_block_size=16, num_kvcache_blocks=24,
             max_model_len=384, max_num_seqs=16) as llm:
        sent = []  # per step: (sampled by every rank over its slice, rows with token masks)
        send = llm.executor.send_to_workers
        llm.executor.send_to_workers = lambda envelope: (
            sent.append((envelope.vocab_parallel is not None,
                         len(envelope.vocab_parallel.masked_rows) if envelope.vocab_parallel else 0)),
            send(envelope))
        alone = [o.token_ids for o in llm.generate(free_prompts, free, use_tqdm=False)]
        # every grammar compiled first: the batch below is admitted at once, so its sequences outgrow the cache
        llm.generate(["warm"] * len(cases), [SamplingParams(max_tokens=1, structured_outputs=spec) for spec, _ in cases],
                     use_tqdm=False)
        outputs = llm.generate(free_prompts + [f"case {i}" for i in range(len(cases))],
                               free + [SamplingParams(n=2, temperature=1.0, seed=i, max_tokens=256,
                                                      structured_outputs=spec) for i, (spec, _) in enumerate(cases)],
                               use_tqdm=False)
        preempted = llm.num_preemptions
    assert [o.token_ids for o in outputs[:2]] == alone
    check_all(outputs[2:], [check for _, check in cases])
    # the constrained rows' steps were sampled on every rank's slice too, their masks in the message
    assert any(masked for _, masked in sent) and all(on_slices for on_slices, masked in sent if masked)
    assert preempted > 0, "the small cache was meant to preempt constrained sequences"
