/* SPDX-License-Identifier: MIT */
/* bench.c — `moe-ep bench`: the wave pipeline at each W, against anchors
 * measured in the same run.
 *
 * Per wave count: warm-up forwards, then timed ones (layer time median, min,
 * max over iterations of the max over ranks). Anchors, on the same cores and
 * ranks, on cold caches: one sgemm of the same FLOPs as a rank's experts
 * (M = its routed pairs plus T per shared expert, N = 3f, K = d), and one
 * plain MPI_Alltoallv pair with the counts the forward's dispatch and
 * combine send to other ranks-> Ceiling = anchor sgemm time / layer time;
 * GEMM efficiency = the anchor's routed share / the routed experts' compute
 * time; all-to-all efficiency = anchor time / the forward's all-to-alls alone
 * (all in flight, as measured for the overlap). Peak RSS per rank during the
 * W's forwards against the least the rank must hold. The physical limit
 * beside the sgemm: the cores' fp32 FMA peak (independent FMA chains at each
 * vector width the CPU has, rank 0 alone and all ranks at once), and the
 * layer's and the experts' share of it; the layer's own GEMM on each rank's
 * core at once (a core slower than the others bounds every rank). Rank 0
 * prints a table, and writes --csv and --plot.
 */
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <spawn.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include "moe/clock.h"
#include "moe/cli.h"
#include "moe/gemm.h"
#include "moe/peak.h"
#include "moe/timeline.h"
#include "moe/context.h"
#include "moe/wire.h"
#include "moe/workload.h"

typedef struct {
    int waves, wave_kind, ranks;
    double layer, layer_min, layer_max;  /* seconds */
    double tokens_per_second;            /* all ranks */
    double ceiling;                      /* the sgemm anchor's time / layer time */
    double of_peak;                      /* the layer's expert FLOP/s / the FMA peak, all ranks */
    double experts_of_peak;              /* the experts' FLOP/s (their compute time) / the peak */
    double expert_gflops;                /* all ranks, over the expert compute time */
    double gemm_efficiency;
    double a2a_bytes_per_second;         /* bytes crossing ranks (all) over T_comm */
    double a2a_efficiency;
    double overlap;
    double rss_mb, rss_ratio;            /* peak per rank (max), against the minimum */
    /* --backward: the layer above is the training step (forward + backward) */
    bool training;
    double forward;                      /* seconds, the step's forward */
    double dgrad_gflops, wgrad_gflops;   /* per rank, over each stage's time */
    double dgrad_efficiency, wgrad_efficiency; /* against the sgemm anchor's rate */
    double wgrad_shape_efficiency;       /* against an sgemm of the wgrad's own shapes */
    /* the run's, the same in every row (NAN where not measured) */
    double rank_limit;                   /* one rank's FMA peak limit, FLOP/s */
    double layer_gemm_of_peak;           /* the layer's GEMM on the slowest rank's core / that */
} bench_row;

/* Bytes written before each anchor run to push its data out of the caches
 * (twice the 32 MiB last-level cache of the machine docs/performance.md measures). */
#define EVICT_BYTES ((size_t)64 << 20)

/* The median over 3 runs of fn, all ranks starting together after a
 * barrier: of the max over ranks, or (per_rank) of this rank's own times.
 * Each run starts on cold caches, as the forward's data does: its rows are
 * packed, and its expert outputs written, long before they move, with the
 * expert weights streaming through the caches in between; an anchor run on
 * hot buffers would be measured against a forward on cold ones. */
static double timed(const moe_comm *c, void (*fn)(void *), void *arg, bool per_rank)
{
    double t[3];
    volatile unsigned char *evict = moe_xmalloc(EVICT_BYTES);
    fn(arg); /* warm-up */
    for (int n = 0; n < 3; n++) {
        for (size_t i = 0; i < EVICT_BYTES; i += 64)
            evict[i] = (unsigned char)n;
        if (c) /* NULL: a process of its own without MPI (the default kernel's anchor) */
            moe_comm_barrier(c);
        const double start = c ? moe_clock_now() : moe_monotonic_seconds();
        fn(arg);
        const double own = (c ? moe_clock_now() : moe_monotonic_seconds()) - start;
        t[n] = per_rank || !c ? own : moe_comm_max(c, own);
    }
    free((void *)evict);
    return moe_median(t, 3);
}

typedef struct {
    moe_index M, N, K;
    float *A, *B, *C;
} sgemm_anchor;

/* n floats of small values: real pages (untouched ones all map the zero
 * page, which reads faster than data), and no subnormals. */
static float *filled(size_t n)
{
    float *v = moe_xmalloc(sizeof(float) * n);
    for (size_t i = 0; i < n; i++)
        v[i] = (float)(i % 61) * (1.0f / 64.0f) - 0.5f;
    return v;
}

static void run_sgemm(void *arg)
{
    sgemm_anchor *g = arg;
    moe_sgemm_nn(g->M, g->N, g->K, g->A, g->K, g->B, g->N, g->C, g->N); /* the experts' layout */
}

extern char **environ;

/* `moe-ep sgemm-anchor M N K`, which bench starts on every rank when the
 * environment chose OpenBLAS's kernel (OPENBLAS_CORETYPE): the anchor's
 * sgemm in a process of its own, without MPI and without that variable, so
 * with the kernel OpenBLAS picks for this CPU, as a user's run gets it.
 * Prints "KERNEL SECONDS" (the median of `timed`'s runs). */
int moe_cli_sgemm_anchor(int argc, char **argv)
{
    long long shape[3];
    for (int n = 0; n < 3; n++)
        if (argc < 5 || sscanf(argv[2 + n], "%lld", &shape[n]) != 1 || shape[n] < 1) {
            fprintf(stderr, "moe-ep: error: usage: moe-ep sgemm-anchor M N K (bench runs it)\n");
            return MOE_EXIT_USAGE;
        }
    sgemm_anchor g = {shape[0], shape[1], shape[2], NULL, NULL, NULL};
    g.A = filled((size_t)(g.M * g.K));
    g.B = filled((size_t)(g.N * g.K));
    g.C = filled((size_t)(g.M * g.N));
    printf("%s %.9g\n", moe_blas_corename(), timed(NULL, run_sgemm, &g, true));
    free(g.C);
    free(g.B);
    free(g.A);
    return MOE_EXIT_OK;
}

/* The same sgemm with the kernel OpenBLAS picks for this CPU, in a child
 * (moe_cli_sgemm_anchor) with this rank's threads: its seconds, its kernel
 * in `kernel`; NAN when it could not run (no /proc/self/exe, a failed
 * spawn). Every rank at once, as the in-process anchor. Collective. */
static double default_kernel_sgemm(const moe_comm *c, const sgemm_anchor *g, char *kernel,
                                   size_t size)
{
    char dims[3][24], threads[48], omp[48];
    snprintf(dims[0], sizeof dims[0], "%lld", (long long)(g->M > 0 ? g->M : 1));
    snprintf(dims[1], sizeof dims[1], "%lld", (long long)g->N);
    snprintf(dims[2], sizeof dims[2], "%lld", (long long)g->K);
    snprintf(threads, sizeof threads, "OPENBLAS_NUM_THREADS=%d", c->threads);
    snprintf(omp, sizeof omp, "OMP_NUM_THREADS=%d", c->threads);
    char *args[] = {"moe-ep", "sgemm-anchor", dims[0], dims[1], dims[2], NULL};
    size_t count = 0;
    while (environ[count])
        count++;
    char **env = moe_xcalloc(count + 3, sizeof *env);
    size_t kept = 0;
    for (size_t n = 0; n < count; n++)
        if (strncmp(environ[n], "OPENBLAS_CORETYPE=", 18) &&
            strncmp(environ[n], "OPENBLAS_NUM_THREADS=", 21) && strncmp(environ[n], "OMP_NUM_THREADS=", 16))
            env[kept++] = environ[n];
    env[kept++] = threads;
    env[kept++] = omp;
    double seconds = NAN;
    int out[2];
    moe_comm_barrier(c);
    if (pipe(out) == 0) {
        posix_spawn_file_actions_t actions;
        posix_spawn_file_actions_init(&actions);
        posix_spawn_file_actions_adddup2(&actions, out[1], STDOUT_FILENO);
        posix_spawn_file_actions_addclose(&actions, out[0]);
        pid_t pid;
        const int spawned = posix_spawn(&pid, "/proc/self/exe", &actions, NULL, args, env) == 0;
        posix_spawn_file_actions_destroy(&actions);
        close(out[1]);
        char line[160] = "";
        FILE *from = fdopen(out[0], "r");
        const bool got = from && fgets(line, sizeof line, from);
        if (from)
            fclose(from);
        else
            close(out[0]);
        int status = 0;
        char name[64];
        double t;
        if (spawned && waitpid(pid, &status, 0) == pid && WIFEXITED(status) &&
            WEXITSTATUS(status) == 0 && got && sscanf(line, "%63s %lf", name, &t) == 2 && t > 0) {
            seconds = t;
            snprintf(kernel, size, "%s", name);
        }
    }
    free(env);
    const double failed = moe_comm_max(c, isnan(seconds) ? 1.0 : 0.0);
    return failed > 0 ? NAN : moe_comm_max(c, seconds);
}

