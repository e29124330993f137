"""The ledger (engine/: sequences, blocks, scheduling) is plain Python: importing it loads neither torch nor transformers."""
import subprocess
import sys

CHECK = """
import sys
import tpengine
import tpengine.engine.block_manager, tpengine.engine.scheduler, tpengine.engine.sequence
from tpengine import SamplingParams, WorkerFailedError
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "transformers"))
assert not heavy, heavy[:5]
"""


def test_importing_the_ledger_loads_neither_torch_nor_transformers():
    result = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
