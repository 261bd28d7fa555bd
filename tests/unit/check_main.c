/* SPDX-License-Identifier: MIT */
/* check_main.c — runs every unit suite (pure core, no MPI); exit 1 on any failure. */
#include <stdlib.h>

#include "suites.h"

int main(void)
{
    SRunner *runner = srunner_create(make_rng_suite());
    srunner_add_suite(runner, make_config_suite());
    srunner_add_suite(runner, make_router_suite());
    srunner_add_suite(runner, make_layout_suite());
    srunner_add_suite(runner, make_experts_suite());
    srunner_add_suite(runner, make_backward_suite());
    srunner_add_suite(runner, make_link_suite());
    srunner_add_suite(runner, make_cluster_suite());
    srunner_add_suite(runner, make_quant_suite());
    srunner_add_suite(runner, make_golden_suite());
    srunner_add_suite(runner, make_eplb_suite());
    srunner_add_suite(runner, make_capacity_suite());
    srunner_add_suite(runner, make_workload_suite());
    srunner_add_suite(runner, make_mask_suite());
    srunner_run_all(runner, CK_NORMAL);
    int failed = srunner_ntests_failed(runner);
    srunner_free(runner);
    return failed == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}
