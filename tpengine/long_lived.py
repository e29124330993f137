"""What a process makes while it starts (imported modules, the model's modules and weights' wrappers, tokenizers,
the server's app) lives as long as the process, so the cycle collector need not walk it again. Left in the oldest
generation, every full collection walked all of it: on the tiny model a server's took up to 136 ms, holding the
GIL, so the engine's step and every stream stalled with it (the inter-token p99 at saturation; docs/benchmarks.md).
"""
import gc


def freeze_start_up_objects() -> None:
    """Collect what start-up left as garbage, then move every object still alive out of the collector's sight
    (gc.freeze): later collections walk only what was made after. Called again by a later start-up stage, it
    adds that stage's objects."""
    gc.collect()
    gc.freeze()


def thaw_start_up_objects() -> None:
    """Hand the frozen objects back to the collector: the server that froze them stopped, and its process (a test's,
    say) may go on without it."""
    gc.unfreeze()
