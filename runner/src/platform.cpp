#include "platform.h"

#include <sys/resource.h>

namespace llmnpu::platform {

double peak_rss_mib() {
  struct rusage usage {};
  getrusage(RUSAGE_SELF, &usage);
  return usage.ru_maxrss / 1024.0;   // KiB on Linux and Android
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
