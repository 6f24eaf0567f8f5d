#include "runtime/generate/generation.h"

#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <utility>

namespace libpipe::generate {

namespace {

double ms_between(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double, std::milli>(b - a).count();
}

}  // namespace

Generation::Generation(int64_t prompt_tokens, Clock::time_point submitted, std::function<void()> wake,
                       bool keeps_logprobs, bool keeps_prompt_logprobs)
    : prompt_tokens_(prompt_tokens),
      submitted_(submitted),
      wake_(std::move(wake)),
      keeps_logprobs_(keeps_logprobs),
      keeps_prompt_logprobs_(keeps_prompt_logprobs) {
  if (keeps_prompt_logprobs_) {
    prompt_logprobs_.resize(static_cast<size_t>(prompt_tokens));
    prompt_scored_.assign(static_cast<size_t>(prompt_tokens), false);
  }
}

Generation::~Generation() {
  if (event_fd_ >= 0) ::close(event_fd_);
}

size_t Generation::read(int64_t* tokens, size_t capacity, bool* finished) {
  std::lock_guard lock(mutex_);
  const size_t n = std::min(capacity, tokens_.size() - read_);
  if (n > 0) std::copy_n(tokens_.data() + read_, n, tokens);
  read_ += n;
  const bool ended = reason_ != FinishReason::None;
  if (finished) *finished = ended && read_ == tokens_.size();
  set_fd_locked(read_ < tokens_.size() || ended);
  return n;
}

bool Generation::wait_until(Clock::time_point until) {
  std::unique_lock lock(mutex_);
  return ended_.wait_until(lock, until, [&] { return reason_ != FinishReason::None; });
}

Status Generation::status() {
  std::lock_guard lock(mutex_);
  return status_;
}

std::string Generation::message() {
  std::lock_guard lock(mutex_);
  return message_;
}

void Generation::cancel() {
  {
    std::lock_guard lock(mutex_);
    if (reason_ != FinishReason::None) return;
  }
  cancel_requested_.store(true, std::memory_order_release);
  if (wake_) wake_();
}

bool Generation::on_event(EventFn fn) {
  std::unique_lock lock(mutex_);
  if (callback_set_) return false;
  callback_set_ = true;
  callback_ = std::move(fn);
  notify(lock);  // what is already pending is told at once, here
  return true;
}

int Generation::event_fd() {
  std::lock_guard lock(mutex_);
  if (event_fd_ < 0) {
    event_fd_ = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (event_fd_ < 0)
      throw Error(Status::Io, std::string("cannot create the generation's event descriptor (eventfd: ") +
                                  std::strerror(errno) + "); close descriptors or raise the process's limit");
    fd_readable_ = false;
    set_fd_locked(read_ < tokens_.size() || reason_ != FinishReason::None);
  }
  return event_fd_;
}

void Generation::set_fd_locked(bool readable) {
  if (event_fd_ < 0 || readable == fd_readable_) return;
  if (readable) {
    const uint64_t one = 1;
    // Cannot block or overflow: the counter only ever goes between 0 and 1.
    [[maybe_unused]] const ssize_t n = ::write(event_fd_, &one, sizeof one);
  } else {
    uint64_t value = 0;
    [[maybe_unused]] const ssize_t n = ::read(event_fd_, &value, sizeof value);
  }
  fd_readable_ = readable;
}

void Generation::notify(std::unique_lock<std::mutex>& lock) {
  set_fd_locked(read_ < tokens_.size() || reason_ != FinishReason::None);
  if (!callback_ || told_finished_ || abandoned_) return;
  // One caller at a time runs the callback; news that arrive meanwhile make it run once more, so no event is lost
  // and the callback never runs on two threads at once.
  if (callback_running_) {
    callback_pending_ = true;
    return;
  }
  do {
    callback_pending_ = false;
    const size_t available = tokens_.size() - read_;
    const bool finished = reason_ != FinishReason::None;
    if (!finished && available == 0) break;
    if (finished) told_finished_ = true;
    EventFn fn = callback_;
    callback_running_ = true;
    callback_thread_ = std::this_thread::get_id();
    lock.unlock();
    fn(available, finished);
    fn = nullptr;  // what it captured goes before abandon() may return
    lock.lock();
    callback_running_ = false;
    callback_returned_.notify_all();
  } while (callback_pending_ && !told_finished_ && !abandoned_);
  if (told_finished_) callback_ = nullptr;  // it is never called again
}

void Generation::abandon() {
  cancel();
  std::unique_lock lock(mutex_);
  abandoned_ = true;
  // A callback on this very thread is the one abandon() is called from (which the C ABI forbids): waiting for it
  // would wait forever.
  callback_returned_.wait(lock, [&] { return !callback_running_ || callback_thread_ == std::this_thread::get_id(); });
  callback_ = nullptr;
  if (event_fd_ >= 0) {
    ::close(event_fd_);
    event_fd_ = -1;
  }
}

GenerationInfo Generation::info() {
  std::lock_guard lock(mutex_);
  GenerationInfo info;
  info.finish_reason = reason_;
  info.prompt_tokens = prompt_tokens_;
  info.generated_tokens = static_cast<int64_t>(tokens_.size());
  info.cached_tokens = cached_tokens_;
  if (has_started_) info.queued_ms = ms_between(submitted_, started_);
  if (!tokens_.empty()) info.time_to_first_token_ms = ms_between(submitted_, first_token_);
  if (tokens_.size() >= 2)
    info.mean_inter_token_ms = ms_between(first_token_, last_token_) / static_cast<double>(tokens_.size() - 1);
  return info;
}

void Generation::started(Clock::time_point now, int64_t cached_tokens) {
  std::lock_guard lock(mutex_);
  has_started_ = true;
  started_ = now;
  cached_tokens_ = cached_tokens;
}

void Generation::publish(const int64_t* tokens, size_t count, Clock::time_point now, const TokenLogprobs* logprobs) {
  if (count == 0) return;
  std::unique_lock lock(mutex_);
  if (reason_ != FinishReason::None) return;  // ended meanwhile (a deadline): later tokens are dropped
  if (tokens_.empty()) first_token_ = now;
  last_token_ = now;
  tokens_.insert(tokens_.end(), tokens, tokens + count);
  if (logprobs) logprobs_.insert(logprobs_.end(), logprobs, logprobs + count);
  notify(lock);
}

bool Generation::logprobs(size_t index, TokenLogprobs* out) {
  std::lock_guard lock(mutex_);
  if (index >= logprobs_.size()) return false;
  *out = logprobs_[index];
  return true;
}

void Generation::scored(int64_t position, TokenLogprobs logprobs) {
  std::lock_guard lock(mutex_);
  if (position <= 0 || static_cast<size_t>(position) >= prompt_logprobs_.size()) return;
  prompt_logprobs_[static_cast<size_t>(position)] = std::move(logprobs);
  prompt_scored_[static_cast<size_t>(position)] = true;
}

bool Generation::prompt_logprobs(size_t position, TokenLogprobs* out) {
  std::lock_guard lock(mutex_);
  if (position >= prompt_scored_.size() || !prompt_scored_[position]) return false;
  *out = prompt_logprobs_[position];
  return true;
}

void Generation::finish(FinishReason reason, Status status, const std::string& message) {
  std::unique_lock lock(mutex_);
  if (reason_ != FinishReason::None) return;
  reason_ = reason;
  status_ = status;
  message_ = message;
  ended_.notify_all();
  notify(lock);
}

bool Generation::finished() {
  std::lock_guard lock(mutex_);
  return reason_ != FinishReason::None;
}

}  // namespace libpipe::generate
