"""Every rank's copy of the running sequences' block tables, kept between steps: a step message carries only
what changed (runner/inputs.py reads the tables; the ledger, engine/scheduler.py, says what changed)."""
import numpy as np

from tpengine.distributed.messages import StepMessage


class BlockTables:
    """This rank's copy of every running sequence's block table (seq id -> block ids).

    Each table is also a row of one array, zero past its end, so a step's padded [rows, width] table is one
    gather (`padded`) rather than a list per row. Row 0 is never taken: all zeros, a padding row's table.
    """

    def __init__(self):
        self.tables: dict[int, list[int]] = {}
        self.row_of: dict[int, int] = {}
        self.rows = np.zeros((16, 16), dtype=np.int32)
        self.lengths = np.zeros(16, dtype=np.int64)     # each row's table length
        self._free_rows = list(range(15, 0, -1))

    def update(self, step: StepMessage) -> None:
        """Apply what the step changed: cut tables, drop the sequences that left, take whole tables, append
        blocks."""
        tables, row_of = self.tables, self.row_of  # self.rows may be replaced below (_fit, _new_row): no alias
        if step.reset_tables:
            tables.clear()
            row_of.clear()
            self._free_rows = list(range(len(self.rows) - 1, 0, -1))
        for seq_id, num_blocks in zip(step.truncated_seq_ids, step.truncated_num_blocks):
            del tables[seq_id][num_blocks:]
            row = row_of[seq_id]
            self.rows[row, num_blocks:] = 0
            self.lengths[row] = min(self.lengths[row], num_blocks)
        for seq_id in step.released:
            del tables[seq_id]
            self._free_rows.append(row_of.pop(seq_id))  # cleared when a table takes it
        for table in step.new_tables:
            tables[table.seq_id] = table.block_ids
            row = row_of.get(table.seq_id)
            if row is None:
                row = row_of[table.seq_id] = self._new_row()
            self._fit(len(table.block_ids))
            self.rows[row] = 0
            self.rows[row, :len(table.block_ids)] = table.block_ids
            self.lengths[row] = len(table.block_ids)
        for seq_id, block_id in zip(step.appended_seq_ids, step.appended_block_ids):
            table = tables[seq_id]
            table.append(block_id)
            row = row_of[seq_id]
            self._fit(len(table))
            self.rows[row, len(table) - 1] = block_id
            self.lengths[row] = len(table)

    def row_indices(self, seq_ids) -> np.ndarray:
        """Each sequence's row (seq_ids: any iterable of ints)."""
        return np.fromiter(map(self.row_of.__getitem__, seq_ids), dtype=np.int64)

    def padded(self, rows: np.ndarray) -> np.ndarray:
        """The tables of those rows as one [len(rows), longest] int32 array, padded with 0."""
        width = int(self.lengths[rows].max()) if len(rows) else 0
        return self.rows[rows, :max(width, 1)]

    def _new_row(self) -> int:
        if not self._free_rows:  # twice the rows: the new ones (all but row 0 are in use) free
            old = len(self.rows)
            self.rows = np.concatenate([self.rows, np.zeros_like(self.rows)])
            self.lengths = np.concatenate([self.lengths, np.zeros_like(self.lengths)])
            self._free_rows = list(range(2 * old - 1, old - 1, -1))
        return self._free_rows.pop()

    def _fit(self, length: int) -> None:
        """Room for a table of length blocks in every row."""
        width = self.rows.shape[1]
        if length > width:
            self.rows = np.concatenate([self.rows, np.zeros((len(self.rows), max(length, 2 * width) - width),
                                                            dtype=np.int32)], axis=1)
