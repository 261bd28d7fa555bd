/* config.c — flags, presets and validation of a run (see config.h).
 *
 * One table describes every flag: its name (also the preset key), type,
 * allowed range and help. Parsing, preset loading and --help all read it.
 */
#define _POSIX_C_SOURCE 200809L
#include "moe/config.h"
#include "moe/capacity.h"
#include "moe/eplb.h"
#include "moe/experts.h"
#include "moe/gemm.h"
#include "moe/layout.h"
#include "moe/link.h"
#include "moe/router.h"
#include "moe/wire.h"

#include <ctype.h>
#include <dirent.h>
#include <errno.h>
#include <float.h>
#include <math.h>
#include <limits.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#ifndef MOE_SOURCE_DATA_DIR
#define MOE_SOURCE_DATA_DIR "data"
#endif
#ifndef MOE_INSTALLED_DATA_DIR
#define MOE_INSTALLED_DATA_DIR "/usr/local/share/moe-ep"
#endif

enum flag_kind {
    FLAG_INT, FLAG_SEED, FLAG_BOOL, FLAG_PRESET, FLAG_CLUSTER, FLAG_CHOICE, FLAG_TEXT, FLAG_WAVES,
    FLAG_REAL
};

/* Which subcommands take a flag (and use its preset key). */
/* bench takes every flag of run (it runs the same layer) and its own;
 * explain those that make the layer and its tokens (EXPLAIN). */
enum {
    RUN = 1 << MOE_CMD_RUN | 1 << MOE_CMD_BENCH,
    EXPLAIN = 1 << MOE_CMD_EXPLAIN,
    RUN_ONLY = 1 << MOE_CMD_RUN, /* run only: bench does not take it */
    PLAN = 1 << MOE_CMD_PLAN,
    BENCH = 1 << MOE_CMD_BENCH,
    BOTH = RUN | PLAN
};

/* A FLAG_CHOICE's names and the enum values they stand for; a NULL name ends the list. */
typedef struct {
    const char *name;
    int value;
} flag_choice;

static const flag_choice router_choices[] = {
    {"softmax", MOE_ROUTER_SOFTMAX}, {"deepseek-v3", MOE_ROUTER_DEEPSEEK_V3}, {NULL, 0}};
static const flag_choice weight_at_choices[] = {
    {"output", MOE_WEIGHT_AT_OUTPUT}, {"activation", MOE_WEIGHT_AT_ACTIVATION}, {NULL, 0}};
static const flag_choice progress_choices[] = {
    {"poll", MOE_PROGRESS_POLL}, {"thread", MOE_PROGRESS_THREAD}, {NULL, 0}};
static const flag_choice gemm_choices[] = {
    {"blas", MOE_GEMM_BLAS}, {"exact", MOE_GEMM_EXACT}, {"packed", MOE_GEMM_PACKED}, {NULL, 0}};
static const flag_choice packed_isa_choices[] = {
    {"widest", MOE_ISA_WIDEST}, {"avx2", MOE_ISA_AVX2}, {"portable", MOE_ISA_PORTABLE}, {NULL, 0}};
static const flag_choice dtype_choices[] = {
    {"fp32", MOE_DTYPE_FP32}, {"bf16", MOE_DTYPE_BF16}, {"fp8", MOE_DTYPE_FP8}, {NULL, 0}};
static const flag_choice norm_topk_choices[] = {
    {"auto", MOE_NORM_TOPK_AUTO}, {"true", MOE_NORM_TOPK_ON}, {"false", MOE_NORM_TOPK_OFF}, {NULL, 0}};
static const flag_choice input_dist_choices[] = {
    {"uniform", MOE_INPUT_UNIFORM}, {"activations", MOE_INPUT_ACTIVATIONS}, {NULL, 0}};
static const flag_choice fp8_recipe_choices[] = {
    {"moe", MOE_FP8_RECIPE_MOE}, {"deepep", MOE_FP8_RECIPE_DEEPEP},
    {"deepgemm", MOE_FP8_RECIPE_DEEPGEMM}, {"v3", MOE_FP8_RECIPE_V3}, {NULL, 0}};
static const flag_choice replica_choices[] = {
    {"spread", MOE_REPLICA_SPREAD}, {"dedup", MOE_REPLICA_DEDUP}, {NULL, 0}};
static const flag_choice drop_policy_choices[] = {
    {"probs", MOE_DROP_PROBS}, {"position", MOE_DROP_POSITION}, {NULL, 0}};
static const flag_choice wave_by_choices[] = {
    {"auto", MOE_WAVE_BY_AUTO}, {"experts", MOE_WAVE_BY_EXPERTS}, {"tokens", MOE_WAVE_BY_TOKENS}, {NULL, 0}};
static const flag_choice dispatch_choices[] = {
    {"flat", MOE_DISPATCH_FLAT}, {"hierarchical", MOE_DISPATCH_HIERARCHICAL}, {NULL, 0}};
static const flag_choice schedule_choices[] = {
    {"step", MOE_SCHEDULE_STEP}, {"dualpipe", MOE_SCHEDULE_DUALPIPE}, {NULL, 0}};
static const flag_choice combine_choices[] = {
    {"reduced", MOE_COMBINE_REDUCED}, {"pairs", MOE_COMBINE_PAIRS}, {NULL, 0}};
static const flag_choice mode_choices[] = {
    {"normal", MOE_MODE_NORMAL}, {"low-latency", MOE_MODE_LOW_LATENCY}, {NULL, 0}};
static const flag_choice rma_choices[] = {{"put", MOE_RMA_PUT}, {"get", MOE_RMA_GET}, {NULL, 0}};
static const flag_choice layout_choices[] = {
    {"auto", MOE_LAYOUT_AUTO}, {"rows", MOE_LAYOUT_ROWS}, {"masked", MOE_LAYOUT_MASKED},
    {"contiguous", MOE_LAYOUT_CONTIGUOUS}, {NULL, 0}};
static const flag_choice fp8_scale_choices[] = {
    {"float", MOE_FP8_SCALE_FLOAT}, {"ue8m0", MOE_FP8_SCALE_UE8M0}, {NULL, 0}};

typedef struct {
    const char *name; /* flag without "--", and preset key */
    enum flag_kind kind;
    size_t offset;
    int64_t min, max; /* FLAG_INT and FLAG_WAVES; FLAG_REAL: [min, max] too */
    const char *value_name; /* what --help shows after the flag; NULL for choices and bools */
    const flag_choice *choices; /* FLAG_CHOICE: the names and the values stored */
    const char *default_value;  /* what moe_config_defaults sets, as on the command line;
                                   NULL: none (preset, cluster) */
    const char *help;
    unsigned commands; /* RUN, PLAN or BOTH */
} flag_spec;

static bool value_name_ends(const flag_spec *flag, const char *word)
{
    const char *name = flag->value_name;
    return name && strlen(name) > strlen(word) && !strcmp(name + strlen(name) - strlen(word), word);
}

/* A FLAG_INT whose value name ends in "|auto" also takes "auto", stored as -1. */
static bool takes_auto(const flag_spec *flag)
{
    return value_name_ends(flag, "|auto");
}

/* A FLAG_REAL whose value name ends in "|none" takes "none", stored as 0,
 * or a number above its min (0 is not one: "none" says it). */
static bool takes_none(const flag_spec *flag)
{
    return value_name_ends(flag, "|none");
}

#define FIELD(f) offsetof(moe_config, f)

