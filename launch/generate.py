"""`tpengine generate` under torchrun: one process per rank, rank 0 schedules and samples, the others serve steps.

    torchrun --nproc-per-node 4 launch/generate.py --model PATH "prompt" ...

Takes every flag of `tpengine generate` (see `tpengine generate --help`), --tp and --pp
included: their product is torchrun's world size (--tp defaults to it over --pp). Multi-node: see
launch/multinode.sh. Reads the variables torchrun sets:
RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT.
"""
import sys

from tpengine.cli import main_under_torchrun

if __name__ == "__main__":
    sys.exit(main_under_torchrun("generate"))
