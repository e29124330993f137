"""The CPU token-mask kernel sets exactly the logits whose mask bit is 0 to -inf (as xgrammar's apply does):
mixed words, whole-zero and whole-one words, a vocabulary that ends inside a word, chosen rows only, and
rows that are not contiguous."""
import pytest
import torch
import xgrammar as xgr

from tpengine.kernels.cpu import token_bitmask

pytestmark = pytest.mark.skipif(not token_bitmask.available(), reason="the CPU token-mask kernel does not build here")


@pytest.mark.parametrize("vocab", [1, 31, 32, 33, 1000, 4099])
def test_masked_logits_equal_xgrammars(vocab):
    g = torch.Generator().manual_seed(vocab)
    rows = 6
    bitmask = torch.randint(-2**31, 2**31 - 1, xgr.get_bitmask_shape(rows, vocab), dtype=torch.int32, generator=g)
    bitmask[1] = -1          # every token allowed
    bitmask[2] = 0           # none
    bitmask[3, ::2] = 0      # alternating whole words
    logits = torch.randn(rows, vocab, generator=g)
    ours = logits.clone()
    chosen = [0, 2, 3, 5]
    token_bitmask.apply_token_bitmask(ours, bitmask, chosen)
    bits = (bitmask.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1  # token j: bit j % 32 of word j // 32
    allowed = bits.flatten(1)[:, :vocab].bool()
    expected = logits.clone()
    expected[chosen] = torch.where(allowed[chosen], logits[chosen], float("-inf"))
    assert torch.equal(ours, expected)
    if vocab > 1:  # xgrammar's own apply agrees (at a one-token vocabulary it masks an unchosen row too)
        theirs = logits.clone()
        xgr.apply_token_bitmask_inplace(theirs, bitmask, indices=chosen)
        assert torch.equal(ours, theirs)


def test_rows_of_a_wider_tensor():
    wide = torch.randn(3, 80)
    logits = wide[:, :70]  # rows 80 apart: contiguous within a row only
    bitmask = torch.zeros(xgr.get_bitmask_shape(3, 70), dtype=torch.int32)
    bitmask[:, 0] = 0b101
    token_bitmask.apply_token_bitmask(logits, bitmask, [0, 1, 2])
    assert torch.isfinite(logits[:, [0, 2]]).all() and torch.isinf(logits[:, 1]).all()
    assert torch.isinf(logits[:, 3:]).all() and torch.isfinite(wide[:, 70:]).all()