static const flag_spec flags[] = {
    {"preset", FLAG_PRESET, FIELD(preset), 0, 0, "NAME", NULL, NULL, "data/presets/NAME.conf, or a path to a .conf file", BOTH | EXPLAIN},
    {"tokens", FLAG_INT, FIELD(tokens), 1, 1 << 24, "T", NULL, "256", "tokens per rank", BOTH | EXPLAIN},
    {"hidden", FLAG_INT, FIELD(hidden), 1, 65536, "d", NULL, "256", "hidden size", BOTH | EXPLAIN},
    {"ffn", FLAG_INT, FIELD(ffn), 1, 65536, "f", NULL, "128", "FFN size of one expert", BOTH | EXPLAIN},
    {"experts", FLAG_INT, FIELD(experts), 1, 4096, "E", NULL, "8", "routed experts", BOTH | EXPLAIN},
    {"topk", FLAG_INT, FIELD(topk), 1, 4096, "k", NULL, "2", "experts per token, 1 <= k <= E", BOTH | EXPLAIN},
    {"router", FLAG_CHOICE, FIELD(router), 0, 0, NULL, router_choices, "softmax", "the gate (router.h)", BOTH | EXPLAIN},
    {"groups", FLAG_INT, FIELD(groups), 1, 4096, "N", NULL, "1", "deepseek-v3 expert groups (= nodes: node-limited routing)", BOTH | EXPLAIN},
    {"topk-groups", FLAG_INT, FIELD(topk_groups), 1, 4096, "M", NULL, "1", "deepseek-v3 groups kept per token", BOTH | EXPLAIN},
    {"route-scale", FLAG_REAL, FIELD(route_scale), 0, 1000, "S", NULL, "1", "scale of the k weights (every router, as V2 and V3 apply it)", RUN | EXPLAIN},
    {"bias-scale", FLAG_REAL, FIELD(bias_scale), 0, 100, "B", NULL, "0.01", "deepseek-v3 correction bias, uniform in [-B, B); 0 = none (V2 style)", RUN | EXPLAIN},
    {"norm-topk", FLAG_CHOICE, FIELD(norm_topk), 0, 0, NULL, norm_topk_choices, "auto", "divide the k weights by their sum; auto: as the gate's reference code (softmax and V3 yes, V2 no); alone: true", RUN | EXPLAIN},
    {"weight-at", FLAG_CHOICE, FIELD(weight_at), 0, 0, NULL, weight_at_choices, "output", "gate weight on the expert output (V3 reference) or before L2 (fused kernels)", RUN | EXPLAIN},
    {"skew", FLAG_TEXT, FIELD(skew), 0, 0, "SPEC", NULL, "", "logit bias: hot:EXPERT=+B[,...] or zipf:S", RUN | PLAN | EXPLAIN},
    {"redundant-experts", FLAG_INT, FIELD(redundant_experts), 0, 32767, "N", NULL, "0", "E + N physical experts, each rank (E + N)/G, placed by DeepSeek's EPLB from a measured load: hot experts get copies (docs/load-balance.md)", RUN_ONLY | PLAN},
    {"eplb-window", FLAG_INT, FIELD(eplb_window), 1, 1000, "S", NULL, "1", "--redundant-experts: the load is the routing counts of S earlier batches of fresh tokens", RUN_ONLY},
    {"expert-load", FLAG_TEXT, FIELD(expert_load), 0, 0, "FILE", NULL, "", "--redundant-experts: the load from FILE (E numbers, tokens per expert) instead of --eplb-window", RUN_ONLY | PLAN},
    {"replica-choice", FLAG_CHOICE, FIELD(replica_choice), 0, 0, NULL, replica_choices, "spread", "--redundant-experts: each pair to a copy on its token's node, spread by token id; or dedup: to a copy on a rank the token's rows go to anyway when there is one (fewer rows, a less even split)", RUN_ONLY},
    {"steps", FLAG_INT, FIELD(steps), 1, 10000, "N", NULL, "1", "N steps of route, forward and --bias-update on fresh batches before the timed forwards, each step's balance printed (docs/load-balance.md)", RUN_ONLY},
    {"bias-update", FLAG_REAL, FIELD(bias_update), 0, 1, "GAMMA|none", NULL, "none", "deepseek-v3: after each step, bias_i += GAMMA sign(mean load - load_i) (V3's auxiliary-loss-free balancing)", RUN_ONLY},
    {"capacity-factor", FLAG_REAL, FIELD(capacity_factor), 0, 1000, "C|none", NULL, "none", "each expert takes at most ceil(C T k / E) pairs of each rank's T tokens, the rest are dropped (Megatron-Core's capacity; docs/load-balance.md)", RUN_ONLY},
    {"drop-policy", FLAG_CHOICE, FIELD(drop_policy), 0, 0, NULL, drop_policy_choices, "probs", "--capacity-factor: the pairs an expert keeps: the largest gate weights, or the first tokens", RUN_ONLY},
    {"pad-to-capacity", FLAG_BOOL, FIELD(pad_to_capacity), 0, 0, NULL, NULL, "false", "--capacity-factor: each expert computes G x ceil(C T k / E) rows, zero rows filling what its kept pairs leave (Megatron-Core's fixed shape); the output does not change", RUN_ONLY},
    {"steps-csv", FLAG_TEXT, FIELD(steps_csv), 0, 0, "FILE", NULL, "", "--steps: each step's imbalance, expert time, balance losses and bias as CSV", RUN_ONLY},
    {"steps-plot", FLAG_TEXT, FIELD(steps_plot), 0, 0, "FILE.svg", NULL, "", "--steps: max/mean load per expert and per rank against the step", RUN_ONLY},
    {"shared-experts", FLAG_INT, FIELD(shared_experts), 0, 64, "S", NULL, "0", "shared experts, applied to every token on its home rank", BOTH | EXPLAIN},
    {"seed", FLAG_SEED, FIELD(seed), 0, 0, "S", NULL, "1", "data seed, 0 .. 2^64-1", RUN | EXPLAIN},
    {"init-scale", FLAG_REAL, FIELD(init_scale), 0, 1000000000000000000LL, "S", NULL, "1", "input tokens uniform in [-S, S)", RUN | EXPLAIN},
    {"input-dist", FLAG_CHOICE, FIELD(input_dist), 0, 0, NULL, input_dist_choices, "uniform", "input tokens: uniform, or activations (per-token binades, 1 channel in 32 an outlier x16; docs/data.md)", RUN | EXPLAIN},
    {"gate-ties", FLAG_INT, FIELD(gate_ties), 0, 4095, "N", NULL, "0", "gate rows of experts 1..N copy expert 0's: they tie on every token (docs/data.md)", RUN | EXPLAIN},
    {"iters", FLAG_INT, FIELD(iters), 1, 100000, "N", NULL, "1", "timed forward passes", RUN},
    {"waves", FLAG_WAVES, FIELD(waves_list), 1, 1024, "W[,W...]", NULL, "4", "pipelined waves, at most --tokens; a list runs each and prints the speed-up curve", BOTH | EXPLAIN},
    {"lookahead", FLAG_INT, FIELD(lookahead), 1, 1024, "A", NULL, "2", "waves dispatched ahead of the computing one (1: neighbours only)", RUN},
    {"wave-by", FLAG_CHOICE, FIELD(wave_by), 0, 0, NULL, wave_by_choices, "auto", "waves as groups of expert slots (auto: when every rank has >= W experts) or chunks of tokens (keep the dedup)", RUN | EXPLAIN},
    {"dispatch", FLAG_CHOICE, FIELD(dispatch), 0, 0, NULL, dispatch_choices, "flat", "one all-to-all over all ranks, or two stages: once per node between nodes, then within each (waves of tokens; nodes of --ranks-per-node)", RUN},
    {"combine", FLAG_CHOICE, FIELD(combine), 0, 0, NULL, combine_choices, "reduced", "per (token, rank) its experts' weighted outputs summed at the source (DeepEP), or every (token, expert) output (--mode low-latency: pairs)", RUN | EXPLAIN},
    {"mode", FLAG_CHOICE, FIELD(mode), 0, 0, NULL, mode_choices, "normal", "the forward's path: count exchange and MPI_Alltoallv (prefill), or one-sided MPI into fixed per-expert buffers, no count exchange (decode; docs/low-latency.md)", RUN},
    {"max-tokens-per-rank", FLAG_INT, FIELD(max_tokens_per_rank), 1, 1 << 24, "N|auto", NULL, "auto", "--mode low-latency and --expert-layout masked: tokens per rank the fixed buffers hold (auto: --tokens); plan: their size", BOTH},
    {"rma", FLAG_CHOICE, FIELD(rma), 0, 0, NULL, rma_choices, "put", "--mode low-latency: the source writes rows into the owner's window (push), or the owner reads them from the source's (pull)", RUN},
    {"expert-layout", FLAG_CHOICE, FIELD(expert_layout), 0, 0, NULL, layout_choices, "auto", "the tensor the expert GEMMs read: the received rows, per expert a fixed capacity of G*N slots (DeepGEMM's masked input), or the experts back to back, each padded to --expert-alignment rows (its contiguous input); auto: rows, masked with --mode low-latency (docs/layouts.md)", RUN},
    {"expert-alignment", FLAG_INT, FIELD(expert_alignment), 1, 1024, "A", NULL, "128", "--expert-layout contiguous: each expert's rows padded to a multiple of A, a power of two", RUN},
    {"blocking", FLAG_BOOL, FIELD(blocking), 0, 0, NULL, NULL, "false", "the blocking reference path (MPI_Alltoallv, no waves)", RUN},
    {"progress", FLAG_CHOICE, FIELD(progress), 0, 0, NULL, progress_choices, "poll", "who drives MPI progress while experts compute", RUN},
    {"gemm", FLAG_CHOICE, FIELD(gemm), 0, 0, NULL, gemm_choices, "packed", "expert GEMM: OpenBLAS, the fixed-order kernel, or FMA over weights packed once", RUN | EXPLAIN},
    {"packed-isa", FLAG_CHOICE, FIELD(packed_isa), 0, 0, NULL, packed_isa_choices, "widest", "--gemm packed: its tiles, the widest the CPU has (AVX-512F 6x32, else AVX2 6x16), at most the AVX2 one, or the portable fmaf loop; the same bits from each", RUN | EXPLAIN},
    {"backward", FLAG_BOOL, FIELD(backward), 0, 0, NULL, NULL, "false", "a training step: the blocking forward, then the gradients for a synthetic dy in --waves W token chunks, its all-to-alls in flight behind the data and weight gradients (blocking with --blocking; docs/backward.md); bench: fwd+bwd per W", RUN},
    {"grad-output", FLAG_TEXT, FIELD(grad_output), 0, 0, "FILE", NULL, "", "--backward's upstream gradient: backward.dy (G*T, d) of FILE.safetensors instead of the synthetic one", RUN_ONLY},
    {"check", FLAG_BOOL, FIELD(check), 0, 0, NULL, NULL, "false", "compare with the dense fp64 truth; exit 1 on FAIL", RUN},
    {"routing", FLAG_TEXT, FIELD(routing), 0, 0, "FILE", NULL, "", "replay top-k ids and weights from FILE.safetensors instead of the router (docs/golden.md)", RUN | EXPLAIN},
    {"token", FLAG_TEXT, FIELD(explain), 0, 0, "N[,N...]", NULL, "0", "the tokens to follow, by global id (rank r's token i is r*T + i)", EXPLAIN},
    {"dump", FLAG_TEXT, FIELD(dump), 0, 0, "DIR", NULL, "", "write the golden set of this run (docs/golden.md)", RUN | EXPLAIN},
    {"dump-weights", FLAG_BOOL, FIELD(dump_weights), 0, 0, NULL, NULL, "true", "include the weights in --dump", RUN | EXPLAIN},
    {"report", FLAG_TEXT, FIELD(report), 0, 0, "FILE.html", NULL, "", "a self-contained HTML page of the run: stage times, the timeline, the traffic heat map, tokens per expert, expert time per rank, nodes per token", RUN_ONLY},
    {"trace", FLAG_TEXT, FIELD(trace), 0, 0, "FILE.json", NULL, "", "Chrome trace of the last forward or training step (Perfetto)", RUN},
    {"timeline", FLAG_TEXT, FIELD(timeline), 0, 0, "FILE.svg", NULL, "", "SVG Gantt chart of the last forward (with --backward: of the last training step)", RUN},
    {"link", FLAG_TEXT, FIELD(link), 0, 0, "SPEC", NULL, "", "emulated links: cb=RATIO[,inter-cb=RATIO] | bw=BW[:LAT] | intra=BW[:LAT],inter=BW[:LAT]", RUN},
    {"ranks-per-node", FLAG_INT, FIELD(ranks_per_node), 0, 1 << 20, "R|auto", NULL, "auto", "ranks per node: virtual nodes of R consecutive ranks (0 = one node), or auto: the machines the ranks run on", RUN | EXPLAIN},
    {"compare-serial", FLAG_BOOL, FIELD(compare_serial), 0, 0, NULL, NULL, "false", "add the same forward (with --backward: step) at W = 1 to the timeline", RUN},
    {"warmup", FLAG_INT, FIELD(warmup), 0, 1000, "N", NULL, "2", "untimed forwards before each wave count", BENCH},
    {"samples", FLAG_INT, FIELD(samples), 1, 1000000, "N", NULL, "200", "--mode low-latency: timed forwards per latency point (median and p99)", BENCH},
    {"schedule", FLAG_CHOICE, FIELD(schedule), 0, 0, NULL, schedule_choices, "step", "with --backward: time one micro-batch's steps, or pairs of micro-batches serial, in waves, with DualPipe's pairing, and both (docs/backward.md)", BENCH},
    {"csv", FLAG_TEXT, FIELD(csv), 0, 0, "FILE", NULL, "", "write the table as CSV", BENCH},
    {"plot", FLAG_TEXT, FIELD(plot), 0, 0, "FILE.svg", NULL, "", "plot layer time and overlap against W", BENCH},
    {"layers", FLAG_INT, FIELD(layers), 1, 1000, "L", NULL, "1", "transformer layers", PLAN},
    {"moe-layers", FLAG_INT, FIELD(moe_layers), 0, 1000, "L", NULL, "1", "of which MoE layers", PLAN},
    {"dtype", FLAG_CHOICE, FIELD(param_dtype), 0, 0, NULL, dtype_choices, "fp32", "weights and input tokens (run: fp32 or bf16)", BOTH | EXPLAIN},
    {"dispatch-dtype", FLAG_CHOICE, FIELD(dispatch_dtype), 0, 0, NULL, dtype_choices, "fp32", "dispatched rows (fp8: E4M3, one scale per 128 values)", BOTH | EXPLAIN},
    {"combine-dtype", FLAG_CHOICE, FIELD(combine_dtype), 0, 0, NULL, dtype_choices, "fp32", "expert outputs sent back (run: fp32 or bf16)", BOTH | EXPLAIN},
    {"fp8-scale", FLAG_CHOICE, FIELD(fp8_scale), 0, 0, NULL, fp8_scale_choices, "float", "fp8 dispatch scales: amax/448, or a power of two", RUN | EXPLAIN},
    {"fp8-recipe", FLAG_CHOICE, FIELD(fp8_recipe), 0, 0, NULL, fp8_recipe_choices, "moe", "whose fp8 quantiser, to the bit: moe-ep's, DeepEP's kernels, DeepGEMM's or V3's act_quant (docs/golden.md)", RUN | EXPLAIN},
    {"cluster", FLAG_CLUSTER, FIELD(cluster), 0, 0, "NAME", NULL, NULL, "data/clusters/NAME.conf, or a path", PLAN},
    {"gpus", FLAG_INT, FIELD(gpus), 1, 1 << 20, "N", NULL, "1", "GPUs in the cluster", PLAN},
    {"gpus-per-node", FLAG_INT, FIELD(gpus_per_node), 1, 1024, "N", NULL, "1", "GPUs per node (one NVLink domain)", PLAN},
    {"ep", FLAG_INT, FIELD(ep), 1, 1 << 20, "N", NULL, "1", "expert-parallel group size", PLAN},
    {"intra-bw", FLAG_REAL, FIELD(intra_bw), 0, 100000, "GB/s", NULL, "0", "per-GPU bandwidth inside a node", PLAN},
    {"inter-bw", FLAG_REAL, FIELD(inter_bw), 0, 100000, "GB/s", NULL, "0", "per-GPU bandwidth between nodes", PLAN},
    {"tflops", FLAG_REAL, FIELD(tflops), 0, 1000000, "TFLOP/s", NULL, "0", "per-GPU dense FLOP/s of the expert GEMMs", PLAN},
    {"nodes-per-token", FLAG_TEXT, FIELD(nodes_per_token), 0, 0, "HIST", NULL, "", "nodes a token reaches, measured: N:PERCENT,... as run prints it (default: sampled from the router)", PLAN},
};
#define N_FLAGS (sizeof flags / sizeof flags[0])

