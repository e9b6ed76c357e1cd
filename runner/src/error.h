// One exception type: its message is the one line the user sees.
#pragma once
#include <stdexcept>
#include <string>

namespace llmnpu {

// Bad input (program, sidecar, prompt, flags): exit code 2.
struct InputError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// A method call failed while running: exit code 1.
struct RunError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

}  // namespace llmnpu
