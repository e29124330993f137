"""benchmarks/bench_lora.py --quick runs end to end: the decode table (no LoRA, LoRA on with base rows, one adapter on
every row, adapters spread over the batch), the load table, the first-request table, the aims and --json; and the
adapters it writes without peft read back through tpengine's own reader."""
import json

from tests.benchmarks import import_script, run_script
from tpengine.bench.models import QUICK_MODEL


def test_lora_bench_reports_decode_ratios_loads_and_first_request(quick_model, tmp_path):
    path = tmp_path / "lora.json"
    out = run_script("bench_lora.py", "--quick", "--model", quick_model, "--json", str(path)).stdout
    for row in ("| no LoRA | 1 |", "| LoRA on, base rows | 1 |", "| one adapter, every row | 1 |",
                "| LoRA on, base rows | 4 |", "| 4 adapters, rows spread | 4 |",
                "| read from disk (read_adapter_weights + mapping) |", "| slot writes |",
                "| **load (read + writes)** |",
                "| reload from the host cache (writes) |", "| adapter loaded first |", "| adapter resident |",
                "| no adapter |", "| batch | base matmuls | LoRA add, base rows |",
                "aim: one rank-16 adapter on every row at batch 1 <= 1.15x",
                "aim: 4 adapters spread over batch 4 <= 1.3x", "aim: a rank-16 load on the decode model"):
        assert row in out, out
    assert "| 4 adapters, rows spread | 1 |" not in out  # one row cannot spread over adapters
    record = json.loads(path.read_text())
    assert record["benchmark"] == "bench_lora" and record["rank"] == 16
    assert {(s["configuration"], s["batch"]) for s in record["series"]} == {
        (name, batch) for name in ("no LoRA", "LoRA on, base rows", "one adapter, every row") for batch in (1, 4)
    } | {("adapters, rows spread", 4)}
    assert all(ms > 0 for s in record["series"] for ms in s["step_ms"])
    assert record["load"]["layers"] == 2 * 4  # 2 layers of qkv, o, gate_up, down (q/k/v and gate/up are packed)


def test_adapters_written_without_peft_read_as_peft_ones(tmp_path):
    from tpengine.lora.adapter import read_adapter_config, read_adapter_weights

    bench = import_script("bench_lora")
    folder = bench.write_adapter(str(tmp_path / "adapter"), QUICK_MODEL, rank=4, seed=1,
                                 targets=bench.ATTENTION)
    config = read_adapter_config(folder, max_lora_rank=16)
    assert config.rank == 4 and config.target_modules == bench.ATTENTION
    weights = read_adapter_weights(folder, config)
    a, b, scale = weights["model.layers.1.self_attn.k_proj"]
    kv = QUICK_MODEL["num_key_value_heads"] * QUICK_MODEL["head_dim"]
    assert a.shape == (4, QUICK_MODEL["hidden_size"]) and b.shape == (kv, 4) and scale == 2.0
    assert len(weights) == QUICK_MODEL["num_hidden_layers"] * 4
