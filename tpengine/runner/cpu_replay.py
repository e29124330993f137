"""Decode steps replayed on the CPU without the model's Python: one recorded forward per row bucket.

At small batches a CPU decode forward's Python (module calls, attribute reads, checks, op wrappers) costs about
150 µs a layer on a 2-core EPYC: 4.5 ms of a 32 ms Qwen3-0.6B int8 step. The first decode step of each row bucket
runs its forward under a recorder (a TorchDispatchMode) that keeps every op the forward dispatched with its
arguments; later steps of the bucket copy their inputs into the same static buffers and call those ops again, in
order, each op's outputs standing in for the recorded ones in the arguments of the ops after it. What CUDA graphs
do on a GPU, without a graph: the ops still run one by one, but none of the model's Python does. The ops are called
from C++ (kernels/cpu/op_replay.cpp: their boxed arguments converted once, at the recording, and the GIL released
for the whole forward), or from Python where that is not built.

A recording is only as good as the forward is a fixed function of its input tensors. So a bucket is replayed only
when every op the forward dispatched is one that computes from tensors alone (RECORDABLE: tpengine's own ops and
aten's views, allocations and arithmetic; no op that hands a value back to Python); otherwise that bucket stays
eager. What the recorder cannot see, Python reading a tensor's values without an op (`tolist()`), the caller rules
out: replays run on one pipeline stage, for models without experts (their routing groups tokens in Python), with an
attention backend whose decode reads only tensors. At tp > 1 every rank records and replays the same steps, and
the all-reduce is recorded as a host call (parallel_state.py) whose Python runs again at each replay, between the
ops before and after it.
"""
import logging

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _pop_mode_temporarily

from tpengine.attention.metadata import AttentionMetadata
from tpengine.kernels.cpu import op_replay

logger = logging.getLogger("tpengine")

# Ops a recorded decode forward may contain: tpengine's (the CPU platform's fused ops, linears and attention) and
# oneDNN's packed linear, and aten ops that compute from tensors alone
RECORDABLE_NAMESPACES = ("tpengine_", "mkldnn")
RECORDABLE_ATEN = frozenset({
    "empty", "empty_like", "zeros", "zeros_like", "detach", "alias", "view", "_unsafe_view", "reshape", "flatten",
    "split", "split_with_sizes", "chunk", "slice", "select", "narrow", "unsqueeze", "squeeze", "t", "transpose",
    "permute", "expand", "contiguous", "clone", "copy_", "to", "_to_copy", "cat", "stack", "add", "add_", "sub", "mul",
    "mul_", "div", "neg", "tanh", "exp", "rsqrt", "pow", "mean", "silu", "gelu", "linear", "addmm", "mm", "matmul",
    "bmm", "embedding", "index_select", "fill_", "zero_",
    # quantizing a row per token (quantization/weights.py quantize_per_token: a GGUF K-quant's minimum sums)
    "abs", "amax", "round", "clamp", "clamp_", "ones_like",
    # masks computed and applied elementwise (a vocabulary-parallel embedding's rows of other ranks); never a mask
    # that picks elements (nonzero, masked_select, boolean indexing: their shapes come from the values)
    "eq", "ne", "lt", "le", "gt", "ge", "__and__", "__or__", "bitwise_and", "bitwise_or", "bitwise_not",
    "logical_and", "logical_or", "logical_not", "where", "masked_fill", "masked_fill_",
})


def recordable(op) -> bool:
    namespace, name = op.namespace, op._schema.name.split("::")[-1]
    return namespace.startswith(RECORDABLE_NAMESPACES) or namespace == "aten" and name in RECORDABLE_ATEN


