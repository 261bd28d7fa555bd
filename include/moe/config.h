/* SPDX-License-Identifier: MIT */
/* config.h — the run configuration: flags, presets, validation, memory estimate.
 *
 * Pure: no MPI. Every rank parses the same arguments and reaches the same
 * verdict, so a usage error is decided before any communication. Preset files
 * are `key = value` lines whose keys are the flag names without dashes.
 */
#ifndef MOE_CONFIG_H
#define MOE_CONFIG_H

#include <stdbool.h>
#include <stdint.h>

#include "moe/common.h"
#include "moe/dims.h"

#define MOE_NAME_MAX 256
#define MOE_MAX_WAVE_RUNS 8 /* entries of --waves 1,2,4,8 */

enum moe_command { MOE_CMD_RUN, MOE_CMD_PLAN, MOE_CMD_BENCH, MOE_CMD_EXPLAIN };
enum moe_progress_kind { MOE_PROGRESS_POLL, MOE_PROGRESS_THREAD };
enum moe_dtype { MOE_DTYPE_FP32, MOE_DTYPE_BF16, MOE_DTYPE_FP8 };
/* Whether the k gate weights are divided by their sum: auto follows the
 * reference code of each gate (moe_config_norm_topk). */
enum moe_norm_topk { MOE_NORM_TOPK_AUTO, MOE_NORM_TOPK_ON, MOE_NORM_TOPK_OFF };
/* FP8 dispatch scales: amax/448 in fp32, or rounded up to a power of two. */
enum moe_fp8_scale { MOE_FP8_SCALE_FLOAT, MOE_FP8_SCALE_UE8M0 };
/* The input tokens' distribution (rng.h, docs/data.md). */
enum moe_input_dist { MOE_INPUT_UNIFORM, MOE_INPUT_ACTIVATIONS };
/* Whose FP8 quantiser the dispatch emulates, to the bit (quant.h). */
enum moe_fp8_recipe { MOE_FP8_RECIPE_MOE, MOE_FP8_RECIPE_DEEPEP, MOE_FP8_RECIPE_DEEPGEMM, MOE_FP8_RECIPE_V3 };
/* Where the gate weight multiplies: the expert output after L2 (DeepSeek-V3's
 * reference code), or the SwiGLU output before L2 (fused GPU kernels). */
enum moe_weight_at { MOE_WEIGHT_AT_OUTPUT, MOE_WEIGHT_AT_ACTIVATION };
/* How a forward's pairs are grouped into waves (layout.h): expert slots
 * when every rank has at least W experts (auto), expert slots, or chunks of
 * tokens (which keep the per-rank dedup of one wave). */
enum moe_wave_by { MOE_WAVE_BY_AUTO, MOE_WAVE_BY_EXPERTS, MOE_WAVE_BY_TOKENS };
/* The dispatch's shape: one all-to-all over all ranks, or two stages (between
 * nodes, then within them; ep_hier.c). */
enum moe_dispatch_kind { MOE_DISPATCH_FLAT, MOE_DISPATCH_HIERARCHICAL };
/* What the combine sends back: every (token, expert) output, or per
 * (token, rank) the rank's gate-weighted outputs summed at the source. */
enum moe_combine_kind { MOE_COMBINE_PAIRS, MOE_COMBINE_REDUCED };
/* The forward's path: the normal one (count exchange, MPI_Alltoallv, the
 * rows deduplicated per rank), or the low-latency one of decode (one-sided
 * MPI into fixed per-expert buffers, no count exchange; ep_ll.c). */
enum moe_mode { MOE_MODE_NORMAL, MOE_MODE_LOW_LATENCY };
/* How the low-latency mode moves rows: the source writes them into the
 * owner's window (put), or the owner reads them from the source's (get). */
enum moe_rma { MOE_RMA_PUT, MOE_RMA_GET };
/* The tensor the expert GEMMs read (layout.h, moe_expert_slots): auto is
 * rows on the normal path, masked in the low-latency mode. */
enum moe_layout_kind { MOE_LAYOUT_ROWS, MOE_LAYOUT_MASKED, MOE_LAYOUT_CONTIGUOUS, MOE_LAYOUT_AUTO };
/* What bench --backward times: one micro-batch's training step, or pairs of
 * micro-batches (serial, waves, DualPipe's pairing, both). */