static int set_value(moe_config *cfg, const flag_spec *flag, const char *value, const char *where,
                     moe_status *st);
static const flag_spec *find_flag(const char *name, size_t len);

void moe_config_defaults(moe_config *cfg)
{
    memset(cfg, 0, sizeof *cfg);
    for (size_t n = 0; n < N_FLAGS; n++)
        if (flags[n].default_value && *flags[n].default_value) { /* "" is memset's already */
            moe_status st = {0};
            set_value(cfg, &flags[n], flags[n].default_value, "default", &st);
            MOE_ASSERT(st.code == MOE_EXIT_OK);
        }
}

/* The value a FLAG_CHOICE stores for name, or -1 when it has no such choice. */
static int choice_value(const flag_spec *flag, const char *name)
{
    for (const flag_choice *c = flag->choices; c->name; c++)
        if (!strcmp(name, c->name))
            return c->value;
    return -1;
}

const char *moe_config_choice_name(const char *flag, int value)
{
    const flag_spec *spec = find_flag(flag, strlen(flag));
    for (const flag_choice *c = spec && spec->choices ? spec->choices : NULL; c && c->name; c++)
        if (c->value == value)
            return c->name;
    return "?";
}

bool moe_config_truth_shares(const moe_config *cfg)
{
    return !(cfg->combine == MOE_COMBINE_REDUCED && cfg->dispatch == MOE_DISPATCH_HIERARCHICAL);
}

bool moe_config_norm_topk(const moe_config *cfg)
{
    if (cfg->norm_topk != MOE_NORM_TOPK_AUTO)
        return cfg->norm_topk == MOE_NORM_TOPK_ON;
    return cfg->router == MOE_ROUTER_SOFTMAX || cfg->bias_scale > 0;
}

/* "a|b|c": the names of a FLAG_CHOICE, for help and errors. */
static const char *choice_names(const flag_spec *flag, char *buf, size_t size)
{
    size_t used = 0;
    buf[0] = '\0';
    for (const flag_choice *c = flag->choices; c->name && used < size; c++)
        used += (size_t)snprintf(buf + used, size - used, "%s%s", used ? "|" : "", c->name);
    return buf;
}

/* What --help shows after the flag: its value's name, or its choices. */
static const char *value_text(const flag_spec *flag, char *buf, size_t size)
{
    if (flag->kind == FLAG_CHOICE)
        return choice_names(flag, buf, size);
    return flag->value_name ? flag->value_name : "";
}

static const flag_spec *find_flag(const char *name, size_t len)
{
    for (size_t n = 0; n < N_FLAGS; n++)
        if (strlen(flags[n].name) == len && strncmp(flags[n].name, name, len) == 0)
            return &flags[n];
    return NULL;
}

/* Well-formed UTF-8 (no overlong forms, surrogates or code points past U+10FFFF). */
static bool utf8_valid(const char *text)
{
    for (const unsigned char *c = (const unsigned char *)text; *c;) {
        int extra = *c < 0x80 ? 0 : (*c & 0xe0) == 0xc0 ? 1 : (*c & 0xf0) == 0xe0 ? 2
                  : (*c & 0xf8) == 0xf0 ? 3 : -1;
        if (extra < 0)
            return false;
        uint32_t point = extra ? *c & (0x3f >> extra) : *c;
        c++;
        for (int n = 0; n < extra; n++, c++) {
            if ((*c & 0xc0) != 0x80)
                return false;
            point = point << 6 | (*c & 0x3f);
        }
        static const uint32_t least[] = {0, 0x80, 0x800, 0x10000};
        if (point < least[extra] || point > 0x10ffff || (point >= 0xd800 && point <= 0xdfff))
            return false;
    }
    return true;
}

