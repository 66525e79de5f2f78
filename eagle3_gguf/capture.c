/* Layer inputs of llama.cpp graphs that do not record them (no `t_layer_inp` hook): an eval callback
 * (llama_context_params.cb_eval) that asks for the graph tensors named in `struct capture` and copies each
 * one out as it is computed. Built once by eagle3_gguf/capture.py with the system C compiler; it calls ggml
 * through the function pointers the struct holds, so it links against nothing. Per graph node: one name
 * lookup and a few strcmp (a Python callback costs ~0.5 us a node: ~10% of a SmolLM2 step). */
#include <stdbool.h>
#include <stddef.h>
#include <string.h>

#define CAPTURE_SLOTS 4
#define CAPTURE_NAME 64 /* GGML_MAX_NAME */

struct ggml_tensor;

struct capture {
    const char * (*get_name)(const struct ggml_tensor *);                          /* ggml_get_name */
    size_t (*nbytes)(const struct ggml_tensor *);                                  /* ggml_nbytes */
    void (*tensor_get)(const struct ggml_tensor *, void *, size_t, size_t);       /* ggml_backend_tensor_get */
    int n;                                      /* slots in use */
    char names[CAPTURE_SLOTS][CAPTURE_NAME];    /* graph tensor names, e.g. "l_out-13" */
    char * dst[CAPTURE_SLOTS];                  /* where each slot's rows go */
    size_t cap[CAPTURE_SLOTS];                  /* bytes there */
    size_t off[CAPTURE_SLOTS];                  /* bytes written since the caller reset it (one per ubatch) */
    int overflow;                               /* set when a slot would have overflowed (nothing written) */
};

size_t eagle3_capture_size(void) { return sizeof(struct capture); } /* checked against ctypes' */

bool eagle3_capture(struct ggml_tensor * t, bool ask, void * user_data) {
    struct capture * c = (struct capture *) user_data;
    const char * name = c->get_name(t);
    for (int i = 0; i < c->n; i++) {
        if (strcmp(name, c->names[i]) != 0) {
            continue;
        }
        if (ask) {
            return true;
        }
        size_t n = c->nbytes(t);
        if (c->off[i] + n > c->cap[i]) {
            c->overflow = 1;
        } else {
            c->tensor_get(t, c->dst[i] + c->off[i], 0, n);
            c->off[i] += n;
        }
        return true;
    }
    return !ask; /* asked: not wanted; told: go on computing */
}
