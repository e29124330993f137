"""One scheduled step as a value, made once by the ledger: what every rank runs, and how rank 0 samples."""
from dataclasses import dataclass

from tpengine.distributed.messages import StepMessage
from tpengine.sampling_params import SamplingRecord


@dataclass(slots=True)
class StepPlan:
    """message: the forward every rank runs (decode rows first, then prompt chunks, then verify rows; the
    block-table changes since the last step). sampling: one record per sampled row, in row order: every
    decode row, each prompt chunk that reaches its sequence's last token, every row of each verify row.
    The sampled tokens come back in that order."""
    message: StepMessage
    sampling: list[SamplingRecord]
    num_prefill_tokens: int
    num_verify_tokens: int = 0  # speculative decoding: verify rows' tokens, each a last token or a draft

    @property
    def num_decode(self) -> int:
        return self.message.num_decode_rows

    @property
    def num_tokens(self) -> int:
        """Tokens through the forward: never more than the scheduler's max_num_batched_tokens."""
        return self.num_decode + self.num_prefill_tokens + self.num_verify_tokens

    def __bool__(self) -> bool:
        return bool(self.message.decode_seq_ids or self.message.prefill)