/* The FMA peak: per core (rank 0 alone, the others asleep) and all ranks at
 * once (their rates summed), at each width the CPU has; widest: the
 * largest of those rates. The peak columns divide by the fastest the
 * cores ran in the whole run: that, or the fastest of the probes beside
 * the forwards and the anchors (fma_probes; none measured, as on a CPU
 * without x86 FMA: those columns read nan). */
typedef struct {
    double alone[MOE_FMA_WIDTHS], together[MOE_FMA_WIDTHS]; /* FLOP/s, 0: not on this CPU */
    int widest;                                             /* index of the fastest width */
    double rank_least, rank_most; /* one rank's rate at the widest, all at once: min, max */
    double limit;      /* all ranks at once, the fastest of the run: the peak columns' */
    double rank_limit; /* one rank's, likewise: the layer's GEMM line's */
    int probes;        /* fma_probes taken */
    double typical;    /* their median, all ranks at once: the clock the run mostly had */
} fma_peak;

enum { PEAK_SECONDS_MS = 300 }; /* all widths in turn, per way */

/* A rank's share of a core when more ranks than cores share its host (the
 * cores its ranks may run on: all online ones, or fewer under taskset or a
 * binding). Each rank's rate is its median batch, and most batches fall in
 * a time slice it had a core to itself; summed as they are, the host's
 * cores would count once per rank instead of once each. */
static double core_share(const moe_comm *c)
{
    return c->ranks_on_host > c->host_cores ? (double)c->host_cores / c->ranks_on_host : 1.0;
}

/* The FMA peak beside timed work, every rank at once for PROBE_SECONDS_MS
 * at the widest width the CPU has (its median batch, as the peak's), before
 * each W's first timed forward and after each (moe_run_context.between),
 * and before and after the sgemm anchor and the layer's GEMM. A core's
 * clock moves: a Zen 1 guest's flips between about 40 and 48 GFLOP/s a
 * core from one second to the next, and a row divided by a peak measured
 * in the slower state after the sweep read 101 % of it, the layer's GEMM
 * 101-103 %. The fastest of the run is the limit: no figure can pass it. */
enum { PROBE_SECONDS_MS = 20 };

typedef struct {
    const moe_comm *c;
    int taken, capacity;
    double *sums; /* [capacity] each probe's, all ranks at once */
    double rank;  /* the fastest one rank's own (max over ranks) */
} fma_probes;

static void probe_fma(fma_probes *p)
{
    const int bits = moe_fma_widest_bits();
    moe_comm_barrier(p->c);
    const double own = bits ? moe_fma_rate(bits, PROBE_SECONDS_MS * 1e-3) * core_share(p->c) : 0.0;
    const double sum = moe_comm_sum(p->c, own);
    p->rank = fmax(p->rank, moe_comm_max(p->c, own));
    if (p->taken < p->capacity)
        p->sums[p->taken++] = sum;
}

static void probe_between(void *arg)
{
    probe_fma(arg);
}

static void measure_fma_peak(const moe_comm *c, const fma_probes *probes, fma_peak *p)
{
    memset(p, 0, sizeof *p);
    double own[MOE_FMA_WIDTHS];
    if (c->rank == 0)
        moe_fma_rates(PEAK_SECONDS_MS * 1e-3, p->alone);
    moe_comm_barrier_idle(c);
    moe_comm_barrier(c);
    moe_fma_rates(PEAK_SECONDS_MS * 1e-3, own);
    for (int w = 0; w < MOE_FMA_WIDTHS; w++) {
        own[w] *= core_share(c);
        p->together[w] = moe_comm_sum(c, own[w]);
        if (p->together[w] > p->together[p->widest])
            p->widest = w;
    }
    p->rank_least = moe_comm_min(c, own[p->widest]);
    p->rank_most = moe_comm_max(c, own[p->widest]);
    p->limit = p->together[p->widest];
    for (int n = 0; n < probes->taken; n++)
        p->limit = fmax(p->limit, probes->sums[n]);
    p->rank_limit = fmax(p->rank_most, probes->rank);
    p->probes = probes->taken;
    p->typical = probes->taken ? moe_median(probes->sums, probes->taken) : NAN;
}

/* An expert's mean rows on this rank (rounded up; 0 without experts): the
 * M of the anchors in an expert's shapes. */
static moe_index mean_expert_rows(const moe_run_context *ctx)
{
    const int EL = ctx->ep.local_experts;
    return EL ? (ctx->last.pairs_received + EL - 1) / EL : 0;
}

/* The layer's own GEMM on each rank's core, all ranks at once: the
 * experts' first product (h = x W1^T, N = 2f, K = d) on the rank's own
 * expert weights in turn, at their mean rows. It tells a core that runs
 * the kernel slower than the others (a virtual machine's vCPU can, while
 * its FMA peak looks whole) from the kernel itself: every rank waits at
 * the all-to-alls for the slowest, whatever the FMA peak says. */
typedef struct {
    const moe_ep *ep;
    moe_index rows;
    int passes; /* over the experts, for KERNEL_FLOPS at least */
    float *A, *C;
} kernel_anchor;

#define KERNEL_FLOPS 2e9 /* about 10 ms a run: small layers' GEMMs run many passes */

static void run_kernel(void *arg)
{
    const kernel_anchor *k = arg;
    const moe_index d = k->ep->cfg->hidden, f = k->ep->cfg->ffn;
    const size_t size1 = (size_t)moe_expert_w1_floats(k->ep->gemm, d, f);
    for (int p = 0; p < k->passes; p++)
        for (int l = 0; l < k->ep->local_experts; l++)
            moe_expert_gemm(k->ep->gemm, k->rows, 2 * f, d, k->A, d,
                            k->ep->w1 + (size_t)l * size1, k->C, 2 * f);
}

/* Each rank's rate (FLOP/s; NAN with no experts, or with more ranks than
 * cores on a host, where the ranks take turns and a rank's rate is its
 * share's): the least and the most over the ranks, and which. Collective. */
typedef struct {
    moe_index rows;
    double least, most;
    int slowest, fastest;
} kernel_rates;

static void measure_kernel(const moe_run_context *ctx, fma_probes *probes, kernel_rates *k)
{
    const moe_comm *c = ctx->comm;
    const moe_ep *ep = &ctx->ep;
    const int EL = ep->local_experts;
    const moe_index d = ctx->cfg.hidden, f = ctx->cfg.ffn;
    kernel_anchor a = {ep, mean_expert_rows(ctx), 1, NULL, NULL};
    k->rows = (moe_index)moe_comm_max(c, (double)a.rows);
    const double pass = 2.0 * (double)EL * (double)a.rows * 2.0 * (double)f * (double)d;
    if (pass > 0 && pass < KERNEL_FLOPS)
        a.passes = (int)ceil(KERNEL_FLOPS / pass);
    double rate = NAN;
    const bool own_core = moe_comm_min(c, core_share(c)) >= 1.0; /* on every host */
    if (own_core) {
        a.A = filled((size_t)(a.rows * d) + 1);
        a.C = filled((size_t)(a.rows * 2 * f) + 1);
        probe_fma(probes);
        const double seconds = timed(c, run_kernel, &a, true);
        probe_fma(probes);
        if (a.rows > 0 && seconds > 0)
            rate = pass * a.passes / seconds;
        free(a.C);
        free(a.A);
    }
    k->least = -moe_comm_maxloc(c, isnan(rate) ? -INFINITY : -rate, &k->slowest);
    k->most = moe_comm_maxloc(c, isnan(rate) ? -INFINITY : rate, &k->fastest);
    if (!isfinite(k->least) || !isfinite(k->most))
        k->least = k->most = NAN;
}

/* Every rank reading its own READ_BYTES at once (moe_read_bandwidth): the
 * least rank's rate, and all ranks' summed (each rank's share of a core
 * counted as the FMA peak counts it). Collective. */
#define READ_BYTES ((size_t)128 << 20) /* four times the last-level cache of docs/performance.md's */

static void measure_read_bandwidth(const moe_comm *c, double *rank, double *all)
{
    moe_comm_barrier(c);
    const double own = moe_read_bandwidth(READ_BYTES, 3);
    *rank = moe_comm_min(c, own);
    *all = moe_comm_sum(c, core_share(c) * own);
}

/* The rate the peak columns divide by: NAN when nothing was measured. */
static double peak_rate(const fma_peak *p)
{
    return p->limit > 0 ? p->limit : NAN;
}

