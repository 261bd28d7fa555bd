/* SPDX-License-Identifier: MIT */
/* report.h — rank 0's text report of a run. Pure formatting: the numbers are
 * gathered by the caller (src/cli/run.c); nothing here communicates.
 */
#ifndef MOE_REPORT_H
#define MOE_REPORT_H

#include <stdbool.h>
#include <stdio.h>

#include "moe/config.h"
#include "moe/eplb.h"
#include "moe/layout.h"
#include "moe/link.h"
#include "moe/stats.h"
#include "moe/timeline.h"
#include "moe/truth.h"
#include "moe/wave_estimate.h"

typedef struct {
    double min, mean, max;
} moe_spread;

/* One point of the speed-up curve (--waves W1,W2,...). */
typedef struct {
    int waves;
    double layer_seconds, pipeline_seconds, compute_seconds, comm_seconds;
    double fill_seconds; /* of compute_seconds, the shared experts run in the waits */
    int wave_kind;
    double rows_sent; /* dispatched rows, all ranks */
} moe_curve_point;

/* The gradient tensors --backward --check compares with the fp64 truth. */
enum { MOE_GRAD_DX, MOE_GRAD_DW1, MOE_GRAD_DW2, MOE_GRAD_SHARED_W1, MOE_GRAD_SHARED_W2,
       MOE_GRAD_GATE, MOE_GRAD_TENSORS };
extern const char *const moe_grad_names[MOE_GRAD_TENSORS];

/* One gradient tensor against its truth, over every rank's part. */
typedef struct {
    bool checked;
    double length;       /* the accumulation length its tolerance counts (truth.h); for a
                            tensor split by expert, the longest of any expert's */
    double rms;          /* of the truth (per expert for dW: the largest) */
    double max_abs;      /* max |got - truth| */
    double max_used;     /* max |got - truth| / (abs + rel |truth|); <= 1 passes */
    bool nonfinite;
} moe_grad_check;

