"""An earlier revision of a CPU kernel, built beside this one for A/B runs in one process.

The source is kernels/cpu/NAME.cpp as `git show REV:` gives it, or another file's text; its ops are renamed from
torch.ops.tpengine_cpu to torch.ops.tpengine_baseline, so both kernels load side by side and run on the same inputs.
"""
import os
import subprocess
from collections.abc import Callable

import torch

from tpengine.kernels.cpu.build import _compile_command, compiler_name

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_baseline(source: str, revision: str, source_file: str | None, folder: str,
                  extra_flags: tuple[str, ...] = ()) -> None:
    """Builds and loads the baseline of `source` (a path under the repository, kernels/cpu/...) into folder:
    source_file's text if given, else the file at revision. Its ops are then torch.ops.tpengine_baseline.*."""
    start_baseline(source, revision, source_file, folder, extra_flags)()


def start_baseline(source: str, revision: str, source_file: str | None, folder: str,
                   extra_flags: tuple[str, ...] = ()) -> Callable[[], None]:
    """load_baseline's build, started in the background (the compiler runs for seconds): the function returned
    waits for it and loads the ops."""
    if source_file:
        with open(source_file) as f:
            text = f.read()
    else:
        text = subprocess.run(["git", "-C", ROOT, "show", f"{revision}:{source}"], check=True,
                              capture_output=True, text=True).stdout
    name = os.path.splitext(os.path.basename(source))[0]
    cpp, library = os.path.join(folder, f"baseline_{name}.cpp"), os.path.join(folder, f"baseline_{name}.so")
    with open(cpp, "w") as f:
        f.write(text.replace("tpengine_cpu", "tpengine_baseline"))
    build = subprocess.Popen(_compile_command(compiler_name(), cpp, library, extra_flags))

    def finish() -> None:
        if build.wait() != 0:
            raise subprocess.CalledProcessError(build.returncode, build.args)
        torch.ops.load_library(library)
    return finish
