"""The paged KV cache's arithmetic, which the ledger and every rank share: how many blocks hold a number of
tokens, and when the next token opens a block."""


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks that hold num_tokens tokens."""
    return -(-num_tokens // block_size)


def opens_block(num_tokens: int, block_size: int) -> bool:
    """Whether the last of num_tokens, the token a decode step computes, is the first of a new block
    (len(seq) % block_size == 1 in the seed's can_append)."""
    return num_tokens % block_size == 1
