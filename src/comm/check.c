/* check.c — collective comparison with the dense truth (see check.h). */
#include "moe/check.h"

#include <math.h>

void moe_check_collective(const moe_comm *c, const moe_config *cfg, const float *y,
                          const double *truth, const double *allow, moe_run_summary *s)
{
    const moe_index T = cfg->tokens, d = cfg->hidden, n = T * d;
    const double count = (double)c->ranks * (double)n;
    s->ref_rms = sqrt(moe_comm_sum(c, moe_sum_squares(truth, n)) / count);
    s->tol = moe_tolerance_for(cfg, s->ref_rms);

    moe_compare_stats mine;
    moe_compare(y, truth, allow, n, s->tol, &mine);
    s->cmp.max_abs = moe_comm_max(c, mine.max_abs);
    s->cmp.max_rel = moe_comm_max(c, mine.max_rel);

    /* The location reported: the first non-finite value if any, else the
     * element that used the most of its tolerance. */
    const bool nonfinite = mine.first_nonfinite >= 0;
    s->nonfinite = moe_comm_max(c, nonfinite ? 1.0 : 0.0) > 0.0;
    double key = s->nonfinite ? (nonfinite ? 1.0 : 0.0) : mine.max_used;
    moe_comm_maxloc(c, key, &s->worst_rank);
    s->cmp.max_used = moe_comm_max(c, mine.max_used);
    long long where[2] = {-1, -1};
    moe_index at = nonfinite ? mine.first_nonfinite : mine.worst;
    if (at >= 0) {
        where[0] = (long long)(c->rank * T + at / d);
        where[1] = (long long)(at % d);
    }
    moe_comm_bcast(c, where, sizeof where, s->worst_rank);
    s->worst_token = where[0];
    s->worst_column = where[1];
    s->checked = true;
}
