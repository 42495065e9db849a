// graph.c — the ggml side: ls_ffn_build puts one custom node per layer into llama.cpp's graph
// (the patched build_ffn calls it), and ggml's threads enter the op through ls_op_compute.

#include "internal.h"

#include "ggml.h"

static void ls_op_compute(struct ggml_tensor * dst, int ith, int nth, void * userdata) {
    ls_layer * L = userdata;
    const struct ggml_tensor * src = dst->src[0];
    const struct ggml_tensor * res = dst->src[1];
    const int64_t n_tokens = ggml_nrows(src);
    // the residual of the last token row (decode: the only one)
    const float * x_res = res ? (const float *) ((const char *) res->data + (size_t) (ggml_nrows(res) - 1) * res->nb[1]) : NULL;
    ls_op_run(L->e, L, (const float *) src->data, src->nb[1], x_res, (float *) dst->data, n_tokens, ith, nth);
}

struct ggml_tensor * ls_ffn_build(struct ggml_context * ctx0, struct ggml_tensor * cur, struct ggml_tensor * ffn_inp,
                                  int32_t il, void * engine) {
    ls_engine * e = engine;
    if (!e || il < 0 || il >= e->n_layers) {
        if (e) ls_engine_record_error(e, LS_ERR_ARG, "llama.cpp asked for FFN layer %d, the model directory has %d", il, e->n_layers);
        return NULL;
    }
    ls_layer * L = &e->layers[il];
    if (cur->type != GGML_TYPE_F32 || cur->ne[0] != L->info.n_embd || !ggml_is_contiguous_rows(cur) ||
        cur->ne[2] * cur->ne[3] != 1) {
        ls_engine_record_error(e, LS_ERR_UNSUPPORTED, "layer %d: FFN input [%lld, %lld, %lld] %s does not fit the block files (n_embd %lld)",
                               il, (long long) cur->ne[0], (long long) cur->ne[1], (long long) cur->ne[2],
                               ggml_type_name(cur->type), (long long) L->info.n_embd);
        return NULL;
    }
    // the residual entering the FFN (llama.cpp hands it over by name), as the predictors' input
    const bool res_ok = ffn_inp && ffn_inp->type == GGML_TYPE_F32 && ffn_inp->ne[0] == cur->ne[0] &&
                        ggml_nrows(ffn_inp) == ggml_nrows(cur) && ggml_is_contiguous_rows(ffn_inp);
    struct ggml_tensor * args[2] = { cur, res_ok ? ffn_inp : NULL };
    if (e->policy->sparse && !args[1]) {
        ls_engine_record_error(e, LS_ERR_UNSUPPORTED, "layer %d: llama.cpp did not hand over the residual entering "
                               "the FFN (needed by sparse modes) for this architecture", il);
        return NULL;
    }
    // sized from cur->ne[1]: the last layer sees only the output rows (inp_out_ids)
    return ggml_custom_4d(ctx0, GGML_TYPE_F32, cur->ne[0], cur->ne[1], 1, 1, args, args[1] ? 2 : 1,
                          ls_op_compute, GGML_N_TASKS_MAX, L);
}
