// comm_test_support.h: what the communicator tests share. The same tests run on the
// local backend (dp_unit_tests) and under mpiexec on the mpi backend (dp_mpi_tests):
// the environment variable DPLAB_TEST_BACKEND picks the backend.
#pragma once

#include <chrono>
#include <cstdlib>
#include <string>

#include "dp/launch.h"
#ifdef DP_TESTS_LINK_GRADING
#include "grading.h"
#endif

namespace dp::testing {

/// The backend the communicator tests run on: $DPLAB_TEST_BACKEND, "local" by default.
inline Backend test_backend() {
#ifdef DP_TESTS_LINK_GRADING
  // The check programs' support (dp_grading, linked into dp_mpi_tests for its main) takes
  // the grading variables out of the environment before main, so that lab code cannot read
  // them; it keeps them for the checks.
  return grading::check_backend();
#else
  const char* name = std::getenv("DPLAB_TEST_BACKEND");
  return name == nullptr ? Backend::kLocal : parse_backend(name);
#endif
}

/// Launch options for `world_size` ranks on the test backend.
inline LaunchOptions test_launch(
    int world_size, std::chrono::milliseconds hang_timeout = std::chrono::seconds(60)) {
  LaunchOptions options;
  options.world_size = world_size;
  options.backend = test_backend();
  options.comm.hang_timeout = hang_timeout;
  return options;
}

}  // namespace dp::testing
