/*
 * libQnnHtp.so shim: lets ExecuTorch 1.5.1 (built against QNN 2.37 headers) create an HTP device
 * with the QNN 2.47+ libraries that onnxruntime-qnn ships.
 *
 * ExecuTorch passes each HTP device custom config as {uint32 option; payload at byte 4}. Since QNN
 * 2.47 the payload union holds a pointer, so the library reads it at byte 8 and sees socModel 0.
 * This library stands in for libQnnHtp.so, loads the real one (libQnnHtp_real.so beside it),
 * forwards QnnInterface_getProviders, and wraps deviceCreate so every custom config reaches the
 * real library with its payload moved from byte 4 to byte 8. Nothing else is touched.
 *
 * ABI used (QNN API 2.x, x86-64): the function table of QnnInterface_t starts at byte 40 and
 * deviceCreate is its entry 40; QnnDevice_Config_t is {int32 option @0; void *custom @8}, option 0
 * being CUSTOM; configs arrive as a NULL-terminated array. Old custom payloads are <= 8 bytes.
 *
 * Build: gcc -shared -fPIC -O2 -Wl,-soname,libQnnHtp.so -Wl,-z,nodelete htp_shim.c -ldl
 * (nodelete: ExecuTorch closes the backend and reopens it by bare name with RTLD_NOLOAD; that
 * reopen must find this library, not the real one).
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <limits.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

typedef uint64_t ErrorHandle;   /* Qnn_ErrorHandle_t */
typedef ErrorHandle (*GetProvidersFn)(const void ***providers, uint32_t *count);
typedef ErrorHandle (*DeviceCreateFn)(void *log, const void **config, void **device);

#define TABLE_OFFSET 40
#define DEVICE_CREATE_INDEX 40
#define CONFIG_OPTION_CUSTOM 0
#define MAX_CONFIGS 64
#define SHIM_ERROR 1000   /* QNN_COMMON_ERROR_GENERAL-like: any non-zero is a failure */

typedef struct { int32_t option; int32_t pad; void *custom; } DeviceConfig;   /* 16 bytes */
typedef struct { uint32_t option; uint32_t pad; uint8_t payload[56]; } NewCustomConfig;

static GetProvidersFn real_get_providers;
static DeviceCreateFn real_device_create;

static void fail(const char *what, const char *detail) {
    fprintf(stderr, "llmnpu QNN shim: %s%s%s\n", what, detail ? ": " : "", detail ? detail : "");
}

static int load_real(void) {
    if (real_get_providers) return 0;
    Dl_info info;
    if (!dladdr((void *)&load_real, &info) || !info.dli_fname) {
        fail("cannot locate this library's own path", NULL);
        return -1;
    }
    char dir[PATH_MAX], path[PATH_MAX + 32], real[PATH_MAX];
    snprintf(dir, sizeof dir, "%s", info.dli_fname);
    char *slash = strrchr(dir, '/');
    if (slash) *slash = '\0'; else snprintf(dir, sizeof dir, ".");
    snprintf(path, sizeof path, "%s/libQnnHtp_real.so", dir);
    /* the link's target: its $ORIGIN-relative run path must see the files beside the real library */
    const char *target = realpath(path, real) ? real : path;
    void *handle = dlopen(target, RTLD_NOW | RTLD_LOCAL);
    if (!handle) {
        fail("cannot load the real HTP library", dlerror());
        return -1;
    }
    real_get_providers = (GetProvidersFn)dlsym(handle, "QnnInterface_getProviders");
    if (!real_get_providers) {
        fail("QnnInterface_getProviders missing in the real HTP library", dlerror());
        return -1;
    }
    return 0;
}

static ErrorHandle device_create(void *log, const void **config, void **device) {
    if (!config) return real_device_create(log, config, device);
    size_t n = 0;
    while (config[n]) n++;
    if (n > MAX_CONFIGS) {
        fail("too many device configs", NULL);
        return SHIM_ERROR;
    }
    DeviceConfig configs[MAX_CONFIGS];
    NewCustomConfig customs[MAX_CONFIGS];
    const void *list[MAX_CONFIGS + 1];
    for (size_t i = 0; i < n; i++) {
        configs[i] = *(const DeviceConfig *)config[i];
        if (configs[i].option == CONFIG_OPTION_CUSTOM && configs[i].custom) {
            const uint8_t *old = (const uint8_t *)configs[i].custom;
            memset(&customs[i], 0, sizeof customs[i]);
            memcpy(&customs[i].option, old, 4);
            memcpy(customs[i].payload, old + 4, 8);   /* payload: byte 4 -> byte 8 */
            configs[i].custom = &customs[i];
        }
        list[i] = &configs[i];
    }
    list[n] = NULL;
    return real_device_create(log, list, device);
}

static int patch_table(const void *provider) {
    void **slot = (void **)((uint8_t *)provider + TABLE_OFFSET + DEVICE_CREATE_INDEX * sizeof(void *));
    if (*slot == (void *)device_create) return 0;
    if (real_device_create && *slot != (void *)real_device_create) {
        fail("providers disagree on deviceCreate", NULL);
        return -1;
    }
    real_device_create = (DeviceCreateFn)*slot;
    long page = sysconf(_SC_PAGESIZE);
    uintptr_t start = (uintptr_t)slot & ~(uintptr_t)(page - 1);
    if (mprotect((void *)start, (size_t)page, PROT_READ | PROT_WRITE) != 0) {
        fail("cannot make the provider table writable", NULL);
        return -1;
    }
    *slot = (void *)device_create;
    return 0;
}

ErrorHandle QnnInterface_getProviders(const void ***providers, uint32_t *count) {
    if (load_real() != 0) return SHIM_ERROR;
    ErrorHandle err = real_get_providers(providers, count);
    if (err != 0 || !providers || !*providers || !count) return err;
    for (uint32_t i = 0; i < *count; i++)
        if (patch_table((*providers)[i]) != 0) return SHIM_ERROR;
    return err;
}
