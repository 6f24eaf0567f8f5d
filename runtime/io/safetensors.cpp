#include "runtime/io/safetensors.h"

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <limits>

#include "runtime/error.h"

namespace libpipe::io {
namespace {

using Json = nlohmann::ordered_json;

// Headers beyond this are refused before allocating: real checkpoints have headers of a few MB,
// and the reference implementation uses the same bound.
constexpr uint64_t kMaxHeaderBytes = 100u * 1024u * 1024u;

struct DtypeName {
  const char* name;
  at::ScalarType type;
};

constexpr DtypeName kDtypes[] = {
    {"F64", at::kDouble},
    {"F32", at::kFloat},
    {"F16", at::kHalf},
    {"BF16", at::kBFloat16},
    {"I64", at::kLong},
    {"I32", at::kInt},
    {"I16", at::kShort},
    {"I8", at::kChar},
    {"U8", at::kByte},
    {"BOOL", at::kBool},
    {"U16", at::kUInt16},
    {"U32", at::kUInt32},
    {"U64", at::kUInt64},
    {"F8_E4M3", at::kFloat8_e4m3fn},
    {"F8_E5M2", at::kFloat8_e5m2},
};

[[noreturn]] void bad(const std::string& what) { throw Error(Status::InvalidFormat, "malformed safetensors: " + what); }

at::ScalarType dtype_from_name(const std::string& entry, const std::string& name) {
  for (const auto& d : kDtypes)
    if (name == d.name) return d.type;
  bad("tensor '" + entry + "' has unknown dtype '" + name + "'");
}

const char* dtype_name(at::ScalarType type) {
  for (const auto& d : kDtypes)
    if (type == d.type) return d.name;
  throw Error(Status::Unsupported, std::string("cannot write dtype ") + c10::toString(type) + " to safetensors");
}

uint64_t read_u64_le(const unsigned char* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

}  // namespace

std::vector<TensorEntry> parse_safetensors_header(const std::string& header_json, uint64_t data_size) {
  Json header;
  try {
    header = Json::parse(header_json);
  } catch (const Json::exception& e) {
    bad(std::string("header is not valid JSON (") + e.what() + ")");
  }
  if (!header.is_object()) bad("header is not a JSON object");

  std::vector<TensorEntry> entries;
  for (auto it = header.begin(); it != header.end(); ++it) {
    const std::string& name = it.key();
    const Json& v = it.value();
    if (name == "__metadata__") {
      if (!v.is_object()) bad("__metadata__ is not an object");
      for (const auto& m : v.items())
        if (!m.value().is_string()) bad("__metadata__ value '" + m.key() + "' is not a string");
      continue;
    }
    if (!v.is_object()) bad("entry '" + name + "' is not an object");
    if (!v.contains("dtype") || !v["dtype"].is_string()) bad("tensor '" + name + "' has no dtype");
    if (!v.contains("shape") || !v["shape"].is_array()) bad("tensor '" + name + "' has no shape");
    if (!v.contains("data_offsets") || !v["data_offsets"].is_array() || v["data_offsets"].size() != 2)
      bad("tensor '" + name + "' has no data_offsets [begin, end]");

    TensorEntry e;
    e.name = name;
    e.dtype = dtype_from_name(name, v["dtype"].get<std::string>());
    uint64_t numel = 1;
    for (const Json& d : v["shape"]) {
      if (!d.is_number_unsigned() && !(d.is_number_integer() && d.get<int64_t>() >= 0))
        bad("tensor '" + name + "' has a shape entry that is not a non-negative integer");
      uint64_t dim = d.get<uint64_t>();
      if (dim > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()) ||
          (dim != 0 && numel > std::numeric_limits<uint64_t>::max() / dim))
        bad("tensor '" + name + "' has a shape too large to address");
      numel *= dim;
      e.shape.push_back(static_cast<int64_t>(dim));
    }
    for (const Json& o : v["data_offsets"])
      if (!o.is_number_unsigned() && !(o.is_number_integer() && o.get<int64_t>() >= 0))
        bad("tensor '" + name + "' has data_offsets that are not non-negative integers");
    e.begin = v["data_offsets"][0].get<uint64_t>();
    e.end = v["data_offsets"][1].get<uint64_t>();
    if (e.begin > e.end) bad("tensor '" + name + "' has data_offsets with begin after end");
    if (e.end > data_size)
      bad("tensor '" + name + "' has data_offsets [" + std::to_string(e.begin) + ", " + std::to_string(e.end) +
          "] beyond the " + std::to_string(data_size) + "-byte data section (truncated file?)");
    const uint64_t elem = c10::elementSize(e.dtype);
    if (numel > std::numeric_limits<uint64_t>::max() / elem || numel * elem != e.end - e.begin)
      bad("tensor '" + name + "' has " + std::to_string(e.end - e.begin) + " bytes but its dtype and shape need " +
          std::to_string(numel) + " x " + std::to_string(elem));
    entries.push_back(std::move(e));
  }

