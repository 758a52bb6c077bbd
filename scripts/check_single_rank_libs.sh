#!/usr/bin/env bash
# Checks that single-rank programs (TRAIN_GPT_MPI=OFF, train_gpt_cpu_nompi) load no MPI, no NCCL and
# no shared C++ runtime, so that a machine without them, or with an older libstdc++, runs them: what
# ldd lists for each must hold none of libmpi, libopen-rte, libopen-pal, libnccl or libstdc++
# (libgcc_s may stay: cuBLASLt itself needs it). Prints each program's libraries; exits 1 naming
# every offending library.
# Usage: scripts/check_single_rank_libs.sh PROGRAM...
set -uo pipefail
if [ $# -eq 0 ]; then
  echo "usage: scripts/check_single_rank_libs.sh PROGRAM..." >&2
  exit 2
fi
forbidden='^(libmpi|libopen-rte|libopen-pal|libnccl|libstdc\+\+)'
status=0
for program in "$@"; do
  if [ ! -f "$program" ]; then
    echo "check_single_rank_libs: $program: no such file" >&2
    status=1
    continue
  fi
  if ! listing=$(ldd "$program" 2>&1); then
    echo "check_single_rank_libs: ldd $program failed: $listing" >&2
    status=1
    continue
  fi
  libs=$(printf '%s\n' "$listing" | awk '{print $1}' | sed 's|.*/||' | sort -u)
  bad=$(printf '%s\n' "$libs" | grep -E "$forbidden" | tr '\n' ' ')
  echo "$(basename "$program"): $(printf '%s\n' "$libs" | tr '\n' ' ')"
  if [ -n "$bad" ]; then
    echo "check_single_rank_libs: $program loads ${bad}(a single-rank program must link none of MPI, NCCL or a shared libstdc++)" >&2
    status=1
  fi
done
exit $status
