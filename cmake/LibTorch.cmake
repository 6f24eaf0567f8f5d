# Imports LibTorch from the PyTorch wheel installed in the project virtualenv.
#
# The wheel is a CUDA build, and its TorchConfig.cmake refuses to configure without a CUDA
# toolkit (nvcc), which CPU machines do not have. LibTorch's CPU libraries need none of it, so
# this file asks the wheel's Python where its headers and libraries are and imports them as the
# target torch::libtorch, compiled with the wheel's own _GLIBCXX_USE_CXX11_ABI setting.
#
# Input:  LIBPIPE_PYTHON  the virtualenv's python (scripts/install-deps.sh creates it)
# Output: torch::libtorch, TORCH_ROOT, TORCH_VERSION

if(NOT LIBPIPE_PYTHON)
  message(FATAL_ERROR "Set LIBPIPE_PYTHON to the python of the virtualenv holding torch "
                      "(scripts/install-deps.sh creates it; scripts/build.sh passes it).")
endif()

execute_process(
  COMMAND "${LIBPIPE_PYTHON}" -c
          "import os, torch; print(os.path.dirname(torch.__file__)); print(int(torch._C._GLIBCXX_USE_CXX11_ABI)); print(torch.__version__)"
  OUTPUT_VARIABLE _torch_info
  ERROR_VARIABLE _torch_error
  RESULT_VARIABLE _torch_rc
  OUTPUT_STRIP_TRAILING_WHITESPACE)
if(NOT _torch_rc EQUAL 0)
  message(FATAL_ERROR "${LIBPIPE_PYTHON} cannot import torch; run scripts/install-deps.sh.\n${_torch_error}")
endif()
string(REPLACE "\n" ";" _torch_info "${_torch_info}")
list(GET _torch_info 0 TORCH_ROOT)
list(GET _torch_info 1 _torch_cxx11_abi)
list(GET _torch_info 2 TORCH_VERSION)
message(STATUS "LibTorch ${TORCH_VERSION} from ${TORCH_ROOT} (_GLIBCXX_USE_CXX11_ABI=${_torch_cxx11_abi})")

# The CPU libraries only; CUDA kernels (libtorch_cuda) are not needed by CPU stages.
set(_torch_libs)
foreach(_lib torch_cpu c10)
  find_library(_torch_lib_${_lib} NAMES ${_lib} PATHS "${TORCH_ROOT}/lib" NO_DEFAULT_PATH REQUIRED)
  list(APPEND _torch_libs "${_torch_lib_${_lib}}")
endforeach()

add_library(torch::libtorch INTERFACE IMPORTED)
target_include_directories(torch::libtorch SYSTEM INTERFACE
  "${TORCH_ROOT}/include"
  "${TORCH_ROOT}/include/torch/csrc/api/include")
target_compile_definitions(torch::libtorch INTERFACE _GLIBCXX_USE_CXX11_ABI=${_torch_cxx11_abi})
target_link_libraries(torch::libtorch INTERFACE ${_torch_libs})
set(TORCH_LIBRARY_DIR "${TORCH_ROOT}/lib")
