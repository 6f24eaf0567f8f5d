#include "runtime/comm/wire.h"

#include <torch/csrc/jit/serialization/pickle.h>

#include <cstring>

#include "runtime/error.h"

namespace libpipe::comm::wire {

namespace {

// "libpipe" + the format's version in the last byte: a peer of another version is refused
// rather than misread.
constexpr int64_t kMagic = 0x6c69627069706501;

enum Word : size_t { kMagicWord, kKind, kRequest, kMicrobatch, kStatus, kTextBytes, kPickleBytes, kMetaWords };
static_assert(kMetaWords + 1 == kPreambleWords, "preamble layout");

[[noreturn]] void malformed(const std::string& why) {
  throw Error(Status::Communication,
              "a peer sent a malformed message (" + why + "); are all processes running the same libpipe version?");
}

}  // namespace

at::Tensor byte_view(const at::Tensor& tensor) { return tensor.view({-1}).view(at::kByte); }

Frame encode(const Message& message) {
  Frame frame;
  std::vector<at::Tensor> table;
  std::vector<char> pickled;
  if (!message.values.empty()) {
    pickled = torch::jit::pickle(c10::ivalue::Tuple::create(message.values), &table);
  }
  for (auto& t : table) {
    if (t.layout() != at::kStrided || t.is_quantized())
      throw Error(Status::Unsupported,
                  "a " + c10::str(t.layout()) + " tensor cannot be sent between processes; only dense tensors can");
    // A view shares its base's storage: send only the view's own elements.
    t = t.contiguous();
    frame.meta.push_back(static_cast<int64_t>(t.scalar_type()));
    frame.meta.push_back(t.dim());
    for (int64_t d : t.sizes()) frame.meta.push_back(d);
  }
  frame.tensors = std::move(table);
  frame.bytes.resize(message.text.size() + pickled.size());
  if (!message.text.empty()) std::memcpy(frame.bytes.data(), message.text.data(), message.text.size());
  if (!pickled.empty()) std::memcpy(frame.bytes.data() + message.text.size(), pickled.data(), pickled.size());
  frame.preamble = {kMagic,
                    static_cast<int64_t>(message.kind),
                    static_cast<int64_t>(message.request),
                    static_cast<int64_t>(message.microbatch),
                    message.status,
                    static_cast<int64_t>(message.text.size()),
                    static_cast<int64_t>(pickled.size()),
                    static_cast<int64_t>(frame.meta.size())};
  return frame;
}

Announced announced(const Preamble& p) {
  if (p[kMagicWord] != kMagic) malformed("bad magic number");
  if (p[kTextBytes] < 0 || p[kPickleBytes] < 0 || p[kMetaWords] < 0) malformed("negative sizes");
  return {static_cast<size_t>(p[kMetaWords]), static_cast<size_t>(p[kTextBytes] + p[kPickleBytes])};
}

std::vector<at::Tensor> allocate(const std::vector<int64_t>& meta, const at::TensorOptions& options) {
  std::vector<at::Tensor> tensors;
  size_t i = 0;
  while (i < meta.size()) {
    if (i + 2 > meta.size()) malformed("truncated tensor header");
    const int64_t dtype = meta[i], ndim = meta[i + 1];
    if (dtype < 0 || dtype >= static_cast<int64_t>(c10::ScalarType::NumOptions)) malformed("unknown dtype");
    if (ndim < 0 || i + 2 + static_cast<size_t>(ndim) > meta.size()) malformed("bad tensor rank");
    std::vector<int64_t> sizes(meta.begin() + static_cast<std::ptrdiff_t>(i + 2),
                               meta.begin() + static_cast<std::ptrdiff_t>(i + 2 + ndim));
    for (int64_t d : sizes)
      if (d < 0) malformed("negative tensor size");
    tensors.push_back(at::empty(sizes, options.dtype(static_cast<c10::ScalarType>(dtype))));
    i += 2 + static_cast<size_t>(ndim);
  }
  return tensors;
}

Message decode(const Preamble& p, const std::vector<uint8_t>& bytes, std::vector<at::Tensor> tensors) {
  const auto sizes = announced(p);
  if (bytes.size() != sizes.bytes) malformed("payload size differs from its announcement");
  Message message;
  message.kind = static_cast<Kind>(p[kKind]);
  message.request = static_cast<uint64_t>(p[kRequest]);
  message.microbatch = static_cast<uint64_t>(p[kMicrobatch]);
  message.status = static_cast<int32_t>(p[kStatus]);
  const auto text_bytes = static_cast<size_t>(p[kTextBytes]);
  message.text.assign(reinterpret_cast<const char*>(bytes.data()), text_bytes);
  if (p[kPickleBytes] > 0) {
    c10::IValue values;
    try {
      values = torch::jit::unpickle(reinterpret_cast<const char*>(bytes.data()) + text_bytes,
                                    static_cast<size_t>(p[kPickleBytes]), nullptr, tensors);
    } catch (const std::exception& e) {
      malformed(std::string("its values do not unpickle: ") + e.what());
    }
    if (!values.isTuple()) malformed("its values are not a tuple");
    const auto& items = values.toTupleRef().elements();
    message.values.assign(items.begin(), items.end());
  }
  return message;
}

}  // namespace libpipe::comm::wire
