"""The user's cache folder for what tpengine writes once and reuses: the tiny model, built kernels."""
import os


def cache_dir(*parts: str) -> str:
    """$TPENGINE_CACHE_DIR, else $XDG_CACHE_HOME/tpengine, else ~/.cache/tpengine; joined with parts."""
    root = os.environ.get("TPENGINE_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "tpengine")
    return os.path.join(root, *parts)
