/* The head's greedy draft chain in one call: decode, read the graph's choice (choice.c), judge, feed the step's
 * pre-norm hidden state back, again, with no Python between steps (a step's Python, cache-cold, cost ~35 us on a
 * 2-core EPYC with runner-ups, where the step's graph takes ~0.35 ms on a GPU: bench/NOTES.md "chain").
 * Eagle3Session.draft's loop, the same steps in the same order; the judges are draft.py's judge_p_min and
 * AdaptivePolicy.judge, written again here over the policy's own arrays (Acceptance's), which this call updates in
 * place as the Python judge does.
 * Built once by eagle3_gguf/chain.py with the system C compiler (cbuild.py); it calls llama.cpp through the function
 * pointers `struct chain` holds, so it links against nothing. */
#include <stdbool.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

struct llama_context;

#define CHOICE_MAX 64 /* the most tokens the graph may choose a step (chain.py's CHOICE_MAX) */

typedef struct llama_batch { /* llama.h's, at the pinned llama.cpp */
    int32_t n_tokens;
    int32_t * token;
    float * embd;
    int32_t * pos;
    int32_t * n_seq_id;
    int32_t ** seq_id;
    int8_t * logits;
} llama_batch;

struct chain {
    int32_t (*decode)(struct llama_context *, llama_batch);                          /* llama_decode */
    void (*synchronize)(struct llama_context *);                                     /* llama_synchronize */
    int32_t (*sampled_token)(struct llama_context *, int32_t);                       /* llama_get_sampled_token_ith */
    float * (*sampled_probs)(struct llama_context *, int32_t);                       /* llama_get_sampled_probs_ith */
    uint32_t (*sampled_probs_count)(struct llama_context *, int32_t);                /* ..._probs_count_ith */
    int32_t * (*sampled_candidates)(struct llama_context *, int32_t);                /* ..._candidates_ith */
    uint32_t (*sampled_candidates_count)(struct llama_context *, int32_t);           /* ..._candidates_count_ith */
    int32_t (*encode)(struct llama_context *, llama_batch);                          /* llama_encode */
    void * (*get_memory)(struct llama_context *);                                    /* llama_get_memory */
    bool (*seq_rm)(void *, int32_t, int32_t, int32_t);                               /* llama_memory_seq_rm */
    int32_t (*seq_pos_max)(void *, int32_t);                                         /* llama_memory_seq_pos_max */
    float * (*nextn_ith)(struct llama_context *, int32_t);                           /* llama_get_embeddings_nextn_ith */
    float * (*nextn)(struct llama_context *);                                        /* llama_get_embeddings_nextn */
    int32_t n_embd;                                                                  /* the head's */
    int32_t n_feat;                                                                  /* its encoder's input: 3 layers */
};

/* Eagle3Session._seed_aside's: the rows set aside, encoded straight into the decoder batch behind the deferred pair
 * (o = 1) and before the seed step, all one run of positions from pos0. */
struct chain_seed {
    const float * feats;     /* [n, n_feat]: the rows set aside */
    const int32_t * tokens;  /* [o + n]: token[p + 1] at each position p, id_last at the seed's */
    const float * pending_g; /* [n_embd]: the deferred pair's g (o = 1) */
    float * seed_g;          /* [n_embd] out: the seed step's g (the next pending_g) */
    int32_t n;
    int32_t o;
    int32_t pos0;            /* the decoder batch's first position */
};

/* The judge between steps. kind 0: judge_p_min. kind 1: AdaptivePolicy.judge, over Acceptance's arrays. */
struct judge {
    int32_t kind;
    int32_t k_max;             /* Acceptance's positions (n_max <= k_max) */
    int32_t n_bins;
    double p_min;              /* kind 0 */
    double prior;              /* PRIOR_COUNT */
    double ema;                /* LOOKAHEAD_EMA */
    double r;                  /* the rate to beat, tokens per calibrated second */
    double step_s;             /* a draft step's price */
    const double * prices;     /* [k_max + 1]: verifying 1.. rows this cycle */
    const double * hits;       /* [k_max, n_bins] */
    const double * seen;       /* [k_max, n_bins] */
    const double * pool_hits;  /* [n_bins] */
    const double * pool_seen;  /* [n_bins] */
    double * lookahead;        /* [k_max], updated in place (saw_step) */
    const double * confs_seen; /* [n_max] or NULL: the confidences the judge sees instead of the head's (a replay) */
    double best_gain;          /* out (kind 1): the expected drafts kept of the prefix chosen */
};

struct chain_run { /* the buffers a draft writes, and what it says */
    int32_t k;          /* the tokens the graph chooses a step */
    int32_t n_alt;      /* runner-ups reported a step (< k) */
    int32_t * tokens;   /* [n_max] out */
    double * confs;     /* [n_max] out */
    int32_t * alt_tokens; /* [n_max, n_alt] out, the likeliest first */
    double * alt_probs;   /* [n_max, n_alt] out */
    int32_t steps;      /* out: steps run */
    int32_t decoded;    /* out: whether a graph succeeded (its outputs are there to read) */
    int32_t seeded;     /* out: the seed's batch was filled and the head's cache cut after its position */
    int32_t keep;       /* out: drafts to verify */
    double t_native;    /* out: seconds in decode + synchronize */
    double t_steps;     /* out: seconds from the second step's start to the end */
};