static void print_fma_peak(FILE *out, const fma_peak *p, const moe_comm *c)
{
    char cpu[128], shared[96] = "";
    moe_cpu_model(cpu, sizeof cpu);
    if (core_share(c) < 1.0)
        snprintf(shared, sizeof shared, " (%d on %d cores: each rank's rate times %d/%d)",
                 c->ranks_on_host, c->host_cores, c->host_cores, c->ranks_on_host);
    fprintf(out, "          fp32 FMA peak on %s (OpenBLAS kernel %s), GFLOP/s per core (rank 0 "
                 "alone) / all %d ranks at once%s:", cpu, moe_blas_corename(), c->ranks, shared);
    bool any = false;
    for (int w = 0; w < MOE_FMA_WIDTHS; w++)
        if (p->together[w] > 0) {
            fprintf(out, "%s %d-bit %.1f / %.1f", any ? " ·" : "", moe_fma_bits[w],
                    p->alone[w] * 1e-9, p->together[w] * 1e-9);
            any = true;
        }
    if (!any) {
        fprintf(out, " not measured (no x86 FMA here)\n");
        return;
    }
    fprintf(out, "; the peak columns' limit, the fastest of that and %d probes of %d ms at %d "
                 "bits beside the forwards and the anchors, all ranks at once: %.1f (one rank %.1f; "
                 "the probes' median %.1f)\n", p->probes, PROBE_SECONDS_MS, moe_fma_widest_bits(),
            p->limit * 1e-9, p->rank_limit * 1e-9, p->typical * 1e-9);
}

/* The kernel anchor's line: the slowest and the fastest rank, each against
 * one rank's FMA peak (all at once, the fastest of the run), and the bound
 * the slowest sets. */
static void print_kernel(FILE *out, const kernel_rates *k, const fma_peak *p,
                         const moe_run_context *ctx)
{
    const moe_index d = ctx->cfg.hidden, f = ctx->cfg.ffn;
    fprintf(out, "          the layer's GEMM (%s) on each rank's core, all at once: h = x W1^T of "
                 "the rank's experts, %lld x %lld x %lld: ", moe_gemm_label(ctx->ep.gemm),
            (long long)k->rows, (long long)(2 * f), (long long)d);
    if (isnan(k->least)) {
        fprintf(out, "not measured (%s)\n", k->rows > 0 ? "more ranks than cores on a host: they "
                                                          "take turns" : "no rank holds an expert");
        return;
    }
    const bool peak = p->rank_limit > 0; /* none without x86 FMA */
    fprintf(out, "slowest rank %d %.1f GFLOP/s", k->slowest, k->least * 1e-9);
    if (peak)
        fprintf(out, " (%.0f %% of a core's FMA peak)", 100.0 * k->least / p->rank_limit);
    fprintf(out, ", fastest rank %d %.1f", k->fastest, k->most * 1e-9);
    if (peak)
        fprintf(out, " (%.0f %%)", 100.0 * k->most / p->rank_limit);
    if (k->least < 0.9 * k->most) {
        fprintf(out, "; the cores differ by more than 10 %%");
        if (peak)
            fprintf(out, " (their FMA peaks, one rank each at once: %.1f-%.1f)",
                    p->rank_least * 1e-9, p->rank_most * 1e-9);
        fprintf(out, " and every rank waits for the slowest");
    }
    if (peak)
        fprintf(out, "; so peak stays under about %.0f %%", 100.0 * k->least / p->rank_limit);
    fprintf(out, "\n");
}

typedef struct {
    moe_alltoallv_anchor *dispatch, *combine;
} a2a_anchor;

static void run_alltoallv(void *arg)
{
    a2a_anchor *a = arg;
    moe_comm_alltoallv_run(a->dispatch);
    moe_comm_alltoallv_run(a->combine);
}

/* The least a rank must hold for a forward: its weights, the tokens and the
 * output, and each row once where it must be: the rows it sends to and
 * receives from other ranks, the expert outputs it computes, and those that
 * come back from other ranks (its own rows and outputs need no copy). */
static double minimum_bytes(const moe_ep *ep, const moe_forward_stats *f)
{
    const moe_config *cfg = ep->cfg;
    const double d = (double)cfg->hidden, f3 = 3.0 * (double)cfg->ffn * d;
    const double weights = (ep->local_experts + cfg->shared_experts) * f3 + cfg->experts * d;
    const double own = (double)(f->rows_sent - f->rows_sent_remote); /* rows for its own experts */
    const double rows = 2.0 * (double)cfg->tokens + (double)f->rows_sent_remote +
                        ((double)f->rows_received - own) + (double)f->pairs_received +
                        (double)f->pairs_back_remote;
    return 4.0 * (weights + rows * d);
}

/* The least a rank must hold for a training step: the forward's least,
 * gradients the size of its weights, dy and dx of its tokens, the dy rows
 * it receives and the dx rows that travel back, and per pair what its
 * weight gradient reads besides x and dy (dH and a': 3f). */
static double minimum_training_bytes(const moe_ep *ep, const moe_forward_stats *f)
{
    const moe_config *cfg = ep->cfg;
    const double d = (double)cfg->hidden, f3 = 3.0 * (double)cfg->ffn * d;
    const double grads = (ep->local_experts + cfg->shared_experts) * f3 + cfg->experts * d;
    const double own = (double)(f->rows_sent - f->rows_sent_remote);
    const double rows = 2.0 * (double)cfg->tokens + ((double)f->rows_received - own) +
                        (double)f->rows_sent_remote;
    return minimum_bytes(ep, f) +
           4.0 * (grads + rows * d + (double)f->pairs_received * 3.0 * (double)cfg->ffn);
}

typedef struct {
    int experts;          /* a rank's local experts */
    moe_index n, d, f;    /* rows per expert (the mean), hidden, ffn */
    float *A, *B, *C;
} wgrad_anchor;

/* The weight gradients' products with OpenBLAS: per expert dW1 (2f, d) =
 * dH^T (2f, n) x (n, d) and dW2 (d, f) = dO^T (d, n) a' (n, f), K = n. */
static void run_wgrad_sgemms(void *arg)
{
    wgrad_anchor *g = arg;
    for (int e = 0; e < g->experts; e++) {
        moe_sgemm_nn(2 * g->f, g->d, g->n, g->A, g->n, g->B, g->d, g->C, g->d);
        moe_sgemm_nn(g->d, g->f, g->n, g->A, g->n, g->B, g->f, g->C, g->f);
    }
}

/* With --backward a row is the training step's: its time, and its expert
 * FLOPs at the sgemm anchor's rate (all ranks: anchor_rate) for the
 * ceiling. Routed FLOPs as the GEMMs counted them (the data gradient
 * recomputes h); the shared experts' per token 22fd: forward 6fd, data
 * gradient 10fd (h recomputed, dA, dx), weight gradient 6fd. The forward is
 * the blocking one: no overlap or all-to-all figures. */
static void training_row(bench_row *r, const moe_run_summary *s, double anchor_rate,
                         double wgrad_anchor_rate, double peak_rate)
{
    const moe_config *cfg = s->cfg;
    const double G = r->ranks, T = (double)cfg->tokens;
    const double shared = G * T * (double)cfg->shared_experts * 22.0 * (double)cfg->ffn *
                          (double)cfg->hidden;
    const double flops = s->expert_flops + s->dgrad_flops + s->wgrad_flops + shared;
    const double per_rank_anchor = anchor_rate / G;
    const double dgrad_time = s->bwd_seconds[MOE_BWD_DGRAD], wgrad_time = s->bwd_seconds[MOE_BWD_WGRAD];
    r->training = true;
    r->forward = s->layer_seconds;
    r->layer = s->step_seconds;
    r->layer_min = s->step_min;
    r->layer_max = s->step_max;
    r->tokens_per_second = G * T / s->step_seconds;
    r->ceiling = flops / anchor_rate / s->step_seconds;
    r->of_peak = flops / peak_rate / s->step_seconds;
    r->dgrad_gflops = dgrad_time > 0 ? s->dgrad_flops / G / dgrad_time * 1e-9 : NAN;
    r->wgrad_gflops = wgrad_time > 0 ? s->wgrad_flops / G / wgrad_time * 1e-9 : NAN;
    r->dgrad_efficiency = r->dgrad_gflops * 1e9 / per_rank_anchor;
    r->wgrad_efficiency = r->wgrad_gflops * 1e9 / per_rank_anchor;
    r->wgrad_shape_efficiency = r->wgrad_gflops * 1e9 / wgrad_anchor_rate;
    r->a2a_bytes_per_second = r->a2a_efficiency = r->overlap = NAN;
}

/* The training steps' table (bench --backward). */
static void print_training(FILE *out, const bench_row *rows, double wgrad_anchor_rate)
{
    fprintf(out, "          and the weight gradients' own shapes (K = an expert's mean rows): %.1f "
                 "GFLOP/s per rank\n", wgrad_anchor_rate * 1e-9);
    fprintf(out, "          a training step per W: the blocking forward, the backward in W token "
                 "chunks (without --link, with --wave-by auto, their data gradients in one pass); "
                 "ceiling = the step's expert FLOPs (forward, dgrad with h recomputed, "
                 "wgrad; routed and shared) at the sgemm's rate / the step's time; peak = the "
                 "same FLOPs at the FMA peak's limit / the step's time\n");
    fprintf(out, "          gemm = a stage's GFLOP/s per rank / the sgemm's (wgrad also / its own "
                 "shapes'); RSS against weights, gradients, saved rows and the step's least buffers\n");
    fprintf(out, "%4s %24s %9s %10s %9s %8s %5s %13s %13s %13s %6s %14s\n", "W",
            "step ms (med min-max)", "fwd ms", "tokens/s", "per rank", "ceiling", "peak",
            "fwd GF/s gemm", "dgrad", "wgrad", "/shape", "RSS MB (ratio)");
    for (const bench_row *r = rows; r->waves; r++)
        fprintf(out, "%4d %8.2f %7.2f-%-7.2f %9.2f %10.0f %9.0f %7.0f%% %4.0f%% %7.1f %5.2f %7.1f "
                     "%5.2f %7.1f %5.2f %6.2f %8.0f (%.2f)\n",
                r->waves, 1e3 * r->layer, 1e3 * r->layer_min, 1e3 * r->layer_max,
                1e3 * r->forward, r->tokens_per_second, r->tokens_per_second / r->ranks,
                100.0 * r->ceiling, 100.0 * r->of_peak, r->expert_gflops / r->ranks, r->gemm_efficiency,
                r->dgrad_gflops, r->dgrad_efficiency, r->wgrad_gflops, r->wgrad_efficiency,
                r->wgrad_shape_efficiency, r->rss_mb, r->rss_ratio);
}

