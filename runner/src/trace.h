// The Chrome/Perfetto trace of a prefill, in the format of runtime/trace.py chrome_trace: one
// complete event per task, one thread row per processor. Written to a temporary name, then renamed.
#pragma once
#include <string>
#include <vector>

#include "schedule.h"
#include "sidecar.h"

namespace llmnpu {

void write_trace(const std::string& path, const Sidecar& s, const std::vector<Record>& records);

}  // namespace llmnpu