/* A number as moe-ep reads it: a digit first, or a sign then a digit when
 * `sign` (no leading space, "+ 1", "inf" or "nan"), or ".5". */
static bool number_start(const char *value, bool sign)
{
    const char *c = value;
    if (sign && (*c == '-' || *c == '+'))
        c++;
    if (*c == '.')
        c++;
    return isdigit((unsigned char)*c);
}

int moe_parse_int_list(const char *text, int64_t min, int64_t max, int64_t *out, int capacity)
{
    int count = 0;
    for (const char *item = text;; item++) {
        char *end;
        errno = 0;
        const long long v = strtoll(item, &end, 10);
        if (!number_start(item, false) || (*end != ',' && *end != '\0') || errno == ERANGE ||
            v < min || v > max)
            return -1;
        if (count == capacity)
            return -2;
        out[count++] = v;
        if (*end == '\0')
            return count;
        item = end;
    }
}

/* `where` is "--tokens" for a flag or "FILE:LINE: tokens" for a preset key. */
static int set_value(moe_config *cfg, const flag_spec *flag, const char *value, const char *where,
                     moe_status *st)
{
    char *base = (char *)cfg + flag->offset;
    char *end = NULL;
    switch (flag->kind) {
    case FLAG_INT: {
        if (takes_auto(flag) && !strcmp(value, "auto")) {
            *(int64_t *)base = -1;
            return MOE_EXIT_OK;
        }
        errno = 0;
        long long v = strtoll(value, &end, 10);
        if (!number_start(value, true) || *end != '\0' || errno == ERANGE || v < flag->min ||
            v > flag->max)
            return moe_fail(st, MOE_EXIT_USAGE,
                            "%s must be an integer in [%lld, %lld], got '%s'", where,
                            (long long)flag->min, (long long)flag->max, value);
        *(int64_t *)base = v;
        return MOE_EXIT_OK;
    }
    case FLAG_SEED: {
        errno = 0;
        const bool hex = value[0] == '0' && (value[1] == 'x' || value[1] == 'X');
        unsigned long long v = strtoull(value, &end, hex ? 16 : 10); /* decimal, or 0x hex */
        if (!number_start(value, false) || *end != '\0' || errno == ERANGE)
            return moe_fail(st, MOE_EXIT_USAGE,
                            "%s must be an integer in [0, 18446744073709551615], got '%s'", where,
                            value);
        *(uint64_t *)base = v;
        return MOE_EXIT_OK;
    }
    case FLAG_BOOL:
        if (!strcmp(value, "true") || !strcmp(value, "yes") || !strcmp(value, "1"))
            *(bool *)base = true;
        else if (!strcmp(value, "false") || !strcmp(value, "no") || !strcmp(value, "0"))
            *(bool *)base = false;
        else
            return moe_fail(st, MOE_EXIT_USAGE, "%s must be true or false, got '%s'", where,
                            value);
        return MOE_EXIT_OK;
    case FLAG_PRESET:
    case FLAG_CLUSTER:
        return moe_fail(st, MOE_EXIT_USAGE, "%s: a .conf file cannot name another", where);
    case FLAG_WAVES: {
        const int count =
            moe_parse_int_list(value, flag->min, flag->max, cfg->waves_list, MOE_MAX_WAVE_RUNS);
        if (count == -1)
            return moe_fail(st, MOE_EXIT_USAGE,
                            "%s must be an integer in [%lld, %lld] or a list of them, got '%s'",
                            where, (long long)flag->min, (long long)flag->max, value);
        if (count < 0)
            return moe_fail(st, MOE_EXIT_USAGE, "%s lists at most %d wave counts, got '%s'",
                            where, MOE_MAX_WAVE_RUNS, value);
        cfg->waves_count = count;
        return MOE_EXIT_OK;
    }
    case FLAG_REAL: {
        if (takes_none(flag) && !strcmp(value, "none")) {
            *(double *)base = 0.0;
            return MOE_EXIT_OK;
        }
        errno = 0;
        double v = strtod(value, &end);
        if (!number_start(value, true) || strpbrk(value, "xX") || *end != '\0' || errno == ERANGE ||
            !(takes_none(flag) ? v > (double)flag->min : v >= (double)flag->min) ||
            !(v <= (double)flag->max))
            return moe_fail(st, MOE_EXIT_USAGE, "%s must be a number in %c%lld, %lld]%s, got '%s'",
                            where, takes_none(flag) ? '(' : '[', (long long)flag->min,
                            (long long)flag->max, takes_none(flag) ? " or none" : "", value);
        *(double *)base = v;
        return MOE_EXIT_OK;
    }
    case FLAG_TEXT:
        if (!*value && strcmp(flag->value_name, "SPEC")) /* an output or input path, given empty */
            return moe_fail(st, MOE_EXIT_USAGE, "%s needs a %s, got ''", where, flag->value_name);
        if (strlen(value) >= MOE_NAME_MAX)
            return moe_fail(st, MOE_EXIT_USAGE, "%s: %s longer than %d characters", where,
                            strcmp(flag->value_name, "SPEC") ? "path" : "value",
                            MOE_NAME_MAX - 1);
        if (!utf8_valid(value)) /* the golden manifest records it as JSON text */
            return moe_fail(st, MOE_EXIT_USAGE, "%s must be UTF-8 text", where);
        snprintf(base, MOE_NAME_MAX, "%s", value);
        return MOE_EXIT_OK;
    case FLAG_CHOICE: {
        const int chosen = choice_value(flag, value);
        if (chosen >= 0) {
            *(int *)base = chosen;
            return MOE_EXIT_OK;
        }
        char names[128];
        return moe_fail(st, MOE_EXIT_USAGE, "%s must be one of %s, got '%s'", where,
                        choice_names(flag, names, sizeof names), value);
    }
    }
    return MOE_EXIT_OK;
}

const char *moe_config_data_path(const char *kind)
{
    static char path[4 * PATH_MAX];
    const char *env = getenv("MOE_EP_DATA_DIR");
    snprintf(path, sizeof path, "%s%s%s%s%s/%s:%s/%s", env ? env : "", env ? "/" : "",
             env ? kind : "", env ? ":" : "", MOE_SOURCE_DATA_DIR, kind, MOE_INSTALLED_DATA_DIR,
             kind);
    return path;
}

static bool valid_name(const char *name)
{
    if (!*name)
        return false;
    for (const char *c = name; *c; c++)
        if (!isalnum((unsigned char)*c) && *c != '-' && *c != '_')
            return false;
    return true;
}

/* Names of the .conf files of `kind` in its search path, for a hint. */
static void list_names(const char *kind, char *out, size_t size)
{
    char path[4 * PATH_MAX];
    snprintf(path, sizeof path, "%s", moe_config_data_path(kind));
    out[0] = '\0';
    size_t used = 0;
    for (char *save = NULL, *dir = strtok_r(path, ":", &save); dir;
         dir = strtok_r(NULL, ":", &save)) {
        DIR *d = opendir(dir);
        if (!d)
            continue;
        for (struct dirent *ent; (ent = readdir(d));) {
            size_t len = strlen(ent->d_name);
            if (len <= 5 || strcmp(ent->d_name + len - 5, ".conf"))
                continue;
            int n = snprintf(out + used, size - used, "%s%.*s", used ? ", " : "",
                             (int)(len - 5), ent->d_name);
            if (n < 0 || (size_t)n >= size - used)
                break;
            used += (size_t)n;
        }
        closedir(d);
        if (used)
            break;
    }
}

/* Open data/KIND/NAME.conf (a preset or a cluster), or NAME itself when it is
 * a path. flag names the flag for messages ("preset" or "cluster"). */
static FILE *open_conf(const char *flag, const char *kind, const char *name, char *file,
                       size_t size, moe_status *st)
{
    if (strchr(name, '/')) {
        snprintf(file, size, "%s", name);
        char what[32];
        snprintf(what, sizeof what, "--%s: ", flag);
        return moe_open_input(what, file, st);
    }
    if (!valid_name(name)) {
        moe_fail(st, MOE_EXIT_USAGE,
                 "--%s must be a name of letters, digits, '-' and '_', or a path, got '%s'", flag,
                 name);
        return NULL;
    }
    char path[4 * PATH_MAX];
    snprintf(path, sizeof path, "%s", moe_config_data_path(kind));
    for (char *save = NULL, *dir = strtok_r(path, ":", &save); dir;
         dir = strtok_r(NULL, ":", &save)) {
        snprintf(file, size, "%s/%s.conf", dir, name);
        if (access(file, F_OK) == 0) {
            char what[32];
            snprintf(what, sizeof what, "--%s: ", flag);
            return moe_open_input(what, file, st);
        }
    }
    char known[512];
    list_names(kind, known, sizeof known);
    moe_fail(st, MOE_EXIT_USAGE, "unknown %s '%s' (available: %s)", flag, name,
             known[0] ? known : "none found");
    return NULL;
}

static char *trim(char *s)
{
    while (isspace((unsigned char)*s))
        s++;
    char *end = s + strlen(s);
    while (end > s && isspace((unsigned char)end[-1]))
        *--end = '\0';
    return s;
}