static void write_csv(FILE *out, const void *arg)
{
    const bench_row *rows = arg;
    fprintf(out, "waves,kind,layer_ms,layer_min_ms,layer_max_ms,tokens_per_s,expert_gflops,"
                 "gemm_efficiency,a2a_gb_per_s,a2a_efficiency,overlap,rss_mb,rss_ratio,of_ceiling,"
                 "tokens_per_s_per_rank,backward,forward_ms,dgrad_gflops,wgrad_gflops,"
                 "dgrad_efficiency,wgrad_efficiency,wgrad_shape_efficiency,of_fma_peak,"
                 "experts_of_fma_peak,rank_fma_limit_gflops,layer_gemm_of_fma_peak\n");
    for (const bench_row *r = rows; r->waves; r++)
        fprintf(out, "%d,%s,%.3f,%.3f,%.3f,%.1f,%.2f,%.3f,%.3f,%.3f,%.3f,%.1f,%.2f,%.3f,%.1f,"
                     "%d,%.3f,%.2f,%.2f,%.3f,%.3f,%.3f,%.3f,%.3f,%.1f,%.3f\n",
                r->waves,
                r->wave_kind == MOE_WAVES_EXPERT_SLOTS ? "expert-slots" : "token-chunks",
                1e3 * r->layer, 1e3 * r->layer_min, 1e3 * r->layer_max, r->tokens_per_second,
                r->expert_gflops, r->gemm_efficiency, r->a2a_bytes_per_second * 1e-9,
                r->a2a_efficiency, r->overlap, r->rss_mb, r->rss_ratio, r->ceiling,
                r->tokens_per_second / r->ranks, r->training, 1e3 * r->forward,
                r->dgrad_gflops, r->wgrad_gflops, r->dgrad_efficiency, r->wgrad_efficiency,
                r->wgrad_shape_efficiency, r->of_peak, r->experts_of_peak, r->rank_limit * 1e-9,
                r->layer_gemm_of_peak);
}

/* Layer time (left axis) and overlap (right axis) against W. */
static void write_plot(FILE *out, const void *arg)
{
    const bench_row *rows = arg;
    int n = 0;
    double most = 0.0;
    for (; rows[n].waves; n++)
        most = fmax(most, rows[n].layer_max);
    const int left = 80, top = 40, width = 560, height = 300;
    fprintf(out, "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"760\" height=\"420\" "
                 "font-family=\"sans-serif\" font-size=\"12\">\n<rect width=\"100%%\" height=\"100%%\" fill=\"white\"/>\n");
    fprintf(out, "<text x=\"%d\" y=\"24\" font-size=\"15\" font-weight=\"bold\">moe-ep bench: layer time "
                 "(median, min-max) and overlap against W</text>\n", left);
    const double top_ms = ceil(1e3 * most / 10.0) * 10.0;
    for (int t = 0; t <= 4; t++) {
        const double y = top + height - t * height / 4.0;
        fprintf(out, "<line x1=\"%d\" y1=\"%.1f\" x2=\"%d\" y2=\"%.1f\" stroke=\"#ddd\"/>"
                     "<text x=\"%d\" y=\"%.1f\" text-anchor=\"end\">%.0f ms</text>"
                     "<text x=\"%d\" y=\"%.1f\">%d%%</text>\n",
                left, y, left + width, y, left - 6, y + 4, top_ms * t / 4.0, left + width + 6, y + 4, 25 * t);
    }
    for (int line = 0; line < 2; line++) {
        fprintf(out, "<polyline fill=\"none\" stroke=\"%s\" stroke-width=\"2\" points=\"", line ? "#e15759" : "#4e79a7");
        for (int i = 0; i < n; i++) {
            const double v = line ? rows[i].overlap : 1e3 * rows[i].layer / top_ms;
            fprintf(out, "%.1f,%.1f ", left + (i + 0.5) * width / n, top + height - v * height);
        }
        fprintf(out, "\"/>\n");
    }
    for (int i = 0; i < n; i++) {
        const double x = left + (i + 0.5) * width / n;
        fprintf(out, "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#4e79a7\"/>\n", x,
                top + height - 1e3 * rows[i].layer_min / top_ms * height, x,
                top + height - 1e3 * rows[i].layer_max / top_ms * height);
        fprintf(out, "<circle cx=\"%.1f\" cy=\"%.1f\" r=\"4\" fill=\"#4e79a7\"/>"
                     "<text x=\"%.1f\" y=\"%d\" text-anchor=\"middle\">W = %d</text>\n",
                x, top + height - 1e3 * rows[i].layer / top_ms * height, x, top + height + 18, rows[i].waves);
    }
    fprintf(out, "<text x=\"%d\" y=\"%d\" fill=\"#4e79a7\">layer time (left)</text>"
                 "<text x=\"%d\" y=\"%d\" fill=\"#e15759\">overlap (right)</text>\n</svg>\n",
            left, top + height + 44, left + 200, top + height + 44);
}

/* bench --backward --schedule dualpipe: pairs of micro-batches, B's
 * forward with A's backward (moe_ep_pair_step), four ways per W. */
enum { PAIR_SERIAL, PAIR_WAVES, PAIR_DUALPIPE_ONLY, PAIR_BOTH, PAIR_KINDS };
static const char *const pair_names[PAIR_KINDS] = {"serial", "waves only", "DualPipe only",
                                                   "both"};

typedef struct {
    int waves;
    double seconds[PAIR_KINDS];  /* median over pairs of the max over ranks */
    double differ;               /* values of y and the gradients unlike the serial pair's */
} pair_row;

/* The median time of one way at W, after the warm-up; y and g hold the last
 * pair's output and gradients. */
static int time_pairs(moe_run_context *ctx, int kind, int W, float *y, moe_ep_grads *g,
                      double *median)
{
    static const enum moe_pair_mode modes[PAIR_KINDS] = {MOE_PAIR_SERIAL, MOE_PAIR_WAVES,
                                                         MOE_PAIR_DUALPIPE, MOE_PAIR_DUALPIPE};
    const int iters = (int)ctx->cfg.iters, warmup = (int)ctx->cfg.warmup;
    moe_schedule sched = ctx->schedule;
    sched.waves = kind == PAIR_DUALPIPE_ONLY ? 1 : W;
    double *t = moe_xmalloc(sizeof(double) * (size_t)iters);
    int rc = MOE_EXIT_OK;
    for (int it = -warmup; it < iters && rc == MOE_EXIT_OK; it++) {
        moe_forward_stats fwd;
        moe_backward_stats bwd;
        double seconds = 0.0;
        rc = moe_ep_pair_step(&ctx->ep, &sched, modes[kind], ctx->x, ctx->logits, ctx->ids,
                              ctx->weights, ctx->dy, y, g, &fwd, &bwd, &seconds, &ctx->status);
        if (it >= 0)
            t[it] = moe_comm_max(ctx->comm, seconds);
    }
    *median = rc == MOE_EXIT_OK ? moe_median(t, iters) : 0.0;
    free(t);
    return rc;
}

/* Values of (y, g) unlike (y0, g0). */
static double count_differ(const moe_ep *ep, const float *y, const moe_ep_grads *g,
                           const float *y0, const moe_ep_grads *g0)
{
    const float *a[MOE_EP_GRAD_TENSORS], *b[MOE_EP_GRAD_TENSORS];
    moe_index n[MOE_EP_GRAD_TENSORS];
    moe_ep_grads_tensors(ep, g, a, n);
    moe_ep_grads_tensors(ep, g0, b, n);
    double differ = 0.0;
    for (moe_index m = 0; m < ep->cfg->tokens * ep->cfg->hidden; m++)
        differ += memcmp(&y[m], &y0[m], sizeof(float)) != 0;
    for (int t = 0; t < MOE_EP_GRAD_TENSORS; t++)
        for (moe_index m = 0; m < n[t]; m++)
            differ += memcmp(&a[t][m], &b[t][m], sizeof(float)) != 0;
    return differ;
}

static void write_pairs_csv(FILE *out, const void *arg)
{
    const pair_row *rows = arg;
    fprintf(out, "waves,serial_ms,waves_only_ms,dualpipe_only_ms,both_ms,values_differ\n");
    for (const pair_row *r = rows; r->waves; r++)
        fprintf(out, "%d,%.3f,%.3f,%.3f,%.3f,%.0f\n", r->waves, 1e3 * r->seconds[PAIR_SERIAL],
                1e3 * r->seconds[PAIR_WAVES], 1e3 * r->seconds[PAIR_DUALPIPE_ONLY],
                1e3 * r->seconds[PAIR_BOTH], r->differ);
}

