/* SPDX-License-Identifier: MIT */
/* flags.c — the flag table (flags.h): every flag's name (also its preset
 * key), type, allowed range, default and help; --help, the canonical
 * config and a golden manifest's flags printed from it.
 */
#include "flags.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "moe/capacity.h"
#include "moe/eplb.h"
#include "moe/experts.h"
#include "moe/gemm.h"
#include "moe/layout.h"
#include "moe/router.h"
#include "moe/workload.h"

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
static const flag_choice workload_choices[] = {
    {"none", MOE_WORKLOAD_NONE}, {"balanced", MOE_WORKLOAD_BALANCED},
    {"hot-experts", MOE_WORKLOAD_HOT_EXPERTS}, {"hot-rank", MOE_WORKLOAD_HOT_RANK},
    {"spread-hot", MOE_WORKLOAD_SPREAD_HOT}, {"ragged", MOE_WORKLOAD_RAGGED},
    {"zero-rank", MOE_WORKLOAD_ZERO_RANK}, {"rotating", MOE_WORKLOAD_ROTATING},
    {"burst", MOE_WORKLOAD_BURST}, {"all", MOE_WORKLOAD_ALL}, {NULL, 0}};
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

static bool value_name_ends(const flag_spec *flag, const char *word)
{
    const char *name = flag->value_name;
    return name && strlen(name) > strlen(word) && !strcmp(name + strlen(name) - strlen(word), word);
}

bool moe_flag_takes_auto(const flag_spec *flag)
{
    return value_name_ends(flag, "|auto");
}

bool moe_flag_min_open(const flag_spec *flag)
{
    return flag->min_open || moe_flag_takes_none(flag);
}

bool moe_flag_takes_none(const flag_spec *flag)
{
    return value_name_ends(flag, "|none");
}

#define FIELD(f) offsetof(moe_config, f)

