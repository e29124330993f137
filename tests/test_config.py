"""EngineConfig: every setting declared once with its group; each group validates its own; resolve() fills in what
the model decides, and the engine runs and logs the resolved config."""
import logging

import pytest

from tpengine import LLM
from tpengine.config import SETTING_GROUPS, EngineConfig, engine_fields
from tpengine.hf_config import load_hf_config, max_positions_of


def test_every_setting_is_declared_with_a_known_group_and_help():
    assert {field.setting.group for field in engine_fields().values()} == set(SETTING_GROUPS)
    assert [name for name, field in engine_fields().items() if not field.setting.help] == []


def test_resolve_bounds_max_model_len_by_the_models_positions_and_leaves_the_config_given_as_it_was(tied_model):
    hf_config = load_hf_config(tied_model)
    config = EngineConfig(model=tied_model, max_model_len=10**6, speculative_config={"method": "ngram",
                                                                                        "num_speculative_tokens": 2})
    resolved = config.resolve(hf_config)
    assert resolved.max_model_len == max_positions_of(hf_config) < 10**6
    assert resolved.max_steps_in_flight == 1 and resolved.speculative_config.prompt_lookup_max == 5
    assert config.max_model_len == 10**6 and config.max_steps_in_flight is None
    assert isinstance(config.speculative_config, dict)


@pytest.mark.parametrize("setting, message", [
    (dict(device="tpu"), "device must be one of ('auto', 'cpu', 'cuda'), got 'tpu'"),
    (dict(reasoning_parser="o1"), "reasoning_parser must be one of ('qwen3', 'deepseek_r1') or None, got 'o1'"),
    (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization must be in (0, 1], got 1.5"),
    (dict(kvcache_memory_gb=0), "kvcache_memory_gb must be > 0, got 0"),
    (dict(max_steps_in_flight=2), "max_steps_in_flight must be an integer from 1 to pipeline_parallel_size=1"),
    (dict(step_timeout_s=0), "step_timeout_s must be a number of seconds > 0, got 0"),
    (dict(max_model_len=0), "max_model_len must be an integer >= 1, got 0"),
    (dict(quantization_group_size=64), "quantization_group_size=64 applies to quantization='int4' only"),
])
def test_a_setting_that_can_never_work_is_a_value_error_naming_it(tied_model, setting, message):
    with pytest.raises(ValueError) as error:
        EngineConfig(model=tied_model, **setting).resolve(load_hf_config(tied_model))
    assert message in str(error.value)


def test_describe_gives_one_line_per_group_naming_every_setting_once(tied_model):
    lines = EngineConfig(model=tied_model).describe()
    assert [line.split(":")[0] for line in lines] == list(SETTING_GROUPS)
    named = [item.split("=")[0] for line in lines for item in line.split(": ", 1)[1].split(" ")]
    assert named == list(engine_fields())


def test_the_engine_runs_and_logs_the_resolved_config(tied_model, caplog):
    with caplog.at_level(logging.INFO, logger="tpengine"):
        with LLM(tied_model, device="cpu", max_model_len=10**6, kvcache_block_size=16, num_kvcache_blocks=64) as llm:
            config = llm.config
    assert config.max_model_len == llm.max_model_len == max_positions_of(load_hf_config(tied_model))
    assert config.num_kvcache_blocks == 64 and config.max_num_batched_tokens == 2048  # the CPU's default
    logged = [record.getMessage() for record in caplog.records if record.getMessage().startswith("config ")]
    assert logged == [f"config {line}" for line in config.describe()]
    assert f"max_model_len={config.max_model_len}" in logged[0]
