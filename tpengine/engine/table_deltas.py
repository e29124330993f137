"""The block-table changes the next step carries: every rank keeps the running sequences' tables between steps
(runner/block_tables.py), so a StepMessage holds only what changed since the last one."""
from tpengine.distributed.messages import BlockTable
from tpengine.engine.sequence import Sequence


class TableDeltas:
    """Changes noted as the ledger makes them, handed out once per step (take), applied by every rank in the
    order StepMessage gives."""

    def __init__(self):
        self.released: list[int] = []            # sequences that left (finished, aborted, preempted)
        self.appended_seq_ids: list[int] = []    # appended_block_ids[i] becomes the last block of appended_seq_ids[i]
        self.appended_block_ids: list[int] = []
        self.truncated_seq_ids: list[int] = []   # tables cut to truncated_num_blocks[i] (rejected drafts' blocks)
        self.truncated_num_blocks: list[int] = []
        self.reset = False                       # every rank drops every table first (a step was interrupted)
        # after a reset, until every running sequence has its whole table again
        self.resend_decode_tables = False

    def append(self, seq: Sequence, block_id: int) -> None:
        self.appended_seq_ids.append(seq.seq_id)
        self.appended_block_ids.append(block_id)

    def release(self, seq: Sequence) -> None:
        """seq's blocks went back: every rank drops its table with the next step."""
        if seq.on_workers:
            seq.on_workers = False
            self.released.append(seq.seq_id)

    def truncate(self, seq: Sequence, num_blocks: int) -> None:
        self.truncated_seq_ids.append(seq.seq_id)
        self.truncated_num_blocks.append(num_blocks)

    @staticmethod
    def add_whole_table(seq: Sequence, new_tables: list[BlockTable]) -> None:
        """seq (admitted, re-admitted after a preemption, or forked) takes its whole table, unless the ranks
        hold it."""
        if not seq.on_workers:
            new_tables.append(BlockTable(seq.seq_id, list(seq.block_table)))
            seq.on_workers = True

    def resend_tables_of(self, rows: list[Sequence], running, new_tables: list[BlockTable]) -> None:
        """After the ranks dropped every table: whole tables for the decode and verify rows that lack theirs (the
        blocks their tokens open included, so they are not appended again)."""
        resent = {seq.seq_id for seq in rows if not seq.on_workers}
        for seq in rows:
            if seq.seq_id in resent:
                self.add_whole_table(seq, new_tables)
        if resent:
            kept = [(i, b) for i, b in zip(self.appended_seq_ids, self.appended_block_ids) if i not in resent]
            self.appended_seq_ids, self.appended_block_ids = [i for i, _ in kept], [b for _, b in kept]
        self.resend_decode_tables = any(not seq.on_workers for seq in running)

    def take(self) -> dict:
        """The changes as StepMessage's fields, and a clean slate for the next step."""
        changes = dict(released=self.released, appended_seq_ids=self.appended_seq_ids,
                       appended_block_ids=self.appended_block_ids, reset_tables=self.reset,
                       truncated_seq_ids=self.truncated_seq_ids, truncated_num_blocks=self.truncated_num_blocks)
        self._clear()
        self.reset = False
        return changes

    def start_over(self, sequences) -> None:
        """No one knows which changes of an interrupted step the ranks applied: every rank drops every table and
        each of sequences takes its whole table when it next runs."""
        for seq in sequences:
            seq.on_workers = False
        self._clear()
        self.reset = self.resend_decode_tables = True

    def _clear(self) -> None:
        self.released, self.appended_seq_ids, self.appended_block_ids = [], [], []
        self.truncated_seq_ids, self.truncated_num_blocks = [], []
