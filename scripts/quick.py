"""--quick, which every script in scripts/ has: the script's own code at small sizes, seconds on 2 CPU cores.

tests/scripts runs each script so, and a signature change that breaks a benchmark fails the suite.
Imports nothing heavy: scripts that never touch torch (bench_scheduler.py) stay light.
"""
import argparse

# The model a --quick run writes (bench.write_model): writes and loads in a second. bench.py's CPU_MODEL's
# vocabulary, as the workloads draw token ids below 10,000.
QUICK_MODEL = dict(vocab_size=16384, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
                   rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=True, initializer_range=0.02)


def parse_with_quick(parser: argparse.ArgumentParser, argv, quick_defaults: dict, note: str = ""):
    """parser's arguments plus --quick, which makes quick_defaults the defaults: flags given still win.
    --help lists them, and note says what else --quick changes."""
    shown = ", ".join(f"--{dest.replace('_', '-')} {' '.join(map(str, value)) if isinstance(value, list) else value}"
                      for dest, value in quick_defaults.items())
    parser.add_argument("--quick", action="store_true",
                        help="; ".join(["a smoke run in seconds on 2 CPU cores", *filter(None, [shown, note])]))
    if parser.parse_known_args(argv)[0].quick:
        parser.set_defaults(**quick_defaults)
    return parser.parse_args(argv)
