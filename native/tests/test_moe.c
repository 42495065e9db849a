// test_moe.c — the MoE op as llama.cpp's graph runs it: ls_moe_build's node in a ggml graph on
// the CPU backend, with selected a strided view (as ggml_argsort_top_k makes it) and weights
// [1, n_used, n_tokens] (as build_moe_ffn's get_rows makes them), gives the bits ls_moe_eval gives
// on plain arrays, at 1 and 3 graph threads; shapes that do not fit are refused with a status,
// not an abort. Built and run by tests/native/test_moe.py:
//     ./test_moe EXPERT_FILE        (layer 0's expert file)
// Prints one line per check and "N failure(s)"; exit status 0 when all pass.
//
// The programs of native/tests/ link libleanstream and libllama only (leanstream_ggml/build.py
// builds them all so, for aarch64 too): ggml's functions are looked up in the libggml that
// libllama loaded (the instance libleanstream's op runs on), through the GGML_FNS table.

#define _GNU_SOURCE   // RTLD_DEFAULT
#include "leanstream.h"

#include "ggml.h"
#include "ggml-backend.h"

#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define GGML_FNS(X) X(ggml_backend_load_all) X(ggml_init) X(ggml_free) X(ggml_new_tensor_2d) X(ggml_new_tensor_3d) \
    X(ggml_view_2d) X(ggml_new_graph) X(ggml_build_forward_expand) X(ggml_backend_init_by_type) X(ggml_backend_free) \
    X(ggml_backend_get_device) X(ggml_backend_dev_backend_reg) X(ggml_backend_reg_get_proc_address) X(ggml_backend_graph_compute)
#define GGML_PTR(f) static __typeof__(&f) p_##f;
GGML_FNS(GGML_PTR)
#define GGML_LOOKUP(f) if (!(p_##f = (__typeof__(&f)) dlsym(RTLD_DEFAULT, #f))) { printf("FAIL ggml has no %s\n", #f); return 0; }
static int load_ggml(void) { GGML_FNS(GGML_LOOKUP) return 1; }

static int failures = 0;

