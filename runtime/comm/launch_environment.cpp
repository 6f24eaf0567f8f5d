#include "runtime/comm/launch_environment.h"

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <initializer_list>

#include "runtime/error.h"

namespace libpipe::comm {

namespace {

const char* env(const char* name) {
  const char* v = std::getenv(name);
  return v && *v ? v : nullptr;
}

int number(const char* name, const char* value, int lowest) {
  char* end = nullptr;
  errno = 0;
  const long v = std::strtol(value, &end, 10);
  if (end == value || *end != '\0' || errno == ERANGE || v < lowest || v > INT_MAX)
    throw Error(Status::InvalidArgument,
                std::string(name) + "='" + value + "' is not a number of at least " + std::to_string(lowest));
  return static_cast<int>(v);
}

// Every variable of `names` that is unset, for the message.
std::string missing(std::initializer_list<const char*> names) {
  std::string out;
  for (const char* n : names)
    if (!env(n)) out += (out.empty() ? "" : ", ") + std::string(n);
  return out;
}

std::string store_address(const std::string& host, int port) {
  return (host.find(':') != std::string::npos ? "[" + host + "]" : host) + ":" + std::to_string(port);
}

void check_rank(const LaunchEnvironment& e, const char* rank_var, const char* world_var) {
  if (e.rank >= e.world_size)
    throw Error(Status::InvalidArgument, std::string(rank_var) + "=" + std::to_string(e.rank) + " is not below " +
                                             world_var + "=" + std::to_string(e.world_size));
  if (e.local_rank >= e.local_world_size)
    throw Error(Status::InvalidArgument, "the local rank " + std::to_string(e.local_rank) +
                                             " is not below the processes on this machine (" +
                                             std::to_string(e.local_world_size) + ")");
}

}  // namespace

std::string first_host(const std::string& nodelist) {
  // The first entry: up to the first comma outside brackets.
  size_t end = 0;
  int depth = 0;
  for (; end < nodelist.size(); ++end) {
    if (nodelist[end] == '[') ++depth;
    if (nodelist[end] == ']') --depth;
    if (depth < 0) break;
    if (nodelist[end] == ',' && depth == 0) break;
  }
  const std::string entry = nodelist.substr(0, end);
  std::string host;
  bool ok = depth == 0 && !entry.empty();
  for (size_t i = 0; ok && i < entry.size();) {
    if (entry[i] != '[') {
      ok = entry[i] != ']';
      host += entry[i++];
      continue;
    }
    const size_t close = entry.find(']', i);
    // The group's first value: up to its first ',' or '-' (leading zeros kept, as scontrol keeps them).
    const std::string group = close == std::string::npos ? "" : entry.substr(i + 1, close - i - 1);
    const std::string first = group.substr(0, group.find_first_of(",-"));
    ok = !first.empty() && first.find_first_not_of("0123456789") == std::string::npos;
    host += first;
    i = close == std::string::npos ? entry.size() : close + 1;
  }
  if (!ok || host.empty())
    throw Error(Status::InvalidArgument,
                "cannot read the SLURM node list '" + nodelist + "'; set MASTER_ADDR to rank 0's host instead");
  return host;
}

std::optional<LaunchEnvironment> launch_environment() {
  LaunchEnvironment e;
  // MASTER_ADDR alone is no launcher: SLURM users set it for torch.distributed themselves.
  if (env("RANK") || env("WORLD_SIZE") || env("LOCAL_RANK")) {
    const std::string absent = missing({"RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"});
    if (!absent.empty())
      throw Error(Status::InvalidArgument,
                  "a torchrun-style environment needs RANK, WORLD_SIZE, MASTER_ADDR and "
                  "MASTER_PORT; " +
                      absent + (absent.find(',') == std::string::npos ? " is" : " are") +
                      " not set (unset them all to run without a launcher)");
    e.launcher = "torchrun";
    e.rank = number("RANK", env("RANK"), 0);
    e.world_size = number("WORLD_SIZE", env("WORLD_SIZE"), 1);
    e.local_rank = env("LOCAL_RANK") ? number("LOCAL_RANK", env("LOCAL_RANK"), 0) : 0;
    e.local_world_size =
        env("LOCAL_WORLD_SIZE") ? number("LOCAL_WORLD_SIZE", env("LOCAL_WORLD_SIZE"), 1) : e.local_rank + 1;
    check_rank(e, "RANK", "WORLD_SIZE");
    int port = number("MASTER_PORT", env("MASTER_PORT"), 1);
    const char* agent = env("TORCHELASTIC_USE_AGENT_STORE");
    if (agent && std::strcmp(agent, "True") == 0) ++port;  // torchrun's own store holds MASTER_PORT
    if (env("LIBPIPE_PORT")) port = number("LIBPIPE_PORT", env("LIBPIPE_PORT"), 1);
    if (port > 65535)
      throw Error(Status::InvalidArgument,
                  "the store's port " + std::to_string(port) + " is not below 65536; set LIBPIPE_PORT");
    e.store = store_address(env("MASTER_ADDR"), port);
    return e;
  }
  if (env("SLURM_PROCID")) {
    const char* nodelist = env("SLURM_JOB_NODELIST") ? env("SLURM_JOB_NODELIST") : env("SLURM_NODELIST");
    std::string absent = missing({"SLURM_NTASKS"});
    if (!nodelist && !env("MASTER_ADDR"))
      absent += (absent.empty() ? "" : ", ") + std::string("SLURM_JOB_NODELIST (or MASTER_ADDR)");
    if (!absent.empty())
      throw Error(Status::InvalidArgument,
                  "a SLURM environment (SLURM_PROCID is set) needs SLURM_NTASKS and "
                  "SLURM_JOB_NODELIST; missing: " +
                      absent);
    e.launcher = "slurm";
    e.rank = number("SLURM_PROCID", env("SLURM_PROCID"), 0);
    e.world_size = number("SLURM_NTASKS", env("SLURM_NTASKS"), 1);
    e.local_rank = env("SLURM_LOCALID") ? number("SLURM_LOCALID", env("SLURM_LOCALID"), 0) : 0;
    e.local_world_size = e.local_rank + 1;
    if (const char* per_node = env("SLURM_TASKS_PER_NODE")) {
      // "2(x3),1": this machine's count is not known from it alone; the first group's is the usual one.
      e.local_world_size = std::max(e.local_world_size, std::atoi(per_node));
    }
    check_rank(e, "SLURM_PROCID", "SLURM_NTASKS");
    int port = 29500;
    if (env("MASTER_PORT")) port = number("MASTER_PORT", env("MASTER_PORT"), 1);
    if (env("LIBPIPE_PORT")) port = number("LIBPIPE_PORT", env("LIBPIPE_PORT"), 1);
    if (port > 65535)
      throw Error(Status::InvalidArgument,
                  "the store's port " + std::to_string(port) + " is not below 65536; set LIBPIPE_PORT");
    e.store = store_address(env("MASTER_ADDR") ? env("MASTER_ADDR") : first_host(nodelist), port);
    return e;
  }
  return std::nullopt;
}

}  // namespace libpipe::comm
