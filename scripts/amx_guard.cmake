# Keeps llama.cpp's CPU backend off AMX where its AMX kernels cannot run.
#
# A native x86 build (-march=native) compiles ggml's AMX kernels whenever the CPU has AMX, and ggml
# then uses them for Q4_0/Q4_1/Q8_0 weights. Built by GCC 12 they crash: GCC drops the stores that
# fill the tile configuration before ldtilecfg, so every process dies on its first matrix multiply
# (a general protection fault or illegal instruction in ggml_backend_amx_mul_mat), plain
# llama-cpp-python and llama.cpp's own tools alike. A machine whose kernel or hypervisor withholds
# the tile state fails the same way. Included into llama-cpp-python's and llama.cpp's CMake projects
# (CMAKE_PROJECT_INCLUDE: the README's CMAKE_ARGS, scripts/build_upstream.py), it builds and runs
# amx_probe.cpp once, with the build's compiler at -O3 -march=native, and where the probe fails it
# compiles C and C++ with -mno-amx-*: ggml then takes its AVX-512/AVX2 kernels. Where the probe runs
# (a fixed compiler on an AMX machine) AMX stays; on other CPUs the probe fails harmlessly (no AMX to
# turn off) and the flags change nothing.
include_guard(GLOBAL)

if(CMAKE_SYSTEM_NAME STREQUAL "Linux" AND CMAKE_SYSTEM_PROCESSOR MATCHES "^(x86_64|AMD64|amd64)$")
  if(NOT DEFINED EAGLE3_AMX_RUNS)
    try_run(_amx_run_rc _amx_compiled
            "${CMAKE_BINARY_DIR}/amx_probe"
            "${CMAKE_CURRENT_LIST_DIR}/amx_probe.cpp"
            COMPILE_DEFINITIONS -O3 -march=native)
    if(_amx_compiled AND "${_amx_run_rc}" STREQUAL "0")
      set(EAGLE3_AMX_RUNS ON CACHE BOOL "ggml's AMX kernels run on this machine, as this compiler builds them")
    else()
      set(EAGLE3_AMX_RUNS OFF CACHE BOOL "ggml's AMX kernels run on this machine, as this compiler builds them")
    endif()
  endif()
  if(NOT EAGLE3_AMX_RUNS)
    message(STATUS "eagle3-gguf: AMX kernels would crash here (amx_probe.cpp): building without AMX")
    add_compile_options("$<$<COMPILE_LANGUAGE:C,CXX>:-mno-amx-tile;-mno-amx-int8;-mno-amx-bf16>")
  endif()
endif()