/* Apply a .conf file: keys of `command` are set; keys of the other command
 * are skipped (a model preset serves run and plan alike); others fail. */
static int load_conf(moe_config *cfg, enum moe_command command, const char *flag,
                     const char *kind, const char *name, moe_status *st)
{
    char file[PATH_MAX];
    FILE *fp = open_conf(flag, kind, name, file, sizeof file, st);
    if (!fp)
        return st->code;
    char *line = NULL;
    size_t capacity = 0;
    int number = 0, rc = MOE_EXIT_OK;
    for (ssize_t got; rc == MOE_EXIT_OK && (got = getline(&line, &capacity, fp)) >= 0;) {
        if (++number == 1 && !strncmp(line, "\xef\xbb\xbf", 3)) /* a UTF-8 byte-order mark */
            memmove(line, line + 3, (size_t)(got -= 3) + 1);
        if (strlen(line) != (size_t)got) { /* text stops at a NUL; the rest would be lost */
            rc = moe_fail(st, MOE_EXIT_USAGE, "%s:%d: a NUL byte: not a text file", file, number);
            break;
        }
        char *hash = strchr(line, '#');
        if (hash)
            *hash = '\0';
        char *text = trim(line);
        if (!*text)
            continue;
        char *equals = strchr(text, '=');
        if (!equals) {
            rc = moe_fail(st, MOE_EXIT_USAGE, "%s:%d: expected 'key = value', got '%s'", file,
                          number, text);
            break;
        }
        *equals = '\0';
        char *key = trim(text), *value = trim(equals + 1);
        const flag_spec *spec = find_flag(key, strlen(key));
        char where[PATH_MAX + 64];
        snprintf(where, sizeof where, "%s:%d: %s", file, number, key);
        if (!spec)
            rc = moe_fail(st, MOE_EXIT_USAGE, "%s:%d: unknown key '%s'", file, number, key);
        else if (spec->kind == FLAG_PRESET || spec->kind == FLAG_CLUSTER)
            rc = moe_fail(st, MOE_EXIT_USAGE, "%s: a .conf file cannot name another", where);
        else if (spec->commands & (1u << command))
            rc = set_value(cfg, spec, value, where, st);
    }
    if (rc == MOE_EXIT_OK && ferror(fp))
        rc = moe_fail(st, MOE_EXIT_USAGE, "--%s: cannot read '%s': %s", flag, file, strerror(errno));
    free(line);
    fclose(fp);
    return rc;
}

int moe_config_load_preset(moe_config *cfg, enum moe_command command, const char *name,
                           moe_status *st)
{
    if (load_conf(cfg, command, "preset", "presets", name, st))
        return st->code;
    snprintf(cfg->preset, sizeof cfg->preset, "%s", name);
    return MOE_EXIT_OK;
}

static const char *const command_names[] = {"run", "plan", "bench", "explain"};

/* Is next the value of a switch (a bool, or a choice that has true) rather
 * than the next argument? */
static bool switch_value(const flag_spec *flag, const char *next)
{
    if (flag->kind == FLAG_CHOICE)
        return choice_value(flag, next) >= 0;
    static const char *const words[] = {"true", "false", "yes", "no", "1", "0"};
    for (size_t n = 0; n < sizeof words / sizeof words[0]; n++)
        if (!strcmp(next, words[n]))
            return true;
    return false;
}

/* Splits "--name=value" / "--name value"; returns the flag or sets st. */
static const flag_spec *parse_flag(enum moe_command command, int argc, char **argv, int *at,
                                   const char **value, moe_status *st)
{
    const char *arg = argv[*at];
    if (strncmp(arg, "--", 2) != 0) {
        moe_fail(st, MOE_EXIT_USAGE, "unexpected argument '%s' (flags start with --)", arg);
        return NULL;
    }
    const char *name = arg + 2, *equals = strchr(name, '=');
    size_t len = equals ? (size_t)(equals - name) : strlen(name);
    const flag_spec *flag = find_flag(name, len);
    if (!flag || !(flag->commands & (1u << command))) {
        moe_fail(st, MOE_EXIT_USAGE, "unknown flag '--%.*s' for moe-ep %s (see moe-ep %s --help)",
                 (int)len, name, command_names[command], command_names[command]);
        return NULL;
    }
    const bool switch_like = flag->kind == FLAG_BOOL ||
                             (flag->kind == FLAG_CHOICE && choice_value(flag, "true") >= 0);
    if (equals)
        *value = equals + 1;
    else if (switch_like && *at + 1 < argc && switch_value(flag, argv[*at + 1]))
        *value = argv[++*at]; /* --check false, as --check=false */
    else if (switch_like)
        *value = "true"; /* a switch, or a choice that has true, may stand alone */
    else if (*at + 1 < argc)
        *value = argv[++*at];
    else {
        char names[128];
        moe_fail(st, MOE_EXIT_USAGE, "--%s needs a value (%s)", flag->name,
                 value_text(flag, names, sizeof names));
        return NULL;
    }
    return flag;
}

int moe_config_parse(moe_config *cfg, enum moe_command command, int argc, char **argv,
                     moe_status *st)
{
    /* Pass 1: the preset and the cluster, so that flags override them
     * whatever their order. */
    const char *preset = NULL, *cluster = NULL;
    for (int at = 0; at < argc; at++) {
        const char *value = NULL;
        const flag_spec *flag = parse_flag(command, argc, argv, &at, &value, st);
        if (!flag)
            return st->code;
        if (flag->kind == FLAG_PRESET)
            preset = value;
        if (flag->kind == FLAG_CLUSTER)
            cluster = value;
    }
    if (preset && moe_config_load_preset(cfg, command, preset, st))
        return st->code;
    if (cluster) {
        if (load_conf(cfg, command, "cluster", "clusters", cluster, st))
            return st->code;
        snprintf(cfg->cluster, sizeof cfg->cluster, "%s", cluster);
    }
    for (int at = 0; at < argc; at++) {
        const char *value = NULL;
        const flag_spec *flag = parse_flag(command, argc, argv, &at, &value, st);
        if (flag->kind == FLAG_PRESET || flag->kind == FLAG_CLUSTER)
            continue;
        char where[64];
        snprintf(where, sizeof where, "--%s", flag->name);
        if (set_value(cfg, flag, value, where, st))
            return st->code;
    }
    return MOE_EXIT_OK;
}

static int validate_router(const moe_config *cfg, moe_status *st)
{
    const int64_t E = cfg->experts, N = cfg->groups, M = cfg->topk_groups;
    if (cfg->router != MOE_ROUTER_DEEPSEEK_V3) {
        if (N != 1 || M != 1)
            return moe_fail(st, MOE_EXIT_USAGE,
                            "--groups and --topk-groups need --router deepseek-v3");
    } else {
        if (E % N != 0)
            return moe_fail(st, MOE_EXIT_USAGE,
                            "--groups must divide --experts %lld, got %lld", (long long)E, (long long)N);
        if (M > N)
            return moe_fail(st, MOE_EXIT_USAGE, "--topk-groups must be in [1, %lld] (at most --groups), got %lld",
                            (long long)N, (long long)M);
        if (cfg->bias_scale > 0 && N > 1 && E / N < 2)
            return moe_fail(st, MOE_EXIT_USAGE,
                            "--groups %lld leaves 1 expert per group, but the biased group score sums "
                            "the top 2: use at most %lld groups, or --bias-scale 0",
                            (long long)N, (long long)(E / 2));
        if (cfg->topk > M * (E / N))
            return moe_fail(st, MOE_EXIT_USAGE,
                            "--topk must be at most %lld (the experts in the %lld kept groups of %lld), got %lld",
                            (long long)(M * (E / N)), (long long)M, (long long)(E / N), (long long)cfg->topk);
    }
    float skew[4096];
    return moe_skew_parse(cfg->skew, (int)E, skew, st);
}

/* --backward: the blocking forward, its mirror in fp32 on the wire in waves
 * of token chunks, through the router's own weights (ep.h,
 * moe_ep_backward_step). */
static int validate_backward(const moe_config *cfg, moe_status *st)
{
    if (cfg->wave_by == MOE_WAVE_BY_EXPERTS)
        return moe_fail(st, MOE_EXIT_USAGE,
                        "--backward splits its waves by tokens (a token's rows and pairs in one "
                        "wave, the dedup kept): --wave-by must be auto or tokens, got experts");
    if (cfg->dispatch == MOE_DISPATCH_HIERARCHICAL)
        return moe_fail(st, MOE_EXIT_USAGE,
                        "--backward mirrors the flat dispatch: --dispatch must be flat, got hierarchical");
    if (cfg->dispatch_dtype != MOE_DTYPE_FP32 || cfg->combine_dtype != MOE_DTYPE_FP32)
        return moe_fail(st, MOE_EXIT_USAGE,
                        "--backward moves fp32 rows both ways: --dispatch-dtype and --combine-dtype "
                        "must be fp32, got %s and %s",
                        moe_config_choice_name("dispatch-dtype", cfg->dispatch_dtype),
                        moe_config_choice_name("combine-dtype", cfg->combine_dtype));
    if (cfg->routing[0])
        return moe_fail(st, MOE_EXIT_USAGE,
                        "--backward differentiates the router's weights: replayed ones (--routing) "
                        "have no router behind them");
    return MOE_EXIT_OK;
}