#define CHECK(cond, ...) do {                                              \
        if (cond) { printf("ok   %s\n", #cond); }                          \
        else { printf("FAIL %s: ", #cond); printf(__VA_ARGS__); printf("\n"); failures++; } \
    } while (0)

enum { T = 5, N_USED = 3 };

static void set_threads(ggml_backend_t be, int n) {
    ggml_backend_reg_t reg = p_ggml_backend_dev_backend_reg(p_ggml_backend_get_device(be));
    ggml_backend_set_n_threads_t fn = (ggml_backend_set_n_threads_t) p_ggml_backend_reg_get_proc_address(reg, "ggml_backend_set_n_threads");
    if (fn) fn(be, n);
}

int main(int argc, char ** argv) {
    if (argc < 2) { fprintf(stderr, "usage: test_moe EXPERT_FILE\n"); return 2; }
    if (!load_ggml()) { printf("1 failure(s)\n"); return 1; }
    p_ggml_backend_load_all();
    ls_moe_params p;
    ls_moe_params_init(&p);
    p.n_layer = 1;
    const char * paths[1] = { argv[1] };
    ls_moe * m = NULL;
    ls_status st = ls_moe_create(&p, paths, &m);
    CHECK(st == LS_OK, "%s", ls_errmsg());
    if (st != LS_OK) { printf("%d failure(s)\n", failures); return 1; }
    ls_moe_info info;
    CHECK(ls_moe_layer_info(m, 0, &info) == LS_OK, "%s", ls_errmsg());
    const int64_t n_embd = info.n_embd, ne = info.n_expert;

    struct ggml_init_params ip = { 64u << 20, NULL, false };
    struct ggml_context * ctx = p_ggml_init(ip);
    struct ggml_tensor * cur = p_ggml_new_tensor_2d(ctx, GGML_TYPE_F32, n_embd, T);          // [n_embd, T]
    struct ggml_tensor * all = p_ggml_new_tensor_2d(ctx, GGML_TYPE_I32, ne, T);              // a ranking per token
    struct ggml_tensor * w = p_ggml_new_tensor_3d(ctx, GGML_TYPE_F32, 1, N_USED, T);         // [1, n_used, T]
    int32_t ids[T][N_USED];                                                                // contiguous copies for eval
    float wts[T][N_USED];
    for (int64_t t = 0; t < T; t++) {
        for (int64_t i = 0; i < n_embd; i++) ((float *) cur->data)[t * n_embd + i] = (float) ((i * 7 + t * 13) % 17) / 8.0f - 1.0f;
        for (int64_t j = 0; j < ne; j++) ((int32_t *) all->data)[t * ne + j] = (int32_t) ((t + j * 3) % ne);
        for (int k = 0; k < N_USED; k++) {
            ids[t][k] = ((int32_t *) all->data)[t * ne + k];
            wts[t][k] = ((float *) w->data)[t * N_USED + k] = 0.5f / (float) (k + 1);
        }
    }
    struct ggml_tensor * sel = p_ggml_view_2d(ctx, all, N_USED, T, all->nb[1], 0);           // top-k view: nb[1] > N_USED * 4
    struct ggml_tensor * node = ls_moe_build(ctx, cur, sel, w, 0, m);
    CHECK(node != NULL, "ls_moe_build refused the shapes");
    char msg[LS_MAX_ERRMSG];
    // a wrong width: NULL and an error, no abort
    struct ggml_tensor * bad = p_ggml_new_tensor_2d(ctx, GGML_TYPE_F32, n_embd + 1, T);
    CHECK(ls_moe_build(ctx, bad, sel, w, 0, m) == NULL, "accepted n_embd + 1");
    CHECK(ls_moe_take_error(m, msg, sizeof msg) == LS_ERR_UNSUPPORTED, "no error recorded");
    CHECK(ls_moe_build(ctx, cur, sel, w, 1, m) == NULL, "accepted a layer without an expert file");
    ls_moe_take_error(m, msg, sizeof msg);

    float * y_eval = malloc(sizeof(float) * (size_t) (n_embd * T));
    float * y_graph = malloc(sizeof(float) * (size_t) (n_embd * T));
    st = ls_moe_eval(m, 0, (const float *) cur->data, T, &ids[0][0], &wts[0][0], N_USED, y_eval, 2);
    CHECK(st == LS_OK, "%s", ls_errmsg());
    if (node) {
        struct ggml_cgraph * gf = p_ggml_new_graph(ctx);
        p_ggml_build_forward_expand(gf, node);
        ggml_backend_t be = p_ggml_backend_init_by_type(GGML_BACKEND_DEVICE_TYPE_CPU, NULL);
        CHECK(be != NULL, "no CPU backend");
        for (int nt = 1; be && nt <= 3; nt += 2) {
            set_threads(be, nt);
            CHECK(p_ggml_backend_graph_compute(be, gf) == GGML_STATUS_SUCCESS, "graph at %d threads", nt);
            CHECK(ls_moe_take_error(m, msg, sizeof msg) == LS_OK, "%s", msg);
            memcpy(y_graph, node->data, sizeof(float) * (size_t) (n_embd * T));
            CHECK(memcmp(y_graph, y_eval, sizeof(float) * (size_t) (n_embd * T)) == 0, "graph at %d threads != eval", nt);
        }
        if (be) p_ggml_backend_free(be);
    }
    ls_moe_counters c;
    CHECK(ls_moe_stats(m, -1, &c) == LS_OK && c.op_calls == 3 && c.routed == 3 * T * N_USED, "op_calls %llu routed %llu",
          (unsigned long long) c.op_calls, (unsigned long long) c.routed);
    free(y_eval);
    free(y_graph);
    p_ggml_free(ctx);
    ls_moe_free(m);
    printf("%d failure(s)\n", failures);
    return failures ? 1 : 0;
}
