// The C ABI: tensor lists (the outputs of a call, or tensors a caller builds) and their safetensors files.
#include <cstring>

#include "capi/boundary.h"
#include "capi/dlpack_bridge.h"
#include "runtime/io/safetensors.h"

using namespace libpipe::capi;
using libpipe::Error;
using libpipe::Status;

namespace {

libpipe::capi::TensorListHandle::Entry& live_entry(pipe_tensor_list* list, size_t index, const char* function) {
  require_index(index, get(list)->entries.size(), function, "index");
  auto& e = get(list)->entries[index];
  if (e.taken)
    throw Error(Status::InvalidArgument,
                std::string(function) + ": entry '" + e.name + "' was already taken out of the list");
  return e;
}

}  // namespace

extern "C" {

pipe_status pipe_tensor_list_size(const pipe_tensor_list* list, size_t* size) {
  return guarded(__func__, [&](const char* fn) {
    require(list, fn, "list");
    require(size, fn, "size");
    *size = get(list)->entries.size();
  });
}

pipe_status pipe_tensor_list_name(const pipe_tensor_list* list, size_t index, const char** name) {
  return guarded(__func__, [&](const char* fn) {
    require(list, fn, "list");
    require(name, fn, "name");
    require_index(index, get(list)->entries.size(), fn, "index");
    *name = get(list)->entries[index].name.c_str();
  });
}

pipe_status pipe_tensor_list_find(const pipe_tensor_list* list, const char* name, size_t* index) {
  return guarded(__func__, [&](const char* fn) {
    require(list, fn, "list");
    require(name, fn, "name");
    require(index, fn, "index");
    for (size_t i = 0; i < get(list)->entries.size(); ++i)
      if (get(list)->entries[i].name == name) {
        *index = i;
        return;
      }
    throw Error(Status::NotFound, std::string(fn) + ": no entry named '" + name + "'");
  });
}

pipe_status pipe_tensor_list_get(pipe_tensor_list* list, size_t index, const DLManagedTensor** tensor) {
  return guarded(__func__, [&](const char* fn) {
    require(list, fn, "list");
    require(tensor, fn, "tensor");
    auto& e = live_entry(list, index, fn);
    if (!e.view) e.view = static_cast<DLManagedTensor*>(libpipe::capi::tensor_to_dlpack(e.tensor));
    *tensor = e.view;
  });
}

pipe_status pipe_tensor_list_take(pipe_tensor_list* list, size_t index, DLManagedTensor** tensor) {
  return guarded(__func__, [&](const char* fn) {
    require(list, fn, "list");
    require(tensor, fn, "tensor");
    auto& e = live_entry(list, index, fn);
    DLManagedTensor* out = e.view ? e.view : static_cast<DLManagedTensor*>(libpipe::capi::tensor_to_dlpack(e.tensor));
    e.view = nullptr;
    e.tensor.reset();
    e.taken = true;
    *tensor = out;
  });
}

pipe_status pipe_tensor_list_create(pipe_tensor_list** list) {
  return guarded(__func__, [&](const char* fn) {
    require(list, fn, "list");
    *list = handle(new libpipe::capi::TensorListHandle());
  });
}

pipe_status pipe_tensor_list_append(pipe_tensor_list* list, const char* name, const DLManagedTensor* tensor) {
  return guarded(__func__, [&](const char* fn) {
    require(list, fn, "list");
    require(name, fn, "name");
    require(tensor, fn, "tensor");
    if (!*name) throw Error(Status::InvalidArgument, std::string(fn) + ": name is empty");
    auto& entries = get(list)->entries;
    for (const auto& e : entries)
      if (e.name == name)
        throw Error(Status::InvalidArgument, std::string(fn) + ": the list already has an entry '" + name + "'");
    libpipe::capi::require_readable_dlpack(*tensor, fn, std::string("'") + name + "'");
    at::Tensor copy;
    try {
      copy = libpipe::capi::tensor_from_borrowed_dlpack(tensor).clone(at::MemoryFormat::Contiguous);
    } catch (const c10::Error& e) {
      throw Error(Status::Input, std::string(fn) + ": '" + name +
                                     "' is not a tensor LibTorch can read: " + e.what_without_backtrace());
    }
    entries.push_back({name, std::move(copy)});
  });
}

void pipe_tensor_list_destroy(pipe_tensor_list* list) { delete get(list); }

/* ---- safetensors ---- */

pipe_status pipe_safetensors_read(const char* path, pipe_tensor_list** list) {
  return guarded(__func__, [&](const char* fn) {
    require(path, fn, "path");
    require(list, fn, "list");
    *list = make_list(libpipe::io::read_safetensors(path));
  });
}

pipe_status pipe_safetensors_write(const pipe_tensor_list* list, const char* path) {
  return guarded(__func__, [&](const char* fn) {
    require(list, fn, "list");
    require(path, fn, "path");
    std::vector<libpipe::NamedTensor> tensors;
    for (const auto& e : get(list)->entries) {
      if (e.taken)
        throw Error(Status::InvalidArgument,
                    std::string(fn) + ": entry '" + e.name + "' was taken out of the list and cannot be written");
      tensors.push_back({e.name, e.tensor});
    }
    libpipe::io::write_safetensors(path, tensors);
  });
}

}  // extern "C"