int moe_config_check_replicas(const moe_config *cfg, int ranks, const char *group,
                              moe_status *st)
{
    const int64_t N = cfg->redundant_experts, E = cfg->experts, P = E + N;
    if (N == 0) {
        if (cfg->expert_load[0] || cfg->eplb_window != 1)
            return moe_fail(st, MOE_EXIT_USAGE, "--%s is the load of redundant experts: add --redundant-experts N",
                            cfg->expert_load[0] ? "expert-load" : "eplb-window");
        return MOE_EXIT_OK;
    }
    if (P % ranks != 0) {
        const int64_t next = (P + ranks - 1) / ranks * ranks - E;
        return moe_fail(st, MOE_EXIT_USAGE,
                        "--redundant-experts %lld: the %lld + %lld = %lld physical experts must be a "
                        "multiple of the %d %s (each the same number of slots): the next N that fits "
                        "is %lld", (long long)N, (long long)E, (long long)N, (long long)P, ranks,
                        group, (long long)next);
    }
    if (P > MOE_META_MAX_EXPERTS)
        return moe_fail(st, MOE_EXIT_USAGE,
                        "--redundant-experts must be at most %lld (E + N physical ids travel as 16 bits), got %lld",
                        (long long)(MOE_META_MAX_EXPERTS - E), (long long)N);
    const char *other = cfg->backward ? "--backward (the copies' weight gradients would need summing)"
                        : cfg->dump[0] ? "--dump (a golden set names experts by their logical id)"
                                       : NULL;
    if (other)
        return moe_fail(st, MOE_EXIT_USAGE, "--redundant-experts serves inference: drop %s", other);
    return MOE_EXIT_OK;
}

/* --steps and --bias-update: the bias is the deepseek-v3 router's; the
 * steps route fresh batches of the router's own. */
static int validate_steps(const moe_config *cfg, moe_status *st)
{
    if (cfg->bias_update > 0 && (cfg->router != MOE_ROUTER_DEEPSEEK_V3 || !(cfg->bias_scale > 0)))
        return moe_fail(st, MOE_EXIT_USAGE,
                        "--bias-update moves deepseek-v3's correction bias: add --router deepseek-v3 "
                        "with --bias-scale above 0 (without a bias the router is V2's)");
    if (cfg->steps == 1 && !(cfg->bias_update > 0) && (cfg->steps_csv[0] || cfg->steps_plot[0]))
        return moe_fail(st, MOE_EXIT_USAGE, "--%s records the steps: add --steps N",
                        cfg->steps_csv[0] ? "steps-csv" : "steps-plot");
    if ((cfg->steps > 1 || cfg->bias_update > 0) && cfg->routing[0])
        return moe_fail(st, MOE_EXIT_USAGE,
                        "--steps routes fresh batches with the router: drop --routing");
    if ((cfg->steps > 1 || cfg->bias_update > 0) && (cfg->backward || cfg->dump[0]))
        return moe_fail(st, MOE_EXIT_USAGE, "--steps and --bias-update run forwards: drop %s",
                        cfg->backward ? "--backward" : "--dump");
    return MOE_EXIT_OK;
}

/* --capacity-factor: the forward drops pairs; what reads every pair of
 * the routing refuses. --drop-policy and --replica-choice say nothing
 * without the capacity or the copies they choose for. */
static int validate_capacity(const moe_config *cfg, moe_status *st)
{
    if (cfg->drop_policy != MOE_DROP_PROBS && !(cfg->capacity_factor > 0))
        return moe_fail(st, MOE_EXIT_USAGE,
                        "--drop-policy chooses what --capacity-factor drops: add --capacity-factor C");
    if (cfg->replica_choice != MOE_REPLICA_SPREAD && cfg->redundant_experts == 0)
        return moe_fail(st, MOE_EXIT_USAGE,
                        "--replica-choice chooses among the copies of --redundant-experts: add "
                        "--redundant-experts N");
    if (cfg->pad_to_capacity && !(cfg->capacity_factor > 0))
        return moe_fail(st, MOE_EXIT_USAGE,
                        "--pad-to-capacity fills each expert to the capacity of --capacity-factor: "
                        "add --capacity-factor C");
    if (!(cfg->capacity_factor > 0))
        return MOE_EXIT_OK;
    const char *other = cfg->backward ? "--backward (the gradient of a dropped pair is not built)"
                        : cfg->dump[0] ? "--dump (a golden set holds every pair of the routing)"
                                       : NULL;
    if (other)
        return moe_fail(st, MOE_EXIT_USAGE, "--capacity-factor drops pairs of the forward: drop %s",
                        other);
    return MOE_EXIT_OK;
}

/* --pad-to-capacity: the zero rows of an expert are G C minus the pairs it
 * computes, so each expert must compute all its pairs in one batch, on the
 * flat path where each pair reaches one copy of its expert. */
static int validate_padding(const moe_config *cfg, int ranks, moe_status *st)
{
    if (!cfg->pad_to_capacity)
        return MOE_EXIT_OK;
    const char *other = cfg->mode == MOE_MODE_LOW_LATENCY
                            ? "--mode low-latency (its masked layout is the fixed shape, computed "
                              "only where its counts fill it)"
                        : cfg->dispatch == MOE_DISPATCH_HIERARCHICAL
                            ? "--dispatch hierarchical (its waves split an expert's pairs by tokens)"
                        : cfg->redundant_experts > 0
                            ? "--redundant-experts (copies split an expert's pairs)"
                            : NULL;
    if (other)
        return moe_fail(st, MOE_EXIT_USAGE,
                        "--pad-to-capacity fills each expert's whole batch to G C rows: drop %s", other);
    const int64_t fewest = cfg->experts / ranks; /* waves of expert slots up to this many */
    for (int n = 0; n < cfg->waves_count && !cfg->blocking; n++) {
        const int64_t W = cfg->waves_list[n];
        if (W > 1 && (cfg->wave_by == MOE_WAVE_BY_TOKENS || W > fewest))
            return moe_fail(st, MOE_EXIT_USAGE,
                            "--pad-to-capacity fills each expert's whole batch to G C rows: waves of "
                            "tokens split it (--waves %lld, the fewest experts a rank holds %lld); "
                            "use --wave-by experts with at most that many waves, or --blocking",
                            (long long)W, (long long)fewest);
    }
    return MOE_EXIT_OK;
}

int moe_config_layout(const moe_config *cfg)
{
    if (cfg->expert_layout != MOE_LAYOUT_AUTO)
        return cfg->expert_layout;
    return cfg->mode == MOE_MODE_LOW_LATENCY ? MOE_LAYOUT_MASKED : MOE_LAYOUT_ROWS;
}

int64_t moe_config_max_tokens(const moe_config *cfg)
{
    return cfg->max_tokens_per_rank > 0 ? cfg->max_tokens_per_rank : cfg->tokens;
}

/* --expert-layout: what each layout needs (layout.h). */
static int validate_layout(const moe_config *cfg, moe_status *st)
{
    const int64_t A = cfg->expert_alignment;
    if (A & (A - 1))
        return moe_fail(st, MOE_EXIT_USAGE,
                        "--expert-alignment must be a power of two in [1, 1024], got %lld", (long long)A);
    const int layout = moe_config_layout(cfg);
    if (cfg->mode == MOE_MODE_LOW_LATENCY && layout == MOE_LAYOUT_ROWS)
        return moe_fail(st, MOE_EXIT_USAGE,
                        "--mode low-latency receives into the masked layout: --expert-layout must "
                        "be auto, masked or contiguous, got rows");
    if (cfg->backward && layout != MOE_LAYOUT_ROWS && cfg->mode == MOE_MODE_NORMAL)
        return moe_fail(st, MOE_EXIT_USAGE,
                        "--backward reads the forward's received rows in place: --expert-layout "
                        "must be auto or rows, got %s", moe_config_choice_name("expert-layout", layout));
    return MOE_EXIT_OK;
}

/* --mode low-latency: a forward of its own (ep_ll.c), one round each way;
 * and the tokens per rank its buffers and the masked layout hold. */
static int validate_low_latency(const moe_config *cfg, moe_status *st)
{
    const bool masked = moe_config_layout(cfg) == MOE_LAYOUT_MASKED;
    if (cfg->mode != MOE_MODE_LOW_LATENCY && !masked) {
        if (cfg->max_tokens_per_rank >= 0)
            return moe_fail(st, MOE_EXIT_USAGE,
                            "--max-tokens-per-rank sizes the low-latency mode's buffers and the "
                            "masked layout: add --mode low-latency or --expert-layout masked");
        return MOE_EXIT_OK;
    }
    if (cfg->max_tokens_per_rank >= 0 && cfg->max_tokens_per_rank < cfg->tokens)
        return moe_fail(st, MOE_EXIT_USAGE,
                        "--max-tokens-per-rank must be in [%lld, %d] (at least --tokens: a rank's "
                        "tokens must fit the fixed buffers), got %lld",
                        (long long)cfg->tokens, 1 << 24, (long long)cfg->max_tokens_per_rank);
    if (cfg->mode != MOE_MODE_LOW_LATENCY)
        return MOE_EXIT_OK;
    const char *other = cfg->backward                             ? "--backward"
                        : cfg->dispatch == MOE_DISPATCH_HIERARCHICAL ? "--dispatch hierarchical"
                        : cfg->trace[0]                           ? "--trace"
                        : cfg->timeline[0]                        ? "--timeline"
                        : cfg->dump[0]                            ? "--dump"
                                                                  : NULL;
    if (other)
        return moe_fail(st, MOE_EXIT_USAGE,
                        "--mode low-latency runs the decode forward alone (one round each way, no "
                        "waves): %s needs --mode normal", other);
    return MOE_EXIT_OK;
}