const flag_spec moe_flags[] = {
    {"preset", FLAG_PRESET, FIELD(preset), 0, 0, "NAME", NULL, NULL, "data/presets/NAME.conf, or a path to a .conf file", BOTH | EXPLAIN, false},
    {"tokens", FLAG_INT, FIELD(tokens), 1, 1 << 24, "T", NULL, "256", "tokens per rank", BOTH | EXPLAIN, false},
    {"hidden", FLAG_INT, FIELD(hidden), 1, 65536, "d", NULL, "256", "hidden size", BOTH | EXPLAIN, false},
    {"ffn", FLAG_INT, FIELD(ffn), 1, 65536, "f", NULL, "128", "FFN size of one expert", BOTH | EXPLAIN, false},
    {"experts", FLAG_INT, FIELD(experts), 1, 4096, "E", NULL, "8", "routed experts", BOTH | EXPLAIN, false},
    {"topk", FLAG_INT, FIELD(topk), 1, 4096, "k", NULL, "2", "experts per token, 1 <= k <= E", BOTH | EXPLAIN, false},
    {"router", FLAG_CHOICE, FIELD(router), 0, 0, NULL, router_choices, "softmax", "the gate (router.h)", BOTH | EXPLAIN, false},
    {"groups", FLAG_INT, FIELD(groups), 1, 4096, "N", NULL, "1", "deepseek-v3 expert groups (= nodes: node-limited routing)", BOTH | EXPLAIN, false},
    {"topk-groups", FLAG_INT, FIELD(topk_groups), 1, 4096, "M", NULL, "1", "deepseek-v3 groups kept per token", BOTH | EXPLAIN, false},
    {"route-scale", FLAG_REAL, FIELD(route_scale), 0, 1000, "S", NULL, "1", "scale of the k weights (every router, as V2 and V3 apply it)", RUN | EXPLAIN, false},
    {"bias-scale", FLAG_REAL, FIELD(bias_scale), 0, 100, "B", NULL, "0.01", "deepseek-v3 correction bias, uniform in [-B, B); 0 = none (V2 style)", RUN | EXPLAIN, false},
    {"norm-topk", FLAG_CHOICE, FIELD(norm_topk), 0, 0, NULL, norm_topk_choices, "auto", "divide the k weights by their sum; auto: as the gate's reference code (softmax and V3 yes, V2 no); alone: true", RUN | EXPLAIN, false},
    {"weight-at", FLAG_CHOICE, FIELD(weight_at), 0, 0, NULL, weight_at_choices, "output", "gate weight on the expert output (V3 reference) or before L2 (fused kernels)", RUN | EXPLAIN, false},
    {"skew", FLAG_TEXT, FIELD(skew), 0, 0, "SPEC", NULL, "", "logit bias: hot:EXPERT=+B[,...] or zipf:S", RUN | PLAN | EXPLAIN, false},
    {"redundant-experts", FLAG_INT, FIELD(redundant_experts), 0, MOE_META_MAX_EXPERTS - 1, "N", NULL, "0", "E + N physical experts, each rank (E + N)/G, placed by DeepSeek's EPLB from a measured load: hot experts get copies (docs/load-balance.md)", RUN_ONLY | PLAN, false},
    {"eplb-window", FLAG_INT, FIELD(eplb_window), 1, 1000, "S", NULL, "1", "--redundant-experts: the load is the routing counts of S earlier batches of fresh tokens", RUN_ONLY, false},
    {"expert-load", FLAG_TEXT, FIELD(expert_load), 0, 0, "FILE", NULL, "", "--redundant-experts: the load from FILE (E numbers, tokens per expert) instead of --eplb-window", RUN_ONLY | PLAN, false},
    {"replica-choice", FLAG_CHOICE, FIELD(replica_choice), 0, 0, NULL, replica_choices, "spread", "--redundant-experts: each pair to a copy on its token's node, spread by token id; or dedup: to a copy on a rank the token's rows go to anyway when there is one (fewer rows, a less even split)", RUN_ONLY, false},
    {"steps", FLAG_INT, FIELD(steps), 1, 10000, "N", NULL, "1", "N steps of route, forward and --bias-update on fresh batches before the timed forwards, each step's balance printed (docs/load-balance.md)", RUN_ONLY, false},
    {"bias-update", FLAG_REAL, FIELD(bias_update), 0, 1, "GAMMA|none", NULL, "none", "deepseek-v3: after each step, bias_i += GAMMA sign(mean load - load_i) (V3's auxiliary-loss-free balancing)", RUN_ONLY, false},
    {"capacity-factor", FLAG_REAL, FIELD(capacity_factor), 0, 1000, "C|none", NULL, "none", "each expert takes at most ceil(C T k / E) pairs of each rank's T tokens, the rest are dropped (Megatron-Core's capacity; docs/load-balance.md)", RUN_ONLY, false},
    {"drop-policy", FLAG_CHOICE, FIELD(drop_policy), 0, 0, NULL, drop_policy_choices, "probs", "--capacity-factor: the pairs an expert keeps: the largest gate weights, or the first tokens", RUN_ONLY, false},
    {"pad-to-capacity", FLAG_BOOL, FIELD(pad_to_capacity), 0, 0, NULL, NULL, "false", "--capacity-factor: each expert computes G x ceil(C T k / E) rows, zero rows filling what its kept pairs leave (Megatron-Core's fixed shape); the output does not change", RUN_ONLY, false},
    {"steps-csv", FLAG_TEXT, FIELD(steps_csv), 0, 0, "FILE", NULL, "", "--steps: each step's imbalance, expert time, balance losses and bias as CSV", RUN_ONLY, false},
    {"steps-plot", FLAG_TEXT, FIELD(steps_plot), 0, 0, "FILE.svg", NULL, "", "--steps: max/mean load per expert and per rank against the step", RUN_ONLY, false},
    {"shared-experts", FLAG_INT, FIELD(shared_experts), 0, 64, "S", NULL, "0", "shared experts, applied to every token on its home rank", BOTH | EXPLAIN, false},
    {"seed", FLAG_SEED, FIELD(seed), 0, 0, "S", NULL, "1", "data seed, 0 .. 2^64-1", RUN | EXPLAIN, false},
    {"init-scale", FLAG_REAL, FIELD(init_scale), 0, 1000000000000000000LL, "S", NULL, "1", "input tokens uniform in [-S, S)", RUN | EXPLAIN, true},
    {"input-dist", FLAG_CHOICE, FIELD(input_dist), 0, 0, NULL, input_dist_choices, "uniform", "input tokens: uniform, or activations (per-token binades, 1 channel in 32 an outlier x16; docs/data.md)", RUN | EXPLAIN, false},
    {"gate-ties", FLAG_INT, FIELD(gate_ties), 0, 4095, "N", NULL, "0", "gate rows of experts 1..N copy expert 0's: they tie on every token (docs/data.md)", RUN | EXPLAIN, false},
    {"iters", FLAG_INT, FIELD(iters), 1, 100000, "N", NULL, "1", "timed forward passes", RUN, false},
    {"waves", FLAG_WAVES, FIELD(waves_list), 1, 1024, "W[,W...]", NULL, "4", "pipelined waves, at most --tokens; a list runs each and prints the speed-up curve", BOTH | EXPLAIN, false},
    {"lookahead", FLAG_INT, FIELD(lookahead), 1, 1024, "A", NULL, "2", "waves dispatched ahead of the computing one (1: neighbours only)", RUN, false},
    {"wave-by", FLAG_CHOICE, FIELD(wave_by), 0, 0, NULL, wave_by_choices, "auto", "waves as groups of expert slots or chunks of tokens (keep the dedup); auto: with --link the one estimated faster for each W, else expert slots when every rank has >= W experts; --backward: token chunks, and with auto and no --link their data gradients in one pass", RUN | EXPLAIN, false},
    {"dispatch", FLAG_CHOICE, FIELD(dispatch), 0, 0, NULL, dispatch_choices, "flat", "one all-to-all over all ranks, or two stages: once per node between nodes, then within each (waves of tokens; nodes of --ranks-per-node)", RUN | EXPLAIN, false},
    {"combine", FLAG_CHOICE, FIELD(combine), 0, 0, NULL, combine_choices, "reduced", "per (token, rank) its experts' weighted outputs summed at the source (DeepEP), or every (token, expert) output (--mode low-latency: pairs)", RUN | EXPLAIN, false},
    {"mode", FLAG_CHOICE, FIELD(mode), 0, 0, NULL, mode_choices, "normal", "the forward's path: count exchange and MPI_Alltoallv (prefill), or one-sided MPI into fixed per-expert buffers, no count exchange (decode; docs/low-latency.md)", RUN | EXPLAIN, false},
    {"max-tokens-per-rank", FLAG_INT, FIELD(max_tokens_per_rank), 1, 1 << 24, "N|auto", NULL, "auto", "--mode low-latency and --expert-layout masked: tokens per rank the fixed buffers hold (auto: --tokens); plan: their size", BOTH, false},
    {"rma", FLAG_CHOICE, FIELD(rma), 0, 0, NULL, rma_choices, "put", "--mode low-latency: the source writes rows into the owner's window (push), or the owner reads them from the source's (pull)", RUN | EXPLAIN, false},
    {"expert-layout", FLAG_CHOICE, FIELD(expert_layout), 0, 0, NULL, layout_choices, "auto", "the tensor the expert GEMMs read: the received rows, per expert a fixed capacity of G*N slots (DeepGEMM's masked input), or the experts back to back, each padded to --expert-alignment rows (its contiguous input); auto: rows, masked with --mode low-latency (docs/layouts.md)", RUN, false},
    {"expert-alignment", FLAG_INT, FIELD(expert_alignment), 1, 1024, "A", NULL, "128", "--expert-layout contiguous: each expert's rows padded to a multiple of A, a power of two", RUN, false},
    {"blocking", FLAG_BOOL, FIELD(blocking), 0, 0, NULL, NULL, "false", "the blocking reference path (MPI_Alltoallv, no waves)", RUN, false},
    {"progress", FLAG_CHOICE, FIELD(progress), 0, 0, NULL, progress_choices, "poll", "who drives MPI progress while experts compute", RUN, false},
    {"gemm", FLAG_CHOICE, FIELD(gemm), 0, 0, NULL, gemm_choices, "packed", "expert GEMM: OpenBLAS, the fixed-order kernel, or FMA over weights packed once", RUN | EXPLAIN, false},
    {"packed-isa", FLAG_CHOICE, FIELD(packed_isa), 0, 0, NULL, packed_isa_choices, "widest", "--gemm packed: its tiles, the widest the CPU has (AVX-512F 6x32, else AVX2 6x16), at most the AVX2 one, or the portable fmaf loop; the same bits from each", RUN | EXPLAIN, false},
    {"backward", FLAG_BOOL, FIELD(backward), 0, 0, NULL, NULL, "false", "a training step: the blocking forward, then the gradients for a synthetic dy in --waves W token chunks, its all-to-alls in flight behind the data and weight gradients (blocking with --blocking; docs/backward.md); bench: fwd+bwd per W", RUN, false},
    {"grad-output", FLAG_TEXT, FIELD(grad_output), 0, 0, "FILE", NULL, "", "--backward's upstream gradient: backward.dy (G*T, d) of FILE.safetensors instead of the synthetic one", RUN_ONLY, false},
    {"check", FLAG_BOOL, FIELD(check), 0, 0, NULL, NULL, "false", "compare with the dense fp64 truth; exit 1 on FAIL", RUN, false},
    {"routing", FLAG_TEXT, FIELD(routing), 0, 0, "FILE", NULL, "", "replay top-k ids and weights from FILE.safetensors instead of the router (docs/golden.md)", RUN | EXPLAIN, false},
    {"workload", FLAG_CHOICE, FIELD(workload), 0, 0, NULL, workload_choices, "none", "top-k ids and weights of a named imbalance workload instead of the router (W0-W7, docs/data.md; bench: all, one row each)", RUN | EXPLAIN, false},
    {"workload-step", FLAG_INT, FIELD(workload_step), 0, 2147483647, "S", NULL, "0", "the step --workload draws (rotating moves its hot rank every 3, burst bursts when S mod 4 = 3)", RUN | EXPLAIN, false},
    {"mask-ranks", FLAG_TEXT, FIELD(mask_ranks), 0, 0, "LIST", NULL, "", "run as if ranks R[,R...] or A-B were lost: their tokens go to no expert, and pairs to their experts are dropped, the kept weights rescaled (docs/diagnosis.md)", RUN | PLAN | EXPLAIN, false},
    {"watchdog", FLAG_REAL, FIELD(watchdog), 0, 86400, "SECONDS", NULL, "60", "end the job (exit 3, one report naming the stage and the ranks that have not arrived) when a rank waits longer than this at a forward's collective or one-sided epoch (raise it where one rank's forward may take longer); 0 = off (docs/diagnosis.md)", RUN, false},
    {"token", FLAG_TEXT, FIELD(explain), 0, 0, "N[,N...]", NULL, "0", "the tokens to follow, by global id (rank r's token i is r*T + i)", EXPLAIN, false},
    {"dump", FLAG_TEXT, FIELD(dump), 0, 0, "DIR", NULL, "", "write the golden set of this run (docs/golden.md)", RUN | EXPLAIN, false},
    {"dump-weights", FLAG_BOOL, FIELD(dump_weights), 0, 0, NULL, NULL, "true", "include the weights in --dump", RUN | EXPLAIN, false},
    {"report", FLAG_TEXT, FIELD(report), 0, 0, "FILE.html", NULL, "", "a self-contained HTML page of the run: stage times, the timeline, the traffic heat map, tokens per expert, expert time per rank, nodes per token", RUN_ONLY, false},
    {"trace", FLAG_TEXT, FIELD(trace), 0, 0, "FILE.json", NULL, "", "Chrome trace of the last forward or training step (Perfetto)", RUN, false},
    {"placement-svg", FLAG_TEXT, FIELD(placement_svg), 0, 0, "FILE.svg", NULL, "", "a picture of who holds which expert (nodes, ranks, experts, copies marked) and the first --token's rows: IB arrows between nodes, NVLink within", EXPLAIN, false},
    {"timeline", FLAG_TEXT, FIELD(timeline), 0, 0, "FILE.svg", NULL, "", "SVG Gantt chart of the last forward of the largest --waves W, its W = 1 beside it when listed (with --backward: of the last training step)", RUN, false},
    {"link", FLAG_TEXT, FIELD(link), 0, 0, "SPEC", NULL, "", "emulated links: cb=RATIO[,inter-cb=RATIO] | bw=BW[:LAT] | intra=BW[:LAT],inter=BW[:LAT]", RUN, false},
    {"ranks-per-node", FLAG_INT, FIELD(ranks_per_node), 0, 1 << 20, "R|auto", NULL, "auto", "ranks per node: virtual nodes of R consecutive ranks (0 = one node), or auto: the machines the ranks run on", RUN | EXPLAIN, false},
    {"compare-serial", FLAG_BOOL, FIELD(compare_serial), 0, 0, NULL, NULL, "false", "add the same forward (with --backward: step) at W = 1 to the timeline, where --waves lists no W = 1", RUN, false},
    {"warmup", FLAG_INT, FIELD(warmup), 0, 1000, "N", NULL, "2", "untimed forwards before each wave count", BENCH, false},
    {"samples", FLAG_INT, FIELD(samples), 1, 1000000, "N", NULL, "200", "--mode low-latency: timed forwards per latency point (median and p99)", BENCH, false},
    {"schedule", FLAG_CHOICE, FIELD(schedule), 0, 0, NULL, schedule_choices, "step", "with --backward: time one micro-batch's steps, or pairs of micro-batches serial, in waves, with DualPipe's pairing, and both (docs/backward.md)", BENCH, false},
    {"csv", FLAG_TEXT, FIELD(csv), 0, 0, "FILE", NULL, "", "write the table as CSV", BENCH, false},
    {"plot", FLAG_TEXT, FIELD(plot), 0, 0, "FILE.svg", NULL, "", "plot layer time and overlap against W", BENCH, false},
    {"layers", FLAG_INT, FIELD(layers), 1, 1000, "L", NULL, "1", "transformer layers", PLAN, false},
    {"moe-layers", FLAG_INT, FIELD(moe_layers), 0, 1000, "L", NULL, "1", "of which MoE layers", PLAN, false},
    {"dtype", FLAG_CHOICE, FIELD(param_dtype), 0, 0, NULL, dtype_choices, "fp32", "weights and input tokens (fp8: DeepSeek-V3's checkpoint: expert weights E4M3 in 128 x 128 blocks with --fp8-scale scales, gate and tokens bf16)", BOTH | EXPLAIN, false},
    {"dispatch-dtype", FLAG_CHOICE, FIELD(dispatch_dtype), 0, 0, NULL, dtype_choices, "fp32", "dispatched rows (fp8: E4M3, one scale per 128 values)", BOTH | EXPLAIN, false},
    {"combine-dtype", FLAG_CHOICE, FIELD(combine_dtype), 0, 0, NULL, dtype_choices, "fp32", "expert outputs sent back (run: fp32 or bf16)", BOTH | EXPLAIN, false},
    {"topk-weights-dtype", FLAG_CHOICE, FIELD(topk_weights_dtype), 0, 0, NULL, dtype_choices, "fp32", "the router's top-k weights, rounded last (bf16: DeepSeek-V3's weights.type_as(x); fp32 or bf16)", RUN | EXPLAIN, false},
    {"output-dtype", FLAG_CHOICE, FIELD(output_dtype), 0, 0, NULL, dtype_choices, "fp32", "the layer output y, rounded once at home after every sum (bf16: DeepEP's combine output; fp32 or bf16)", RUN | EXPLAIN, false},
    {"gemm-out-dtype", FLAG_CHOICE, FIELD(gemm_out_dtype), 0, 0, NULL, dtype_choices, "fp32", "the routed experts' GEMM outputs, h = x W1^T before the activation and the expert output, each rounded to it (bf16: as a bf16 grouped GEMM such as DeepGEMM's writes them; fp32 or bf16)", RUN | EXPLAIN, false},
    {"act-dtype", FLAG_CHOICE, FIELD(act_dtype), 0, 0, NULL, dtype_choices, "fp32", "the routed experts' SwiGLU activation, rounded before the second GEMM (fp8: E4M3, one --fp8-recipe/--fp8-scale scale per 128 values of a row, as an FP8 down projection reads it)", RUN | EXPLAIN, false},
    {"fp8-scale", FLAG_CHOICE, FIELD(fp8_scale), 0, 0, NULL, fp8_scale_choices, "float", "fp8 scales (the dispatch's, --dtype fp8's weight blocks): amax/448, or a power of two", RUN | EXPLAIN, false},
    {"fp8-recipe", FLAG_CHOICE, FIELD(fp8_recipe), 0, 0, NULL, fp8_recipe_choices, "moe", "whose fp8 quantiser, to the bit: moe-ep's, DeepEP's kernels, DeepGEMM's or V3's act_quant (docs/golden.md)", RUN | EXPLAIN, false},
    {"cluster", FLAG_CLUSTER, FIELD(cluster), 0, 0, "NAME", NULL, NULL, "data/clusters/NAME.conf, or a path", PLAN, false},
    {"gpus", FLAG_INT, FIELD(gpus), 1, 1 << 20, "N", NULL, "1", "GPUs in the cluster", PLAN, false},
    {"gpus-per-node", FLAG_INT, FIELD(gpus_per_node), 1, 1024, "N", NULL, "1", "GPUs per node (one NVLink domain)", PLAN, false},
    {"ep", FLAG_INT, FIELD(ep), 1, 1 << 20, "N", NULL, "1", "expert-parallel group size", PLAN, false},
    {"pp", FLAG_INT, FIELD(pp), 1, 1 << 20, "N", NULL, "1", "pipeline-parallel stages (the GPUs are PP x EP x DP)", PLAN, false},
    {"intra-bw", FLAG_REAL, FIELD(intra_bw), 0, 100000, "GB/s", NULL, "0", "per-GPU bandwidth inside a node", PLAN, false},
    {"inter-bw", FLAG_REAL, FIELD(inter_bw), 0, 100000, "GB/s", NULL, "0", "per-GPU bandwidth between nodes", PLAN, false},
    {"tflops", FLAG_REAL, FIELD(tflops), 0, 1000000, "TFLOP/s", NULL, "0", "per-GPU dense FLOP/s of the expert GEMMs", PLAN, false},
    {"nodes-per-token", FLAG_TEXT, FIELD(nodes_per_token), 0, 0, "HIST", NULL, "", "nodes a token reaches, measured: N:PERCENT,... as run prints it (default: sampled from the router)", PLAN, false},
};
const size_t moe_flag_count = sizeof moe_flags / sizeof moe_flags[0];
_Static_assert(sizeof moe_flags / sizeof moe_flags[0] <= 128, "moe_config.given holds 128 flags");


