// test_engine.c — the I/O engine and the dense FFN op from C alone, on one layer's block file: the
// blocks read from disk (O_DIRECT where the file system allows it) and computed, then computed
// again on the resident layer; each token of a batch bit for bit that token alone (a verify
// pass equals decoding). Written for running the library of another architecture under
// qemu-user (tests/native/test_cross.py), where Python is not there: the caller compares the
// output with the numpy reference.
//
//     test_engine BLOCK_FILE X_FILE N_TOKENS ACT Y_FILE
//
// X_FILE: N_TOKENS x n_embd f32 (native byte order); ACT: silu or gelu; Y_FILE receives the
// first (reading) pass's output, the same shape. Prints one line per check; exit status 0 when
// all pass.

#include "leanstream.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int failures = 0;

#define CHECK(cond, ...) do {                                              \
        if (cond) { printf("ok   %s\n", #cond); }                          \
        else { printf("FAIL %s: ", #cond); printf(__VA_ARGS__); printf("\n"); failures++; } \
    } while (0)

static float * read_floats(const char * path, long * n) {
    FILE * f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    *n = ftell(f) / (long) sizeof(float);
    fseek(f, 0, SEEK_SET);
    float * v = malloc((size_t) *n * sizeof(float));
    if (v && fread(v, sizeof(float), (size_t) *n, f) != (size_t) *n) { free(v); v = NULL; }
    fclose(f);
    return v;
}

int main(int argc, char ** argv) {
    if (argc != 6) { fprintf(stderr, "usage: %s BLOCK_FILE X_FILE N_TOKENS ACT Y_FILE\n", argv[0]); return 2; }
    const char * paths[1] = { argv[1] };
    const long n_tokens = atol(argv[3]);
    long nx = 0;
    float * x = read_floats(argv[2], &nx);
    if (!x || n_tokens <= 0 || nx % n_tokens) { fprintf(stderr, "%s: not %ld rows of f32\n", argv[2], n_tokens); return 2; }
    const long n_embd = nx / n_tokens;
    printf("kernels: %s\n", ls_kernel_isa());

    ls_engine_params p;
    ls_engine_params_init(&p);
    p.n_layers = 1;
    p.block_paths = paths;
    p.activation = strcmp(argv[4], "gelu") == 0 ? LS_ACT_GELU : LS_ACT_SILU;
    p.mode = LS_MODE_DENSE;
    ls_engine * e = NULL;
    ls_status st = ls_engine_create(&p, &e);
    CHECK(st == LS_OK && e, "create: status %d, %s", st, ls_errmsg());
    if (!e) return 1;

    float * y = calloc((size_t) nx, sizeof(float));
    float * y2 = calloc((size_t) nx, sizeof(float));
    float * one = calloc((size_t) n_embd, sizeof(float));
    st = ls_ffn_eval_layers(e, 0, 1, x, NULL, y, n_tokens, 2);   // reads the blocks
    CHECK(st == LS_OK, "first pass: status %d", st);
    st = ls_ffn_eval_layers(e, 0, 1, x, NULL, y2, n_tokens, 2);  // on the resident layer
    CHECK(st == LS_OK, "second pass: status %d", st);
    int differ = 0;
    for (long i = 0; i < nx; i++) differ += y[i] != y2[i];
    CHECK(differ == 0 || n_tokens > LS_EXACT_ROWS, "%d values differ between reading and resident", differ);
    if (n_tokens <= LS_EXACT_ROWS) {
        int rows_differ = 0;
        for (long t = 0; t < n_tokens; t++) {
            if (ls_ffn_eval_layers(e, 0, 1, x + t * n_embd, NULL, one, 1, 2) != LS_OK) { rows_differ++; continue; }
            rows_differ += memcmp(one, y + t * n_embd, (size_t) n_embd * sizeof(float)) != 0;
        }
        CHECK(rows_differ == 0, "%d of %ld rows differ from that token alone", rows_differ, n_tokens);
    }
    char msg[LS_MAX_ERRMSG];
    CHECK(ls_engine_take_error(e, msg, sizeof msg) == LS_OK, "engine error: %s", msg);
    ls_engine_free(e);

    FILE * f = fopen(argv[5], "wb");
    CHECK(f && fwrite(y, sizeof(float), (size_t) nx, f) == (size_t) nx, "cannot write %s", argv[5]);
    if (f) fclose(f);
    free(x); free(y); free(y2); free(one);
    printf("%d failure(s)\n", failures);
    return failures ? 1 : 0;
}
