# Finds NCCL and the CUDA runtime for the NCCL transport (runtime/comm/nccl_transport.cpp).
#
# Looks next to the torch package (the pip wheel's NVIDIA packages: ../nvidia/nccl and
# ../nvidia/cu13 or ../nvidia/cu12 / ../nvidia/cuda_runtime), then in a system CUDA/NCCL. What
# each pip package gives:
#   nvidia-nccl-cu13     libnccl.so.2 and nccl.h
#   nvidia-cuda-runtime  libcudart.so.13 and cuda_runtime_api.h (with LibTorch's wheel)
#   nvidia-cuda-crt      crt/host_defines.h and the rest of crt/, which cuda_runtime_api.h includes
#   nvidia-cuda-cccl     CCCL (<nv/target>, <cuda/std/...>), which nccl.h's cuda_fp16.h includes
# (the last two are in scripts/requirements.txt: LibTorch's wheel does not pull them in). With
# them a host compiler builds against the real headers; no nvcc is needed.
#
# Input:  TORCH_ROOT (cmake/LibTorch.cmake), option LIBPIPE_WITH_NCCL (default ON)
# Output: LIBPIPE_HAVE_NCCL (ON/OFF); when ON, the INTERFACE IMPORTED target libpipe::nccl
#         (compile definition LIBPIPE_HAVE_NCCL, the headers' include dirs, links to libnccl and
#         libcudart).

option(LIBPIPE_WITH_NCCL "Build the NCCL transport when NCCL and the CUDA runtime are found" ON)
set(LIBPIPE_HAVE_NCCL OFF)

if(NOT LIBPIPE_WITH_NCCL)
  message(STATUS "NCCL transport: off (LIBPIPE_WITH_NCCL=OFF)")
  return()
endif()

set(_nvidia "${TORCH_ROOT}/../nvidia")
find_library(LIBPIPE_NCCL_LIBRARY NAMES nccl libnccl.so.2
  HINTS "${_nvidia}/nccl/lib" ENV NCCL_HOME PATH_SUFFIXES lib lib64
  PATHS /usr/local/cuda/lib64 /usr/lib/x86_64-linux-gnu)
find_library(LIBPIPE_CUDART_LIBRARY NAMES cudart libcudart.so.13 libcudart.so.12
  HINTS "${_nvidia}/cu13/lib" "${_nvidia}/cu12/lib" "${_nvidia}/cuda_runtime/lib" ENV CUDA_HOME
  PATH_SUFFIXES lib lib64
  PATHS /usr/local/cuda/lib64 /usr/lib/x86_64-linux-gnu)
find_path(LIBPIPE_NCCL_INCLUDE_DIR nccl.h HINTS "${_nvidia}/nccl/include" ENV NCCL_HOME PATH_SUFFIXES include
  PATHS /usr/local/cuda/include /usr/include)
set(_cuda_include_hints "${_nvidia}/cu13/include" "${_nvidia}/cu12/include" "${_nvidia}/cuda_runtime/include")
find_path(LIBPIPE_CUDART_INCLUDE_DIR cuda_runtime_api.h HINTS ${_cuda_include_hints} ENV CUDA_HOME
  PATH_SUFFIXES include PATHS /usr/local/cuda/include)
find_path(LIBPIPE_CUDA_CRT_INCLUDE_DIR crt/host_defines.h HINTS ${_cuda_include_hints} ENV CUDA_HOME
  PATH_SUFFIXES include PATHS /usr/local/cuda/include)
# CCCL: a CUDA toolkit keeps <nv/target> beside the runtime headers; the pip package in cccl/.
find_path(LIBPIPE_CCCL_INCLUDE_DIR nv/target HINTS ${_cuda_include_hints} ENV CUDA_HOME
  PATH_SUFFIXES include/cccl cccl include PATHS /usr/local/cuda/include)
find_library(_libpipe_torch_cuda torch_cuda PATHS "${TORCH_ROOT}/lib" NO_DEFAULT_PATH)

set(_missing)
foreach(_v LIBPIPE_NCCL_LIBRARY LIBPIPE_CUDART_LIBRARY LIBPIPE_NCCL_INCLUDE_DIR LIBPIPE_CUDART_INCLUDE_DIR
           LIBPIPE_CUDA_CRT_INCLUDE_DIR LIBPIPE_CCCL_INCLUDE_DIR _libpipe_torch_cuda)
  if(NOT ${_v})
    list(APPEND _missing ${_v})
  endif()
endforeach()
if(_missing)
  message(STATUS "NCCL transport: off (not found: ${_missing}); this LibTorch or machine has no NCCL/CUDA runtime")
  return()
endif()

set(LIBPIPE_HAVE_NCCL ON)
add_library(libpipe::nccl INTERFACE IMPORTED)
target_compile_definitions(libpipe::nccl INTERFACE LIBPIPE_HAVE_NCCL)
target_include_directories(libpipe::nccl SYSTEM INTERFACE "${LIBPIPE_NCCL_INCLUDE_DIR}" "${LIBPIPE_CUDART_INCLUDE_DIR}"
  "${LIBPIPE_CUDA_CRT_INCLUDE_DIR}" "${LIBPIPE_CCCL_INCLUDE_DIR}")
# libtorch_cuda is not linked: nothing of libpipe calls into it, but loading it registers the CUDA
# kernels and hooks (at::empty on a CUDA device, .to(cuda)), and it pulls cuBLAS, cuDNN and more
# into every process. The NCCL transport loads it when a session first asks for a GPU
# (schedule::nccl_device), so CPU users never pay for it.
target_link_libraries(libpipe::nccl INTERFACE "${LIBPIPE_NCCL_LIBRARY}" "${LIBPIPE_CUDART_LIBRARY}")
get_filename_component(_nccl_dir "${LIBPIPE_NCCL_LIBRARY}" DIRECTORY)
get_filename_component(_cudart_dir "${LIBPIPE_CUDART_LIBRARY}" DIRECTORY)
set(LIBPIPE_NCCL_RPATH "${_nccl_dir};${_cudart_dir}")
message(STATUS "NCCL transport: on (${LIBPIPE_NCCL_LIBRARY}, ${LIBPIPE_CUDART_LIBRARY})")