const char *const moe_command_names[] = {"run", "plan", "bench", "explain"};

int moe_flag_choice_value(const flag_spec *flag, const char *name)
{
    for (const flag_choice *c = flag->choices; c->name; c++)
        if (!strcmp(name, c->name))
            return c->value;
    return -1;
}

const char *moe_config_choice_name(const char *flag, int value)
{
    const flag_spec *spec = moe_flag_find(flag, strlen(flag));
    for (const flag_choice *c = spec && spec->choices ? spec->choices : NULL; c && c->name; c++)
        if (c->value == value)
            return c->name;
    return "?";
}

const char *moe_flag_choice_names(const flag_spec *flag, char *buf, size_t size)
{
    size_t used = 0;
    buf[0] = '\0';
    for (const flag_choice *c = flag->choices; c->name && used < size; c++)
        used += (size_t)snprintf(buf + used, size - used, "%s%s", used ? "|" : "", c->name);
    return buf;
}

const char *moe_flag_value_text(const flag_spec *flag, char *buf, size_t size)
{
    if (flag->kind == FLAG_CHOICE)
        return moe_flag_choice_names(flag, buf, size);
    return flag->value_name ? flag->value_name : "";
}

const flag_spec *moe_flag_find(const char *name, size_t len)
{
    for (size_t n = 0; n < moe_flag_count; n++)
        if (strlen(moe_flags[n].name) == len && strncmp(moe_flags[n].name, name, len) == 0)
            return &moe_flags[n];
    return NULL;
}

