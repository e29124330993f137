"""The model runner's warm-up step: what the KV-cache sizing on CUDA measures (its parts run on any device)."""
from tests.conftest import TP_MODEL
from tpengine import LLM


def test_largest_step_samples_max_num_seqs_full_vocabulary_rows_and_frees_its_cache(tiny_model):
    # fewer batched tokens than max_num_seqs: a decode step can still hold max_num_seqs sequences
    with LLM(tiny_model, kvcache_block_size=16, max_num_seqs=40, max_num_batched_tokens=16) as llm:
        runner = llm.executor.runner
        shapes = []
        warm_up = runner.sampler.warm_up
        runner.sampler.warm_up = lambda logits: shapes.append(tuple(logits.shape)) or warm_up(logits)
        cache_bytes = runner.run_largest_step()
        assert shapes == [(40, TP_MODEL["vocab_size"])]
        layers, kv_heads, head_dim = TP_MODEL["num_hidden_layers"], TP_MODEL["num_key_value_heads"], TP_MODEL["head_dim"]
        assert cache_bytes == 2 * layers * 16 * kv_heads * head_dim * 4  # one 16-token block, float32
        assert [t.numel() for t in runner.kv_cache.tensors] == [0]  # the scratch cache is freed again