size_t eagle3_chain_size(void) { return sizeof(struct chain); } /* checked against ctypes' */
size_t eagle3_chain_judge_size(void) { return sizeof(struct judge); }
size_t eagle3_chain_run_size(void) { return sizeof(struct chain_run); }
size_t eagle3_chain_seed_size(void) { return sizeof(struct chain_seed); }

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double) t.tv_sec + 1e-9 * (double) t.tv_nsec;
}

static int bin_of(double conf, int n_bins) {
    int b = (int) (conf * n_bins);
    return b < n_bins - 1 ? b : n_bins - 1;
}

/* Acceptance.prob(i, conf) */
static double prob(const struct judge * j, int i, double conf) {
    int b = bin_of(conf, j->n_bins);
    double pooled = j->pool_hits[b] / j->pool_seen[b];
    return (j->hits[i * j->n_bins + b] + j->prior * pooled) / (j->seen[i * j->n_bins + b] + j->prior);
}

static void saw_step(struct judge * j, int i, double p) {
    j->lookahead[i] += j->ema * (p - j->lookahead[i]);
}

/* After step i = n (confs[0..n-1]): -1 to draft another step, else the drafts to verify. */
static int judge(struct judge * j, const double * confs, int n, int n_max) {
    if (j->kind == 0) {
        if (confs[n - 1] < j->p_min) {
            return n - 1;
        }
        return n >= n_max ? n : -1;
    }
    const double * c = j->prices;
    const double last = confs[n - 1];
    double reach = 1.0, gain = 0.0, best_v = -j->r * c[0], best_gain = 0.0;
    int best_j = 0;
    for (int t = 1; t <= n; t++) { /* stopping now: the best prefix of what was drafted */
        reach *= prob(j, t - 1, confs[t - 1]);
        gain += reach;
        double v = gain - j->r * c[t];
        if (v > best_v) {
            best_j = t, best_v = v, best_gain = gain;
        }
    }
    saw_step(j, n - 1, prob(j, n - 1, last));
    for (int t = n; t < j->k_max; t++) {
        saw_step(j, t, prob(j, t, last));
    }
    for (int t = n + 1; t <= n_max; t++) { /* drafting on, at the last step's acceptance (prob reads no lookahead) */
        reach *= prob(j, t - 1, last);
        gain += reach;
        if (gain - j->r * (c[t] + (double) (t - n) * j->step_s) > best_v) {
            return -1;
        }
    }
    j->best_gain = best_gain;
    return best_j;
}

/* The step's token, top probability and runner-ups (the likeliest first) as the graph chose them at batch row `row`;
 * -1 where it chose nothing there. */
static int chosen(const struct chain * api, struct llama_context * ctx, const struct chain_run * run, int row,
                  int step) {
    const int k = run->k;
    if ((int) api->sampled_probs_count(ctx, row) != k ||
        (k > 1 && (int) api->sampled_candidates_count(ctx, row) != k)) {
        return -1;
    }
    const float * p = api->sampled_probs(ctx, row);
    int32_t one;
    const int32_t * ids = k > 1 ? api->sampled_candidates(ctx, row) : (one = api->sampled_token(ctx, row), &one);
    int order[CHOICE_MAX];
    for (int i = 0; i < k; i++) { /* insertion sort, likeliest first; ties keep the graph's order (Python's sorted) */
        int t = i;
        while (t > 0 && p[order[t - 1]] < p[i]) {
            order[t] = order[t - 1];
            t--;
        }
        order[t] = i;
    }
    run->tokens[step] = ids[order[0]];
    run->confs[step] = (double) p[order[0]];
    for (int a = 0; a < run->n_alt; a++) {
        run->alt_tokens[step * run->n_alt + a] = ids[order[1 + a]];
        run->alt_probs[step * run->n_alt + a] = (double) p[order[1 + a]];
    }
    return 0;
}

/* Timed into run->t_native: a graph call and llama_synchronize. */
static int32_t run_graph(const struct chain * api, struct llama_context * ctx, struct chain_run * run,
                         int32_t (*graph)(struct llama_context *, llama_batch), llama_batch * batch) {
    double t0 = now();
    int32_t rc = graph(ctx, *batch);
    api->synchronize(ctx);
    run->t_native += now() - t0;
    if (rc == 0) {
        run->decoded = 1;
    }
    return rc;
}

static int start(struct chain_run * run, const struct judge * j, int32_t n_max, int32_t k, int32_t n_alt) {
    run->k = k, run->n_alt = n_alt;
    run->steps = 0, run->decoded = 0, run->seeded = 0, run->keep = 0, run->t_native = 0.0, run->t_steps = 0.0;
    return k <= CHOICE_MAX && n_alt < k && (j->kind != 1 || n_max <= j->k_max);
}