typedef struct {
    const moe_config *cfg;
    const struct moe_path_s *path; /* the path the run took (path.h) */
    const moe_link *link;
    int ranks, ranks_on_host, cores, bound, threads, blas_threads;
    int progress;                 /* enum moe_progress_kind, as granted */
    int local_experts_min, local_experts_max;
    moe_spread rows_received;     /* dispatch rows per rank */
    moe_spread pairs_received;    /* (row, expert) pairs computed per rank */
    double layout_slots;          /* rows of the expert GEMMs' layout tensors, all ranks (stats.h) */
    double rows_sent, rows_sent_remote;    /* summed over ranks, one forward */
    double rows_one_wave;                  /* the rows one wave sends (full per-rank dedup) */
    double tier_bytes[2];                  /* sent over each tier, all ranks (stats.h) */
    double rows_inter, rows_intra;         /* --dispatch hierarchical: stage-1 rows between
                                              nodes, stage-2 rows within them, all ranks */
    moe_node_rows node_rows;               /* what each dispatch puts on each tier, all ranks */
    double pairs_back_remote;
    double bytes_dispatched, bytes_combined;
    double stage_seconds[MOE_STAGES]; /* median over iterations of the max over ranks */
    double layer_seconds;             /* the same for the whole forward */
    double layer_min, layer_max;      /* over the iterations */
    double expert_flops;              /* summed over ranks, one forward */
    double fill_flops;                /* the same, of the shared experts run in the pipeline's waits */
    double expert_seconds;            /* median of the max over ranks */
    double expert_window;             /* median of: last rank's expert end - first rank's start */
    /* the wave pipeline (waves > 0) */
    int waves, wave_kind;
    double pipeline_seconds, compute_seconds, comm_seconds, test_seconds;
    double fill_seconds; /* of compute_seconds, the shared experts run in the waits */
    bool ref_compared, ref_bitwise_expected;
    bool ref_two_stage;           /* compared with the blocking two-stage path (its own sums) */
    double ref_differ, ref_max_diff; /* values that differ from the blocking path */
    double rank_flops;               /* --link cb: measured expert FLOP/s of a rank */
    moe_curve_point curve[MOE_MAX_WAVE_RUNS];
    int curve_count;
    const moe_wave_choice *wave_choices; /* (cfg->waves_count) --wave-by auto's choices under
                                            --link (ep.h); NULL: none made */
    /* routing and traffic detail, filled on rank 0 */
    int ranks_per_node, nodes;
    const double *matrix;        /* (G, G) dispatch bytes, row rank to column rank */
    const double *wire;          /* (G, G) the two-stage dispatch's as they cross the links; NULL flat */
    const double *nodes_hist;    /* (nodes + 1) tokens whose experts span n nodes */
    const double *rank_expert_seconds; /* (G) each rank's expert time, last forward */
    const double *posted;        /* (G, 2W + A) on rank 0: when each rank posted each dispatch
                                    and combine of the last forward (moe_trace_posts) and reached
                                    each of its A agreements (moe_ep_arrivals) */
    int posted_waves, posted_agreements; /* W and A of posted */
    int posted_side[MOE_ARRIVALS_MAX];   /* each agreement's side (moe_waits_analyze) */
    const double *tokens_expert;       /* (E) (token, expert) pairs of each expert, all ranks */
    moe_spread tokens_per_expert;
    /* --redundant-experts, filled on rank 0 (replicas NULL without) */
    const moe_replicas *replicas;
    const double *expert_load;         /* (E) the load EPLB placed by */
    const double *rank_pairs[2];       /* (G) (token, expert) pairs each rank computes: with
                                          the logical experts E/G a rank, and with the copies */
    moe_spread tokens_per_physical;    /* pairs of each physical expert */
    double expert_bytes;               /* one routed expert's weights in memory */
    double mask_dropped;               /* --mask-ranks: the pairs it dropped, summed over ranks */
    /* --capacity-factor, filled on rank 0 (capacity 0 without) */
    moe_index capacity;                /* pairs an expert takes of each rank's tokens */
    double pairs_dropped;              /* summed over ranks */
    const double *expert_dropped;      /* (E) pairs dropped of each logical expert */
    const double *rank_pairs_routed;   /* (G) pairs each rank's experts were routed */
    const double *rank_pairs_kept;     /* (G) and computed */
    double rows_undropped;             /* dispatch rows the forward would send without drops */
    double pad_rows;                   /* --pad-to-capacity: zero rows computed, summed over ranks */
    bool drop_error_measured;          /* --check: y against the truth of every pair */
    double drop_max_abs, drop_max_rel_rms;
    /* what --dtype, --dispatch-dtype, --combine-dtype cost against fp32 */
    double dump_bytes, dump_seconds; /* --dump */
    double rss_peak;                 /* the most any rank held resident (moe_peak_rss) */
    double memory_estimate;          /* moe_config_memory_per_rank: what was checked up front */
    bool quantised;
    double quant_max_abs, quant_max_rel_rms; /* max |y - y_fp32|, and over rms(y_fp32) */
    /* --backward */
    bool backward;
    double bwd_seconds[MOE_BWD_STAGES]; /* median over steps of the max over ranks */
    double step_seconds;                /* the same for forward + backward */
    double step_min, step_max;          /* over steps */
    double bwd_bytes_combine, bwd_bytes_dispatch; /* summed over ranks, one step */
    double dgrad_flops, wgrad_flops;    /* the routed experts', summed over ranks */
    bool grads_identical;               /* every step gave the same gradient bits */
    bool bwd_overlapped;                /* the backward's all-to-alls ran in flight */
    bool bwd_one_pass;                  /* and its waves' data gradients in one pass */
    double bwd_in_flight[2];            /* combine, dispatch backward: posted .. complete, last step */
    bool bwd_ref_compared;              /* --check: against the blocking backward */
    bool bwd_ref_bitwise_expected;      /* rows independent (packed, exact), or one wave */
    double bwd_ref_differ;              /* gradient values that differ from it */
    moe_grad_check grad_check[MOE_GRAD_TENSORS]; /* --check */
    /* --check */
    bool checked;
    bool iterations_identical; /* every iteration gave the same bits */
    double ref_rms;
    moe_tolerance tol;
    moe_compare_stats cmp; /* over all ranks */
    int worst_rank;        /* rank holding cmp.worst */
    long long worst_token, worst_column; /* global token id and hidden index */
    bool nonfinite;
} moe_run_summary;

/* The rows the flat dispatch's waves of expert slots send beyond one
 * wave's (a token goes once per wave holding one of its experts on a
 * rank): 0 for token chunks, and for paths whose rows are counted another
 * way (the two-stage dispatch's hops, the low-latency pairs). */
double moe_report_wave_extra_rows(const moe_run_summary *s);

void moe_report_print(FILE *out, const moe_run_summary *s);

/* `run --report`: one self-contained HTML page (inline CSS and SVG, no
 * script, nothing fetched): the configuration and verdict, the stage
 * times, the timeline of the panels (none: left out), the dispatch matrix
 * as a heat map, tokens per expert, KiB received and expert time per rank,
 * and the nodes-per-token histogram. */
void moe_report_write_html(FILE *out, const moe_run_summary *s, const moe_timeline_panel *panels,
                           int n_panels, const moe_timeline_curve *curve);

/* The report's `machine` line: ranks on this host, cores, threads per rank,
 * binding, and a note when the binding and the threads do not fit. */
void moe_report_print_machine(FILE *out, const moe_run_summary *s);

/* The lower bound of a curve point's pipeline time: with the links busy
 * T_comm and the cores T_compute in all, W equal waves take at least
 * max(T_comm, T_compute, T_routed + T_comm/W) (docs/link-model.md), T_routed
 * the routed experts' part of T_compute (the shared experts can run while
 * the first dispatch and the last combine are in flight). */
double moe_curve_bound(const moe_curve_point *p);

/* True when the check passed: within tolerance, finite, and run-to-run identical. */
bool moe_report_check_passed(const moe_run_summary *s);

#endif
