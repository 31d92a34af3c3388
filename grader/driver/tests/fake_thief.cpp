// fake_thief.cpp: the part of fake_checks that plays a lab which got past the check
// program's defences: its .preinit_array entry copies the results channel's directory and
// token before the reporter's entry takes them. Entries of different objects run in link
// order, and this object comes before fake_checks.cpp's (grader/driver/tests/CMakeLists.txt),
// so the driver's tests can forge lines with the token and see the driver refuse them.
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>

#include "result_channel.h"

char stolen_directory[4096];
char stolen_token[dp::grader::channel::kMaxTokenBytes + 1];

int fake_rank_in(char** envp) {
  // Under mpirun, Open MPI's own variable: the fake does not start MPI.
  for (const std::string_view name : {"FAKE_CHECKS_RANK", "OMPI_COMM_WORLD_RANK"})
    for (char** variable = envp; variable != nullptr && *variable != nullptr; ++variable)
      if (std::string_view(*variable).starts_with(std::string(name) + "="))
        return std::atoi(*variable + name.size() + 1);
  return 0;
}

namespace {

void steal_the_channel(int, char**, char** envp) {
  const std::string_view name = dp::grader::channel::kChannelVariable;
  for (char** variable = envp; variable != nullptr && *variable != nullptr; ++variable) {
    const std::string_view text(*variable);
    if (!text.starts_with(name) || text.size() <= name.size() || text[name.size()] != '=') continue;
    std::snprintf(stolen_directory, sizeof stolen_directory, "%s", *variable + name.size() + 1);
    const std::string token_file =
        dp::grader::channel::token_path(stolen_directory, fake_rank_in(envp));
    if (std::FILE* file = std::fopen(token_file.c_str(), "r")) {
      if (std::fgets(stolen_token, sizeof stolen_token, file) == nullptr) stolen_token[0] = '\0';
      std::fclose(file);
    }
  }
}

[[gnu::section(".preinit_array"), gnu::used]] void (*const steal)(int, char**,
                                                                  char**) = &steal_the_channel;

}  // namespace