/* The steps from the seed's decode on (the batch holds it at `row`, head position `pos`). */
static int32_t steps(const struct chain * api, struct llama_context * ctx, llama_batch * batch, struct chain_run * run,
                     struct judge * j, int32_t row, int32_t pos, int32_t n_max) {
    double t_later = 0.0;
    for (;;) {
        int32_t rc = run_graph(api, ctx, run, api->decode, batch);
        if (rc != 0) {
            return rc;
        }
        const int step = run->steps;
        if (chosen(api, ctx, run, row, step) != 0) {
            return -100000 - row;
        }
        run->steps = step + 1;
        const double * confs = j->confs_seen != NULL ? j->confs_seen : run->confs;
        if (!(confs[step] >= 0.0 && confs[step] <= 1.0)) { /* NaN included */
            return -400000 - step;
        }
        int keep = judge(j, confs, step + 1, n_max);
        if (keep >= 0) {
            run->keep = keep;
            if (t_later != 0.0) {
                run->t_steps = now() - t_later;
            }
            return 0;
        }
        if (t_later == 0.0) {
            t_later = now();
        }
        const float * h = api->nextn_ith(ctx, row);
        if (h == NULL) {
            return -300000 - row;
        }
        memcpy(batch->embd, h, sizeof(float) * (size_t) api->n_embd);
        batch->token[0] = run->tokens[step];
        batch->pos[0] = ++pos;
        batch->logits[0] = 1;
        batch->n_tokens = 1;
        row = 0;
    }
}

/* A draft of up to n_max steps from the seed's decode on (the batch holds it at `row`, head position `pos`), the graph
 * choosing k tokens a step. Returns 0; a decode's nonzero rc; -100000 - row where the graph chose nothing for that
 * row; -200000 for settings it cannot take (chain.py checks them first); -300000 - row where no pre-norm row came
 * back; -400000 - step where a confidence the judge would see is not a probability (a bin's index out of range). */
int32_t eagle3_chain_draft(const struct chain * api, struct llama_context * ctx, llama_batch * batch,
                           struct chain_run * run, struct judge * j, int32_t row, int32_t pos, int32_t n_max,
                           int32_t k, int32_t n_alt) {
    if (!start(run, j, n_max, k, n_alt)) {
        return -200000;
    }
    return steps(api, ctx, batch, run, j, row, pos, n_max);
}

/* eagle3_chain_draft after the seed's batch is made here (Eagle3Session._seed_aside): the encoder on the rows set aside
 * (the encoder batch `enc`, pointed at embedding rows), its g written into the decoder batch (pointed at tokens and
 * embedding rows), the head's cache cut after the seed's position. The same returns; an encode's nonzero rc before
 * run->decoded is set. */
int32_t eagle3_chain_seed_draft(const struct chain * api, struct llama_context * ctx, llama_batch * enc,
                                llama_batch * batch, const struct chain_seed * seed, struct chain_run * run,
                                struct judge * j, int32_t n_max, int32_t k, int32_t n_alt) {
    if (!start(run, j, n_max, k, n_alt)) {
        return -200000;
    }
    const int n = seed->n, o = seed->o, m = o + seed->n;
    const size_t n_embd = (size_t) api->n_embd;
    void * mem = api->get_memory(ctx);
    const int32_t enc_pos = api->seq_pos_max(mem, 0) + 1; /* the encoder ignores positions; llama.cpp wants them after
                                                            * the KV */
    memcpy(enc->embd, seed->feats, sizeof(float) * (size_t) n * (size_t) api->n_feat);
    for (int i = 0; i < n; i++) {
        enc->pos[i] = enc_pos + i;
        enc->logits[i] = 1;
    }
    enc->n_tokens = n;
    int32_t rc = run_graph(api, ctx, run, api->encode, enc);
    if (rc != 0) {
        return rc;
    }
    const float * g = api->nextn(ctx); /* [n, n_embd] */
    if (g == NULL) {
        return -300000;
    }
    if (o) { /* before seed_g is written: the session may pass one buffer as both */
        memcpy(batch->embd, seed->pending_g, sizeof(float) * n_embd);
    }
    memcpy(batch->embd + (size_t) o * n_embd, g, sizeof(float) * (size_t) n * n_embd);
    memcpy(seed->seed_g, g + (size_t) (n - 1) * n_embd, sizeof(float) * n_embd);
    for (int i = 0; i < m; i++) {
        batch->token[i] = seed->tokens[i];
        batch->pos[i] = seed->pos0 + i;
        batch->logits[i] = 1;
    }
    batch->n_tokens = m;
    api->seq_rm(mem, 0, seed->pos0 + m - 1, -1);
    run->seeded = 1;
    return steps(api, ctx, batch, run, j, m - 1, seed->pos0 + m - 1, n_max);
}
