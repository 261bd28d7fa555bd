# SPDX-License-Identifier: MIT
# mpi-env.sh — the environment mpirun needs on a single machine, sourced by
# ./run and by the MPI test runners. Each line is only a default: a value
# already in the environment wins.
#
# Open MPI refuses to start as root without the two ALLOW variables (CI and
# containers run as root). Oversubscribe lets -np exceed the core count
# (4 virtual GPUs on a 2-core laptop). The shared-memory (vader) and self
# transports, with the out-of-band channel on loopback, keep everything on
# this machine. Binding off: bound to one core, a rank with 2 threads halves.
# The ob1 messaging layer is the one Open MPI picks on a machine without
# Omni-Path or InfiniPath; named, it skips probing their libraries at every
# start, which took 0.2 s a process (a one-process run: 0.26 s, 0.06 named).
export OMPI_ALLOW_RUN_AS_ROOT="${OMPI_ALLOW_RUN_AS_ROOT-1}"
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="${OMPI_ALLOW_RUN_AS_ROOT_CONFIRM-1}"
export OMPI_MCA_rmaps_base_oversubscribe="${OMPI_MCA_rmaps_base_oversubscribe-1}"
export OMPI_MCA_btl="${OMPI_MCA_btl-self,vader}"
export OMPI_MCA_pml="${OMPI_MCA_pml-ob1}"
export OMPI_MCA_oob_tcp_if_include="${OMPI_MCA_oob_tcp_if_include-lo}"
export OMPI_MCA_hwloc_base_binding_policy="${OMPI_MCA_hwloc_base_binding_policy-none}"
# hwloc's discovery of I/O devices (PCI, OpenCL, GL) finds nothing a run on
# one machine uses; left out, an np = 4 run of the tiny preset starts
# 0.54 -> 0.46 s. Its plugins for them (Debian's libhwloc-plugins, with
# the libxml2, ICU and X11 they link) were still loaded into every
# process, 34 of a rank's 99 shared libraries; not loaded, the same run
# takes 0.63 -> 0.55 CPU-s (medians of five) and 1,000 page faults fewer.
export HWLOC_COMPONENTS="${HWLOC_COMPONENTS--linuxio,-pci,-opencl,-gl,-xml_libxml}"
export HWLOC_PLUGINS_BLACKLIST="${HWLOC_PLUGINS_BLACKLIST-hwloc_gl,hwloc_opencl,hwloc_pci,hwloc_xml_libxml}"
