// The struct_size check of the versioned structs (capi/struct_sizes.h).
#include "capi/struct_sizes.h"

#include <string>

#include "runtime/error.h"

namespace libpipe::capi {

void require_struct_size(size_t size, const VersionedStruct& s, const char* function, const char* what) {
  for (size_t i = 0; i < s.num_sizes; ++i)
    if (size == s.sizes[i]) return;
  std::string sizes;
  for (size_t i = 0; i < s.num_sizes; ++i)
    sizes += (i == 0 ? "" : i + 1 == s.num_sizes ? " or " : ", ") + std::to_string(s.sizes[i]);
  throw Error(Status::InvalidArgument, std::string(function) + ": " + what + " is " + std::to_string(size) +
                                           ", which is not the size of " + s.name + " in any libpipe version (" +
                                           sizes + " bytes); initialise the struct with " + s.init_macro + " or " +
                                           s.init_function + "(&s, sizeof s)");
}

}  // namespace libpipe::capi
