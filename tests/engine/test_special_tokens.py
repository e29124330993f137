"""EOS ids come from generation_config.json (a list where the checkpoint has several); BOS is added once."""
import json
import os
import shutil

from transformers import AutoTokenizer

from tests.conftest import hf_greedy, random_prompts
from tests.models.families import BOS, family_checkpoint
from tpengine import LLM, SamplingParams


def test_generation_stops_at_any_of_the_generation_configs_eos_ids(tmp_path):
    source = family_checkpoint("llama_tied")
    prompts = random_prompts(21, [4, 9, 15], 300)
    free_run = hf_greedy(source, prompts, 16)
    # three EOS ids, as Llama 3 has: each prompt's greedy run meets one of them at a different step
    eos_ids = [free_run[0][3], free_run[1][6], free_run[2][10]]
    model = str(tmp_path / "three_eos")
    shutil.copytree(source, model)
    with open(os.path.join(model, "generation_config.json")) as f:
        generation_config = json.load(f)
    with open(os.path.join(model, "generation_config.json"), "w") as f:
        json.dump({**generation_config, "eos_token_id": eos_ids}, f)
    with LLM(model, kvcache_block_size=16) as llm:
        outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
    for out, run in zip(outputs, free_run):
        stop = next(i for i, t in enumerate(run) if t in eos_ids)
        assert out.token_ids == run[:stop + 1] and out.finish_reason == "stop"


def test_a_tokenizer_that_adds_bos_adds_it_once():
    model = family_checkpoint("llama_tied")
    tokenizer = AutoTokenizer.from_pretrained(model)
    expected = tokenizer.encode("Hello")
    assert expected[0] == tokenizer.bos_token_id and expected.count(tokenizer.bos_token_id) == 1
    with LLM(model, kvcache_block_size=16) as llm:
        # a prompt rendered from a chat template already starts with BOS
        outputs = llm.generate(["Hello", BOS + "Hello"], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                               use_tqdm=False)
    assert [o.prompt_token_ids for o in outputs] == [expected, expected]
    assert outputs[0].token_ids == outputs[1].token_ids == hf_greedy(model, [expected], 4)[0]
