// test_api.c — the native interface tested from C alone, the way a C host uses it (no Python):
// the ABI version, the mode table, CRC-32C against its reference, and the error paths a host
// meets first (bad parameters, missing and malformed files): each returns a status and a
// message, and never aborts the process. Built and run by tests/native/test_c_api.py:
//     cc -I native/include native/tests/test_api.c -lleanstream -o test_api && ./test_api DIR
// (DIR: a scratch directory). Prints one line per check; exit status 0 when all pass.

#include "leanstream.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int failures = 0;

#define CHECK(cond, ...) do {                                              \
        if (cond) { printf("ok   %s\n", #cond); }                          \
        else { printf("FAIL %s: ", #cond); printf(__VA_ARGS__); printf("\n"); failures++; } \
    } while (0)

static void test_abi_and_modes(void) {
    CHECK(ls_abi_version() == LS_ABI_VERSION, "library ABI %d, header %d", ls_abi_version(), LS_ABI_VERSION);
    CHECK(strcmp(ls_mode_name(LS_MODE_DENSE), "dense") == 0, "mode 0 is %s", ls_mode_name(LS_MODE_DENSE));
    CHECK(ls_mode_name(LS_N_MODES) == NULL && ls_mode_name(-1) == NULL, "names outside the table");
    CHECK(ls_mode_uses(LS_MODE_DENSE) == 0, "dense uses %d", ls_mode_uses(LS_MODE_DENSE));
    for (int32_t m = 1; m < LS_N_MODES; m++) {
        const int32_t u = ls_mode_uses(m);
        // every sparse mode decodes sparse and selects through a sketch or the predictors
        CHECK((u & LS_DECODES_SPARSE) && (u & (LS_USES_SKETCH | LS_USES_PREDICTORS)),
              "mode %s uses %d", ls_mode_name(m), u);
    }
}

static void test_crc32c(void) {
    CHECK(ls_crc32c(0, "123456789", 9) == 0xE3069283u, "check value %08x", ls_crc32c(0, "123456789", 9));
    // every length and alignment up to a few cache lines, and one large buffer in pieces
    static unsigned char buf[70000];
    unsigned s = 12345;
    for (size_t i = 0; i < sizeof buf; i++) { s = s * 1103515245u + 12345u; buf[i] = (unsigned char)(s >> 16); }
    int bad = 0;
    for (size_t off = 0; off < 16; off++)
        for (size_t len = 0; len < 300; len++)
            bad += ls_crc32c(7, buf + off, len) != ls_crc32c_ref(7, buf + off, len);
    CHECK(bad == 0, "%d (offset, length) pairs differ from the reference", bad);
    const uint32_t whole = ls_crc32c(0, buf, sizeof buf);
    const uint32_t parts = ls_crc32c(ls_crc32c(ls_crc32c(0, buf, 1000), buf + 1000, 33333), buf + 34333,
                                     sizeof buf - 34333);
    CHECK(whole == parts && whole == ls_crc32c_ref(0, buf, sizeof buf), "streamed %08x, one-shot %08x", parts, whole);
}

static void test_create_errors(const char * dir) {
    ls_engine_params p;
    ls_engine * e = (ls_engine *)&p;   // must be set to NULL on failure
    ls_engine_params_init(&p);
    ls_status st = ls_engine_create(&p, &e);   // no layers
    CHECK(st == LS_ERR_ARG && e == NULL && ls_errmsg()[0], "status %d, message '%s'", st, ls_errmsg());
    CHECK(ls_engine_create(NULL, &e) == LS_ERR_ARG, "a NULL params pointer");

    char missing[4096], garbage[4096];
    snprintf(missing, sizeof missing, "%s/no-such-file.bin", dir);
    snprintf(garbage, sizeof garbage, "%s/garbage.bin", dir);
    FILE * f = fopen(garbage, "wb");
    for (int i = 0; i < 8192; i++) fputc(i * 7 & 0xff, f);
    fclose(f);

    const char * paths[1] = { missing };
    p.n_layers = 1; p.block_paths = paths;
    st = ls_engine_create(&p, &e);
    CHECK(st == LS_ERR_IO && e == NULL && strstr(ls_errmsg(), "no-such-file"), "status %d, message '%s'", st, ls_errmsg());
    paths[0] = garbage;
    st = ls_engine_create(&p, &e);
    CHECK(st == LS_ERR_FORMAT && e == NULL && strstr(ls_errmsg(), "garbage"), "status %d, message '%s'", st, ls_errmsg());
    p.mode = LS_N_MODES;
    CHECK(ls_engine_create(&p, &e) == LS_ERR_ARG, "an unknown mode");

    ls_predictor * pr = NULL;
    st = ls_predictor_load(garbage, &pr);
    CHECK(st == LS_ERR_FORMAT && pr == NULL, "predictor from garbage: status %d", st);
    st = ls_predictor_load(missing, &pr);
    CHECK(st == LS_ERR_IO && pr == NULL, "predictor from a missing file: status %d", st);
    st = ls_predictor_load_mem("LSPR", 4, &pr);
    CHECK(st == LS_ERR_FORMAT && pr == NULL, "predictor from 4 bytes: status %d", st);
    ls_engine_free(NULL);       // freeing nothing is allowed
    ls_predictor_free(NULL);
}

int main(int argc, char ** argv) {
    if (argc != 2) { fprintf(stderr, "usage: %s SCRATCH_DIR\n", argv[0]); return 2; }
    test_abi_and_modes();
    test_crc32c();
    test_create_errors(argv[1]);
    printf("%d failure(s)\n", failures);
    return failures ? 1 : 0;
}