static int bench_pairs(moe_run_context *ctx)
{
    const moe_comm *c = ctx->comm;
    const moe_config *cfg = &ctx->cfg;
    const moe_index n = cfg->tokens * cfg->hidden;
    pair_row rows[MOE_MAX_WAVE_RUNS + 1];
    memset(rows, 0, sizeof rows);
    float *y0 = moe_xmalloc(sizeof(float) * (size_t)n), *y = moe_xmalloc(sizeof(float) * (size_t)n);
    moe_ep_grads g0, g;
    moe_ep_grads_init(&ctx->ep, &g0);
    moe_ep_grads_init(&ctx->ep, &g);
    moe_ep_route(&ctx->ep, ctx->x, ctx->logits, ctx->scores, ctx->ids, ctx->weights);
    int rc = MOE_EXIT_OK;
    double serial = 0.0, dualpipe_only = 0.0; /* they do not depend on W */
    for (int w = 0; rc == MOE_EXIT_OK && w < cfg->waves_count; w++) {
        pair_row *row = &rows[w];
        row->waves = (int)cfg->waves_list[w];
        if (c->rank == 0)
            fprintf(stderr, "bench: W = %d: pairs of micro-batches, %lld warm-up and %lld timed "
                            "per way\n", row->waves, (long long)cfg->warmup, (long long)cfg->iters);
        for (int kind = 0; rc == MOE_EXIT_OK && kind < PAIR_KINDS; kind++) {
            if (w > 0 && (kind == PAIR_SERIAL || kind == PAIR_DUALPIPE_ONLY)) {
                row->seconds[kind] = kind == PAIR_SERIAL ? serial : dualpipe_only;
                continue;
            }
            const bool reference = w == 0 && kind == PAIR_SERIAL;
            rc = time_pairs(ctx, kind, row->waves, reference ? y0 : y, reference ? &g0 : &g,
                            &row->seconds[kind]);
            if (!reference && rc == MOE_EXIT_OK)
                row->differ += moe_comm_sum(c, count_differ(&ctx->ep, y, &g, y0, &g0));
        }
        serial = row->seconds[PAIR_SERIAL];
        dualpipe_only = row->seconds[PAIR_DUALPIPE_ONLY];
    }
    moe_status local = {0};
    if (rc == MOE_EXIT_OK && c->rank == 0) {
        printf("pairs     micro-batch B's forward with micro-batch A's backward (the same "
               "tokens), ms per pair, median of %lld, max over ranks; A's forward is done before\n"
               "          serial: B's blocking forward, then A's blocking backward · waves only: "
               "B's wave forward, then A's backward in W waves · DualPipe only: B's forward "
               "stages where A's all-to-alls are in flight and the other way round, A's backward "
               "in one wave · both: the pairing with A's backward in W waves\n",
               (long long)cfg->iters);
        printf("%4s %10s %11s %14s %10s %16s  %s\n", "W", pair_names[0], pair_names[1],
               pair_names[2], pair_names[3], "best vs serial", "bits vs serial");
        for (const pair_row *r = rows; r->waves; r++) {
            double best = r->seconds[PAIR_SERIAL];
            for (int kind = 1; kind < PAIR_KINDS; kind++)
                best = fmin(best, r->seconds[kind]);
            printf("%4d %10.2f %11.2f %14.2f %10.2f %15.2fx  %s (%.0f values differ)\n", r->waves,
                   1e3 * r->seconds[PAIR_SERIAL], 1e3 * r->seconds[PAIR_WAVES],
                   1e3 * r->seconds[PAIR_DUALPIPE_ONLY], 1e3 * r->seconds[PAIR_BOTH],
                   r->seconds[PAIR_SERIAL] / best, r->differ == 0.0 ? "identical" : "differ",
                   r->differ);
        }
        fflush(stdout);
        if (cfg->csv[0])
            moe_write_file_atomic(cfg->csv, write_pairs_csv, rows, &local);
    }
    if (rc == MOE_EXIT_OK && moe_comm_agree(c, &local)) {
        ctx->status = local;
        rc = local.code;
    }
    moe_ep_grads_free(&g);
    moe_ep_grads_free(&g0);
    free(y);
    free(y0);
    return rc;
}

/* --mode low-latency: the layer's latency at decode's batch sizes, for the
 * normal path (one wave: count exchange, then the dispatch and combine
 * all-to-alls, the reduced combine)
 * against the low-latency one pushed and pulled, each point --samples
 * forwards after --warmup, every rank starting together; a sample is the
 * slowest rank's time. The fixed buffers hold the largest point (or
 * --max-tokens-per-rank) throughout, as a serving engine sizes them once. */
static const int64_t decode_points[] = {1, 8, 32, 128, 512};
enum { DECODE_POINTS = 5, LATENCY_PATHS = 3 };
static const char *const latency_paths[LATENCY_PATHS] = {"normal", "low-latency put",
                                                         "low-latency get"};

/* The bytes of expert weights a forward of this routing streams on the
 * rank that streams the most: its routed experts that some rank's token
 * chose, and its shared ones, 3 f d fp32 each (as the ranks hold them).
 * Collective. */
static double weights_touched(const moe_comm *c, const moe_ep *ep, const int32_t *ids,
                              moe_index pairs)
{
    const moe_config *cfg = ep->cfg;
    double *chosen = moe_xcalloc((size_t)cfg->experts, sizeof(double));
    for (moe_index m = 0; m < pairs; m++)
        if (ids[m] >= 0)
            chosen[ids[m]] = 1.0;
    moe_comm_max_array(c, chosen, cfg->experts);
    double experts = (double)cfg->shared_experts;
    for (int l = 0; l < ep->local_experts; l++)
        experts += chosen[ep->first_expert + l];
    free(chosen);
    return moe_comm_max(c, experts * 3.0 * (double)cfg->ffn * (double)cfg->hidden * sizeof(float));
}

/* Median and p99 (seconds) of --samples forwards of path p at T tokens,
 * and the bytes of weights they stream (weights_touched). */
static int latency_point(const moe_comm *c, const moe_config *base, const moe_link *link,
                         int64_t T, int64_t N, int p, double *median, double *p99,
                         double *weight_bytes, moe_status *st)
{
    moe_config cfg = *base;
    cfg.tokens = T;
    cfg.mode = p == 0 ? MOE_MODE_NORMAL : MOE_MODE_LOW_LATENCY;
    cfg.rma = p == 2 ? MOE_RMA_GET : MOE_RMA_PUT;
    cfg.max_tokens_per_rank = p == 0 ? -1 : N;
    /* the normal path as it runs by default, its combine summed per rank */
    cfg.combine = p == 0 ? MOE_COMBINE_REDUCED : MOE_COMBINE_PAIRS;
    moe_ep ep;
    int rc = moe_ep_init(&ep, &cfg, c, st);
    if (rc)
        return rc;
    ep.link = *link; /* --link as the run resolved it (cb=RATIO from the measured FLOP/s) */
    moe_schedule sched = moe_schedule_default(&ep);
    sched.waves = 1;
    const moe_index d = cfg.hidden, E = cfg.experts, k = cfg.topk;
    float *x = moe_xmalloc(sizeof(float) * (size_t)(T * d));
    float *y = moe_xmalloc(sizeof(float) * (size_t)(T * d));
    float *logits = moe_xmalloc(sizeof(float) * (size_t)(T * E));
    float *scores = moe_xmalloc(sizeof(float) * (size_t)(T * E));
    int32_t *ids = moe_xmalloc(sizeof(int32_t) * (size_t)(T * k));
    float *weights = moe_xmalloc(sizeof(float) * (size_t)(T * k));
    moe_ep_generate_tokens(&ep, x);
    moe_ep_route(&ep, x, logits, scores, ids, weights);
    *weight_bytes = weights_touched(c, &ep, ids, T * k);
    const int warmup = cfg.warmup > 0 ? (int)cfg.warmup : 1, n = (int)cfg.samples;
    double *t = moe_xmalloc(sizeof(double) * (size_t)n);
    moe_forward_stats stats;
    for (int i = -warmup; i < n && rc == MOE_EXIT_OK; i++) {
        moe_comm_barrier(c);
        const double start = moe_clock_now();
        const moe_path_args a = {.sched = &sched, .x = x, .ids = ids, .weights = weights, .y = y,
                                 .fwd = &stats};
        rc = moe_path_run(ep.path, &ep, &a, st);
        if (i >= 0)
            t[i] = moe_stage_since(start);
    }
    if (rc == MOE_EXIT_OK) {
        moe_comm_max_array(c, t, n);
        *median = moe_median(t, n); /* t sorted */
        *p99 = t[(int)ceil(0.99 * n) - 1];
    }
    free(t);
    free(weights);
    free(ids);
    free(scores);
    free(logits);
    free(y);
    free(x);
    moe_ep_free(&ep);
    return rc;
}

