// Which device each stage runs on, from the user's words: "" (every stage on the CPU), "auto"
// (in one process the visible GPUs in order, contiguous groups of stages per GPU; the CPU when there
// is none; across processes each process's own GPU, schedule/rank_device.h), a
// single device for every stage ("cuda:0"), or one device per stage ("cpu,cuda:0,cuda:1").
#pragma once

#include <c10/core/Device.h>

#include <string>
#include <vector>

namespace libpipe::device {

// One device per stage. Throws Error(InvalidArgument) for a malformed list or one whose length
// is neither 1 nor `num_stages`, and Error(Unsupported) naming the stage and the device for a
// device this machine does not have (checked here, before any stage is built).
std::vector<c10::Device> stage_devices(const std::string& spec, size_t num_stages);

// Whether `spec` asks for "auto" (across processes each process then takes its own GPU instead:
// schedule/rank_device.h).
bool is_auto(const std::string& spec);

// "cpu,cuda:0": the inverse of stage_devices for an explicit list.
std::string describe(const std::vector<c10::Device>& devices);

}  // namespace libpipe::device
