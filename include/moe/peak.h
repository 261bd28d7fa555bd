/* SPDX-License-Identifier: MIT */
/* peak.h — the physical limit of the cores: fp32 fused multiply-adds per
 * second at each vector width the CPU has, and what the CPU and OpenBLAS
 * call themselves. Pure: no MPI (bench runs it on every rank). */
#ifndef MOE_PEAK_H
#define MOE_PEAK_H

#include <stdbool.h>
#include <stddef.h>

/* The vector widths measured, in bits: 128 (SSE registers with FMA), 256
 * (AVX2 with FMA), 512 (AVX-512F). */
enum { MOE_FMA_WIDTHS = 3 };
extern const int moe_fma_bits[MOE_FMA_WIDTHS];

/* Whether this CPU (and this build) runs fp32 FMAs at `bits`. */
bool moe_fma_supported(int bits);

/* The widest of moe_fma_bits this CPU runs; 0 where none (no x86 FMA). */
int moe_fma_widest_bits(void);

/* fp32 FLOP/s (an FMA counts two) of one thread running independent FMA
 * chains at `bits`, enough of them to cover the FMA units' latency (12
 * registers of accumulators at 128 and 256 bits, 16 at 512): the median of
 * batches of about a millisecond, for about `seconds` in all, the clock the
 * core holds. (Not their best: a core whose clock rises for a tenth of a
 * second now and then, as a shared host's can, would put the peak at a
 * clock the work seldom runs at, and a kernel timed inside such a stretch
 * above it.) 0 when the width is not supported. */
double moe_fma_rate(int bits, double seconds);

/* moe_fma_rate at every width at once, in rate[w] for moe_fma_bits[w]: the
 * widths' batches in turn over the same `seconds`, so that a change of
 * clock falls on all of them alike and the fastest width is the fastest,
 * not the one measured at the higher clock (on a Zen 1 guest, whose 128-
 * and 256-bit rates are one, 128 bits once read 95 GFLOP/s on two cores
 * against 77 at 256, measured a tenth of a second apart). */
void moe_fma_rates(double seconds, double rate[MOE_FMA_WIDTHS]);

/* Bytes per second this process reads from memory: the best of `passes`
 * passes, each summing a block of `bytes` (several times the last-level
 * cache) on every OpenMP thread at once, each its share, in four vectors
 * of 16 sums held in registers so the loads, not the adds, set the pace. */
double moe_read_bandwidth(size_t bytes, int passes);

/* Seconds on the monotonic clock: the peak's and bench's timer where no
 * MPI runs (moe-ep sgemm-anchor; MPICH refuses MPI_Wtime before MPI_Init). */
double moe_monotonic_seconds(void);

/* The CPU's model name with its family and model numbers (/proc/cpuinfo;
 * "unknown CPU" elsewhere). */
void moe_cpu_model(char *name, size_t size);

/* The last-level cache's bytes per CPU that shares it: the size of the
 * highest-level unified cache of the first CPU over the CPUs its sysfs
 * entry lists (Linux); 0 where sysfs does not say. (glibc's
 * _SC_LEVEL3_CACHE_SIZE can be the whole chip's: 64 MiB on a Zen 1 EPYC
 * guest whose sysfs gives its two CPUs 8 MiB.) */
size_t moe_llc_share_bytes(void);

/* A core's L2 cache in bytes (sysconf's _SC_LEVEL2_CACHE_SIZE, which glibc
 * reads from the CPU); 0 where the system does not say. */
size_t moe_l2_bytes(void);

/* The kernel family OpenBLAS chose at load time (openblas_get_corename). */
const char *moe_blas_corename(void);

#endif
