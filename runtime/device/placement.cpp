#include "runtime/device/placement.h"

#include "runtime/device/cuda_library.h"
#include "runtime/error.h"

namespace libpipe::device {

namespace {

std::string trim(const std::string& s) {
  const size_t b = s.find_first_not_of(" \t");
  if (b == std::string::npos) return "";
  return s.substr(b, s.find_last_not_of(" \t") - b + 1);
}

c10::Device parse_one(const std::string& text, const std::string& spec) {
  const std::string hint =
      "; write one device per stage, each 'cpu', 'cuda' or 'cuda:N', separated by commas "
      "(or 'auto')";
  if (text.empty()) throw Error(Status::InvalidArgument, "the device list '" + spec + "' has an empty entry" + hint);
  if (text == "cpu") return c10::Device(c10::kCPU);
  if (text == "cuda") return c10::Device(c10::kCUDA, 0);
  if (text.rfind("cuda:", 0) == 0) {
    const std::string index = text.substr(5);
    if (!index.empty() && index.size() <= 3 && index.find_first_not_of("0123456789") == std::string::npos)
      return c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(std::stoi(index)));
  }
  throw Error(Status::InvalidArgument, "'" + text + "' in the device list '" + spec + "' is not a device" + hint);
}

}  // namespace

std::vector<c10::Device> stage_devices(const std::string& raw, size_t num_stages) {
  const std::string spec = trim(raw);
  if (spec.empty()) return std::vector<c10::Device>(num_stages, c10::Device(c10::kCPU));
  std::vector<c10::Device> devices;
  if (spec == "auto") {
    const size_t gpus = static_cast<size_t>(cuda_device_count());
    for (size_t s = 0; s < num_stages; ++s)
      devices.push_back(gpus == 0 ? c10::Device(c10::kCPU)
                                  : c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(s * gpus / num_stages)));
    return devices;
  }
  size_t begin = 0;
  for (;;) {
    const size_t comma = spec.find(',', begin);
    devices.push_back(parse_one(trim(spec.substr(begin, comma - begin)), spec));
    if (comma == std::string::npos) break;
    begin = comma + 1;
  }
  if (devices.size() == 1) devices.resize(num_stages, devices[0]);
  if (devices.size() != num_stages)
    throw Error(Status::InvalidArgument, "the device list '" + spec + "' names " + std::to_string(devices.size()) +
                                             " devices but the plan has " + std::to_string(num_stages) +
                                             " stages; give one device per stage, a single device for all of them, "
                                             "or 'auto'");
  for (size_t s = 0; s < num_stages; ++s) require_device(devices[s], "stage " + std::to_string(s));
  return devices;
}

bool is_auto(const std::string& spec) { return trim(spec) == "auto"; }

std::string describe(const std::vector<c10::Device>& devices) {
  std::string text;
  for (const auto& d : devices) text += (text.empty() ? "" : ",") + d.str();
  return text;
}

}  // namespace libpipe::device