static int bench_latency(moe_run_context *ctx)
{
    const moe_comm *c = ctx->comm;
    const moe_config *cfg = &ctx->cfg;
    const int64_t N = cfg->max_tokens_per_rank > 0 ? cfg->max_tokens_per_rank
                                                   : decode_points[DECODE_POINTS - 1];
    double median[DECODE_POINTS][LATENCY_PATHS], p99[DECODE_POINTS][LATENCY_PATHS];
    double weight_bytes[DECODE_POINTS], read_rank, read_all;
    int points = 0, rc = MOE_EXIT_OK;
    for (int n = 0; n < DECODE_POINTS && decode_points[n] <= N && rc == MOE_EXIT_OK; n++, points++)
        for (int p = 0; p < LATENCY_PATHS && rc == MOE_EXIT_OK; p++) {
            if (c->rank == 0)
                fprintf(stderr, "bench: %lld tokens per rank, %s: %lld samples\n",
                        (long long)decode_points[n], latency_paths[p], (long long)cfg->samples);
            rc = latency_point(c, cfg, &ctx->ep.link, decode_points[n], N, p, &median[n][p],
                               &p99[n][p], &weight_bytes[n], &ctx->status);
        }
    if (rc == MOE_EXIT_OK)
        measure_read_bandwidth(c, &read_rank, &read_all);
    if (rc || c->rank != 0)
        return rc;
    char buffers[32];
    moe_config sized = *cfg;
    sized.max_tokens_per_rank = N;
    printf("moe-ep bench --mode low-latency · G=%d ranks · d=%lld f=%lld E=%lld k=%lld S=%lld · "
           "dispatch %s, combine %s · gemm %s\n",
           c->ranks, (long long)cfg->hidden, (long long)cfg->ffn, (long long)cfg->experts,
           (long long)cfg->topk, (long long)cfg->shared_experts,
           moe_config_choice_name("dispatch-dtype", cfg->dispatch_dtype),
           moe_config_choice_name("combine-dtype", cfg->combine_dtype),
           moe_gemm_label((enum moe_gemm_kind)cfg->gemm));
    printf("latency   one layer, µs: median and p99 of %lld forwards (the slowest rank's), after "
           "%lld warm-up; fixed buffers for N = %lld tokens per rank: %s per rank\n",
           (long long)cfg->samples, (long long)(cfg->warmup > 0 ? cfg->warmup : 1), (long long)N,
           moe_format_bytes(moe_ll_buffer_bytes(&sized, c->ranks), buffers, sizeof buffers));
    if (ctx->ep.link.enabled) {
        char link[160];
        moe_link_describe(&ctx->ep.link, link, sizeof link);
        printf("link      emulated: %s; a round costs a latency (the count exchange one, a "
               "pull two)\n", link);
    }
    printf("weights   the time of streaming them from memory: the bytes of expert weights the "
           "busiest rank's forward reads (its experts some token chose, and the shared ones) / "
           "%.1f GB/s, its memory read rate with every rank reading (measured now); a layer "
           "can take less where the samples' experts stay in the last-level cache\n",
           read_rank * 1e-9);
    printf("   T  %-24s%-24s%-24s%-26s%s\n", "normal (med, p99)", "low-latency put",
           "low-latency get", "normal / best low-latency", "weights MiB, µs");
    int crossover = points; /* the normal path the faster from here on */
    for (int n = 0; n < points; n++) {
        printf("%4lld", (long long)decode_points[n]);
        for (int p = 0; p < LATENCY_PATHS; p++) {
            char cell[32];
            snprintf(cell, sizeof cell, "%.0f, %.0f", 1e6 * median[n][p], 1e6 * p99[n][p]);
            printf("  %-22s", cell);
        }
        const double ll = fmin(median[n][1], median[n][2]);
        char ratio[16];
        snprintf(ratio, sizeof ratio, "%.2f", median[n][0] / ll);
        printf("%-26s%.1f, %.0f\n", ratio, weight_bytes[n] / 1048576.0, 1e6 * weight_bytes[n] / read_rank);
        if (median[n][0] >= ll)
            crossover = points;
        else if (crossover == points)
            crossover = n;
    }
    if (crossover == 0)
        printf("crossover none here: the normal path is the faster at every T measured (medians)\n");
    else if (crossover < points)
        printf("crossover the normal path is the faster from T = %lld tokens per rank on (medians)\n",
               (long long)decode_points[crossover]);
    else
        printf("crossover none here: the low-latency path is the faster at the largest T measured "
               "(medians)\n");
    return MOE_EXIT_OK;
}

/* --workload all: the named workloads W0 .. W7 one after another at the
 * first --waves, each --warmup untimed then --iters timed forwards, as
 * Megatron-LM's imbalance benchmark tabulates them: the layer (median of
 * the max over ranks), how unevenly the ranks receive rows and spend expert
 * time (max over the mean), and the spread of the layer over workloads. */
static int bench_workloads(moe_run_context *ctx)
{
    const moe_comm *c = ctx->comm;
    const moe_config *cfg = &ctx->cfg;
    ctx->schedule.waves = (int)cfg->waves_list[0];
    double layer[MOE_WORKLOADS], rows[MOE_WORKLOADS], expert[MOE_WORKLOADS], expert_max[MOE_WORKLOADS];
    for (int n = 0; n < MOE_WORKLOADS; n++) {
        const int w = MOE_WORKLOAD_BALANCED + n;
        if (c->rank == 0)
            fprintf(stderr, "bench: W%d %s: %lld warm-up and %lld timed forwards\n", n,
                    moe_workload_name(w), (long long)cfg->warmup, (long long)cfg->iters);
        moe_context_workload(ctx, w);
        int rc = cfg->warmup > 0 ? moe_context_timed_forwards(ctx, (int)cfg->warmup) : MOE_EXIT_OK;
        if (rc == MOE_EXIT_OK)
            rc = moe_context_timed_forwards(ctx, (int)cfg->iters);
        if (rc)
            return rc;
        const moe_run_summary *s = &ctx->summary;
        layer[n] = s->layer_seconds;
        rows[n] = s->rows_received.mean > 0 ? s->rows_received.max / s->rows_received.mean : 0.0;
        expert_max[n] = moe_comm_max(c, ctx->last_expert_seconds);
        const double mean = moe_comm_sum(c, ctx->last_expert_seconds) / c->ranks;
        expert[n] = mean > 0 ? expert_max[n] / mean : 0.0;
    }
    if (c->rank != 0)
        return MOE_EXIT_OK;
    double lo = layer[0], hi = layer[0];
    for (int n = 1; n < MOE_WORKLOADS; n++)
        lo = layer[n] < lo ? layer[n] : lo, hi = layer[n] > hi ? layer[n] : hi;
    printf("moe-ep bench --workload all · preset %s · G=%d ranks · T=%lld d=%lld f=%lld E=%lld k=%lld · "
           "W = %d · step %lld · %lld timed forwards each (after %lld warm-up)\n",
           cfg->preset[0] ? cfg->preset : "(none)", c->ranks, (long long)cfg->tokens,
           (long long)cfg->hidden, (long long)cfg->ffn, (long long)cfg->experts, (long long)cfg->topk,
           ctx->schedule.waves, (long long)cfg->workload_step, (long long)cfg->iters,
           (long long)cfg->warmup);
    printf("          rows = dispatch rows received, max rank / mean; expert = expert-stage time, "
           "max rank / mean (last forward)\n");
    printf("    workload          layer ms  vs W0   rows  expert  expert ms (max)\n");
    for (int n = 0; n < MOE_WORKLOADS; n++)
        printf("    W%d %-12s %10.2f %6.2f %6.2f %7.2f %16.2f\n", n,
               moe_workload_name(MOE_WORKLOAD_BALANCED + n), 1e3 * layer[n], layer[n] / layer[0],
               rows[n], expert[n], 1e3 * expert_max[n]);
    printf("spread    %.2fx: the slowest workload's layer over the fastest's\n", lo > 0 ? hi / lo : 0.0);
    fflush(stdout);
    return MOE_EXIT_OK;
}

static void print_usage(FILE *out)
{
    fprintf(out,
            "usage: mpirun -np G moe-ep bench [--preset NAME] [--waves 1,2,4,8] [flags]\n"
            "\n"
            "The wave pipeline at each W (default 1,2,4,8), --warmup untimed then --iters timed\n"
            "forwards, against anchors measured in the same run: one sgemm of the experts' FLOPs,\n"
            "one plain MPI_Alltoallv of the forward's counts, the cores' FMA peak, the layer's\n"
            "GEMM on each rank's core and the memory read rate. Takes every flag of run.\n"
            "With --mode low-latency: the layer's latency at 1, 8, 32, 128 and 512 tokens per\n"
            "rank (up to --max-tokens-per-rank), the normal path against put and get.\n"
            "With --workload all: one row per named imbalance workload (W0-W7, docs/data.md).\n"
            "\n");
    moe_config_print_flags(out, MOE_CMD_BENCH);
}

/* One W of the sweep, as measured: the anchors come after the whole sweep. */
typedef struct {
    int waves;
    moe_run_summary s;        /* the W's summary */
    double rss_max;           /* peak RSS, max over ranks */
    double rss_ratio;         /* max over ranks of the peak against the rank's least */
    double a2a_anchor;        /* the plain MPI_Alltoallv pair of this W's counts, seconds */
    bool travels;             /* something crosses ranks */
} sweep_point;

