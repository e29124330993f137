"""The decode path a runner chooses once: recorded forwards where one holds the step, the model's own elsewhere."""
import pytest
import torch

from tests.conftest import TP_MODEL, hf_greedy, random_prompts
from tpengine import LLM, SamplingParams
from tpengine.attention.metadata import AttentionMetadata
from tpengine.runner.decode_path import EagerDecode, ReplayedDecode


class Model:
    def __init__(self):
        self.calls = 0

    def __call__(self, input_ids, positions, meta):
        self.calls += 1
        return torch.zeros(input_ids.size(0), 2)


class Replays:
    """Replays that hold steps of up to max_rows rows."""

    def __init__(self, max_rows: int):
        self.max_rows, self.rows = max_rows, []

    def can_run(self, num_rows: int, block_table_width: int) -> bool:
        return num_rows <= self.max_rows

    def run(self, input_ids, positions, meta):
        self.rows.append(input_ids.size(0))
        return torch.ones(input_ids.size(0), 2)


def decode(path, num_rows: int) -> torch.Tensor:
    meta = AttentionMetadata(is_prefill=False, slot_mapping=torch.full((num_rows,), -1),
                             block_tables=torch.zeros(num_rows, 1, dtype=torch.int32),
                             context_lens=torch.zeros(num_rows, dtype=torch.int32))
    return path.run(torch.zeros(num_rows, dtype=torch.int64), torch.zeros(num_rows, dtype=torch.int64), meta)


def test_a_step_no_recording_holds_runs_the_models_own_forward():
    model, replays = Model(), Replays(max_rows=4)
    path = ReplayedDecode(model, replays)
    assert decode(path, 3).eq(1).all() and decode(path, 5).eq(0).all()
    assert replays.rows == [3] and model.calls == 1


def test_an_eager_path_runs_the_model_every_step_and_replays_nothing():
    model = Model()
    path = EagerDecode(model)
    decode(path, 2), decode(path, 9)
    assert model.calls == 2 and path.replays is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU path")
def test_a_draft_model_leaves_the_cpu_decode_eager_and_transformers_tokens(tiny_model):
    # a drafter runs between the steps, which a recording cannot see (decode_path.py)
    prompts = random_prompts(41, [7, 19], TP_MODEL["vocab_size"])
    spec = {"model": tiny_model, "num_speculative_tokens": 2, "adaptive": False}
    with LLM(tiny_model, kvcache_block_size=16, speculative_config=spec) as llm:
        assert isinstance(llm.executor.runner.decode_path, EagerDecode)
        outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    assert [o.token_ids for o in outputs] == hf_greedy(tiny_model, prompts, 6)