enum moe_schedule_kind { MOE_SCHEDULE_STEP, MOE_SCHEDULE_DUALPIPE };

typedef struct {
    char preset[MOE_NAME_MAX]; /* name or path of the preset applied, "" if none */
    int64_t tokens;            /* T per rank */
    int64_t hidden;            /* d */
    int64_t ffn;               /* f */
    int64_t experts;           /* E */
    int64_t topk;              /* k */
    int64_t shared_experts;    /* S */
    int64_t iters;             /* timed forward passes */
    int64_t waves_list[MOE_MAX_WAVE_RUNS]; /* --waves W or W1,W2,...: the schedules to run */
    int waves_count;
    bool blocking;             /* the blocking reference path instead of waves */
    int64_t lookahead;         /* waves dispatched ahead of the one computing */
    int wave_by;               /* enum moe_wave_by */
    int dispatch;              /* enum moe_dispatch_kind */
    int combine;               /* enum moe_combine_kind */
    int mode;                  /* enum moe_mode */
    int64_t max_tokens_per_rank; /* --mode low-latency: the fixed buffers' tokens per rank; -1: --tokens */
    int rma;                   /* enum moe_rma */
    int expert_layout;         /* enum moe_layout_kind */
    int64_t expert_alignment;  /* --expert-layout contiguous: rows of an expert padded to a multiple */
    int progress;              /* enum moe_progress_kind */
    int gemm;                  /* enum moe_gemm_kind */
    int packed_isa;            /* enum moe_isa: --gemm packed's widest tile */
    uint64_t seed;
    double init_scale;           /* tokens uniform in [-init_scale, init_scale) */
    int input_dist;              /* enum moe_input_dist */
    int64_t gate_ties;           /* gate rows 1..N copy row 0: experts 0..N tie on every token */
    bool backward; /* a training step: forward, then the gradients (moe_ep_backward_ref) */
    char grad_output[MOE_NAME_MAX]; /* --backward's dy from FILE.safetensors, "" for synthetic */
    bool check; /* compare with the dense fp64 truth */
    char trace[MOE_NAME_MAX];    /* Chrome trace JSON path, "" for none */
    char timeline[MOE_NAME_MAX]; /* SVG timeline path, "" for none */
    bool compare_serial;         /* add a W = 1 panel to the timeline */
    char link[MOE_NAME_MAX];     /* link model spec (link.h), "" for none */
    int router;                  /* enum moe_router_kind */
    int64_t groups;              /* deepseek-v3 expert groups */
    int64_t topk_groups;         /* deepseek-v3 groups kept per token */
    double route_scale;          /* deepseek-v3 weight scale */
    double bias_scale;           /* deepseek-v3 correction bias in [-B, B); 0 = none */
    int norm_topk;               /* enum moe_norm_topk */
    char skew[MOE_NAME_MAX];     /* --skew spec, "" for none */
    int weight_at;               /* enum moe_weight_at */
    int64_t redundant_experts;   /* N: E + N physical experts placed by EPLB (eplb.h); 0 = none */
    int64_t eplb_window;         /* batches of fresh tokens whose routing is EPLB's load */
    char expert_load[MOE_NAME_MAX]; /* EPLB's load from a file instead, "" for the window */
    int replica_choice;          /* enum moe_replica_choice: which copy a pair goes to */
    int64_t steps;               /* routing steps on fresh batches before the timed forwards */
    double bias_update;          /* gamma of the aux-loss-free bias update after each step; 0 = none */
    char steps_csv[MOE_NAME_MAX];  /* the steps' figures and bias per step as CSV, "" for none */
    char steps_plot[MOE_NAME_MAX]; /* SVG of the steps' imbalance, "" for none */
    double capacity_factor;      /* C: each expert takes ceil(C T k / E) pairs of a rank's
                                    tokens (capacity.h); 0 = none (dropless) */
    int drop_policy;             /* enum moe_drop_policy: which pairs stay */
    bool pad_to_capacity;        /* each expert also computes the zero rows that fill its
                                    capacity, G C rows in all (Megatron-Core's fixed shape) */
    /* moe-ep bench */
    int64_t warmup;              /* untimed forwards before each wave count */
    int64_t samples;             /* --mode low-latency: timed forwards per latency point */
    int schedule;                /* enum moe_schedule_kind */
    char csv[MOE_NAME_MAX];      /* table as CSV, "" for none */
    char plot[MOE_NAME_MAX];     /* SVG plot of layer time and overlap against W */
    char dump[MOE_NAME_MAX];     /* golden set directory, "" for none */
    char report[MOE_NAME_MAX];   /* self-contained HTML page of the run, "" for none */
    char explain[MOE_NAME_MAX];  /* explain --token: global token ids, "N[,N...]" */
    char placement_svg[MOE_NAME_MAX]; /* explain: the placement picture, "" for none */
    char routing[MOE_NAME_MAX];  /* routing replay file (routing.h), "" for the router */
    int workload;                /* enum moe_workload (workload.h): replayed instead of the router */
    int64_t workload_step;       /* the step a --workload draws (W6 and W7 vary with it) */
    char mask_ranks[MOE_NAME_MAX]; /* --mask-ranks: the ranks run as lost (mask.h), "" none */
    double watchdog;             /* seconds a rank may wait at a forward's collective (watchdog.h); 0 off */
    bool dump_weights;           /* include the weights in the golden set */
    /* moe-ep plan: the whole model and its cluster */
    int64_t layers, moe_layers;
    int param_dtype, dispatch_dtype, combine_dtype; /* enum moe_dtype */
    int output_dtype;            /* enum moe_dtype: the layer output, rounded once at home */
    int gemm_out_dtype;          /* enum moe_dtype: the routed experts' GEMM outputs (h, out) */
    int act_dtype;               /* enum moe_dtype: the routed experts' activation before L2 */
    int topk_weights_dtype;      /* enum moe_dtype: the router's top-k weights */
    int fp8_scale;               /* enum moe_fp8_scale */
    int fp8_recipe;              /* enum moe_fp8_recipe */
    char cluster[MOE_NAME_MAX];  /* cluster preset applied, "" if none */
    int64_t gpus, gpus_per_node, ep, pp;
    double intra_bw, inter_bw;   /* GB/s per GPU */
    double tflops;               /* TFLOP/s per GPU */
    char nodes_per_token[MOE_NAME_MAX]; /* plan: a measured histogram N:PERCENT,... ("": sample) */
    int64_t ranks_per_node;      /* R, virtual nodes; 0 = all ranks on one node */
    /* Not a flag: a library caller's own weights for the truth (moe-ep.h,
     * moe_ep_config_use_weights), fp32, read where the generated ones
     * would be made: w1 (E, 2f, d), w2 (E, d, f), shared_w1 (S, 2f, d),
     * shared_w2 (S, d, f), each NULL for the generated ones. */
    const float *given_w1, *given_w2, *given_shared_w1, *given_shared_w2;
    /* Not flags: which flags were given on the command line (bit n: the
     * table's flag n; moe_config_given), and the W moe_config_fit fitted
     * down to --tokens (0: none), for the report. */
    uint64_t given[2];
    int64_t waves_fitted_from;
} moe_config;

