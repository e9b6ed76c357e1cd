#include "trace.h"

#include <cstdio>
#include <fstream>

#include <nlohmann/json.hpp>

#include "error.h"

namespace llmnpu {

void write_trace(const std::string& path, const Sidecar& s, const std::vector<Record>& records) {
  using nlohmann::json;
  json events = json::array();
  events.push_back({{"name", "process_name"}, {"ph", "M"}, {"pid", 0}, {"args", {{"name", "llmnpu prefill"}}}});
  for (int tid : {kNpu, kCpu})
    events.push_back({{"name", "thread_name"}, {"ph", "M"}, {"pid", 0}, {"tid", tid},
                      {"args", {{"name", kProcessorNames[tid]}}}});
  for (const auto& r : records)
    events.push_back({{"name", "c" + std::to_string(r.chunk) + " " + s.subgraphs[r.step].method},
                      {"ph", "X"}, {"pid", 0}, {"tid", static_cast<int>(r.processor)},
                      {"ts", r.start * 1e6}, {"dur", (r.end - r.start) * 1e6},
                      {"args", {{"chunk", r.chunk}, {"subgraph", r.step}}}});
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp);
    out << json{{"traceEvents", events}, {"displayTimeUnit", "ms"}}.dump();
    if (!out) throw InputError("cannot write the trace to " + path);
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) throw InputError("cannot write the trace to " + path);
}

}  // namespace llmnpu
