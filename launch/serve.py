"""`tpengine serve` under torchrun: rank 0 serves the OpenAI API and schedules, the others execute its steps.

    torchrun --standalone --nproc-per-node 4 launch/serve.py --model PATH --port 8000

Takes every flag of `tpengine serve` (see `tpengine serve --help`); the tensor-parallel size is
torchrun's world size. Stop it with SIGTERM or Ctrl-C to torchrun: rank 0 finishes or aborts what
runs and tells the other ranks to stop, which wait for that instead of dying on the signal.
"""
import signal
import sys

import torch.distributed as dist

from tpengine.distributed.parallel_state import init_torchrun_process_group


def _device_option(argv: list[str]) -> str:
    for i, arg in enumerate(argv):
        if arg == "--device" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--device="):
            return arg.split("=", 1)[1]
    return "auto"


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    init_torchrun_process_group(_device_option(argv))
    try:
        if dist.get_rank() != 0:
            # torchrun signals every rank; rank 0 ends the steps and sends the shutdown the others wait for
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            from tpengine.runner.worker import torchrun_worker_main
            torchrun_worker_main()
            return 0
        from tpengine.cli import main as cli_main
        return cli_main(["serve", *argv, "--tp", str(dist.get_world_size())])
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
