#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "runtime/chunk/microbatch.h"
#include "runtime/error.h"
#include "runtime/log.h"

namespace libpipe {
namespace {

TEST(Microbatch, SplitsUnevenBatchesLikeTensorSplitAsViews) {
  at::Tensor x = at::arange(10 * 3, at::kFloat).reshape({10, 3});
  at::Tensor scale = at::scalar_tensor(2.0);
  auto mbs = chunk::split_inputs({x, scale, c10::IValue(int64_t{7})}, {"x", "scale", "n"}, 4);
  ASSERT_EQ(mbs.size(), 4u);
  const int64_t sizes[] = {3, 3, 2, 2};
  int64_t row = 0;
  for (size_t m = 0; m < 4; ++m) {
    const at::Tensor& part = mbs[m][0].toTensor();
    EXPECT_EQ(part.size(0), sizes[m]);
    EXPECT_TRUE(at::equal(part, x.narrow(0, row, sizes[m])));
    EXPECT_EQ(part.storage().data(), x.storage().data()) << "a view, not a copy";
    row += sizes[m];
    EXPECT_TRUE(mbs[m][1].toTensor().is_same(scale)) << "0-d tensors are replicated";
    EXPECT_EQ(mbs[m][2].toInt(), 7) << "non-tensors are replicated";
  }
}

TEST(Microbatch, DisagreeingBatchSizesNameTheInputs) {
  try {
    chunk::split_inputs({at::ones({4, 2}), at::ones({5, 2})}, {"x", "y"}, 2);
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.status(), Status::Input);
    EXPECT_NE(std::string(e.what()).find("input 'y' has 5 rows"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("input 'x' has 4"), std::string::npos) << e.what();
  }
}

TEST(Microbatch, ZeroMicrobatchesIsAnInvalidArgument) {
  try {
    chunk::split_inputs({at::ones({4})}, {"x"}, 0);
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.status(), Status::InvalidArgument);
  }
}

std::vector<std::string> g_warnings;
void record(void*, int32_t level, const char* message) {
  if (level == log::Warning) g_warnings.push_back(message);
}

TEST(Microbatch, SmallBatchRunsWithFewerMicrobatchesAndWarns) {
  g_warnings.clear();
  log::set_sink(&record, nullptr, log::Warning);
  auto mbs = chunk::split_inputs({at::ones({2, 3})}, {"x"}, 8);
  log::set_sink(nullptr, nullptr, log::Warning);
  EXPECT_EQ(mbs.size(), 2u);
  ASSERT_EQ(g_warnings.size(), 1u);
  EXPECT_NE(g_warnings[0].find("running 2 micro-batches"), std::string::npos) << g_warnings[0];
}

TEST(Microbatch, FlattenNamesTuplesListsAndDicts) {
  c10::impl::GenericDict dict(c10::StringType::get(), c10::TensorType::get());
  dict.insert("logits", at::ones({1}));
  c10::IValue nested =
      c10::ivalue::Tuple::create({at::ones({1}), dict, c10::List<at::Tensor>({at::ones({1}), at::ones({1})})});
  std::vector<std::string> names;
  for (const auto& t : chunk::flatten_output(nested)) names.push_back(t.name);
  EXPECT_EQ(names, (std::vector<std::string>{"output.0", "output.1.logits", "output.2.0", "output.2.1"}));
  EXPECT_EQ(chunk::flatten_output(at::ones({1}))[0].name, "output");
}

TEST(Microbatch, NonTensorOutputIsUnsupported) {
  try {
    chunk::flatten_output(c10::ivalue::Tuple::create({at::ones({1}), c10::IValue(3.5)}));
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.status(), Status::Unsupported);
    EXPECT_NE(std::string(e.what()).find("output 'output.1' is a Double"), std::string::npos) << e.what();
  }
}

TEST(Microbatch, MergeConcatenatesAlongDimZero) {
  at::Tensor a = at::randn({3, 4}), b = at::randn({2, 4});
  auto merged = chunk::merge_outputs({c10::ivalue::Tuple::create({a, a * 2}), c10::ivalue::Tuple::create({b, b * 2})});
  ASSERT_EQ(merged.size(), 2u);
  EXPECT_TRUE(at::equal(merged[0].tensor, at::cat({a, b})));
  EXPECT_TRUE(at::equal(merged[1].tensor, at::cat({a * 2, b * 2})));
}

TEST(Microbatch, MergeRefusesZeroDimOutputsOfSeveralMicrobatches) {
  try {
    chunk::merge_outputs({at::scalar_tensor(1.0), at::scalar_tensor(2.0)});
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("0-d tensor"), std::string::npos);
  }
}

}  // namespace
}  // namespace libpipe
