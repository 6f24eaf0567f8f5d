#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>

#include "fixtures.h"
#include "runtime/error.h"
#include "runtime/io/safetensors.h"

namespace libpipe {
namespace {

std::string temp_path(const std::string& name) { return ::testing::TempDir() + name; }

// Writes a file with a raw header (and `data_bytes` zero bytes after it).
std::string write_raw(const std::string& name, const std::string& header, size_t data_bytes,
                      uint64_t declared_len = UINT64_MAX) {
  std::string path = temp_path(name);
  std::ofstream out(path, std::ios::binary);
  uint64_t len = declared_len == UINT64_MAX ? header.size() : declared_len;
  for (int i = 0; i < 8; ++i) out.put(static_cast<char>(len >> (8 * i)));
  out << header << std::string(data_bytes, '\0');
  return path;
}

using test::status_of;

TEST(Safetensors, RoundTripsDtypesShapesAndOrder) {
  std::vector<NamedTensor> tensors = {
      {"b_float", at::randn({3, 4})},
      {"a_half", at::randn({2, 5}).to(at::kHalf)},
      {"bf16", at::randn({7}).to(at::kBFloat16)},
      {"ints", at::arange(10, at::kLong).reshape({2, 5})},
      {"flags", at::rand({4}) > 0.5},
      {"scalar", at::scalar_tensor(3.5, at::kDouble)},
      {"empty", at::empty({0, 3})},
      {"strided", at::randn({4, 6}).t()},  // non-contiguous input is written contiguous
  };
  const std::string path = temp_path("roundtrip.safetensors");
  io::write_safetensors(path, tensors);
  auto back = io::read_safetensors(path);
  ASSERT_EQ(back.size(), tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    EXPECT_EQ(back[i].name, tensors[i].name) << "file order is kept";
    EXPECT_EQ(back[i].tensor.scalar_type(), tensors[i].tensor.scalar_type()) << tensors[i].name;
    EXPECT_TRUE(at::equal(back[i].tensor, tensors[i].tensor)) << tensors[i].name;
  }
}

TEST(Safetensors, ReadsFilesWrittenByTheReferenceImplementation) {
  auto tensors = io::read_safetensors(test::fixture("example_code.inputs.safetensors"));
  ASSERT_EQ(tensors.size(), 2u);
  for (const auto& t : tensors) {
    EXPECT_TRUE(t.name == "x" || t.name == "y");
    EXPECT_EQ(t.tensor.sizes(), at::IntArrayRef({16, 512}));
    EXPECT_EQ(t.tensor.scalar_type(), at::kFloat);
  }
}

TEST(Safetensors, MissingFileIsNotFound) {
  std::string msg;
  EXPECT_EQ(status_of([] { io::read_safetensors("/nonexistent/in.safetensors"); }, &msg), Status::NotFound);
  EXPECT_NE(msg.find("/nonexistent/in.safetensors"), std::string::npos);
}

struct BadFile {
  const char* what;
  std::string header;
  size_t data_bytes;
  uint64_t declared_len;
  const char* expected_message;
};

void PrintTo(const BadFile& b, std::ostream* os) { *os << b.what; }

class MalformedSafetensors : public ::testing::TestWithParam<BadFile> {};

TEST_P(MalformedSafetensors, IsRefusedWithAMessageNamingTheProblem) {
  const BadFile& bad = GetParam();
  const std::string path =
      write_raw(std::string("bad_") + bad.what + ".safetensors", bad.header, bad.data_bytes, bad.declared_len);
  std::string msg;
  EXPECT_EQ(status_of([&] { io::read_safetensors(path); }, &msg), Status::InvalidFormat) << bad.what;
  EXPECT_NE(msg.find(bad.expected_message), std::string::npos) << bad.what << ": " << msg;
}

INSTANTIATE_TEST_SUITE_P(
    Cases, MalformedSafetensors,
    ::testing::Values(
        BadFile{"absurd_header_length", "{}", 0, 1ull << 40, "declares a"},
        BadFile{"not_json", "{not json", 0, UINT64_MAX, "not valid JSON"},
        BadFile{"not_object", "[1,2]", 0, UINT64_MAX, "not a JSON object"},
        BadFile{"unknown_dtype", R"({"t":{"dtype":"F33","shape":[1],"data_offsets":[0,4]}})", 4, UINT64_MAX,
                "unknown dtype 'F33'"},
        BadFile{"offsets_out_of_range", R"({"t":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})", 8, UINT64_MAX,
                "beyond the 8-byte data section"},
        BadFile{"bytes_disagree_with_shape", R"({"t":{"dtype":"F32","shape":[3],"data_offsets":[0,16]}})", 16,
                UINT64_MAX, "has 16 bytes but its dtype and shape need 3 x 4"},
        BadFile{
            "overlapping",
            R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
            12, UINT64_MAX, "overlap"},
        BadFile{"negative_shape", R"({"t":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}})", 4, UINT64_MAX,
                "non-negative"},
        BadFile{"begin_after_end", R"({"t":{"dtype":"F32","shape":[0],"data_offsets":[8,4]}})", 8, UINT64_MAX,
                "begin after end"},
        BadFile{"missing_offsets", R"({"t":{"dtype":"F32","shape":[1]}})", 4, UINT64_MAX, "data_offsets"},
        BadFile{"huge_shape",
                R"({"t":{"dtype":"F32","shape":[4294967296,4294967296,4294967296],"data_offsets":[0,4]}})", 4,
                UINT64_MAX, "too large"}),
    [](const auto& info) { return std::string(info.param.what); });

TEST(Safetensors, ShorterThanTheLengthFieldIsRefused) {
  const std::string path = temp_path("tiny.safetensors");
  std::ofstream(path, std::ios::binary) << "abc";
  std::string msg;
  EXPECT_EQ(status_of([&] { io::read_safetensors(path); }, &msg), Status::InvalidFormat);
  EXPECT_NE(msg.find("shorter than the 8-byte header length"), std::string::npos) << msg;
}

TEST(Safetensors, WriteRefusesDuplicateNamesAndLeavesNoFile) {
  const std::string path = temp_path("dup.safetensors");
  std::remove(path.c_str());
  std::string msg;
  EXPECT_EQ(status_of([&] { io::write_safetensors(path, {{"a", at::ones({1})}, {"a", at::ones({1})}}); }, &msg),
            Status::InvalidArgument);
  EXPECT_NE(msg.find("appears twice"), std::string::npos);
  EXPECT_FALSE(std::ifstream(path).good());
}

TEST(Safetensors, WriteIntoMissingDirectoryIsAnIoError) {
  EXPECT_EQ(status_of([] { io::write_safetensors("/nonexistent/dir/out.safetensors", {{"a", at::ones({1})}}); }),
            Status::Io);
}

}  // namespace
}  // namespace libpipe
