"""Every rank's copy of the running sequences' block tables, kept between steps: a step message carries only
what changed (runner/inputs.py reads the tables; the ledger, engine/scheduler.py, says what changed)."""
from tpengine.distributed.messages import StepMessage


class BlockTables:
    """This rank's copy of every running sequence's block table (seq id -> block ids)."""

    def __init__(self):
        self.tables: dict[int, list[int]] = {}

    def update(self, step: StepMessage) -> None:
        """Apply what the step changed: cut tables, drop the sequences that left, take whole tables, append
        blocks."""
        tables = self.tables
        if step.reset_tables:
            tables.clear()
        for seq_id, num_blocks in zip(step.truncated_seq_ids, step.truncated_num_blocks):
            del tables[seq_id][num_blocks:]
        for seq_id in step.released:
            del tables[seq_id]
        for table in step.new_tables:
            tables[table.seq_id] = table.block_ids
        for seq_id, block_id in zip(step.appended_seq_ids, step.appended_block_ids):
            tables[seq_id].append(block_id)
