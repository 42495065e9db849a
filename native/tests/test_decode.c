// test_decode.c — a converted model decoded by the patched libllama with libleanstream's FFN op,
// from C alone (the way a C host uses the two libraries): the model's base.gguf loaded by
// llama.cpp, every layer's FFN computed by a dense engine on its block files, a prompt prefilled
// and N tokens decoded greedily. Prints the tokens, so that the caller compares the decode of
// one build (aarch64 under qemu-user) with another's (x86-64): tests/native/test_cross.py.
//
//     test_decode BASE_GGUF ACT N_PREDICT PROMPT_TOKENS BLOCK_FILE...
//
// ACT: silu or gelu; PROMPT_TOKENS: comma-separated token ids. Prints "tokens: t1 t2 ..." and
// one line per check; exit status 0 when all pass.

#include "leanstream.h"
#include "llama.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int failures = 0;

#define CHECK(cond, ...) do {                                              \
        if (cond) { printf("ok   %s\n", #cond); }                          \
        else { printf("FAIL %s: ", #cond); printf(__VA_ARGS__); printf("\n"); failures++; } \
    } while (0)

static int32_t argmax(const float * v, int32_t n) {
    int32_t best = 0;
    for (int32_t i = 1; i < n; i++) if (v[i] > v[best]) best = i;
    return best;
}

int main(int argc, char ** argv) {
    if (argc < 6) {
        fprintf(stderr, "usage: %s BASE_GGUF ACT N_PREDICT PROMPT_TOKENS BLOCK_FILE...\n", argv[0]);
        return 2;
    }
    const int n_predict = atoi(argv[3]);
    llama_token prompt[512];
    int n_prompt = 0;
    for (char * s = argv[4]; *s && n_prompt < 512; ) {
        prompt[n_prompt++] = (llama_token) strtol(s, &s, 10);
        if (*s == ',') s++;
    }

    ls_engine_params p;
    ls_engine_params_init(&p);
    p.n_layers = argc - 5;
    p.block_paths = (const char * const *) (argv + 5);
    p.activation = strcmp(argv[2], "gelu") == 0 ? LS_ACT_GELU : LS_ACT_SILU;
    p.mode = LS_MODE_DENSE;
    ls_engine * e = NULL;
    ls_status st = ls_engine_create(&p, &e);
    CHECK(st == LS_OK, "engine: status %d, %s", st, ls_errmsg());
    if (st != LS_OK) return 1;

    llama_backend_init();
    struct llama_model_params mp = llama_model_default_params();
    struct llama_model * model = llama_model_load_from_file(argv[1], mp);
    CHECK(model != NULL, "cannot load %s", argv[1]);
    if (!model) return 1;
    struct llama_context_params cp = llama_context_default_params();
    cp.n_ctx = 256;
    cp.n_batch = cp.n_ubatch = 64;
    cp.n_threads = cp.n_threads_batch = 2;
    struct llama_context * ctx = llama_init_from_model(model, cp);
    CHECK(ctx != NULL, "cannot create a context");
    if (!ctx) return 1;
    llama_set_ffn_builder(ctx, ls_ffn_build, e);
    const int32_t n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));

    printf("kernels: %s, ggml CPU backend %s\n", ls_kernel_isa(), ls_ggml_cpu_variant());
    llama_token out[512];
    int n_out = 0;
    int rc = llama_decode(ctx, llama_batch_get_one(prompt, n_prompt));
    while (rc == 0 && n_out < n_predict && n_out < 512) {
        llama_token t = argmax(llama_get_logits_ith(ctx, -1), n_vocab);
        out[n_out++] = t;
        rc = llama_decode(ctx, llama_batch_get_one(&out[n_out - 1], 1));
    }
    CHECK(rc == 0, "llama_decode returned %d", rc);
    char msg[LS_MAX_ERRMSG];
    CHECK(ls_engine_take_error(e, msg, sizeof msg) == LS_OK, "engine error: %s", msg);
    printf("tokens:");
    for (int i = 0; i < n_out; i++) printf(" %d", out[i]);
    printf("\n");

    llama_free(ctx);
    llama_model_free(model);
    ls_engine_free(e);
    llama_backend_free();
    printf("%d failure(s)\n", failures);
    return failures ? 1 : 0;
}
