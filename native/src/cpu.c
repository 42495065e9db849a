// ggml's CPU backend, as libggml loaded it.
//
// llama.cpp is built with one CPU backend module per instruction set (libggml-cpu-haswell.so,
// -zen4.so, ...; GGML_BACKEND_DL) and libggml dlopens the best for this CPU, privately
// (RTLD_LOCAL). The op needs that module's type traits (vec_dot, from_float), so they are
// looked up in it here rather than linked: linking a CPU module would load a second copy.

#include "internal.h"

#include <dlfcn.h>
#include <pthread.h>
#include <string.h>

#include "ggml-backend.h"
#include "ggml-cpu.h"

typedef const struct ggml_type_traits_cpu * (*traits_fn)(enum ggml_type);

static pthread_once_t g_once = PTHREAD_ONCE_INIT;
static traits_fn g_traits;
static char g_variant[64] = "none";
static char g_path[512];

static void resolve(void) {
    ggml_backend_reg_t reg = ggml_backend_reg_by_name("CPU");
    if (!reg) {
        ggml_backend_load_all();  // what llama_backend_init does when nothing is loaded yet
        reg = ggml_backend_reg_by_name("CPU");
    }
    if (!reg) return;
    // any address inside the module names its file
    void * probe = ggml_backend_reg_get_proc_address(reg, "ggml_backend_get_features");
    Dl_info info;
    if (!probe || !dladdr(probe, &info) || !info.dli_fname) return;
    void * h = dlopen(info.dli_fname, RTLD_NOW | RTLD_NOLOAD);  // the loaded copy, not a new one
    if (!h) return;
    traits_fn traits = (traits_fn) dlsym(h, "ggml_get_type_traits_cpu");
    void (*init)(void) = (void (*)(void)) dlsym(h, "ggml_cpu_init");
    if (!traits || !init) return;
    init();  // fp16 tables for the type traits (idempotent)
    snprintf(g_path, sizeof g_path, "%s", info.dli_fname);
    const char * base = strrchr(g_path, '/');
    base = base ? base + 1 : g_path;
    // libggml-cpu-<variant>.so[.N]; a build without variants has libggml-cpu.so
    const char * pre = "libggml-cpu";
    if (strncmp(base, pre, strlen(pre)) == 0) base += strlen(pre);
    if (*base == '-') base++;
    const char * so = strstr(base, ".so");   // (ARM variant names have dots: armv8.2_1)
    size_t n = so ? (size_t) (so - base) : strlen(base);
    if (n == 0) snprintf(g_variant, sizeof g_variant, "ggml-cpu");
    else snprintf(g_variant, sizeof g_variant, "%.*s", (int) n, base);
    g_traits = traits;
}

bool ls_cpu_ready(void) {
    pthread_once(&g_once, resolve);
    return g_traits != NULL;
}

const struct ggml_type_traits_cpu * ls_cpu_traits(enum ggml_type t) {
    return ls_cpu_ready() ? g_traits(t) : NULL;
}

bool ls_cpu_dots_rows(int32_t t) {
    if (t < 0 || t >= GGML_TYPE_COUNT) return false;
    const struct ggml_type_traits_cpu * tc = ls_cpu_traits((enum ggml_type) t);
    const struct ggml_type_traits_cpu * vt = tc && tc->vec_dot ? ls_cpu_traits(tc->vec_dot_type) : NULL;
    return tc && tc->vec_dot && vt && vt->from_float;
}

int32_t ls_ggml_type_dots(int32_t t) { return ls_cpu_dots_rows(t) ? 1 : 0; }

const char * ls_ggml_cpu_variant(void) {
    ls_cpu_ready();
    return g_variant;
}

const char * ls_ggml_cpu_path(void) {
    ls_cpu_ready();
    return g_path;
}