/* Every flag at the default its table entry names (the one --help prints). */
void moe_config_defaults(moe_config *cfg);

/* Parse the arguments of `moe-ep run` or `moe-ep plan` (argv[0] is the first
 * flag). A --preset (and for plan a --cluster) is applied first, wherever it
 * stands; the other flags then override it. Returns MOE_EXIT_OK or
 * MOE_EXIT_USAGE with st set. */
int moe_config_parse(moe_config *cfg, enum moe_command command, int argc, char **argv,
                     moe_status *st);

/* Apply the preset NAME (data/presets/NAME.conf) or a path to a .conf file;
 * keys that only the other command takes are skipped. */
int moe_config_load_preset(moe_config *cfg, enum moe_command command, const char *name,
                           moe_status *st);

/* Whether the k weights are renormalised: as --norm-topk says, or with
 * auto as the reference code of the gate does it: softmax yes (Mixtral,
 * GShard), deepseek-v3 with a bias yes (V3 always divides the sigmoid
 * scores by their sum), without one no (DeepSeek-V2's norm_topk_prob is
 * false). */
bool moe_config_norm_topk(const moe_config *cfg);

/* Whether --check may split the truth's routed experts by rank
 * (moe_truth_forward_share): not when the sums it rounds span ranks (the
 * two-stage dispatch's per-node sums with --combine reduced). */
