"""Everything rank 0 sends its workers, as declared msgspec structs (array-like: no field names on the wire)."""
import msgspec
import msgspec.msgpack

from tpengine.config import EngineConfig


class PrefillSeq(msgspec.Struct, array_like=True, gc=False):
    token_ids: list[int]        # only the tokens scheduled this step (a chunk, after any cached prefix)
    num_cached_tokens: int      # tokens before the chunk whose K/V is already in the cache
    block_table: list[int]


class DecodeSeq(msgspec.Struct, array_like=True, gc=False):
    last_token: int
    context_len: int            # tokens to attend to, the last one included
    block_table: list[int]


class BlockCopy(msgspec.Struct, array_like=True, gc=False):
    """Copy the first num_tokens K/V rows of block src into block dst (every layer, K and V)."""
    src: int
    dst: int
    num_tokens: int


class StepMessage(msgspec.Struct, array_like=True, gc=False, tag="step"):
    """One forward: its rows are the decode tokens first, then the prefill chunks (either list may be empty)."""
    prefill: list[PrefillSeq]
    decode: list[DecodeSeq]
    # prefix-cache hits that end inside a block: done on every rank before the step's forward
    block_copies: list[BlockCopy] = []
    # when set, every rank samples the rows over its own slice of the vocabulary and rank 0 gets the
    # tokens (no gather of the logits): each row's temperature (0: greedy) and uniform draw
    temperatures: list[float] = []
    uniforms: list[float] = []


class InitMessage(msgspec.Struct, array_like=True, tag="init"):
    config: EngineConfig
    ring_name: str | None       # the SharedMemory ring; None when steps come over a torch.distributed broadcast


class ShutdownMessage(msgspec.Struct, array_like=True, tag="shutdown"):
    pass


class WorkerError(msgspec.Struct, array_like=True, tag="error"):
    rank: int
    traceback: str


ControlMessage = StepMessage | InitMessage | ShutdownMessage


def slim_step(plan) -> StepMessage:
    """What workers need of a StepPlan: prompt chunks in full, decode rows only their last token and
    context length (never the whole token history)."""
    return StepMessage(
        prefill=[PrefillSeq(seq.token_ids[seq.num_cached_tokens:seq.num_cached_tokens + seq.num_scheduled_tokens],
                            seq.num_cached_tokens, seq.block_table) for seq in plan.prefill],
        decode=[DecodeSeq(seq.last_token, seq.num_tokens, seq.block_table) for seq in plan.decode],
        block_copies=[BlockCopy(*copy) for copy in plan.block_copies])


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
