"""CPU decode steps replayed from recorded forwards: the same greedy tokens as eager decode and as transformers, and
a bucket whose forward the recording cannot hold left eager."""
import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode

from tests.conftest import TP_MODEL, hf_greedy, random_prompts
from tests.runner import test_cuda_graphs as cuda_graph_tests
from tpengine import LLM
from tpengine.attention.metadata import AttentionMetadata
from tpengine.kernels.cpu import op_replay
from tpengine.runner.cpu_replay import DecodeCpuReplays

VOCAB = TP_MODEL["vocab_size"]
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU path")


def count_replayed_rows(runner) -> list[int]:
    """The rows of every decode step from now on that a replay ran (not the recording step of its bucket); each
    replay calls its ops from C++ where that is built."""
    rows = []
    replays = runner.decode_path.replays
    if not isinstance(replays, DecodeCpuReplays):
        return rows
    run = replays.run

    def counted(input_ids, *rest):
        replay = replays.replays.get(input_ids.size(0))
        if replay is not None:
            assert replay.program is not None or not op_replay.available(), "a replay calls its ops from Python"
            rows.append(input_ids.size(0))
        return run(input_ids, *rest)

    replays.run = counted
    return rows


def greedy_tokens(path, prompts, max_tokens, **engine_kwargs):
    return cuda_graph_tests.greedy_tokens(path, prompts, max_tokens, count_replayed_rows, **engine_kwargs)


@pytest.mark.parametrize("block_size", [16, 256])
def test_replayed_decode_equals_eager_and_transformers(tiny_model, block_size):
    # decode batches of 5, 4, 3, 2 and 1 rows, each a bucket of its own, each recorded once then replayed, with
    # prefix hits (the repeated prompt) and contexts crossing block boundaries
    prompts = random_prompts(31, [1, 17, block_size + 3, 40, 5], VOCAB)
    prompts[4] = prompts[3][:20] + prompts[4]
    max_tokens = [14, 12, 9, 6, 3]
    replayed, rows = greedy_tokens(tiny_model, prompts, max_tokens, kvcache_block_size=block_size)
    eager, no_rows = greedy_tokens(tiny_model, prompts, max_tokens, kvcache_block_size=block_size,
                                   enforce_eager=True)
    assert set(rows) == {1, 2, 3, 4, 5} and not no_rows
    assert replayed == eager
    assert replayed == [ref[:n] for ref, n in zip(hf_greedy(tiny_model, prompts, 14), max_tokens)]


def test_replayed_decode_keeps_tokens_through_preemption(tiny_model):
    # 8 blocks of 16 for 4 sequences growing to ~50 tokens: sequences are preempted and recomputed, and the
    # decode batches change size back and forth between buckets
    prompts = random_prompts(32, [20, 24, 28, 30], VOCAB)
    tokens, rows = greedy_tokens(tiny_model, prompts, [30] * 4, kvcache_block_size=16, num_kvcache_blocks=8)
    assert rows
    assert tokens == hf_greedy(tiny_model, prompts, 30)


def test_engines_that_must_run_eagerly_hold_no_replays(tiny_model):
    for kwargs in (dict(enforce_eager=True), dict(attention_backend="torch")):  # the torch decode reads host lists
        with LLM(tiny_model, kvcache_block_size=16, **kwargs) as llm:
            assert llm.executor.runner.decode_path.replays is None


class ReadsAValue(nn.Module):
    """A 'model' whose forward asks Python for a tensor's value (.item()): no recording can replay that."""

    def forward(self, input_ids, positions, meta):
        scale = float(input_ids.sum().item() % 7)
        return torch.ones(input_ids.size(0), 4) * scale


class Plain(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(10, 3), requires_grad=False)

    def forward(self, input_ids, positions, meta):
        rows = nn.functional.embedding(input_ids, self.weight) + positions.unsqueeze(1).float()
        return nn.functional.silu(rows).to(torch.float32).flatten(1) * 2


def step(replays: DecodeCpuReplays, ids: list[int]) -> torch.Tensor:
    n = len(ids)
    meta = AttentionMetadata(is_prefill=False, slot_mapping=torch.full((n,), -1), block_tables=torch.zeros(n, 1,
                             dtype=torch.int32), context_lens=torch.zeros(n, dtype=torch.int32))
    with torch.inference_mode():
        return replays.run(torch.tensor(ids), torch.arange(n) + ids[0], meta)


def test_a_forward_that_reads_a_value_into_python_stays_eager():
    replays = DecodeCpuReplays(ReadsAValue(), max_num_rows=4, max_num_blocks_per_seq=1, block_size=16)
    assert torch.equal(step(replays, [3, 5]), torch.full((2, 4), 1.0))
    assert replays.replays[2] is None and not replays.can_run(2, 1)
    assert replays.can_run(3, 1)  # another bucket is recorded on its own


