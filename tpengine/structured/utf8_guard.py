"""What xgrammar's UTF-8 lets through and no decoder takes: a surrogate, ED followed by A0-BF (U+D800-DFFF). Its
byte-level string rules take one (other ill-formed sequences, overlong or past U+10FFFF, it refuses), so a model
whose vocabulary has byte tokens could write one inside a JSON string: the text then decodes to replacement
characters, longer than the schema's maxLength allowed, not the string the grammar checked. The guard masks, on
top of the grammar, every token that holds a surrogate, and after a token that ends on a lone ED lead, every token
that would continue it into one."""
import numpy as np

LEAD = 0xED
SURROGATE_SECOND = range(0xA0, 0xC0)


class SurrogateGuard:
    def __init__(self, token_bytes: list[bytes], vocab_size: int):
        words = (vocab_size + 31) // 32
        self.everywhere = np.full(words, 0xFFFFFFFF, dtype=np.uint32)   # tokens allowed at any point
        self.after_lead = np.full(words, 0xFFFFFFFF, dtype=np.uint32)   # ... and right after a lone ED
        leaves_lead = []
        for token_id, data in enumerate(token_bytes):
            if not data:
                continue
            if data[0] in SURROGATE_SECOND:
                _clear(self.after_lead, token_id)
            if any(a == LEAD and b in SURROGATE_SECOND for a, b in zip(data, data[1:])):
                _clear(self.everywhere, token_id)
            if data[-1] == LEAD:
                leaves_lead.append(token_id)
        self.after_lead &= self.everywhere
        self.leaves_lead = frozenset(leaves_lead)
        self.needed_everywhere = bool((self.everywhere != 0xFFFFFFFF).any())

    def restrict(self, row: np.ndarray, after_lead: bool) -> None:
        """A bitmask row (uint32 words) of a grammar's allowed tokens, less what the guard forbids now."""
        if after_lead:
            row &= self.after_lead
        elif self.needed_everywhere:
            row &= self.everywhere


def _clear(words: np.ndarray, token_id: int) -> None:
    word, bit = divmod(token_id, 32)
    words[word] &= np.uint32(~(1 << bit) & 0xFFFFFFFF)