class _Recorder(TorchDispatchMode):
    """Every op dispatched inside it, with its arguments and outputs, in order; and the host calls made in it."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # torch's documented opt-out: it never runs under torch.compile, so no dynamo-disable wrapper, whose first
        # call imports torch._dynamo (1.5-2 s on a first request or at start-up)
        return False

    def __init__(self):
        super().__init__()
        self.calls = []
        self.host_calls = []  # (how many ops came before it, fn, the tensor it takes)

    def __torch_dispatch__(self, op, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        outputs = op(*args, **kwargs)
        self.calls.append((op, args, kwargs, outputs))
        return outputs

    def record_host_call(self, fn, tensor: torch.Tensor) -> None:
        """Call fn(tensor) now, outside the recording, and again at each replay with that replay's tensor in its
        place: a collective whose Python (parallel_state.py's all-reduce) must run every time."""
        with _pop_mode_temporarily():
            fn(tensor)
        self.host_calls.append((len(self.calls), fn, tensor))


class _Replay:
    """A recorded forward as a list of ops: each op's arguments with the tensors earlier ops produced left as slots
    that the replay fills with this run's outputs; every other argument (weights, caches, static buffers) as
    recorded."""

    def __init__(self, calls: list, host_calls: list, result: torch.Tensor):
        # id of a recorded output -> its slot, a new one for every output (an op may return its input: to(),
        # flatten() of a vector); the recorded tensors live until this returns, so no id is reused
        slot_of, self.num_slots = {}, 0
        self.ops, recorded = [], []
        # per host call: how many ops of self.ops / of the program run before it, the call, its tensor's slot
        self.host_calls, pending = [], list(reversed(host_calls))
        for index, (op, args, kwargs, outputs) in enumerate(calls):
            while pending and pending[-1][0] == index:
                self._add_host_call(pending.pop(), slot_of, len(recorded))
            if op is torch.ops.aten.detach.default:  # only autograd tells a detached tensor from its source
                if id(args[0]) in slot_of:
                    slot_of[id(outputs)] = slot_of[id(args[0])]
                continue  # a constant's: the constant serves in its place
            template, slots = list(args), []
            for position, arg in enumerate(args):
                if isinstance(arg, torch.Tensor) and id(arg) in slot_of:
                    slots.append((position, slot_of[id(arg)]))
                    template[position] = None
                elif isinstance(arg, (list, tuple)) and any(id(a) in slot_of for a in arg
                                                            if isinstance(a, torch.Tensor)):
                    raise _NotReplayable(f"{op} takes a list of computed tensors")
            if any(isinstance(value, torch.Tensor) and id(value) in slot_of for value in kwargs.values()):
                raise _NotReplayable(f"{op} takes a computed tensor by keyword")
            several = isinstance(outputs, (list, tuple))
            output_slots = []
            for output in outputs if several else (outputs,):
                if isinstance(output, torch.Tensor):
                    slot_of[id(output)] = self.num_slots
                    output_slots.append(self.num_slots)
                    self.num_slots += 1
                else:
                    output_slots.append(None)
            # OpOverload's C++ callable: its __call__ only forwards to it
            self.ops.append((getattr(op, "_op", op), template, slots, output_slots, several, kwargs))
            recorded.append((op, template, kwargs, slots, output_slots))
        for host_call in reversed(pending):  # after the last op
            self._add_host_call(host_call, slot_of, len(recorded))
        if id(result) not in slot_of:
            raise _NotReplayable("the forward's result is no op's output")
        self.result_slot = slot_of[id(result)]
        self.program = _program(recorded) if op_replay.available() else None

    def _add_host_call(self, host_call, slot_of: dict, num_program_ops: int) -> None:
        _, fn, tensor = host_call
        if id(tensor) not in slot_of:
            raise _NotReplayable(f"a host call ({fn.__qualname__}) takes a tensor no op computed")
        self.host_calls.append((num_program_ops, fn, slot_of[id(tensor)]))
        self.ops.append((None, fn, slot_of[id(tensor)], None, None, None))

    def run(self) -> torch.Tensor:
        program = self.program
        if program is not None:
            if not self.host_calls:
                return program.run(self.result_slot)
            program.start()
            for num_ops, fn, slot in self.host_calls:
                fn(program.run_to(num_ops, slot))
            return program.finish(self.result_slot)
        values = [None] * self.num_slots
        for op, template, slots, output_slots, several, kwargs in self.ops:
            if op is None:  # a host call: template is its function, slots its tensor's slot
                template(values[slots])
                continue
            args = template
            if slots:
                args = template.copy()
                for position, slot in slots:
                    args[position] = values[slot]
            outputs = op(*args, **kwargs)
            if several:
                for slot, output in zip(output_slots, outputs):
                    if slot is not None:
                        values[slot] = output
            elif output_slots[0] is not None:
                values[output_slots[0]] = outputs
        return values[self.result_slot]


# A boxed call takes these as ints (c10's MemoryFormat and Layout enums); Python's conversion has no rule for them
_ENUM_VALUES = {torch.contiguous_format: 0, torch.preserve_format: 1, torch.channels_last: 2,
                torch.channels_last_3d: 3, torch.strided: 0, torch.sparse_coo: 1}


def _boxable(argument):
    # what Python's conversion to a boxed argument can type: lists for tuples, ints for enums, a marker for []
    if isinstance(argument, (torch.memory_format, torch.layout)):
        return _ENUM_VALUES[argument]
    if isinstance(argument, (list, tuple)):
        return [_boxable(a) for a in argument] if argument else op_replay.EMPTY_LIST
    return argument


def _program(recorded: list):
    """The recorded ops as an OpReplay (kernels/cpu/op_replay.py), called from C++; None (with a log line) where
    an argument does not convert, so the ops are called from Python."""
    program = op_replay.new_program()
    try:
        for op, template, kwargs, slots, output_slots in recorded:
            schema = op._schema
            arguments = []  # every argument in the schema's order, as a boxed call takes them
            for position, argument in enumerate(schema.arguments):
                if position < len(template):
                    arguments.append(template[position])
                elif argument.name in kwargs:
                    arguments.append(kwargs[argument.name])
                else:
                    assert argument.has_default_value(), f"{op} was called without its argument {argument.name}"
                    arguments.append(argument.default_value)
            arguments = [_boxable(argument) for argument in arguments]
            returns_list = len(schema.returns) == 1 and str(schema.returns[0].type) == "List[Tensor]"
            outputs = [-1 if s is None else s for s in output_slots] if schema.returns else []
            program.add(schema.name, schema.overload_name or "default", arguments, [p for p, _ in slots],
                        [s for _, s in slots], outputs, returns_list)
    except RuntimeError as error:
        logger.info("replayed ops are called from Python: %s", error)
        return None
    return program


class _NotReplayable(Exception):
    pass


class DecodeCpuReplays:
    """Decode forwards of `model` replayed per row bucket (the CPU pads a decode batch to one: platforms/cpu.py's
    row_bucket), over static input buffers; run() records a bucket's first forward."""

    def __init__(self, model: torch.nn.Module, max_num_rows: int, max_num_blocks_per_seq: int, block_size: int):
        self.model = model
        self.max_num_rows, self.max_num_blocks_per_seq = max_num_rows, max_num_blocks_per_seq
        self.max_seqlen_k = max_num_blocks_per_seq * block_size
        # replays read these tensors: run() only copies into them
        self.input_ids = torch.zeros(max_num_rows, dtype=torch.int64)
        self.positions = torch.zeros(max_num_rows, dtype=torch.int64)
        self.slot_mapping = torch.full((max_num_rows,), -1, dtype=torch.int64)
        self.context_lens = torch.zeros(max_num_rows, dtype=torch.int32)
        self.block_tables = torch.zeros(max_num_rows, max_num_blocks_per_seq, dtype=torch.int32)
        self.replays: dict[int, _Replay | None] = {}  # None: this bucket's forward runs eagerly

    def can_run(self, num_rows: int, block_table_width: int) -> bool:
        return (num_rows <= self.max_num_rows and block_table_width <= self.max_num_blocks_per_seq
                and self.replays.get(num_rows, True) is not None)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The decode forward's hidden states [rows, hidden]: input_ids' rows are already a bucket's."""
        n, width = input_ids.size(0), meta.block_tables.size(1)
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.context_lens[:n].copy_(meta.context_lens)
        self.block_tables[:n, :width].copy_(meta.block_tables)
        replay = self.replays.get(n)
        if replay is not None:
            return replay.run()
        static_meta = AttentionMetadata(is_prefill=False, slot_mapping=self.slot_mapping[:n],
                                        block_tables=self.block_tables[:n], context_lens=self.context_lens[:n],
                                        max_seqlen_k=self.max_seqlen_k)
        recorder = _Recorder()
        with recorder:
            hidden_states = self.model(self.input_ids[:n], self.positions[:n], static_meta)
        try:
            unrecordable = sorted({str(op) for op, *_ in recorder.calls if not recordable(op)})
            if unrecordable:
                raise _NotReplayable(f"ops that may read values into Python: {', '.join(unrecordable)}")
            self.replays[n] = _Replay(recorder.calls, recorder.host_calls, hidden_states)
        except _NotReplayable as reason:
            logger.info("decode steps of %d rows run eagerly: %s", n, reason)
            self.replays[n] = None
        return hidden_states