typedef struct {
    double gemm;        /* the sgemm anchor: all expert FLOPs, max over ranks */
    double gemm_routed; /* its share of the routed experts, max over ranks */
    double gemm_forced;   /* with OPENBLAS_CORETYPE set: the sgemm with that kernel (then gemm is
                             the faster of it and gemm_own); 0 otherwise */
    double gemm_own;      /* and with the CPU's own kernel (own_kernel); NAN: it could not run */
    char kernel[64], own_kernel[64]; /* the kernels of gemm's and gemm_own's times */
    double read_rank;     /* memory read bandwidth, bytes/s: the least rank's, all at once */
    double read_all;      /* and all ranks' together */
    double flops;       /* its FLOPs, all ranks */
    double wgrad_rate;  /* --backward: the wgrad-shape sgemms, FLOP/s per rank (min) */
    fma_peak peak;      /* the cores' FMA peak */
    kernel_rates cores;  /* the layer's GEMM on each rank's core */
} anchors;

/* The plain MPI_Alltoallv anchor with this W's counts. Dispatch: this W's
 * rows per destination; combine: the pairs that come back from each rank,
 * sent the other way (the same bytes between every two ranks, transposed). */
static void measure_alltoall(const moe_run_context *ctx, sweep_point *p)
{
    const moe_comm *c = ctx->comm;
    const moe_config *cfg = &ctx->cfg;
    const moe_index T = cfg->tokens;
    double *dispatch_rows = moe_xmalloc(sizeof(double) * (size_t)c->ranks);
    double *combine_rows = moe_xmalloc(sizeof(double) * (size_t)c->ranks);
    moe_waves waves;
    moe_waves_init_by(&waves, &ctx->ep.placement, p->waves, T, moe_ep_wave_by(&ctx->ep, &ctx->schedule));
    moe_rows_per_destination(&ctx->ep.placement, ctx->ids, T, (int)cfg->topk, &waves, dispatch_rows);
    moe_waves_free(&waves);
    moe_send_plan plan;
    moe_send_plan_build(&plan, &ctx->ep.placement, ctx->ids, T, (int)cfg->topk, NULL, 0);
    for (int r = 0; r < c->ranks; r++)
        combine_rows[r] = (double)plan.pair_count[r];
    moe_send_plan_free(&plan);
    dispatch_rows[c->rank] = combine_rows[c->rank] = 0.0; /* as the forward: own rows stay */
    a2a_anchor a = {moe_comm_alltoallv_prepare(c, dispatch_rows, moe_dispatch_row_bytes(cfg)),
                    moe_comm_alltoallv_prepare(c, combine_rows, moe_combine_row_bytes(cfg))};
    p->a2a_anchor = timed(c, run_alltoallv, &a, false);
    /* nothing crosses ranks (one rank): no all-to-all figures */
    p->travels = moe_comm_sum(c, (double)(ctx->last.rows_sent_remote + ctx->last.pairs_back_remote)) > 0;
    moe_comm_alltoallv_free(a.combine);
    moe_comm_alltoallv_free(a.dispatch);
    free(combine_rows);
    free(dispatch_rows);
}

/* The sgemm of the experts' FLOPs (M: the rows this rank's experts take,
 * the routed pairs and its tokens once per shared expert), with
 * --backward the wgrad-shape sgemms, and the FMA peak. */
static void measure_anchors(const moe_run_context *ctx, fma_probes *probes, anchors *a)
{
    const moe_comm *c = ctx->comm;
    const moe_config *cfg = &ctx->cfg;
    const moe_forward_stats *probe = &ctx->last;
    const moe_index T = cfg->tokens, d = cfg->hidden, f = cfg->ffn;
    const moe_index shared_rows = cfg->shared_experts * T;
    sgemm_anchor g = {probe->pairs_received + shared_rows, 3 * f, d, NULL, NULL, NULL};
    g.A = filled((size_t)(g.M * g.K) + 1);
    g.B = filled((size_t)(g.N * g.K) + 1);
    g.C = filled((size_t)(g.M * g.N) + 1);
    probe_fma(probes);
    double own = timed(c, run_sgemm, &g, true);
    probe_fma(probes);
    a->gemm = moe_comm_max(c, own);
    snprintf(a->kernel, sizeof a->kernel, "%s", moe_blas_corename());
    if (getenv("OPENBLAS_CORETYPE")) { /* the environment's kernel: the CPU's own too */
        a->gemm_own = default_kernel_sgemm(c, &g, a->own_kernel, sizeof a->own_kernel);
        a->gemm_forced = a->gemm;
        if (a->gemm_own < a->gemm) { /* NAN (not measured) keeps the forced one */
            own *= a->gemm_own / a->gemm;
            a->gemm = a->gemm_own;
            snprintf(a->kernel, sizeof a->kernel, "%s", a->own_kernel);
        }
    }
    const double routed = g.M ? (double)probe->pairs_received / (double)g.M : 0.0;
    a->gemm_routed = moe_comm_max(c, own * routed);
    a->flops = moe_comm_sum(c, 2.0 * (double)g.M * (double)g.N * (double)g.K);
    free(g.C);
    free(g.B);
    free(g.A);
    measure_kernel(ctx, probes, &a->cores);
    measure_fma_peak(c, probes, &a->peak);
    measure_read_bandwidth(c, &a->read_rank, &a->read_all);
    if (!ctx->ep.path->training)
        return;
    const int EL = ctx->ep.local_experts;
    wgrad_anchor w = {EL, mean_expert_rows(ctx), d, f, NULL, NULL, NULL};
    w.A = filled((size_t)(2 * f * w.n) + 1 > (size_t)(d * w.n) + 1 ? (size_t)(2 * f * w.n) + 1
                                                                    : (size_t)(d * w.n) + 1);
    w.B = filled((size_t)(w.n * d) + 1);
    w.C = filled((size_t)(2 * f * d) + 1);
    const double wgrad_own = timed(c, run_wgrad_sgemms, &w, true);
    const double flops = (double)EL * 6.0 * (double)w.n * (double)f * (double)d;
    a->wgrad_rate = moe_comm_min(c, wgrad_own > 0 ? flops / wgrad_own : INFINITY);
    free(w.C);
    free(w.B);
    free(w.A);
}

/* A table row from a W's measurements and the anchors. */
static void fill_row(bench_row *r, const sweep_point *p, const anchors *a, const moe_config *cfg,
                     int ranks)
{
    const moe_run_summary *s = &p->s;
    /* the bytes that cross ranks, all ranks: rows with their ids out, outputs back */
    const double bytes = s->rows_sent_remote * moe_dispatch_row_bytes(cfg) +
                         s->pairs_back_remote * moe_combine_row_bytes(cfg);
    /* the routed experts' compute (a pipeline's compute also holds the
     * shared experts that ran in its waits); with more ranks than cores
     * the ranks take turns, and a rank's expert time leaves out the turns
     * of the others: the rate of all ranks is then over the window any
     * rank computed in (as run's report gives it), or it reads above the
     * cores' FMA peak */
    const double expert_time = s->ranks_on_host > s->cores && s->expert_window > 0
                                   ? s->expert_window
                                   : s->stage_seconds[MOE_STAGE_EXPERTS];
    *r = (bench_row){
        .waves = p->waves,
        .ranks = ranks,
        .wave_kind = s->wave_kind,
        .layer = s->layer_seconds,
        .layer_min = s->layer_min,
        .layer_max = s->layer_max,
        .tokens_per_second = (double)ranks * (double)cfg->tokens / s->layer_seconds,
        .expert_gflops = s->expert_flops * 1e-9 / expert_time,
        .ceiling = a->gemm / s->layer_seconds,
        .of_peak = a->flops / s->layer_seconds / peak_rate(&a->peak),
        .experts_of_peak = s->expert_flops / expert_time / peak_rate(&a->peak),
        .gemm_efficiency = a->gemm_routed / expert_time,
        .a2a_bytes_per_second = p->travels ? bytes / s->comm_seconds : NAN,
        .a2a_efficiency = p->travels ? p->a2a_anchor / s->comm_seconds : NAN,
        .overlap = moe_overlap(s->pipeline_seconds, s->compute_seconds, s->comm_seconds),
        .rss_mb = p->rss_max / 1048576.0,
        .rss_ratio = p->rss_ratio,
        .rank_limit = a->peak.rank_limit > 0 ? a->peak.rank_limit : NAN,
        .layer_gemm_of_peak = a->peak.rank_limit > 0 ? a->cores.least / a->peak.rank_limit : NAN,
    };
    if (s->path->training)
        training_row(r, s, a->flops / a->gemm, a->wgrad_rate, peak_rate(&a->peak));
}