  std::vector<const TensorEntry*> by_offset;
  for (const auto& e : entries) by_offset.push_back(&e);
  std::sort(by_offset.begin(), by_offset.end(),
            [](const TensorEntry* a, const TensorEntry* b) { return a->begin < b->begin; });
  for (size_t i = 1; i < by_offset.size(); ++i)
    if (by_offset[i]->begin < by_offset[i - 1]->end)
      bad("tensors '" + by_offset[i - 1]->name + "' and '" + by_offset[i]->name + "' overlap in the data section");
  return entries;
}

std::vector<NamedTensor> read_safetensors(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw Error(Status::NotFound, "cannot open safetensors file '" + path + "'");
  in.seekg(0, std::ios::end);
  const auto file_size = static_cast<uint64_t>(in.tellg());
  in.seekg(0);
  if (file_size < 8)
    bad("'" + path + "' is " + std::to_string(file_size) + " bytes, shorter than the 8-byte header length");
  unsigned char len_bytes[8];
  in.read(reinterpret_cast<char*>(len_bytes), 8);
  const uint64_t header_len = read_u64_le(len_bytes);
  if (header_len > kMaxHeaderBytes || header_len > file_size - 8)
    bad("'" + path + "' declares a " + std::to_string(header_len) + "-byte header but the file has " +
        std::to_string(file_size - 8) + " bytes after the length field");
  std::string header(header_len, '\0');
  if (!in.read(header.data(), static_cast<std::streamsize>(header_len)))
    throw Error(Status::Io, "failed reading the header of '" + path + "'");

  const uint64_t data_start = 8 + header_len;
  std::vector<TensorEntry> entries;
  try {
    entries = parse_safetensors_header(header, file_size - data_start);
  } catch (const Error& e) {
    throw Error(e.status(), std::string(e.what()) + " (in '" + path + "')");
  }

  std::vector<NamedTensor> out;
  out.reserve(entries.size());
  for (const auto& e : entries) {
    at::Tensor t = at::empty(e.shape, at::TensorOptions().dtype(e.dtype));
    in.seekg(static_cast<std::streamoff>(data_start + e.begin));
    if (e.end > e.begin && !in.read(static_cast<char*>(t.data_ptr()), static_cast<std::streamsize>(e.end - e.begin)))
      throw Error(Status::Io, "failed reading tensor '" + e.name + "' from '" + path + "'");
    out.push_back({e.name, std::move(t)});
  }
  return out;
}

void write_safetensors(const std::string& path, const std::vector<NamedTensor>& tensors) {
  Json header = Json::object();
  std::vector<at::Tensor> data;
  uint64_t offset = 0;
  for (const auto& nt : tensors) {
    if (nt.name.empty() || nt.name == "__metadata__")
      throw Error(Status::InvalidArgument, "tensor name '" + nt.name + "' cannot be written to safetensors");
    if (header.contains(nt.name)) throw Error(Status::InvalidArgument, "tensor name '" + nt.name + "' appears twice");
    if (!nt.tensor.defined()) throw Error(Status::InvalidArgument, "tensor '" + nt.name + "' holds no data");
    at::Tensor t = nt.tensor.to(at::kCPU).contiguous();
    const uint64_t bytes = t.numel() * t.element_size();
    header[nt.name] = {
        {"dtype", dtype_name(t.scalar_type())}, {"shape", t.sizes().vec()}, {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
    data.push_back(std::move(t));
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // keeps the data section 8-byte aligned

  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    if (!out) throw Error(Status::Io, "cannot create '" + tmp + "' (does the directory exist?)");
    unsigned char len_bytes[8];
    uint64_t n = text.size();
    for (int i = 0; i < 8; ++i) len_bytes[i] = static_cast<unsigned char>(n >> (8 * i));
    out.write(reinterpret_cast<const char*>(len_bytes), 8);
    out.write(text.data(), static_cast<std::streamsize>(text.size()));
    for (const auto& t : data)
      out.write(static_cast<const char*>(t.data_ptr()), static_cast<std::streamsize>(t.numel() * t.element_size()));
    out.flush();
    if (!out) {
      std::remove(tmp.c_str());
      throw Error(Status::Io, "failed writing '" + tmp + "' (disk full?)");
    }
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    std::remove(tmp.c_str());
    throw Error(Status::Io, "cannot rename '" + tmp + "' to '" + path + "'");
  }
}

}  // namespace libpipe::io
