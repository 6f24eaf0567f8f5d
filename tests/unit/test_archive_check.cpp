// The model file's front door: archives are checked before LibTorch reads them.
#include <gtest/gtest.h>
#include <zip.h>

#include <fstream>
#include <iterator>
#include <string>
#include <utility>
#include <vector>

#include "fixtures.h"
#include "runtime/error.h"
#include "runtime/graph/torchscript/model.h"
#include "runtime/io/archive_check.h"

namespace libpipe {
namespace {

using test::status_of;

std::string read_all(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

std::string write_file(const std::string& name, const std::string& bytes) {
  const std::string path = ::testing::TempDir() + name;
  std::ofstream(path, std::ios::binary) << bytes;
  return path;
}

// A zip holding `entries` (name, contents), written with libzip.
std::string write_zip(const std::string& name, const std::vector<std::pair<std::string, std::string>>& entries) {
  const std::string path = ::testing::TempDir() + name;
  std::remove(path.c_str());
  int err = 0;
  zip_t* z = zip_open(path.c_str(), ZIP_CREATE | ZIP_TRUNCATE, &err);
  EXPECT_NE(z, nullptr);
  for (const auto& [entry, contents] : entries) {
    zip_source_t* src = zip_source_buffer(z, contents.data(), contents.size(), 0);
    EXPECT_GE(zip_file_add(z, entry.c_str(), src, ZIP_FL_OVERWRITE), 0);
  }
  EXPECT_EQ(zip_close(z), 0);
  return path;
}

Status check_file(const std::string& path, std::string* msg) {
  return status_of([&] { io::check_model_archive(path); }, msg);
}

TEST(ArchiveCheck, RealTorchScriptFilesPass) {
  for (const char* name : {"example_code.traced.pt", "example_code.scripted.pt", "slow_loop.scripted.pt"}) {
    std::string msg;
    EXPECT_EQ(check_file(test::fixture(name), &msg), Status::Ok) << name << ": " << msg;
  }
}

TEST(ArchiveCheck, TruncatedModelIsRefusedBeforeLibTorchSeesIt) {
  const std::string whole = read_all(test::fixture("example_code.traced.pt"));
  ASSERT_GT(whole.size(), 1000u);
  for (size_t keep : {whole.size() / 2, whole.size() - 10, size_t{100}}) {
    std::string msg;
    const std::string cut = whole.substr(0, keep);
    EXPECT_EQ(status_of([&] { io::check_model_archive(cut.data(), cut.size(), "cut.pt"); }, &msg),
              Status::InvalidFormat)
        << keep;
    EXPECT_NE(msg.find("damaged"), std::string::npos) << msg;
    EXPECT_NE(msg.find("cut.pt"), std::string::npos) << msg;
  }
  // And through the model loader, with the file's name in the message.
  const std::string path = write_file("truncated.pt", whole.substr(0, whole.size() / 2));
  std::string msg;
  EXPECT_EQ(status_of([&] { graph::Model::load(path); }, &msg), Status::InvalidFormat);
  EXPECT_NE(msg.find("truncated.pt"), std::string::npos) << msg;
}

TEST(ArchiveCheck, NotAZipSaysHowToExport) {
  std::string msg;
  EXPECT_EQ(check_file(write_file("junk.pt", "def forward(x): return x\n"), &msg), Status::InvalidFormat);
  EXPECT_NE(msg.find("not a zip archive"), std::string::npos) << msg;
  EXPECT_NE(msg.find("torch.jit.trace"), std::string::npos) << msg;
  EXPECT_EQ(check_file(write_file("empty.pt", ""), &msg), Status::InvalidFormat);
  EXPECT_EQ(check_file(::testing::TempDir() + "does-not-exist.pt", &msg), Status::NotFound);
}

TEST(ArchiveCheck, TorchSaveFileIsNamedAsSuch) {
  // What torch.save() writes: a zip with data.pkl and tensor data, but no TorchScript code.
  std::string msg;
  const auto path = write_zip(
      "state_dict.pt",
      {{"archive/data.pkl", "\x80\x02}q\x00."}, {"archive/version", "3\n"}, {"archive/data/0", std::string(64, '\0')}});
  EXPECT_EQ(check_file(path, &msg), Status::InvalidFormat);
  EXPECT_NE(msg.find("torch.save()"), std::string::npos) << msg;
}

TEST(ArchiveCheck, ZipsOfOtherShapesAreRefused) {
  std::string msg;
  EXPECT_EQ(check_file(write_zip("two_roots.pt", {{"a/data.pkl", "x"}, {"b/code/m.py", "y"}}), &msg),
            Status::InvalidFormat);
  EXPECT_NE(msg.find("one folder"), std::string::npos) << msg;
  EXPECT_EQ(check_file(write_zip("flat.pt", {{"data.pkl", "x"}}), &msg), Status::InvalidFormat);
  EXPECT_NE(msg.find("top-level folder"), std::string::npos) << msg;
  EXPECT_EQ(check_file(write_zip("no_data.pt", {{"m/code/m.py", "y"}}), &msg), Status::InvalidFormat);
  EXPECT_NE(msg.find("neither m/data.pkl"), std::string::npos) << msg;
}

TEST(ArchiveCheck, CentralDirectoryDisagreeingWithTheEntriesIsRefused) {
  std::string bytes = read_all(test::fixture("example_code.traced.pt"));
  // The first central directory record's pointer to its entry's local header (offset 42 in the
  // record) is moved by one byte: the directory now points into the middle of an entry.
  const size_t record = bytes.find("PK\x01\x02");
  ASSERT_NE(record, std::string::npos);
  bytes[record + 42] = static_cast<char>(bytes[record + 42] + 1);
  std::string msg;
  EXPECT_EQ(status_of([&] { io::check_model_archive(bytes.data(), bytes.size(), "bent.pt"); }, &msg),
            Status::InvalidFormat);
  EXPECT_NE(msg.find("bent.pt"), std::string::npos) << msg;
}

}  // namespace
}  // namespace libpipe
