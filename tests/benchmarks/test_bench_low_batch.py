"""benchmarks/bench_low_batch.py --quick runs end to end: floor, decode batches, batched-bench shape, the batch-1
breakdown and the fused-op table; with baselines (transformers for real, llama.cpp and vLLM through stand-ins
that speak their tools' formats) and --json, every engine's rounds land in the table and the JSON."""
import json
import stat
import sys
import textwrap

from tests.benchmarks import import_script, run_script

# llama-batched-bench's table, as it prints it (two rows; the stand-in below prints one per -npl)
BATCHED_BENCH_OUTPUT = """
main: n_kv_max = 32768, n_batch = 2048, n_ubatch = 512, flash_attn = 0, is_pp_shared = 0, n_gpu_layers = -1, n_threads = 2

|    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |
|-------|--------|------|--------|----------|----------|----------|----------|----------|----------|
|   208 |     56 |    1 |    264 |    0.099 |  2101.01 |    0.087 |   643.68 |    0.186 |  1419.35 |
|   208 |     56 |   16 |   4224 |    1.617 |  2058.07 |    0.474 |  1891.44 |    2.091 |  2020.09 |
"""


def test_low_batch_bench_reports_the_floor_decode_batches_breakdown_and_ops(quick_model):
    out = run_script("bench_low_batch.py", "--quick", "--model", quick_model, "--batch-sizes", "1", "3",
                     "--context-len", "20", "--batched-bench", "2", "--breakdown", "--ops").stdout
    for row in ("| weight-read floor: sum over the", "| decode step, batch 1, context 20 |",
                "| decode step, batch 3, context 20 |", "| batched-bench shape, batch 2 (prompt 20, 56 decode steps)",
                "| linears (q/k/v, o, gate/up, down) |", "| decode attention |", "| sampler |",
                "| **whole step (mean, timers on)** |", "| q/k norm + rotary | 2048 |"):
        assert row in out, out


def test_batched_bench_rows_give_decode_tok_s_by_batch():
    rows = import_script("decode_baselines").parse_batched_bench(BATCHED_BENCH_OUTPUT)
    assert sorted(rows) == [1, 16]
    assert rows[16]["decode_tok_s"] == 1891.44 and rows[1]["total_tok_s"] == 1419.35 and rows[1]["prompt"] == 208


def executable(path, text: str) -> str:
    path.write_text(textwrap.dedent(text))
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


def test_baselines_take_turns_each_round_and_land_in_the_json(quick_model, tmp_path):
    bin_dir = tmp_path / "llama"
    bin_dir.mkdir()
    # llama-batched-bench's stand-in: one row per -npl batch, decode at 1,000 tok/s per sequence
    executable(bin_dir / "llama-batched-bench", f"""\
        #!{sys.executable}
        import sys
        args = sys.argv[1:]
        pp, tg = int(args[args.index("-npp") + 1]), int(args[args.index("-ntg") + 1])
        print("|    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |")
        for b in map(int, args[args.index("-npl") + 1].split(",")):
            print(f"| {{pp}} | {{tg}} | {{b}} | {{b * (pp + tg)}} | 0.1 | 100.0 | 0.2 | {{1000.0 * b}} | 0.3 | 300.0 |")
        """)
    # vLLM's python stand-in: speaks benchmarks/vllm_decode.py's protocol, a step of 2 ms at any batch
    vllm_python = executable(tmp_path / "python", f"""\
        #!{sys.executable}
        import json, sys
        print("INFO a log line vLLM prints on stdout", flush=True)
        print("@@", json.dumps({{"version": "0.0-stand-in"}}), flush=True)
        for line in sys.stdin:
            print("@@", json.dumps({{"step_ms": {{b: 2.0 for b in line.split()}}}}), flush=True)
        """)
    path = tmp_path / "low_batch.json"
    out = run_script("bench_low_batch.py", "--quick", "--model", quick_model, "--batch-sizes", "1", "2",
                     "--repeat", "2", "--transformers", "--llama-cpp", str(bin_dir), "--gguf", "f32=model.gguf",
                     "--vllm-python", vllm_python, "--json", str(path)).stdout
    for row in ("| tpengine (float32) |", "| transformers generate (float32) |", "| llama.cpp f32 | 1,000 (1,000-1,000) "
                "| 2,000 (2,000-2,000) |", "| vLLM 0.0-stand-in offline LLM (float32) | 500 (500-500) | 1,000 (1,000-1,000) |",
                "| tpengine (float32) / llama.cpp f32 |"):
        assert row in out, out
    record = json.loads(path.read_text())
    assert record["benchmark"] == "bench_low_batch" and record["rounds"] == 2 and len(record["floor_ms"]) == 2
    assert {"command", "date", "revision", "machine", "load_average_before", "load_average_after"} <= set(record)
    series = {(p["label"], p["batch"]): p["step_ms"] for p in record["series"]}
    assert {label for label, _ in series} == {"tpengine (float32)", "transformers generate (float32)", "llama.cpp f32",
                                             "vLLM 0.0-stand-in offline LLM (float32)"}
    assert all(len(rounds) == 2 for rounds in series.values())
    # transformers' step is the difference of two timed generate calls: over --quick's few steps on a busy
    # machine it can come out at or below zero, so only the directly timed steps must be positive
    assert all(min(rounds) > 0 for (label, _), rounds in series.items() if not label.startswith("transformers"))
    assert series["llama.cpp f32", 2] == [1.0, 1.0] and series["vLLM 0.0-stand-in offline LLM (float32)", 1] == [2.0, 2.0]
    assert record["kv_bytes_per_token"] > 0 and record["weight_bytes"] > 0
