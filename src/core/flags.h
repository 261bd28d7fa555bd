/* SPDX-License-Identifier: MIT */
/* flags.h — the flag table, private to src/core: config.c parses and
 * validates with it, flags.c holds it and prints --help, the canonical
 * config and a golden manifest's flags from it.
 */
#ifndef MOE_FLAGS_H
#define MOE_FLAGS_H

#include <stddef.h>
#include <stdint.h>

#include "moe/config.h"

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
    bool min_open; /* FLAG_REAL: min itself is refused, the range is (min, max] */
} flag_spec;

extern const flag_spec moe_flags[];
extern const size_t moe_flag_count;
extern const char *const moe_command_names[]; /* by enum moe_command */

/* The flag called name (its first len characters), NULL when none. */
const flag_spec *moe_flag_find(const char *name, size_t len);
/* The value a FLAG_CHOICE stores for name, or -1 when it has no such choice. */
int moe_flag_choice_value(const flag_spec *flag, const char *name);
/* "a|b|c": the names of a FLAG_CHOICE, for help and errors. */
const char *moe_flag_choice_names(const flag_spec *flag, char *buf, size_t size);
/* What --help shows after the flag: its value's name, or its choices. */
const char *moe_flag_value_text(const flag_spec *flag, char *buf, size_t size);
/* A FLAG_INT whose value name ends in "|auto" also takes "auto", stored as -1. */
bool moe_flag_takes_auto(const flag_spec *flag);
/* A FLAG_REAL whose value name ends in "|none" takes "none", stored as 0,
 * or a number above its min (0 is not one: "none" says it). */
bool moe_flag_takes_none(const flag_spec *flag);
/* A FLAG_REAL's range is (min, max]: it takes none, or says min_open. */
bool moe_flag_min_open(const flag_spec *flag);

#endif
