#include "runtime/comm/wire.h"

#include <torch/csrc/jit/serialization/pickle.h>

#include <cstdlib>
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

const Limits& limits() {
  static const Limits l = [] {
    Limits out;
    if (const char* env = std::getenv("LIBPIPE_MAX_MESSAGE_BYTES")) {
      char* end = nullptr;
      const unsigned long long v = std::strtoull(env, &end, 10);
      if (end != env && *end == '\0' && v > 0) out.max_tensor_bytes = v;
    }
    return out;
  }();
  return l;
}

Announced announced(const Preamble& p, const Limits& limits) {
  if (p[kMagicWord] != kMagic) malformed("bad magic number");
  if (p[kTextBytes] < 0 || p[kPickleBytes] < 0 || p[kMetaWords] < 0) malformed("negative sizes");
  // Each below the limit first, so that the sum cannot overflow.
  const auto small = static_cast<uint64_t>(limits.max_small_bytes);
  if (static_cast<uint64_t>(p[kTextBytes]) > small || static_cast<uint64_t>(p[kPickleBytes]) > small ||
      static_cast<uint64_t>(p[kTextBytes]) + static_cast<uint64_t>(p[kPickleBytes]) > small)
    malformed("text and structure of " + std::to_string(p[kTextBytes]) + " + " + std::to_string(p[kPickleBytes]) +
              " bytes, more than the " + std::to_string(limits.max_small_bytes) + " allowed");
  if (static_cast<uint64_t>(p[kMetaWords]) > limits.max_meta_words)
    malformed(std::to_string(p[kMetaWords]) + " words of tensor headers, more than the " +
              std::to_string(limits.max_meta_words) + " allowed");
  return {static_cast<size_t>(p[kMetaWords]), static_cast<size_t>(p[kTextBytes] + p[kPickleBytes])};
}

namespace {

// The dtypes a message may carry: those at::empty makes for a plain dense tensor.
bool travels(c10::ScalarType t) {
  switch (t) {
    case c10::ScalarType::Byte:
    case c10::ScalarType::Char:
    case c10::ScalarType::Short:
    case c10::ScalarType::Int:
    case c10::ScalarType::Long:
    case c10::ScalarType::Half:
    case c10::ScalarType::Float:
    case c10::ScalarType::Double:
    case c10::ScalarType::ComplexHalf:
    case c10::ScalarType::ComplexFloat:
    case c10::ScalarType::ComplexDouble:
    case c10::ScalarType::Bool:
    case c10::ScalarType::BFloat16:
    case c10::ScalarType::UInt16:
    case c10::ScalarType::UInt32:
    case c10::ScalarType::UInt64:
    case c10::ScalarType::Float8_e5m2:
    case c10::ScalarType::Float8_e4m3fn:
    case c10::ScalarType::Float8_e5m2fnuz:
    case c10::ScalarType::Float8_e4m3fnuz: return true;
    default: return false;
  }
}

}  // namespace

std::vector<at::Tensor> allocate(const std::vector<int64_t>& meta, const at::TensorOptions& options,
                                 const Limits& limits) {
  // Every header is checked, and the bytes of all added up, before the first tensor is allocated.
  struct Header {
    c10::ScalarType dtype;
    std::vector<int64_t> sizes;
  };
  std::vector<Header> headers;
  uint64_t total = 0;
  size_t i = 0;
  while (i < meta.size()) {
    if (meta.size() - i < 2) malformed("truncated tensor header");
    const int64_t dtype = meta[i], ndim = meta[i + 1];
    if (dtype < 0 || dtype >= static_cast<int64_t>(c10::ScalarType::NumOptions) ||
        !travels(static_cast<c10::ScalarType>(dtype)))
      malformed("unknown dtype " + std::to_string(dtype));
    if (ndim < 0 || ndim > limits.max_rank || static_cast<uint64_t>(ndim) > meta.size() - i - 2)
      malformed("bad tensor rank " + std::to_string(ndim));
    Header h{static_cast<c10::ScalarType>(dtype),
             std::vector<int64_t>(meta.begin() + static_cast<std::ptrdiff_t>(i + 2),
                                  meta.begin() + static_cast<std::ptrdiff_t>(i + 2 + ndim))};
    uint64_t bytes = c10::elementSize(h.dtype), strided = bytes;
    for (int64_t d : h.sizes) {
      if (d < 0) malformed("negative tensor size");
      // bytes * d, refused once it passes the limit (so it never overflows). `strided` leaves out empty
      // dimensions: an empty tensor's strides are still products of its other sizes, which must not overflow
      // either (a [0, 2^62] tensor holds nothing, and its stride would not fit).
      const uint64_t at_least_one = d > 0 ? static_cast<uint64_t>(d) : 1;
      if (strided > limits.max_tensor_bytes / at_least_one)
        malformed("a tensor of more than " + std::to_string(limits.max_tensor_bytes) + " bytes");
      strided *= at_least_one;
      bytes *= static_cast<uint64_t>(d);
    }
    if (bytes > limits.max_tensor_bytes - total)
      malformed("tensors of more than " + std::to_string(limits.max_tensor_bytes) +
                " bytes in one message (LIBPIPE_MAX_MESSAGE_BYTES)");
    total += bytes;
    headers.push_back(std::move(h));
    i += 2 + static_cast<size_t>(ndim);
  }
  std::vector<at::Tensor> tensors;
  tensors.reserve(headers.size());
  for (const auto& h : headers) {
    try {
      tensors.push_back(at::empty(h.sizes, options.dtype(h.dtype)));
    } catch (const c10::Error& e) {
      malformed(std::string("a tensor of its sizes cannot be made: ") + e.what_without_backtrace());
    }
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
