/* SPDX-License-Identifier: MIT */
/* suites.h — one Check suite per core module, chained by check_main.c. */
#ifndef MOE_TEST_SUITES_H
#define MOE_TEST_SUITES_H

#include <check.h>

Suite *make_rng_suite(void);
Suite *make_config_suite(void);
Suite *make_router_suite(void);
Suite *make_layout_suite(void);
Suite *make_experts_suite(void);
Suite *make_backward_suite(void);
Suite *make_link_suite(void);
Suite *make_cluster_suite(void);
Suite *make_quant_suite(void);
Suite *make_golden_suite(void);
Suite *make_eplb_suite(void);
Suite *make_capacity_suite(void);
Suite *make_workload_suite(void);
Suite *make_mask_suite(void);

#endif
