// Stage placement on this machine, whatever it has: device lists parsed and checked before any
// stage is built, "auto" following the visible GPUs, and a CPU place that leaves CPU values as
// they are (no copies, no events) so that CPU sessions pay nothing for GPU support.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "fixtures.h"
#include "runtime/device/cuda_library.h"
#include "runtime/device/place.h"
#include "runtime/device/placement.h"
#include "runtime/error.h"
#include "runtime/graph/plan.h"
#include "runtime/graph/torchscript/model.h"
#include "runtime/schedule/session.h"

namespace libpipe {
namespace {

using device::stage_devices;
using test::status_of;

const c10::Device cpu(c10::kCPU);

TEST(DevicePlacement, NothingPutsEveryStageOnTheCpu) {
  EXPECT_EQ(stage_devices("", 3), std::vector<c10::Device>(3, cpu));
  EXPECT_EQ(stage_devices("  ", 2), std::vector<c10::Device>(2, cpu));
}

TEST(DevicePlacement, OneDeviceForEveryStageOrOnePerStage) {
  EXPECT_EQ(stage_devices("cpu", 3), std::vector<c10::Device>(3, cpu));
  EXPECT_EQ(stage_devices(" cpu , cpu ", 2), std::vector<c10::Device>(2, cpu));
  EXPECT_EQ(device::describe(stage_devices("cpu,cpu", 2)), "cpu,cpu");
}

TEST(DevicePlacement, MalformedListsAreInvalidArguments) {
  for (const char* spec : {"gpu", "cuda:", "cuda:-1", "cuda:1x", "cpu,,cpu", ",", "CPU", "cuda:0:1"}) {
    std::string msg;
    EXPECT_EQ(status_of([&] { stage_devices(spec, 2); }, &msg), Status::InvalidArgument) << spec;
    EXPECT_NE(msg.find("device"), std::string::npos) << msg;
  }
}

TEST(DevicePlacement, AListOfTheWrongLengthNamesBothCounts) {
  std::string msg;
  EXPECT_EQ(status_of([&] { stage_devices("cpu,cpu,cpu", 2); }, &msg), Status::InvalidArgument);
  EXPECT_NE(msg.find("names 3 devices but the plan has 2 stages"), std::string::npos) << msg;
}

TEST(DevicePlacement, AGpuThatIsNotThereIsUnsupportedNamingTheStage) {
  std::string msg;
  EXPECT_EQ(status_of([&] { stage_devices("cpu,cuda:64", 2); }, &msg), Status::Unsupported);
  EXPECT_NE(msg.find("stage 1 is on cuda:64"), std::string::npos) << msg;
  if (device::cuda_device_count() == 0) {
    EXPECT_EQ(status_of([&] { stage_devices("cuda", 2); }, &msg), Status::Unsupported);
    EXPECT_NE(msg.find("stage 0 is on cuda:0"), std::string::npos) << msg;
  }
}

TEST(DevicePlacement, OtherDeviceTypesAreUnsupported) {
  std::string msg;
  EXPECT_EQ(status_of([&] { device::require_device(c10::Device(c10::kMeta), "input 'x'"); }, &msg),
            Status::Unsupported);
  EXPECT_NE(msg.find("input 'x' is on meta"), std::string::npos) << msg;
}

TEST(DevicePlacement, AutoSpreadsTheStagesOverTheVisibleGpusInOrder) {
  const int gpus = device::cuda_device_count();
  const auto devices = stage_devices("auto", 4);
  ASSERT_EQ(devices.size(), 4u);
  for (size_t s = 0; s < 4; ++s) {
    if (gpus == 0) EXPECT_EQ(devices[s], cpu);
    else EXPECT_EQ(devices[s], c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(s * gpus / 4)));
  }
}

TEST(Place, TheCpuLeavesCpuValuesAsTheyAre) {
  device::Place place;
  EXPECT_FALSE(place.on_gpu());
  EXPECT_EQ(place.mark(), nullptr);
  const at::Tensor a = at::randn({2, 3}), b = at::randn({4});
  std::vector<c10::IValue> values{a, c10::ivalue::Tuple::create({b, c10::IValue(3)}), c10::IValue()};
  place.receive(values, {});
  EXPECT_TRUE(values[0].toTensor().is_same(a));
  EXPECT_TRUE(values[1].toTupleRef().elements()[0].toTensor().is_same(b));
  EXPECT_EQ(values[1].toTupleRef().elements()[1].toInt(), 3);
  EXPECT_TRUE(values[2].isNone());
  EXPECT_TRUE(place.send_to_cpu(values[0]).toTensor().is_same(a));
  EXPECT_FALSE(device::holds_gpu_tensor(values[1]));
}

TEST(DevicePlacement, ASessionPlacedOnTheCpuComputesWhatTheDefaultDoes) {
  auto model = graph::Model::load(test::fixture("example_code.traced.pt"));
  auto plan = graph::Plan::from_markers(model);
  const std::vector<c10::IValue> inputs{at::randn({6, 512}), at::randn({6, 512})};
  schedule::SessionOptions placed;
  placed.num_microbatches = 3;
  placed.devices = "cpu,cpu,cpu,cpu";
  schedule::SessionOptions plain = placed;
  plain.devices.clear();
  schedule::Session a(plan, placed), b(plan, plain);
  EXPECT_EQ(a.devices(), std::vector<c10::Device>(4, cpu));
  EXPECT_TRUE(at::equal(a.run(inputs).at(0).tensor, b.run(inputs).at(0).tensor));
}

}  // namespace
}  // namespace libpipe
