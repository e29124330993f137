"""Everything rank 0 sends its workers, as declared msgspec structs (array-like: no field names on the wire)."""
import struct
from array import array

import msgspec
import msgspec.msgpack

from tpengine.config import EngineConfig


class PrefillChunk(msgspec.Struct, array_like=True, gc=False):
    seq_id: int
    token_ids: list[int]        # only the tokens scheduled this step (a chunk, after any cached prefix)
    num_cached_tokens: int      # tokens before the chunk whose K/V is already in the cache
    sampled: bool               # the chunk reaches the sequence's last token: its last row is sampled
    # a verify row (speculative decoding): the sequence's last token, then this many proposed tokens, every
    # row sampled (the last num_draft_tokens + 1)
    num_draft_tokens: int = 0
    # LongRoPE: every row rotated with the long factors (its sequence passed the pre-training window when it was
    # admitted); decode and verify rows need no flag: theirs is the long set exactly when they attend to more
    # tokens than the window (runner/inputs.py)
    long_rope: bool = False
    # a verify row whose drafts the ranks' draft model makes: the tokens from draft_context_start up to the
    # row's last token whose draft K/V is not written yet (it runs only in steps that draft), written first
    draft_context_start: int = 0
    draft_context: list[int] = []
    lora_slot: int = -1         # the sequence's LoRA adapter slot (-1: the base model alone)
    pooling: "PoolChunk | None" = None  # an embedding request's chunk: its rows are pooled, none sampled
    # prompt logprobs (runner/prompt_logprobs.py): every row scores the prompt token after it; the last row's is
    # next_token (-1: the chunk ends the prompt)
    prompt_logprobs: bool = False
    next_token: int = -1
    # an image model's sequence (tpengine/multimodal/): its rows' M-RoPE positions, [3, rows] int64 row-major
    # (b"": each row's index, all three alike), and the images whose placeholders the chunk overlaps
    positions: bytes = b""
    images: list["ImageChunk"] = []


class ImageChunk(msgspec.Struct, array_like=True, gc=False):
    """One image of a sequence, as its chunks need it: which of the sequence's images it is, where its placeholders
    start in the sequence and how many there are, its grid (t, h, w) in patches and its float32 patch rows (the
    image processor's)."""
    index: int
    offset: int
    num_tokens: int
    grid: list[int]
    pixel_values: bytes


class PoolChunk(msgspec.Struct, array_like=True, gc=False):
    """How rank 0 pools an embedding or classification request's rows (runner/pooler.py): the first `dimensions` of
    the vector kept (0: all), normalized or not; a classifier's logits through their activation (sigmoid for one
    label, else softmax) or not; final: the chunk reaches the prompt's end (the vector is made)."""
    dimensions: int
    normalize: bool
    activation: bool
    final: bool


class BlockTable(msgspec.Struct, array_like=True, gc=False):
    """A sequence's whole block table: logical block i -> physical block id."""
    seq_id: int
    block_ids: list[int]


class LoRALoad(msgspec.Struct, array_like=True, gc=False):
    """Put the PEFT adapter at path (lora_int_id: the ranks keep read adapters by it) into slot, before the step's
    forward."""
    slot: int
    lora_int_id: int
    path: str


class BlockCopy(msgspec.Struct, array_like=True, gc=False):
    """Copy the first num_tokens K/V rows of block src into block dst (every layer, K and V)."""
    src: int
    dst: int
    num_tokens: int


def int_column(values: list[int]) -> bytes:
    """Integers as one packed column of native int64s: the decode rows' fields. A worker reads a column
    straight into an array, where a list would cost an int object per row to decode and another to convert.
    (Every rank runs on one machine: one byte order.)"""
    return struct.pack(f"{len(values)}q", *values)


def int_list(column: bytes) -> list[int]:
    """The integers of an int_column (workers read the column as an array instead: runner/inputs.py)."""
    return array("q", column).tolist()


