"""--quick, which every script in benchmarks/ and tools/ has: the script's own code at small sizes, seconds on 2 CPU
cores (the model it writes: models.QUICK_MODEL).

tests/benchmarks and tests/tools run each script so, and a signature change that breaks a benchmark fails the suite.
Imports nothing heavy: scripts that never touch torch (bench_scheduler.py) stay light.
"""
import argparse


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