int moe_config_validate(const moe_config *cfg, int ranks, moe_status *st)
{
    if (cfg->topk > cfg->experts)
        return moe_fail(st, MOE_EXIT_USAGE, "--topk must be in [1, %lld] (at most --experts), got %lld",
                        (long long)cfg->experts, (long long)cfg->topk);
    for (int n = 0; n < cfg->waves_count; n++)
        if (cfg->waves_list[n] > cfg->tokens)
            return moe_fail(st, MOE_EXIT_USAGE,
                            "--waves must be in [1, %lld] (at most --tokens), got %lld",
                            (long long)cfg->tokens, (long long)cfg->waves_list[n]);
    if (validate_router(cfg, st))
        return st->code;
    if (!(cfg->init_scale > 0))
        return moe_fail(st, MOE_EXIT_USAGE, "--init-scale must be a number in (0, 1e18], got %g",
                        cfg->init_scale);
    /* The largest value the layer can make: |h| <= S sqrt(d) (a row of W1
     * has norm <= 1 at scale 1/sqrt(d)), the activation <= |h|^2, an output
     * <= sqrt(f) times that. Past FLT_MAX (bf16's range too) fp32 turns
     * into Inf and NaN; say so before running. --input-dist activations
     * scales a token by up to 2 and an outlier channel by 16 (rng.h). */
    const double peak = cfg->input_dist == MOE_INPUT_ACTIVATIONS ? 32.0 : 1.0;
    const double reach = peak * peak * cfg->init_scale * cfg->init_scale * (double)cfg->hidden *
                         sqrt((double)cfg->ffn);
    if (reach > FLT_MAX / 16)
        return moe_fail(st, MOE_EXIT_USAGE,
                        "--init-scale %g could overflow fp32%s: activations may reach %.1e, past "
                        "FLT_MAX/16 = %.1e (room for the sums); use at most %.3g",
                        cfg->init_scale, cfg->param_dtype == MOE_DTYPE_BF16 ? " and bf16" : "", reach,
                        (double)FLT_MAX / 16,
                        sqrt(FLT_MAX / 16 / ((double)cfg->hidden * sqrt((double)cfg->ffn))) / peak);
    if (cfg->gate_ties >= cfg->experts)
        return moe_fail(st, MOE_EXIT_USAGE, "--gate-ties must be in [0, %lld] (below --experts), got %lld",
                        (long long)cfg->experts - 1, (long long)cfg->gate_ties);
    if (cfg->param_dtype == MOE_DTYPE_FP8)
        return moe_fail(st, MOE_EXIT_USAGE, "--dtype must be fp32 or bf16 for moe-ep run, got fp8");
    if (cfg->combine_dtype == MOE_DTYPE_FP8)
        return moe_fail(st, MOE_EXIT_USAGE, "--combine-dtype must be fp32 or bf16 for moe-ep run, got fp8");
    if (cfg->dump[0] && cfg->gemm == MOE_GEMM_BLAS)
        return moe_fail(st, MOE_EXIT_USAGE,
                        "--dump needs --gemm packed or exact (default packed), got blas: OpenBLAS's "
                        "bits depend on the CPU and the thread count, and a golden set is the same "
                        "bytes on every machine");
    if (cfg->dispatch == MOE_DISPATCH_HIERARCHICAL && cfg->wave_by == MOE_WAVE_BY_EXPERTS)
        return moe_fail(st, MOE_EXIT_USAGE,
                        "--dispatch hierarchical runs waves of tokens (a relay forwards a token once "
                        "per wave): drop --wave-by experts");
    /* local experts of the rank with the fewest */
    const int64_t fewest = (cfg->experts + cfg->redundant_experts) / ranks;
    for (int n = 0; n < cfg->waves_count && cfg->wave_by == MOE_WAVE_BY_EXPERTS; n++)
        if (cfg->waves_list[n] > fewest)
            return moe_fail(st, MOE_EXIT_USAGE,
                            "--wave-by experts needs every rank to hold at least W experts (the fewest "
                            "hold %lld at %d ranks), got --waves %lld; use --wave-by tokens or fewer waves",
                            (long long)fewest, ranks, (long long)cfg->waves_list[n]);
    const int64_t R = cfg->ranks_per_node > 0 ? cfg->ranks_per_node : ranks;
    if (cfg->combine == MOE_COMBINE_REDUCED && cfg->dump[0] && cfg->dispatch == MOE_DISPATCH_HIERARCHICAL)
        return moe_fail(st, MOE_EXIT_USAGE,
                        "--dump writes the flat dispatch's sums per (token, rank) (golden.md); the "
                        "two-stage dispatch sums per node too: add --combine pairs or --dispatch flat");
    if (cfg->dispatch == MOE_DISPATCH_HIERARCHICAL && ranks % R != 0)
        return moe_fail(st, MOE_EXIT_USAGE,
                        "--dispatch hierarchical needs nodes of equal size: --ranks-per-node must "
                        "divide the %d ranks, got %lld", ranks, (long long)R);
    if (cfg->grad_output[0] && !cfg->backward)
        return moe_fail(st, MOE_EXIT_USAGE, "--grad-output is the gradient of a training step: add --backward");
    if (moe_config_check_replicas(cfg, ranks, "ranks", st) || validate_steps(cfg, st) ||
        validate_capacity(cfg, st) || validate_padding(cfg, ranks, st))
        return st->code;
    if (cfg->backward && validate_backward(cfg, st))
        return st->code;
    if (validate_layout(cfg, st) || validate_low_latency(cfg, st))
        return st->code;
    moe_link link = {.ranks_per_node = 1};
    if (moe_link_parse(&link, cfg->link, st))
        return st->code;
    /* Every rank may receive every pair: G*T*k rows must fit an MPI count. */
    double pairs = (double)ranks * (double)cfg->tokens * (double)cfg->topk;
    if (pairs > (double)INT_MAX)
        return moe_fail(st, MOE_EXIT_USAGE,
                        "--tokens must be at most %lld for %d ranks and --topk %lld "
                        "(ranks*tokens*topk must fit a 32-bit MPI count), got %lld",
                        (long long)(INT_MAX / ((double)ranks * (double)cfg->topk)), ranks,
                        (long long)cfg->topk, (long long)cfg->tokens);
    return MOE_EXIT_OK;
}

int moe_config_resolve_nodes(moe_config *cfg, int node_ranks, int ranks, moe_status *st)
{
    if (cfg->ranks_per_node != MOE_RANKS_PER_NODE_AUTO)
        return MOE_EXIT_OK;
    if (node_ranks <= 0)
        return moe_fail(st, MOE_EXIT_USAGE,
                        "--ranks-per-node auto: the %d ranks are not on machines of equal size holding "
                        "consecutive ranks; give --ranks-per-node R", ranks);
    cfg->ranks_per_node = node_ranks == ranks ? 0 : node_ranks; /* one machine: one node */
    return MOE_EXIT_OK;
}

