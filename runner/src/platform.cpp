#include "platform.h"

#include <sys/mman.h>
#include <sys/resource.h>

#include <climits>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <sstream>

namespace llmnpu::platform {

double peak_rss_mib() {
  struct rusage usage {};
  getrusage(RUSAGE_SELF, &usage);
  return usage.ru_maxrss / 1024.0;   // KiB on Linux and Android
}

void advise_random_reads(const std::string& path) {
  char resolved[PATH_MAX];
  if (realpath(path.c_str(), resolved) == nullptr) return;
  std::ifstream maps("/proc/self/maps");
  for (std::string line; std::getline(maps, line);) {
    // start-end perms offset dev inode path
    std::istringstream fields(line);
    std::string range, perms, offset, dev, inode, file;
    fields >> range >> perms >> offset >> dev >> inode;
    std::getline(fields >> std::ws, file);
    if (file != resolved) continue;
    const auto dash = range.find('-');
    const uintptr_t start = std::strtoull(range.substr(0, dash).c_str(), nullptr, 16);
    const uintptr_t end = std::strtoull(range.substr(dash + 1).c_str(), nullptr, 16);
    madvise(reinterpret_cast<void*>(start), end - start, MADV_RANDOM);   // a hint: failure changes nothing
  }
}

const char* backend_library_hint() {
#if defined(__ANDROID__)
  return "QNN's libraries (libQnnHtp.so, libQnnSystem.so, the HTP stub) in LD_LIBRARY_PATH and the DSP's "
         "skeleton library (libQnnHtpV<arch>Skel.so) in ADSP_LIBRARY_PATH";
#else
  return "QNN's host libraries in LD_LIBRARY_PATH (`llmnpu run --pte F --native` sets it from the QNN SDK)";
#endif
}

}  // namespace llmnpu::platform