void moe_config_print_flags(FILE *out, enum moe_command command)
{
    for (size_t n = 0; n < moe_flag_count; n++) {
        const flag_spec *flag = &moe_flags[n];
        if (!(flag->commands & (1u << command)))
            continue;
        char left[64], names[128], range[64] = "", fallback[MOE_NAME_MAX + 16] = "";
        const char *value = moe_flag_value_text(flag, names, sizeof names);
        snprintf(left, sizeof left, "--%s%s%s", flag->name, *value ? " " : "", value);
        if (flag->kind == FLAG_INT || flag->kind == FLAG_REAL)
            snprintf(range, sizeof range, " %c%lld..%lld]", moe_flag_min_open(flag) ? '(' : '[',
                     (long long)flag->min, (long long)flag->max);
        if (flag->default_value && *flag->default_value)
            snprintf(fallback, sizeof fallback, " (default %s)", flag->default_value);
        /* two spaces at least between a flag and its help (docs/flags.py reads them) */
        fprintf(out, "  %-31s%s%s%s%s\n", left, strlen(left) >= 31 ? "  " : " ", flag->help, range,
                fallback);
    }
}

/* A flag's value in cfg as the command line would give it. */
static void value_of(const moe_config *cfg, const flag_spec *flag, char *value, size_t size)
{
    const char *base = (const char *)cfg + flag->offset;
    switch (flag->kind) {
    case FLAG_INT:
        if (moe_flag_takes_auto(flag) && *(const int64_t *)base < 0)
            snprintf(value, size, "auto");
        else
            snprintf(value, size, "%lld", (long long)*(const int64_t *)base);
        break;
    case FLAG_SEED:
        snprintf(value, size, "%llu", (unsigned long long)*(const uint64_t *)base);
        break;
    case FLAG_BOOL:
        snprintf(value, size, "%s", *(const bool *)base ? "true" : "false");
        break;
    case FLAG_REAL:
        if (moe_flag_takes_none(flag) && *(const double *)base == 0.0)
            snprintf(value, size, "none");
        else
            snprintf(value, size, "%.17g", *(const double *)base);
        break;
    case FLAG_CHOICE:
        snprintf(value, size, "%s", "");
        for (const flag_choice *c = flag->choices; c->name; c++)
            if (c->value == *(const int *)base)
                snprintf(value, size, "%s", c->name);
        break;
    case FLAG_WAVES: {
        size_t used = 0;
        value[0] = '\0';
        for (int w = 0; w < cfg->waves_count; w++)
            used += (size_t)snprintf(value + used, size - used, "%s%lld", w ? "," : "",
                                     (long long)cfg->waves_list[w]);
        break;
    }
    default: /* preset, cluster, text */
        snprintf(value, size, "%s", base);
    }
}

void moe_config_describe(const moe_config *cfg, enum moe_command command,
                         void (*emit)(void *ctx, const char *name, const char *value), void *ctx)
{
    for (size_t n = 0; n < moe_flag_count; n++) {
        const flag_spec *flag = &moe_flags[n];
        if (!(flag->commands & (1u << command)))
            continue;
        char value[MOE_NAME_MAX + 32];
        value_of(cfg, flag, value, sizeof value);
        emit(ctx, flag->name, value);
    }
}

bool moe_config_at_default(const moe_config *cfg, const char *flag)
{
    const flag_spec *spec = moe_flag_find(flag, strlen(flag));
    MOE_ASSERT(spec != NULL);
    moe_config fresh;
    moe_config_defaults(&fresh);
    char now[MOE_NAME_MAX + 32], first[MOE_NAME_MAX + 32];
    value_of(cfg, spec, now, sizeof now);
    value_of(&fresh, spec, first, sizeof first);
    return !strcmp(now, first);
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
    snprintf(text, 64, "command=%s\n", moe_command_names[command]);
    moe_config_describe(cfg, command, canonical_line, &text);
    return text;
}
