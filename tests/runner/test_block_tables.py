"""A rank's block tables as rows of one array: after any sequence of changes, a step's padded table gathered
from the rows equals the lists padded with zeros, however many sequences and blocks came and went."""
import random

import numpy as np
import pytest

from tpengine.distributed.messages import BlockTable, StepMessage
from tpengine.runner.block_tables import BlockTables


def padded_lists(tables: list[list[int]]) -> np.ndarray:
    width = max(len(table) for table in tables)
    return np.array([table + [0] * (width - len(table)) for table in tables], dtype=np.int32)


@pytest.mark.parametrize("seed", range(6))
def test_rows_gathered_for_a_step_equal_the_tables_padded(seed):
    rng = random.Random(seed)
    tables, expected = BlockTables(), {}
    next_id = 0
    for _ in range(300):
        new, released, appended, truncated = [], [], [], []
        reset = rng.random() < 0.02
        if reset:
            expected.clear()
        for seq_id in list(expected):
            roll = rng.random()
            if roll < 0.1:
                released.append(seq_id)
                del expected[seq_id]
            elif roll < 0.2 and len(expected[seq_id]) > 1:
                num_blocks = rng.randint(1, len(expected[seq_id]) - 1)
                truncated.append((seq_id, num_blocks))
                del expected[seq_id][num_blocks:]
        for _ in range(rng.randint(0, 6)):  # up to a few hundred sequences at once: the rows grow
            table = [rng.randrange(10_000) for _ in range(rng.randint(1, 40))]  # and so does their width
            new.append(BlockTable(next_id, list(table)))
            expected[next_id] = table
            next_id += 1
        for seq_id in rng.sample(sorted(expected), min(len(expected), 5)):
            block_id = rng.randrange(10_000)
            appended.append((seq_id, block_id))
            expected[seq_id].append(block_id)
        tables.update(StepMessage(
            reset_tables=reset, released=released, new_tables=new,
            truncated_seq_ids=[s for s, _ in truncated], truncated_num_blocks=[n for _, n in truncated],
            appended_seq_ids=[s for s, _ in appended], appended_block_ids=[b for _, b in appended]))
        assert tables.tables == expected
        if expected:
            step_ids = rng.sample(sorted(expected), rng.randint(1, len(expected)))
            rows = tables.row_indices(step_ids)
            assert np.array_equal(tables.padded(rows), padded_lists([expected[s] for s in step_ids]))
            # padding rows read row 0: an empty table
            with_padding = np.concatenate([rows, np.zeros(3, dtype=np.int64)])
            assert np.array_equal(tables.padded(with_padding),
                                  padded_lists([expected[s] for s in step_ids] + [[0]] * 3))
    assert next_id > 100 and tables.rows.shape[1] > 16
