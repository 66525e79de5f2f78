/* A backend sampler (llama.h's llama_sampler_i, backend_apply) that leaves in the graph only what a greedy verify or
 * draft step reads of an output row: its argmax, or its k likeliest token ids in no order, and on request their
 * probabilities under a softmax over the whole row. llama.cpp's own greedy sampler also hands the whole row back
 * (as its "sampled logits": 128,256 floats a row at Llama 3's vocab, copied to the host on every decode).
 * Built once by eagle3_gguf/choice.py with the system C compiler (cbuild.py); it calls ggml through the function
 * pointers `struct choice` holds, so it links against nothing. */
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

struct ggml_tensor;
struct ggml_context;
struct ggml_cgraph;

struct llama_sampler_data {
    struct ggml_tensor * logits;
    struct ggml_tensor * probs;
    struct ggml_tensor * sampled;
    struct ggml_tensor * candidates;
};

typedef struct { int32_t id; float logit; float p; } llama_token_data;
typedef struct { llama_token_data * data; size_t size; int64_t selected; bool sorted; } llama_token_data_array;

struct llama_sampler;

struct llama_sampler_i { /* llama.h's, at the pinned llama.cpp */
    const char * (*name)(const struct llama_sampler *);
    void (*accept)(struct llama_sampler *, int32_t);
    void (*apply)(struct llama_sampler *, llama_token_data_array *);
    void (*reset)(struct llama_sampler *);
    struct llama_sampler * (*clone)(const struct llama_sampler *);
    void (*free)(struct llama_sampler *);
    bool (*backend_init)(struct llama_sampler *, void * buft, uint32_t n_outputs_max_per_seq);
    void (*backend_accept)(struct llama_sampler *, struct ggml_context *, struct ggml_cgraph *, struct ggml_tensor *);
    void (*backend_apply)(struct llama_sampler *, struct ggml_context *, struct ggml_cgraph *,
                          struct llama_sampler_data *);
    void (*backend_set_input)(struct llama_sampler *);
    void (*backend_reset)(struct llama_sampler *);
    void (*copy_state)(const struct llama_sampler *, struct llama_sampler *);
};

struct llama_sampler {
    struct llama_sampler_i * iface;
    void * ctx;
};

struct choice {
    int64_t (*nelements)(const struct ggml_tensor *);                                                  /* ggml_nelements */
    struct ggml_tensor * (*reshape_1d)(struct ggml_context *, struct ggml_tensor *, int64_t);          /* ggml_reshape_1d */
    struct ggml_tensor * (*reshape_2d)(struct ggml_context *, struct ggml_tensor *, int64_t, int64_t); /* ggml_reshape_2d */
    struct ggml_tensor * (*soft_max)(struct ggml_context *, struct ggml_tensor *);                     /* ggml_soft_max */
    struct ggml_tensor * (*argmax)(struct ggml_context *, struct ggml_tensor *);                       /* ggml_argmax */
    struct ggml_tensor * (*top_k)(struct ggml_context *, struct ggml_tensor *, int);                   /* ggml_top_k */
    struct ggml_tensor * (*get_rows)(struct ggml_context *, struct ggml_tensor *, struct ggml_tensor *);/* ggml_get_rows */
    int k;     /* 1: the argmax (as the sampled token); more: the k likeliest ids (as candidates) */
    int probs; /* also their probabilities */
};

size_t eagle3_choice_size(void) { return sizeof(struct choice); } /* checked against ctypes' */

static const char * choice_name(const struct llama_sampler * smpl) {
    (void) smpl;
    return "eagle3-choice";
}

/* Off the graph (llama_sampler_sample): the likeliest candidate. */
static void choice_apply(struct llama_sampler * smpl, llama_token_data_array * cur) {
    (void) smpl;
    size_t best = 0;
    for (size_t i = 1; i < cur->size; i++) {
        if (cur->data[i].logit > cur->data[best].logit) {
            best = i;
        }
    }
    cur->selected = (int64_t) best;
}

static bool choice_backend_init(struct llama_sampler * smpl, void * buft, uint32_t n_outputs_max_per_seq) {
    (void) smpl; (void) buft; (void) n_outputs_max_per_seq;
    return true; /* an op the device lacks runs where ggml's scheduler puts it */
}

static void choice_backend_apply(struct llama_sampler * smpl, struct ggml_context * ctx, struct ggml_cgraph * gf,
                                 struct llama_sampler_data * data) {
    (void) gf;
    const struct choice * c = (const struct choice *) smpl->ctx;
    struct ggml_tensor * row = c->reshape_1d(ctx, data->logits, c->nelements(data->logits)); /* [n_vocab] */
    struct ggml_tensor * ids = c->k > 1 ? c->top_k(ctx, row, c->k) : c->argmax(ctx, row);    /* [k] i32 */
    if (c->probs) {
        struct ggml_tensor * p = c->reshape_2d(ctx, c->soft_max(ctx, row), 1, c->nelements(row)); /* [n_vocab, 1] */
        data->probs = c->get_rows(ctx, p, ids);                                                 /* [k, 1] */
    }
    if (c->k > 1) {
        data->candidates = ids;
    } else {
        data->sampled = ids;
    }
    data->logits = NULL; /* the row stays on the device */
}

static struct llama_sampler_i choice_iface = {
    choice_name, NULL, choice_apply, NULL, NULL, NULL, choice_backend_init, NULL, choice_backend_apply, NULL, NULL,
    NULL,
};

struct llama_sampler_i * eagle3_choice_iface(void) { return &choice_iface; }
