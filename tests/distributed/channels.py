"""What the channel tests send: reproducible payloads of any size."""
import random


def payload(index: int, size: int) -> bytes:
    """Message `index` of `size` random bytes, the same on the writer and on every reader."""
    return random.Random(index).randbytes(size)