double moe_config_memory_per_rank(const moe_config *cfg, enum moe_command command, int ranks)
{
    const double G = ranks, T = (double)cfg->tokens, d = (double)cfg->hidden, f = (double)cfg->ffn;
    const double E = (double)cfg->experts, k = (double)cfg->topk, S = (double)cfg->shared_experts;
    const double N = G * T;                                   /* all ranks' tokens */
    const double EL = (double)((cfg->experts + cfg->redundant_experts + ranks - 1) / ranks);
    const double expert_bytes = 3.0 * f * d * 4.0;            /* W1 (2f,d) + W2 (d,f), fp32 */
    const double meta = 4.0 * (2.0 * k + 1.0);                /* a row's ids and weights */
    double W = 1.0;                                           /* the most waves of one forward */
    for (int n = 0; n < cfg->waves_count && !cfg->blocking; n++)
        W = fmax(W, (double)cfg->waves_list[n]);
    double bytes = MOE_MEMORY_RUNTIME;                        /* MPI, BLAS, the program */
    bytes += (EL + S) * expert_bytes + E * d * 4.0;           /* experts, shared experts, gate */
    bytes += 3.0 * T * d * 4.0;                               /* tokens, output, quantised copy */
    bytes += 2.0 * T * E * 4.0 + T * k * 8.0;                 /* logits, scores, ids and weights */
    /* One forward, the routed rows at their mean (T*k rows and pairs in and
     * out): rows and ids sent and received, expert outputs sent and
     * received back, the experts' inputs and activations, the tables. */
    bytes += 2.0 * T * k * (4.0 * d + meta) + 2.0 * T * k * d * 4.0;
    bytes += T * k * (d + 1.0 + 2.0 * f) * 4.0 + 3.0 * T * k * 8.0;
    /* bf16 or fp8 on the wire: the rows decoded beside their wire copies */
    bytes += (cfg->dispatch_dtype != MOE_DTYPE_FP32 ? 1.0 : 0.0) * T * k * d * 4.0 +
             (cfg->combine_dtype != MOE_DTYPE_FP32 ? 2.0 : 0.0) * T * k * d * 4.0;
    /* The two-stage dispatch adds the relay's hop: the rows and ids it
     * receives and forwards, its table of their ids, the outputs it collects
     * and those it returns home. */
    if (cfg->dispatch == MOE_DISPATCH_HIERARCHICAL)
        bytes += 2.0 * T * k * (4.0 * d + meta) + T * k * k * 4.0 + 2.0 * T * k * d * 4.0;
    /* The low-latency mode's window (wire.h), its experts' decoded batch and
     * activations, the shared experts' outputs kept apart. */
    if (cfg->mode == MOE_MODE_LOW_LATENCY)
        bytes += moe_ll_buffer_bytes(cfg, ranks) + T * k * (d + 2.0 * f) * 4.0 + S * T * d * 4.0;
    /* The wave pipelines run the shared experts in their waits, their
     * outputs kept apart until the reduce (a training step's forward is
     * the blocking one). */
    else if (!cfg->blocking && !cfg->backward)
        bytes += S * T * d * 4.0;
    /* The layout tensor (--expert-layout), fp32: a masked one whole (its
     * empty slots are never touched, but the allocation must succeed), a
     * contiguous one's rows and padding. */
    if (moe_config_layout(cfg) == MOE_LAYOUT_MASKED)
        bytes += EL * G * (double)moe_config_max_tokens(cfg) * d * 4.0;
    else if (moe_config_layout(cfg) == MOE_LAYOUT_CONTIGUOUS)
        bytes += (T * k + EL * (double)(cfg->expert_alignment - 1)) * d * 4.0;
    /* Per wave: a slot-to-pair map of every (token, slot), the counts. */
    bytes += W * (T * k * 8.0 + G * (64.0 + 8.0 * (1.0 + EL)));
    if (cfg->check) /* the truth: fp64 tokens, outputs, activations, one expert's weights, the reference output */
        bytes += T * (3.0 * d + 3.0 * f + 1.0) * 8.0 + 2.0 * T * d * 8.0 + 3.0 * f * d * 12.0 + T * d * 4.0;
    if (cfg->check && moe_config_truth_shares(cfg)) /* every rank's tokens, this rank's share of their truth (and allowance), the sums' chunks */
        bytes += N * (d * 4.0 + k * 12.0 + 16.0 + d * 8.0 * (cfg->combine_dtype != MOE_DTYPE_FP32 ? 2.0 : 1.0)) +
                 2.0 * 65536.0 * G * 8.0;
    if (cfg->backward) {
        /* One expert's weights laid out for the backward, the gradients
         * (routed, shared, gate, dx) and dy; the step's buffers: dy received, dx per
         * pair and back home, an expert batch's rows (x, dy, outputs, dx) and
         * every pair's backward work (dH, a'), the wgrad operands, the shared
         * experts' work on T rows, the fp64 sums over ranks, the router's
         * fp64 gradient. */
        bytes += (EL + S + 1.0) * expert_bytes + E * d * 4.0 + 2.0 * T * d * 4.0;
        bytes += 3.0 * T * k * d * 4.0 + T * k * (4.0 * d + 3.0 * f) * 4.0 +
                 2.0 * T * k * (d + 2.0 * f) * 4.0 + T * (2.0 * d + 3.0 * f) * 4.0 + T * d * 4.0;
        bytes += fmax(E * d, S * 2.0 * f * d) * 8.0 + (65536.0 * G) * 8.0 + T * (E + d) * 8.0;
        if (cfg->check || cfg->dump[0]) /* every token's x, dy, ids and weights; the fp64 truth */
            bytes += N * (2.0 * d + 2.0 * k) * 4.0 + T * d * 8.0 * 4.0 + E * d * 8.0 +
                     fmax(S, 1.0) * expert_bytes * 2.0 + N * (d * 8.0 * 3.0) +
                     (cfg->dump[0] ? (EL + S) * expert_bytes * 2.0 : 0.0);
        if (cfg->check) /* this rank's share of every token's dx and gate-weight gradients, the sums' chunks */
            bytes += N * (d + k) * 8.0 + 2.0 * 65536.0 * G * 8.0;
        if (cfg->dump[0]) /* rank 0 gathers the backward stage: dy, per-pair rows, dx, dW */
            bytes += N * d * (4.0 + 4.0 + 8.0) + 3.0 * N * k * (d + 1.0) * 4.0 + E * expert_bytes * 3.0;
    }
    if (cfg->dump[0]) /* rank 0 gathers the set: per token, per pair, the rows */
        bytes += N * (3.0 * E * 4.0 + k * 8.0 + d * (4.0 + 8.0 + 8.0 + 4.0 + 8.0) + G) +
                 2.0 * N * k * d * 4.0 + 2.0 * T * k * (d * 4.0 + 8.0) + 3.0 * f * d * 4.0 * 2.0;
    if (cfg->dump[0] && moe_config_layout(cfg) != MOE_LAYOUT_ROWS) {
        /* every rank's layout tensor on rank 0, as it travelled and decoded,
         * its scales and who each slot holds: all slots, empty ones too */
        const double slots = moe_config_layout(cfg) == MOE_LAYOUT_MASKED
                                 ? E * G * (double)moe_config_max_tokens(cfg)
                                 : N * k + E * (double)(cfg->expert_alignment - 1);
        bytes += slots * (2.0 * d * 4.0 + 16.0 + 8.0);
    }
    if (command == MOE_CMD_BENCH) /* the anchors: cache eviction, one sgemm, two all-to-alls */
        bytes += 64.0 * 1048576.0 + (T * k + S * T) * (d + 6.0 * f) * 4.0 + 3.0 * f * d * 4.0 +
                 4.0 * T * k * d * 4.0;
    return bytes;
}

void moe_config_print_flags(FILE *out, enum moe_command command)
{
    for (size_t n = 0; n < N_FLAGS; n++) {
        const flag_spec *flag = &flags[n];
        if (!(flag->commands & (1u << command)))
            continue;
        char left[64], names[128], range[64] = "", fallback[MOE_NAME_MAX + 16] = "";
        const char *value = value_text(flag, names, sizeof names);
        snprintf(left, sizeof left, "--%s%s%s", flag->name, *value ? " " : "", value);
        if (flag->kind == FLAG_INT || flag->kind == FLAG_REAL)
            snprintf(range, sizeof range, " %c%lld..%lld]", takes_none(flag) ? '(' : '[',
                     (long long)flag->min, (long long)flag->max);
        if (flag->default_value && *flag->default_value)
            snprintf(fallback, sizeof fallback, " (default %s)", flag->default_value);
        fprintf(out, "  %-31s %s%s%s\n", left, flag->help, range, fallback);
    }
}

void moe_config_describe(const moe_config *cfg, enum moe_command command,
                         void (*emit)(void *ctx, const char *name, const char *value), void *ctx)
{
    for (size_t n = 0; n < N_FLAGS; n++) {
        const flag_spec *flag = &flags[n];
        if (!(flag->commands & (1u << command)))
            continue;
        const char *base = (const char *)cfg + flag->offset;
        char value[MOE_NAME_MAX + 32];
        switch (flag->kind) {
        case FLAG_INT:
            if (takes_auto(flag) && *(const int64_t *)base < 0)
                snprintf(value, sizeof value, "auto");
            else
                snprintf(value, sizeof value, "%lld", (long long)*(const int64_t *)base);
            break;
        case FLAG_SEED:
            snprintf(value, sizeof value, "%llu", (unsigned long long)*(const uint64_t *)base);
            break;
        case FLAG_BOOL:
            snprintf(value, sizeof value, "%s", *(const bool *)base ? "true" : "false");
            break;
        case FLAG_REAL:
            if (takes_none(flag) && *(const double *)base == 0.0)
                snprintf(value, sizeof value, "none");
            else
                snprintf(value, sizeof value, "%.17g", *(const double *)base);
            break;
        case FLAG_CHOICE:
            snprintf(value, sizeof value, "%s", "");
            for (const flag_choice *c = flag->choices; c->name; c++)
                if (c->value == *(const int *)base)
                    snprintf(value, sizeof value, "%s", c->name);
            break;
        case FLAG_WAVES: {
            size_t used = 0;
            value[0] = '\0';
            for (int w = 0; w < cfg->waves_count; w++)
                used += (size_t)snprintf(value + used, sizeof value - used, "%s%lld", w ? "," : "",
                                         (long long)cfg->waves_list[w]);
            break;
        }
        default: /* preset, cluster, text */
            snprintf(value, sizeof value, "%s", base);
        }
        emit(ctx, flag->name, value);
    }
}

static void canonical_line(void *ctx, const char *name, const char *value)
{
    char **text = ctx;
    size_t len = strlen(*text);
    *text = realloc(*text, len + strlen(name) + 2 * strlen(value) + 3);
    MOE_ASSERT(*text != NULL);
    char *at = *text + len;
    at += sprintf(at, "%s=", name);
    for (const char *c = value; *c; c++) /* one line per key, whatever the value holds */
        at += *c == '\n' ? sprintf(at, "\\n") : sprintf(at, "%c", *c);
    sprintf(at, "\n");
}

char *moe_config_canonical(const moe_config *cfg, enum moe_command command)
{
    char *text = moe_xmalloc(64);
    snprintf(text, 64, "command=%s\n", command_names[command]);
    moe_config_describe(cfg, command, canonical_line, &text);
    return text;
}
