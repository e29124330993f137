"""Shared memory between the ranks of one host: segment.py (creating and attaching segments, telling whether
the process at the other end lives), futex.py (sleeping until another process changes a word), ring.py
(rank 0's step messages to the workers) and all_reduce.py (the layers' all-reduce and the LM head's
gather, through one C++ op each)."""