bool moe_config_truth_shares(const moe_config *cfg);

/* The tensor the expert GEMMs read: --expert-layout, auto resolved (rows,
 * or masked with --mode low-latency); and the tokens per rank the masked
 * layout and the low-latency buffers hold (--max-tokens-per-rank, auto:
 * --tokens). */
int moe_config_layout(const moe_config *cfg);
int64_t moe_config_max_tokens(const moe_config *cfg);

/* Was `flag` ("waves") given on the command line (not by a preset, not the
 * default)? Does it hold its default value (whoever set it)? */
bool moe_config_given(const moe_config *cfg, const char *flag);
bool moe_config_at_default(const moe_config *cfg, const char *flag);

/* Fit what the user did not set to the input: a default or preset --waves
 * above --tokens becomes --tokens (decode runs T = 1), the list kept
 * ascending without repeats. A value given on the command line is left
 * for moe_config_validate to refuse. */
void moe_config_fit(moe_config *cfg);

/* The most physical experts one of `ranks` ranks holds: ceil((E + N) / G),
 * N the --redundant-experts copies (what the memory estimates size by). */
int64_t moe_config_most_local_experts(const moe_config *cfg, int ranks);

/* Check the combination for G ranks (k <= E, sizes that fit the index
 * types). Ranks without an expert (E < G) are allowed. */
int moe_config_validate(const moe_config *cfg, int ranks, moe_status *st);

/* --ranks-per-node auto (stored as MOE_RANKS_PER_NODE_AUTO) becomes the
 * ranks of a real node: node_ranks, R when every machine holds R
 * consecutive ranks (0: they do not, a usage error). */
#define MOE_RANKS_PER_NODE_AUTO (-1)
int moe_config_resolve_nodes(moe_config *cfg, int node_ranks, int ranks, moe_status *st);

/* Bytes the fullest rank holds at its peak for command: the runtime
 * (MOE_MEMORY_RUNTIME), weights, tokens, one forward's buffers with the
 * routed rows at their mean (T*k rows in, T*k pairs out), the per-wave
 * plans of the most waves asked for, the truth with --check, rank 0's
 * gathered set with --dump, bench's anchors. An upper bound of the peak
 * resident memory (tests/mpi/memory checks it on a sweep) unless the
 * routing is skewed, when a rank can receive more than the mean. */
#define MOE_MEMORY_RUNTIME (32.0 * 1048576.0)
double moe_config_memory_per_rank(const moe_config *cfg, enum moe_command command, int ranks);

/* The flags of a command with their current values, for a golden
 * manifest: calls emit(ctx, name, value) for each. */
void moe_config_describe(const moe_config *cfg, enum moe_command command,
                         void (*emit)(void *ctx, const char *name, const char *value), void *ctx);

/* The name a choice flag (e.g. "fp8-recipe") gives value, from the flag
 * table; "?" for none. */
const char *moe_config_choice_name(const char *flag, int value);

/* Flag help lines of a command for --help: "  --tokens T   ...\n" ... */
void moe_config_print_flags(FILE *out, enum moe_command command);

/* The directories searched for data/KIND ("presets", "clusters"), in order,
 * separated by ':': $MOE_EP_DATA_DIR/KIND, the source tree's, the installed. */
const char *moe_config_data_path(const char *kind);

/* Open data/KIND/NAME.conf on that path (a preset or a cluster), or NAME
 * itself when it is a path; its path into file. flag names the flag for
 * messages ("preset" or "cluster"). NULL with st set when there is none. */
FILE *moe_config_open_conf(const char *flag, const char *kind, const char *name, char *file,
                           size_t size, moe_status *st);

/* The configuration as text, one "key=value" line per flag of command
 * (after the preset), the command first: what every rank of a job must
 * agree on. Newlines in values are written as \n. Caller frees. */
char *moe_config_canonical(const moe_config *cfg, enum moe_command command);

#endif