class Promotes(nn.Module):
    """Ops whose boxed calls need care: numbers where a tensor is taken (wrapped numbers, which type promotion
    treats as Python scalars: an int64 tensor + 2.5 is float32, not float64), a split into a list, a memory
    format, an in-place op."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(10, 3), requires_grad=False)

    def forward(self, input_ids, positions, meta):
        rows = nn.functional.embedding(input_ids, self.weight).to(torch.float16) * 2.5
        first, last = rows.split([2, 1], dim=1)
        last = last.clone(memory_format=torch.contiguous_format)
        last.add_(1)
        return first.float() * last.float() + (positions + 2.5).unsqueeze(1)


@pytest.mark.parametrize("model", [Plain, Promotes])
def test_ops_called_from_cpp_compute_what_python_calls_do(model):
    model = model()
    replays = DecodeCpuReplays(model, max_num_rows=4, max_num_blocks_per_seq=1, block_size=16)
    step(replays, [1, 2, 3])  # recorded
    replay = replays.replays[3]
    assert replay is not None and (replay.program is not None or not op_replay.available())
    program = replay.program
    for ids in ([7, 0, 5], [2, 2, 9]):
        expected = model(torch.tensor(ids), torch.arange(3) + ids[0], None)
        replay.program = None  # the ops called from Python
        from_python = step(replays, ids)
        replay.program = program
        from_cpp = step(replays, ids)
        assert expected.dtype == from_python.dtype == from_cpp.dtype == torch.float32
        assert torch.equal(from_cpp, expected) and torch.equal(from_python, expected)


class CallsTheHost(nn.Module):
    """A forward with a host call in the middle, made as parallel_state.py makes its all-reduce: Python that runs
    at every replay (here it scales by a count of its calls, in place), between the ops before and after it."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(10, 3), requires_grad=False)
        self.num_calls = 0

    def scale(self, tensor):
        self.num_calls += 1
        tensor.mul_(self.num_calls)

    def forward(self, input_ids, positions, meta):
        rows = nn.functional.embedding(input_ids, self.weight) * 2
        record = getattr(_get_current_dispatch_mode(), "record_host_call", None)
        record(self.scale, rows) if record is not None else self.scale(rows)
        return rows + 1


def test_a_host_call_runs_again_at_every_replay_from_cpp_and_from_python():
    model = CallsTheHost()
    replays = DecodeCpuReplays(model, max_num_rows=4, max_num_blocks_per_seq=1, block_size=16)
    step(replays, [1, 2, 3])  # recorded: the call ran once
    replay = replays.replays[3]
    assert replay is not None and (replay.program is not None or not op_replay.available())
    program = replay.program
    for k, (ids, from_cpp) in enumerate([([7, 0, 5], True), ([2, 2, 9], False), ([4, 1, 1], True)], start=2):
        replay.program = program if from_cpp else None
        expected = model.weight[torch.tensor(ids)] * 2 * k + 1
        assert torch.equal(step(replays, ids), expected)
    assert model.num_calls == 4


def test_a_replay_computes_from_this_steps_inputs():
    model = Plain()
    replays = DecodeCpuReplays(model, max_num_rows=4, max_num_blocks_per_seq=1, block_size=16)
    for ids in ([1, 2, 3], [7, 0, 5], [2, 2, 9]):  # recorded at the first, replayed at the others
        expected = model(torch.tensor(ids), torch.arange(3) + ids[0], None)
        assert torch.equal(step(replays, ids), expected)
    assert replays.replays[3] is not None


def test_replayed_decode_at_tp_2_equals_transformers(tiny_model):
    # every rank records and replays the same steps; the all-reduces (the vocabulary-parallel embedding's and
    # the row-parallel linears') are ops of the recording whose shared-memory Python runs at each replay
    prompts = random_prompts(33, [3, 18, 9], VOCAB)
    tokens, rows = greedy_tokens(tiny_model, prompts, [10, 7, 4], kvcache_block_size=16, tensor_parallel_size=2)
    assert set(rows) == {1, 2, 3}
    assert tokens == [ref[:n] for ref, n in zip(hf_greedy(tiny_model, prompts, 10), [10, 7, 4])]


def test_gemma_decode_is_replayed_and_equals_transformers():
    # Gemma's GELU-and-mul splits its packed gate and up with chunk(): a view op like split, so its steps replay too
    from tests.models.test_gemma import gemma_checkpoint
    path = gemma_checkpoint("gemma2")
    prompts = random_prompts(34, [5, 21], 256)
    tokens, rows = greedy_tokens(path, prompts, [8, 5], kvcache_block_size=16)
    assert set(rows) == {1, 2}
    assert tokens == [ref[:n] for ref, n in zip(hf_greedy(path, prompts, 8), [8, 5])]
