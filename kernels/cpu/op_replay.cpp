// A recorded list of torch ops, called again from C++: runner/cpu_replay.py's replayed decode forward without a
// Python call per op. Each op's arguments are kept as a boxed stack (the schema's every argument, defaults
// included) converted from Python once; at each run the slots that earlier ops' outputs fill are set, and the op is
// called through the dispatcher. A Python call of an op costs 3-4 µs in argument parsing alone; a boxed call from
// here costs a fraction of that.
#include <ATen/ScalarOps.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/ivalue.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <string>
#include <utility>
#include <vector>

namespace {

// Python's conversion cannot type an empty list: the caller sends this in its place, and the schema says which
const char* const kEmptyList = "<empty list>";

c10::IValue empty_list(const c10::Type& type) {
  const auto* optional = type.castRaw<c10::OptionalType>();
  const auto* list = (optional ? *optional->getElementType() : type).castRaw<c10::ListType>();
  TORCH_CHECK(list != nullptr, "an empty list where the op takes ", type.str());
  const auto& element = list->getElementType();
  switch (element->kind()) {
    case c10::TypeKind::IntType:
    case c10::TypeKind::SymIntType: return c10::List<int64_t>();
    case c10::TypeKind::FloatType: return c10::List<double>();
    case c10::TypeKind::BoolType: return c10::List<bool>();
    case c10::TypeKind::TensorType: return c10::List<at::Tensor>();
    default: return c10::impl::GenericList(element);
  }
}

struct RecordedOp {
  c10::OperatorHandle op;
  std::vector<c10::IValue> arguments;                 // the stack the op is called with, slots left as None
  std::vector<std::pair<int64_t, int64_t>> inputs;    // (argument position, slot) filled before each call
  std::vector<int64_t> outputs;                       // per returned tensor (a returned list's elements), its slot
  bool returns_list;                                  // the op returns one Tensor[]: its elements fill the slots
};

struct OpReplay : torch::CustomClassHolder {
  std::vector<RecordedOp> ops;
  int64_t num_slots = 0;

  // name "aten::view", overload "default" (or ""); arguments: every schema argument in order
  void add(const std::string& name, const std::string& overload, c10::List<c10::IValue> arguments,
           std::vector<int64_t> input_positions, std::vector<int64_t> input_slots, std::vector<int64_t> output_slots,
           bool returns_list) {
    auto handle = c10::Dispatcher::singleton().findSchemaOrThrow(name.c_str(),
                                                                 overload == "default" ? "" : overload.c_str());
    TORCH_CHECK(arguments.size() == handle.schema().arguments().size(), name, ": ", arguments.size(),
                " arguments for a schema of ", handle.schema().arguments().size());
    TORCH_CHECK(input_positions.size() == input_slots.size(), "one slot per input position");
    RecordedOp recorded{handle, {}, {}, std::move(output_slots), returns_list};
    recorded.arguments.reserve(arguments.size());
    const auto& schema_arguments = handle.schema().arguments();
    for (size_t i = 0; i < arguments.size(); ++i) {
      c10::IValue argument = arguments.get(i);
      const c10::Type& type = *schema_arguments[i].type();
      if (argument.isString() && argument.toStringRef() == kEmptyList && type.kind() != c10::TypeKind::StringType)
        argument = empty_list(type);
      if (argument.isScalar() && schema_arguments[i].type()->kind() == c10::TypeKind::TensorType) {
        // a number where the op takes a tensor (x * 2): Python's argument parser makes it a wrapped number, which
        // type promotion treats as a Python scalar
        at::Tensor wrapped = c10::scalar_to_tensor(argument.toScalar());
        wrapped.unsafeGetTensorImpl()->set_wrapped_number(true);
        argument = wrapped;
      }
      recorded.arguments.push_back(std::move(argument));
    }
    for (size_t i = 0; i < input_positions.size(); ++i) {
      TORCH_CHECK(input_positions[i] >= 0 && input_positions[i] < static_cast<int64_t>(arguments.size()));
      TORCH_CHECK(input_slots[i] >= 0 && input_slots[i] < num_slots, "a slot no earlier op fills");
      recorded.inputs.emplace_back(input_positions[i], input_slots[i]);
    }
    for (int64_t slot : recorded.outputs) {
      TORCH_CHECK(slot >= -1, "an output slot is a slot or -1 (not kept)");
      if (slot >= num_slots) num_slots = slot + 1;
    }
    ops.push_back(std::move(recorded));
  }

  // A run in parts, for host calls between ops (a collective's Python): start(), run_to(n, slot) to run the ops
  // up to the n-th and hand over a host call's tensor, finish(result_slot) to run the rest. run() is all of it.
  void start() {
    values_.assign(num_slots, c10::IValue());
    next_ = 0;
  }

  void run_ops(int64_t end) {
    TORCH_CHECK(static_cast<size_t>(end) >= next_ && static_cast<size_t>(end) <= ops.size(), "ops ", next_,
                " to ", end, " of ", ops.size());
    torch::jit::Stack stack;
    for (; next_ < static_cast<size_t>(end); ++next_) {
      const RecordedOp& recorded = ops[next_];
      stack.assign(recorded.arguments.begin(), recorded.arguments.end());
      for (const auto& [position, slot] : recorded.inputs) stack[position] = values_[slot];
      recorded.op.callBoxed(stack);
      if (recorded.returns_list) {
        auto tensors = stack.at(0).toTensorList();
        TORCH_CHECK(tensors.size() == recorded.outputs.size(), "a returned list of another length than recorded");
        for (size_t i = 0; i < tensors.size(); ++i)
          if (recorded.outputs[i] >= 0) values_[recorded.outputs[i]] = tensors.get(i);
      } else {
        TORCH_CHECK(stack.size() == recorded.outputs.size(), "another number of outputs than recorded");
        for (size_t i = 0; i < stack.size(); ++i)
          if (recorded.outputs[i] >= 0) values_[recorded.outputs[i]] = std::move(stack[i]);
      }
    }
  }

  // the ops up to end, then the tensor in slot: a host call's, in one call from Python
  at::Tensor run_to(int64_t end, int64_t slot) {
    run_ops(end);
    return value(slot);
  }

  at::Tensor value(int64_t slot) {
    TORCH_CHECK(slot >= 0 && slot < static_cast<int64_t>(values_.size()) && values_[slot].isTensor(),
                "slot ", slot, " holds no tensor yet");
    return values_[slot].toTensor();
  }

  at::Tensor finish(int64_t result_slot) {
    TORCH_CHECK(result_slot >= 0 && result_slot < num_slots, "no such slot");
    run_ops(static_cast<int64_t>(ops.size()));
    at::Tensor result = values_[result_slot].toTensor();
    values_.clear();  // the intermediate tensors go now, not at the next run
    return result;
  }

  at::Tensor run(int64_t result_slot) {
    start();
    return finish(result_slot);
  }

 private:
  std::vector<c10::IValue> values_;
  size_t next_ = 0;
};

}  // namespace

TORCH_LIBRARY(tpengine_op_replay, m) {
  m.class_<OpReplay>("OpReplay")
      .def(torch::init<>())
      .def("add", &OpReplay::add)
      .def("start", &OpReplay::start)
      .def("run_to", &OpReplay::run_to)
      .def("finish", &OpReplay::finish)
      .def("run", &OpReplay::run);
}
