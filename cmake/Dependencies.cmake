# Every third-party dependency is found here, in one place; the README says why each is used.

find_package(OpenMP REQUIRED)          # threads of the CPU kernels
find_package(Threads REQUIRED)
if(DELTATRAIN_FULL)
  find_package(CLI11 CONFIG REQUIRED)    # the deltatrain command line
  find_package(nlohmann_json CONFIG REQUIRED)  # --json output, checkpoint metadata
  find_package(MPI REQUIRED COMPONENTS C)      # CPU communicators, NCCL bootstrap
  find_package(BLAS REQUIRED)            # the reference matrix-product rate in `bench gdn`
  find_package(benchmark)                # optional: micro-benchmarks under bench/
  if(DELTATRAIN_TESTS)
    find_package(GTest REQUIRED)
  endif()
endif()

# CUDA: optional, so that the project builds on machines without nvcc; CI has nvcc and builds it all.
set(DELTATRAIN_WITH_CUDA OFF)
if(DELTATRAIN_CUDA STREQUAL "AUTO")
  include(CheckLanguage)
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    set(DELTATRAIN_WITH_CUDA ON)
  endif()
elseif(DELTATRAIN_CUDA)
  set(DELTATRAIN_WITH_CUDA ON)
endif()
if(DELTATRAIN_WITH_CUDA)
  if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
    # Ampere for mma.sync, Hopper with its arch-specific instructions (wgmma, setmaxnreg).
    set(CMAKE_CUDA_ARCHITECTURES "80-real;90a-real")
  endif()
  enable_language(CUDA)
  # CMake 3.25 does not know nvcc's C++20 flag (3.26 does) and would refuse CUDA_STANDARD 20.
  set(CMAKE_CUDA20_STANDARD_COMPILE_OPTION "-std=c++20")
  set(CMAKE_CUDA20_EXTENSION_COMPILE_OPTION "-std=c++20")
  set(CMAKE_CUDA_STANDARD 20)
  set(CMAKE_CUDA_STANDARD_REQUIRED ON)
  find_package(CUDAToolkit REQUIRED)
  # The CUDA runtime, one choice for every target (a binary with both would hold two runtimes): shared for
  # the project's own build, static for a wheel (pyproject.toml), which then needs only the NVIDIA driver.
  add_library(deltatrain_cudart INTERFACE)
  if(DELTATRAIN_CUDA_STATIC_RUNTIME)
    set(CMAKE_CUDA_RUNTIME_LIBRARY Static)
    target_link_libraries(deltatrain_cudart INTERFACE CUDA::cudart_static)
  else()
    set(CMAKE_CUDA_RUNTIME_LIBRARY Shared)
    target_link_libraries(deltatrain_cudart INTERFACE CUDA::cudart)
  endif()
  find_path(NCCL_INCLUDE_DIR nccl.h HINTS ${CUDAToolkit_INCLUDE_DIRS})
  find_library(NCCL_LIBRARY nccl HINTS ${CUDAToolkit_LIBRARY_DIR} ${CUDAToolkit_LIBRARY_ROOT}/lib)
  # cuDNN's fused attention (model/cuda/cudnn_attention.cpp): the library beside the CUDA toolkit, the
  # header-only cudnn-frontend from PyPI's nvidia-cudnn-frontend (make deps installs it into .venv/). The
  # portable wheel (static runtime, only the driver needed) leaves it out and runs the unfused attention.
  set(DELTATRAIN_WITH_CUDNN OFF)
  if(NOT DELTATRAIN_CUDA_STATIC_RUNTIME)
    find_path(CUDNN_INCLUDE_DIR cudnn.h HINTS ${CUDAToolkit_INCLUDE_DIRS})
    find_library(CUDNN_LIBRARY cudnn HINTS ${CUDAToolkit_LIBRARY_DIR} ${CUDAToolkit_LIBRARY_ROOT}/lib)
    file(GLOB _frontend_hints ${PROJECT_SOURCE_DIR}/.venv/lib/python3*/site-packages/include)
    find_path(CUDNN_FRONTEND_INCLUDE_DIR cudnn_frontend.h HINTS ${_frontend_hints})
    if(CUDNN_INCLUDE_DIR AND CUDNN_LIBRARY AND CUDNN_FRONTEND_INCLUDE_DIR)
      set(DELTATRAIN_WITH_CUDNN ON)
    endif()
  endif()
endif()
message(STATUS "deltatrain: CUDA backends ${DELTATRAIN_WITH_CUDA} (cuDNN attention ${DELTATRAIN_WITH_CUDNN}), "
               "CPU arch ${DELTATRAIN_CPU_ARCH}, whole project ${DELTATRAIN_FULL} (OFF: the Python package only)")

# Warnings for the project's own code.
add_library(deltatrain_warnings INTERFACE)
target_compile_options(deltatrain_warnings INTERFACE
  $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra -Wpedantic -Wno-unused-parameter
    $<$<CXX_COMPILER_ID:GNU>:-Wno-restrict>>)  # GCC 12 false positive on string concatenation (bug 105329)

# CPU kernels: vector ISA chosen at configure time.
add_library(deltatrain_cpu_arch INTERFACE)
target_compile_options(deltatrain_cpu_arch INTERFACE
  $<$<COMPILE_LANGUAGE:CXX>:-march=${DELTATRAIN_CPU_ARCH} -O3 -fopenmp-simd>)
