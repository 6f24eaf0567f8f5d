#include "runtime/libtorch_log.h"

#include <c10/util/Logging.h>

#include <cctype>
#include <iostream>
#include <mutex>
#include <streambuf>
#include <string>

#include "runtime/log.h"

namespace libpipe::log {

namespace {

// "[W1128 09:12:34.567890 123 file.cpp:45] message": a bracket, the severity letter, the month.
bool starts_record(const char* s, std::streamsize n) {
  return n >= 4 && s[0] == '[' && (s[1] == 'I' || s[1] == 'W' || s[1] == 'E' || s[1] == 'F') &&
         std::isdigit(static_cast<unsigned char>(s[2])) && std::isdigit(static_cast<unsigned char>(s[3]));
}

class Filter : public std::streambuf {
 public:
  explicit Filter(std::streambuf* original) : original_(original) {}

 protected:
  std::streamsize xsputn(const char* s, std::streamsize n) override {
    std::string& record = pending();
    // What a log callback writes to std::cerr while a record is delivered passes through as it is, even if it
    // quotes the record: caught again, it would be delivered again, without end.
    if (emitting() || (record.empty() && !starts_record(s, n))) {
      std::lock_guard lock(mutex_);
      return original_->sputn(s, n);
    }
    record.append(s, static_cast<size_t>(n));
    if (!record.empty() && record.back() == '\n') emit(record);
    return n;
  }
  int_type overflow(int_type c) override {
    if (traits_type::eq_int_type(c, traits_type::eof())) return traits_type::not_eof(c);
    const char ch = traits_type::to_char_type(c);
    return xsputn(&ch, 1) == 1 ? c : traits_type::eof();
  }
  int sync() override {
    std::string& record = pending();
    if (!record.empty()) emit(record);
    std::lock_guard lock(mutex_);
    return original_->pubsync();
  }

 private:
  // A record may arrive in several writes from one thread; threads never share one.
  static std::string& pending() {
    thread_local std::string record;
    return record;
  }
  static bool& emitting() {
    thread_local bool active = false;
    return active;
  }
  static void emit(std::string& record) {
    std::string text = std::move(record);
    record.clear();
    while (!text.empty() && (text.back() == '\n' || text.back() == '\r')) text.pop_back();
    // TORCH_WARN's records ("[W... file.cpp:12] Warning: ...") tell the user something about the model;
    // LibTorch's other records are its own notes (nativert lists the operators it has no static
    // kernel for on every load) or describe a failure the caller gets as a status anyway.
    const Level level = text.find("] Warning: ") != std::string::npos ? Warning : Debug;
    emitting() = true;
    try {
      write(level, "LibTorch: " + text);
    } catch (...) {
      emitting() = false;
      throw;
    }
    emitting() = false;
  }

  std::streambuf* original_;
  std::mutex mutex_;
};

std::mutex& level_mutex() {
  static std::mutex m;
  return m;
}

}  // namespace

void raise_libtorch_log_level(int level) {
  std::lock_guard lock(level_mutex());
  if (FLAGS_caffe2_log_level < level) FLAGS_caffe2_log_level = level;
}

LibTorchLogLevelAtMost::LibTorchLogLevelAtMost(int level) {
  level_mutex().lock();
  previous_ = FLAGS_caffe2_log_level;
  if (previous_ > level) FLAGS_caffe2_log_level = level;
}

LibTorchLogLevelAtMost::~LibTorchLogLevelAtMost() {
  FLAGS_caffe2_log_level = previous_;
  level_mutex().unlock();
}

void capture_libtorch_log() {
  static std::once_flag once;
  std::call_once(once, [] {
    // Never destroyed: std::cerr may be written to until the process ends.
    static Filter* filter = new Filter(std::cerr.rdbuf());
    std::cerr.rdbuf(filter);
  });
}

}  // namespace libpipe::log
