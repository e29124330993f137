"""`tpengine serve` under torchrun: rank 0 serves the OpenAI API and schedules, the others execute its steps.

    torchrun --standalone --nproc-per-node 4 launch/serve.py --model PATH --port 8000

Takes every flag of `tpengine serve` (see `tpengine serve --help`), --tp and --pp
included: their product is torchrun's world size (--tp defaults to it over --pp). Stop it with SIGTERM or
Ctrl-C to torchrun: rank 0 finishes or aborts what runs and tells the other ranks to stop, which wait for that instead of dying on the signal.
"""
import sys

from tpengine.cli import main_under_torchrun

if __name__ == "__main__":
    sys.exit(main_under_torchrun("serve"))
