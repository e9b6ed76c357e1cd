// What differs between the systems the runner is built for: Linux on x86-64 (CI), Linux on 64-bit
// Arm (`make runner-arm64`, run under qemu in CI) and Android (the NDK build in
// docs/phone-program.md, untested here). Everything else in the runner is C++17, POSIX and
// ExecuTorch, the same on all three. Paths are the caller's: the runner opens only what it is given
// and the files the sidecar names beside the .pte.
#pragma once
#include <string>

namespace llmnpu::platform {

#if defined(__ANDROID__)
constexpr const char* kName = "android";
#elif defined(__linux__) && defined(__aarch64__)
constexpr const char* kName = "linux-aarch64";
#elif defined(__linux__) && defined(__x86_64__)
constexpr const char* kName = "linux-x86_64";
#else
constexpr const char* kName = "other";
#endif

// The process's peak resident memory so far, in MiB.
double peak_rss_mib();

// Tells the kernel that the process's mappings of `path` (the program's constants, which ExecuTorch
// maps) are read at random: no read-ahead around a fault. The embedding table is one of them, and a
// prompt's lookups touch a few hundred of its rows; with read-ahead (and the page cache's large
// folios) they brought most of it into the process's memory. Linux and Android read /proc/self/maps.
void advise_random_reads(const std::string& path);

// How the backend libraries a program's delegates open at load time are found here (QNN's are
// dlopen'ed by ExecuTorch's Qualcomm backend: libQnnHtp.so and, on a phone, the DSP's skeleton
// library), for the error a failed load gives.
const char* backend_library_hint();

}  // namespace llmnpu::platform
