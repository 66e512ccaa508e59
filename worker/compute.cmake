# Datasets, models and compute backends (CPU; CUDA when SHARDPS_HAVE_CUDA),
# with their tests. Included from worker/CMakeLists.txt;
# paths are relative to this file so that it does not matter who includes it.
set(_compute_dir ${CMAKE_CURRENT_LIST_DIR})
cmake_path(GET _compute_dir PARENT_PATH _compute_root)

# Link libopenblas itself when present: Debian's libblas.so.3 alternative
# forwards cblas_* but not openblas_set_num_threads.
find_library(SHARDPS_OPENBLAS_LIBRARY NAMES openblas)
if(SHARDPS_OPENBLAS_LIBRARY)
  set(_compute_blas ${SHARDPS_OPENBLAS_LIBRARY})
else()
  set(_compute_blas BLAS::BLAS)
endif()

add_library(shardps_data STATIC ${_compute_dir}/dataset.cc)
target_include_directories(shardps_data PUBLIC ${_compute_root})
target_link_libraries(shardps_data
  PUBLIC absl::status absl::statusor absl::strings absl::span
  PRIVATE ZLIB::ZLIB shardps_copts)

add_library(shardps_model STATIC
  ${_compute_dir}/backend.cc
  ${_compute_dir}/cpu_backend.cc
  ${_compute_dir}/model.cc
  ${_compute_dir}/cuda/bias_relu_cpu.cc
  ${_compute_dir}/cuda/softmax_xent_cpu.cc
)
target_include_directories(shardps_model PUBLIC ${_compute_root})
target_include_directories(shardps_model PRIVATE ${CBLAS_INCLUDE_DIR})
target_link_libraries(shardps_model
  PUBLIC absl::status absl::statusor absl::strings absl::span
  PRIVATE ${_compute_blas} shardps_copts)
if(SHARDPS_HAVE_CUDA)
  # The CUDA backend is a shared library that workers load only when a GPU
  # driver exists (cuda_loader.cc): mapping cuBLAS alone costs ~215 MiB of
  # resident memory. Everything but its C entry points is hidden, so it keeps
  # its own copies of the backend's base code.
  target_sources(shardps_model PRIVATE ${_compute_dir}/cuda_loader.cc)
  target_link_libraries(shardps_model PRIVATE ${CMAKE_DL_LIBS}
                        absl::synchronization)
  add_library(shardps_cuda_kernels OBJECT
    ${_compute_dir}/cuda/bias_relu.cu
    ${_compute_dir}/cuda/softmax_xent.cu
  )
  set_target_properties(shardps_cuda_kernels PROPERTIES
    POSITION_INDEPENDENT_CODE ON CUDA_VISIBILITY_PRESET hidden)
  target_include_directories(shardps_cuda_kernels PUBLIC ${_compute_root})
  target_compile_options(shardps_cuda_kernels PRIVATE
    $<$<COMPILE_LANGUAGE:CUDA>:-Xcompiler=-Wall,-Wextra>)
  add_library(shardps_cuda SHARED
    ${_compute_dir}/backend.cc
    ${_compute_dir}/model.cc
    ${_compute_dir}/cuda/bias_relu_cpu.cc
    ${_compute_dir}/cuda/softmax_xent_cpu.cc
    ${_compute_dir}/cuda/cuda_backend.cc
    ${_compute_dir}/cuda/cuda_library.cc
    ${_compute_dir}/cuda/gemm_roofline.cc
    $<TARGET_OBJECTS:shardps_cuda_kernels>
  )
  set_target_properties(shardps_cuda PROPERTIES
    CXX_VISIBILITY_PRESET hidden CUDA_VISIBILITY_PRESET hidden
    VISIBILITY_INLINES_HIDDEN ON)
  target_include_directories(shardps_cuda PRIVATE ${_compute_root})
  # The static runtime: one per process, inside this library. libcublas.so
  # does not need libcudart.so.
  target_link_libraries(shardps_cuda PRIVATE CUDA::cudart_static CUDA::cublas
    absl::status absl::statusor absl::strings absl::span absl::time
    shardps_copts)
  # Built whenever a binary that may load it is.
  add_dependencies(shardps_model shardps_cuda)
else()
  target_sources(shardps_model PRIVATE ${_compute_dir}/no_cuda_backend.cc)
endif()

shardps_cc_test(NAME dataset_test
  SRCS ${_compute_dir}/dataset_test.cc
  DEPS shardps_data ZLIB::ZLIB
  LABEL unit)
shardps_cc_test(NAME model_test
  SRCS ${_compute_dir}/model_test.cc
  DEPS shardps_model
  LABEL unit)
shardps_cc_test(NAME backend_test
  SRCS ${_compute_dir}/backend_test.cc
  DEPS shardps_model
  LABEL unit)
# Built in every configuration; skips where there is no GPU or no CUDA.
shardps_cc_test(NAME cuda_backend_test
  SRCS ${_compute_dir}/cuda/cuda_backend_test.cc
  DEPS shardps_model
  LABEL gpu)
if(SHARDPS_HAVE_CUDA AND TARGET cuda_backend_test)
  # So that a CUDA build that lost its backend fails instead of skipping.
  target_compile_definitions(cuda_backend_test PRIVATE SHARDPS_HAVE_CUDA=1)
endif()
if(SHARDPS_HAVE_CUDA)
  shardps_cc_test(NAME cuda_kernels_test
    SRCS ${_compute_dir}/cuda/kernels_test.cc
         $<TARGET_OBJECTS:shardps_cuda_kernels>
    DEPS shardps_model CUDA::cudart_static
    LABEL gpu)
endif()