class StepMessage(msgspec.Struct, array_like=True, gc=False):
    """One forward: its rows are the decode tokens first, then the prefill chunks (either may be empty).

    Every rank keeps the block table of each running sequence between steps (runner/block_tables.py),
    so a step carries only what changed: the tables of sequences that left (finished, aborted or
    preempted) to drop, whole tables of sequences (re)scheduled, and the blocks a running sequence's
    next tokens open. Applied in that order, after cutting the tables whose rejected draft tokens'
    blocks were freed.
    """
    # the decode rows, one int_column each: their sequences, tokens (each its sequence's last) and the tokens
    # each attends to, its own included
    decode_seq_ids: bytes = b""
    decode_tokens: bytes = b""
    decode_context_lens: bytes = b""
    prefill: list[PrefillChunk] = []
    reset_tables: bool = False          # drop every table first (the last step was interrupted)
    # truncated_seq_ids[i]'s table keeps its first truncated_num_blocks[i] blocks (rejected drafts' freed)
    truncated_seq_ids: list[int] = []
    truncated_num_blocks: list[int] = []
    released: list[int] = []            # sequences whose tables every rank drops, before the rest
    new_tables: list[BlockTable] = []
    appended_seq_ids: list[int] = []    # appended_block_ids[i] becomes the last block of appended_seq_ids[i]
    appended_block_ids: list[int] = []
    # prefix-cache hits that end inside a block: done on every rank before the step's forward
    block_copies: list[BlockCopy] = []
    # speculative decoding's draft model, in a step that does not draft: whether it writes its K/V for the
    # step's prompt chunks (False while steps do not draft: each sequence catches up when it next drafts)
    draft_prompts: bool = True
    # pipeline parallelism: which of the steps in flight this is (its virtual engine), the tag of every
    # point-to-point send of its hidden states and tokens
    virtual_engine: int = 0
    # LoRA (engine/lora_slots.py): adapters into their slots before the forward, each decode row's slot (an
    # int_column), when the engine serves adapters
    lora_loads: list[LoRALoad] = []
    decode_lora_slots: bytes = b""
    # an image model's M-RoPE: what each decode row's position adds to its index (an int_column; b"": nothing)
    decode_position_offsets: bytes = b""

    @property
    def num_decode_rows(self) -> int:
        return len(self.decode_seq_ids) // 8

    @property
    def num_rows(self) -> int:
        return self.num_decode_rows + sum(len(chunk.token_ids) for chunk in self.prefill)


class VocabParallelSampling(msgspec.Struct, array_like=True, gc=False):
    """Every rank samples the step's rows over its own slice of the vocabulary and rank 0 gets the tokens (no
    gather of the logits): each row's temperature (0: greedy) and uniform draw (0.0 for greedy rows), and the rows
    a grammar masks (structured outputs) with their token masks: xgrammar's int32 bitmask words over the whole
    vocabulary, row after row (each rank reads its slice's bits)."""
    temperatures: list[float]
    uniforms: list[float]
    masked_rows: list[int] = []
    token_masks: bytes = b""


class StepEnvelope(msgspec.Struct, array_like=True, gc=False, tag="step"):
    """What the ranks get for a step: the scheduler's StepMessage as it made it, and what the executor adds
    (the sampling path it chose for the step)."""
    step: StepMessage
    vocab_parallel: VocabParallelSampling | None = None


class InitMessage(msgspec.Struct, array_like=True, tag="init"):
    config: EngineConfig
    ring_name: str | None       # the SharedMemory ring; None when steps come over a torch.distributed broadcast


class ShutdownMessage(msgspec.Struct, array_like=True, tag="shutdown"):
    pass


class WorkerError(msgspec.Struct, array_like=True, tag="error"):
    rank: int
    traceback: str


ControlMessage = StepEnvelope | InitMessage | ShutdownMessage


_encoder = msgspec.msgpack.Encoder()
_control_decoder = msgspec.msgpack.Decoder(ControlMessage)
_error_decoder = msgspec.msgpack.Decoder(WorkerError)


def encode(message: ControlMessage | WorkerError) -> bytes:
    return _encoder.encode(message)


def encode_error(rank: int, traceback: str, capacity: int) -> bytes:
    """A WorkerError that encodes to at most capacity bytes.

    An overlong traceback loses its middle, cut before encoding so the report stays decodable:
    the head says where it started, the tail holds the exception itself.
    """
    data = encode(WorkerError(rank, traceback))
    excess = len(data) - capacity
    if excess <= 0:
        return data
    text = traceback.encode()
    marker_room = len(b"\n...[%d bytes cut]...\n" % len(text))
    keep = max(0, len(text) - excess - marker_room - 16)  # 16: room for a longer string header
    marker = b"\n...[%d bytes cut]...\n" % (len(text) - keep)
    head, tail = text[:keep // 2], text[len(text) - (keep - keep // 2):] if keep else b""
    shortened = (head + marker + tail).decode(errors="ignore")  # a cut may split a UTF-8 character
    data = encode(WorkerError(rank, shortened))
    assert len(data) <= capacity, "error slot too small for any report"
    return data


def decode_control(data: bytes) -> ControlMessage:
    return _control_decoder.decode(data)


def decode_error(data: bytes) -> WorkerError:
    return _error_decoder.decode(data)
