"""Write docs/cli.md, every flag of `tpengine generate`, `tpengine serve` and `tpengine bench ...`, from the settings'
declarations (tests/test_cli.py checks the checked-in file is current)."""
from pathlib import Path

from tpengine.cli import flag_reference

if __name__ == "__main__":
    path = Path(__file__).resolve().parent.parent / "docs" / "cli.md"
    path.write_text(flag_reference())
    print(f"wrote {path}")