/* The forward's sweep: one row per W, its rates against the anchors. */
static void print_wave_rows(FILE *out, const bench_row *rows)
{
    fprintf(out, "          ceiling = that sgemm's time / the layer's; gemm = its routed share / the "
                 "routed experts' compute; peak = the layer's expert FLOPs at the FMA peak's limit "
                 "(all ranks) / the layer's time, exp = the experts' GFLOP/s / that limit\n");
    fprintf(out, "%4s %-12s %22s %10s %9s %8s %5s %9s %7s %5s %9s %7s %8s %14s\n", "W", "waves",
            "layer ms (med min-max)", "tokens/s", "per rank", "ceiling", "peak", "GFLOP/s", "gemm",
            "exp", "a2a GB/s", "a2a", "overlap", "RSS MB (ratio)");
    for (const bench_row *r = rows; r->waves; r++) {
        char rate[16] = "-", efficiency[16] = "-"; /* no all-to-all figures: "-" */
        if (!isnan(r->a2a_efficiency)) {
            snprintf(rate, sizeof rate, "%.2f", r->a2a_bytes_per_second * 1e-9);
            snprintf(efficiency, sizeof efficiency, "%.2f", r->a2a_efficiency);
        }
        fprintf(out, "%4d %-12s %8.2f %6.2f-%-6.2f %10.0f %9.0f %7.0f%% %4.0f%% %9.1f %7.2f %4.0f%% "
                     "%9s %7s %7.0f%% %8.0f (%.2f)\n",
                r->waves, r->wave_kind == MOE_WAVES_EXPERT_SLOTS ? "expert slots" : "token chunks",
                1e3 * r->layer, 1e3 * r->layer_min, 1e3 * r->layer_max, r->tokens_per_second,
                r->tokens_per_second / r->ranks, 100.0 * r->ceiling, 100.0 * r->of_peak,
                r->expert_gflops, r->gemm_efficiency, 100.0 * r->experts_of_peak, rate, efficiency,
                100.0 * r->overlap, r->rss_mb, r->rss_ratio);
    }
}

int moe_cli_bench(moe_comm *c, int argc, char **argv)
{
    if (moe_cli_help(c, argc, argv, print_usage))
        return MOE_EXIT_OK;
    moe_run_context ctx;
    int rc = moe_context_open(&ctx, c, MOE_CMD_BENCH, argc, argv);
    if (rc)
        return rc;
    const moe_path *path = ctx.ep.path;
    if (path->low_latency || ctx.cfg.schedule == MOE_SCHEDULE_DUALPIPE) {
        rc = path->low_latency ? bench_latency(&ctx) : bench_pairs(&ctx);
        if (rc)
            moe_comm_print_error(c, &ctx.status);
        moe_context_close(&ctx);
        return rc;
    }
    if (ctx.cfg.workload == MOE_WORKLOAD_ALL) {
        rc = bench_workloads(&ctx);
        if (rc)
            moe_comm_print_error(c, &ctx.status);
        moe_context_close(&ctx);
        return rc;
    }
    const moe_config *cfg = &ctx.cfg;
    const moe_forward_stats *probe = &ctx.last; /* this rank's rows and pairs */
    bench_row rows[MOE_MAX_WAVE_RUNS + 1];
    memset(rows, 0, sizeof rows);
    sweep_point *points = moe_xcalloc((size_t)cfg->waves_count, sizeof *points);
    const int iters = (int)cfg->iters;
    /* before each W's timed forwards and after each; around two anchors */
    const int capacity = cfg->waves_count * (iters + 1) + 4;
    fma_probes probes = {.c = c, .capacity = capacity,
                         .sums = moe_xmalloc(sizeof(double) * (size_t)capacity)};
    int measured = 0;
    for (int n = 0; rc == MOE_EXIT_OK && n < cfg->waves_count; n++) {
        ctx.schedule.waves = (int)cfg->waves_list[n];
        if (c->rank == 0)
            fprintf(stderr, "bench: W = %d: %lld warm-up and %d timed forwards\n",
                    ctx.schedule.waves, (long long)cfg->warmup, iters);
        moe_peak_rss_reset(); /* this W's forwards only, not the ones before */
        if (cfg->warmup > 0)
            rc = moe_context_timed_forwards(&ctx, (int)cfg->warmup);
        ctx.between = probe_between, ctx.between_arg = &probes;
        if (rc == MOE_EXIT_OK)
            rc = moe_context_timed_forwards(&ctx, iters);
        ctx.between = NULL;
        if (rc)
            break;
        moe_context_time_alltoalls(&ctx, iters); /* not a training step's: its forward is blocking */
        sweep_point *p = &points[measured++];
        p->waves = ctx.schedule.waves;
        p->s = ctx.summary;
        const double rss = moe_peak_rss();
        const double least = path->training ? minimum_training_bytes(&ctx.ep, probe)
                                           : minimum_bytes(&ctx.ep, probe);
        p->rss_max = moe_comm_max(c, rss);
        p->rss_ratio = moe_comm_max(c, rss / least);
        measure_alltoall(&ctx, p); /* per W: per-wave dedup changes the counts */
    }
    /* The sgemm anchors and the FMA peak once, after the sweep: the
     * experts' FLOPs do not depend on W, and OpenBLAS keeps the buffers it
     * packs into for the life of the process (about 21 MB a rank at the
     * peer workload), which no row's peak RSS may count. */
    anchors a = {0};
    if (rc == MOE_EXIT_OK)
        measure_anchors(&ctx, &probes, &a);
    for (int n = 0; n < measured; n++)
        fill_row(&rows[n], &points[n], &a, cfg, c->ranks);
    free(points);
    free(probes.sums);
    const moe_run_summary *s = &ctx.summary;
    const moe_index T = cfg->tokens, d = cfg->hidden, f = cfg->ffn;
    const double gemm_anchor = a.gemm, anchor_flops = a.flops, wgrad_anchor_rate = a.wgrad_rate;
    const fma_peak peak = a.peak;
    moe_status local = {0};
    if (rc == MOE_EXIT_OK && c->rank == 0) {
        printf("moe-ep bench · preset %s · G=%d ranks · T=%lld d=%lld f=%lld E=%lld k=%lld · "
               "%lld timed forwards per W (after %lld warm-up) · gemm %s · progress %s\n",
               cfg->preset[0] ? cfg->preset : "(none)", c->ranks, (long long)T, (long long)d,
               (long long)f, (long long)cfg->experts, (long long)cfg->topk, (long long)cfg->iters,
               (long long)cfg->warmup, moe_gemm_label(ctx.ep.gemm), s->progress ? "thread" : "poll");
        moe_report_print_machine(stdout, s);
        printf("anchors   sgemm of the experts' FLOPs (routed%s): %.2f ms (%.1f GFLOP/s on %d ranks, "
               "OpenBLAS kernel %s) · plain MPI_Alltoallv of %s, per W below\n",
               cfg->shared_experts ? " and shared" : "", 1e3 * gemm_anchor,
               anchor_flops * 1e-9 / gemm_anchor, c->ranks, a.kernel,
               path->two_stage
                   ? "the flat dispatch's counts (one hop; the two-stage forward makes four)"
                   : "the same counts");
        if (a.gemm_forced > 0 && isnan(a.gemm_own))
            printf("          OPENBLAS_CORETYPE=%s chose kernel %s: the CPU's own kernel could not be "
                   "measured (moe-ep sgemm-anchor did not run), so the anchor may be slower than a "
                   "user's\n", getenv("OPENBLAS_CORETYPE"), moe_blas_corename());
        else if (a.gemm_forced > 0)
            printf("          OPENBLAS_CORETYPE=%s chose kernel %s here: %.2f ms (%.1f GFLOP/s); the "
                   "CPU's own, %s: %.2f ms (%.1f GFLOP/s); the columns use the faster\n",
                   getenv("OPENBLAS_CORETYPE"), moe_blas_corename(), 1e3 * a.gemm_forced,
                   anchor_flops * 1e-9 / a.gemm_forced, a.own_kernel, 1e3 * a.gemm_own,
                   anchor_flops * 1e-9 / a.gemm_own);
        print_fma_peak(stdout, &peak, c);
        print_kernel(stdout, &a.cores, &peak, &ctx);
        printf("          memory read %.1f GB/s a rank (the least, all %d at once), %.1f GB/s in all",
               a.read_rank * 1e-9, c->ranks, a.read_all * 1e-9);
        const size_t llc = moe_llc_share_bytes();
        if (llc)
            printf(" · last-level cache %.1f MiB a CPU", (double)llc / 1048576.0);
        printf(" · the packed kernel's row blocks %.1f MiB",
               (double)moe_sgemm_packed_block_bytes() / 1048576.0);
        const size_t l2_block = moe_sgemm_packed_l2_block_bytes();
        if (l2_block)
            printf(", %.2f MiB where the rows outgrow a core's L2 (%.1f MiB)",
                   (double)l2_block / 1048576.0, (double)moe_l2_bytes() / 1048576.0);
        printf("\n");
        if (path->training) {
            print_training(stdout, rows, wgrad_anchor_rate);
        } else {
            print_wave_rows(stdout, rows);
        }
        fflush(stdout);
        if (cfg->csv[0])
            moe_write_file_atomic(cfg->csv, write_csv, rows, &local);
        if (cfg->plot[0] && local.code == MOE_EXIT_OK)
            moe_write_file_atomic(cfg->plot, write_plot, rows, &local);
    }
    if (rc == MOE_EXIT_OK && moe_comm_agree(c, &local)) {
        ctx.status = local;
        rc = local.code;
    }
    if (rc)
        moe_comm_print_error(c, &ctx.status);
    moe_context_close(&ctx);
    return rc;
}
