#!/bin/bash
# FlashAttention-4 (sm90) beside solattn on the GPU machine: timings, Nsight Compute, SASS.
# Issue 38 item 1; the findings are in docs/design/fa4-profile.md.
#
# Staging (on the CPU machine, in a folder git ignores, e.g. .fa4/): the wheels CONTRIBUTING.md
# lists, unzipped into one folder (the cuda-bindings *.cpp/*.pyx/*.pxd sources may go), packed
# as `tar c . | xz` and split into parts .fa4/fa4site.part* small enough to carry; a snapshot of
# the package to profile (`git archive HEAD solattn | tar x -C .fa4/src`).
#
# usage: bash tools/profile_fa4.sh STEP...   (run from the repository root; $OUT collects)
#   stash     copy the carried .fa4/fa4site.part* to /root/stash (a first call when the
#             parts need two calls; the second carries the rest)
#   unpack    join /root/stash and .fa4 parts, unpack to /tmp/fa4site
#   bench     python tools/profile_fa4.py bench --variants  -> $OUT/bench.txt
#   ncu       one full Nsight Compute pass (--set full, SourceCounters included,
#             --clock-control none) over the profiled window of `profile_fa4.py profile`
#             -> .ncu-rep and its details/raw/source pages as CSV
#   ncubase   the kernels' durations again with ncu's default clock control (base clocks)
#   sass      cuobjdump -sass / -res-usage of every attention cubin (Triton cache, FA4's dump)
#   pack      xz the text outputs into $OUT/profile_text_$TAG.tar.xz
# env: LIBS (libraries to profile, default both), TAG (output suffix)
# The 2026-11-28 run (docs/design/fa4-profile.md), two calls on one warm machine:
#   bash tools/profile_fa4.sh stash && bash tools/profile_fa4.sh bench
#       LIBS=solattn TAG=ours bash tools/profile_fa4.sh ncu sass pack      (part 1 carried)
#   bash tools/profile_fa4.sh unpack bench && LIBS=fa4 TAG=fa4 bash tools/profile_fa4.sh ncu sass pack
#   TAG=base bash tools/profile_fa4.sh ncubase pack                        (part 2 carried)
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" /root/stash
SITE=/tmp/fa4site
SRC=${SRC:-$PWD/.fa4/src}
export PYTHONPATH=$SRC:$SITE:$SITE/nvidia_cutlass_dsl/dsl_packages
export PYTHONUNBUFFERED=1 SOLATTN_BACKEND=hopper
export TRITON_CACHE_DIR=/root/tcache
export FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1 FLASH_ATTENTION_CUTE_DSL_CACHE_DIR=/root/fa4cache
export CUTE_DSL_KEEP=cubin,ptx CUTE_DSL_DUMP_DIR=/root/cutedump
mkdir -p /root/cutedump /root/fa4cache "$OUT/txt"
T=$OUT/txt
KERNELS='regex:attn|bwd|flash|Flash|fmha|Fmha'
LIBS=${LIBS:-}   # profile_fa4.py libraries to profile (default: both)
TAG=${TAG:-all}  # suffix of the ncu outputs
CUOBJDUMP=$(command -v cuobjdump || python3 -c \
    "import triton, os; print(os.path.dirname(triton.__file__) + '/backends/nvidia/bin/cuobjdump')")
start=$SECONDS
log() { echo "[$((SECONDS - start))s] $*"; }

for step in "$@"; do
  case $step in
    stash)
      cp .fa4/fa4site.part* /root/stash/ && ls -la /root/stash ;;
    unpack)
      if [ ! -d $SITE/flash_attn ]; then
        mkdir -p $SITE
        cp .fa4/fa4site.part* /root/stash/ 2>/dev/null
        cat /root/stash/fa4site.part* | xz -d -T0 | tar x -C $SITE || exit 1
      fi
      python3 -c "import flash_attn.cute, cutlass; print('fa4 imports')" || exit 1
      log unpacked ;;
    bench)
      nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv
      python3 tools/profile_fa4.py bench --variants 2>&1 | tee $T/bench.txt
      log bench done ;;
    ncu)
      ncu --version | tail -1
      ncu --profile-from-start off --clock-control none --set full --import-source no \
          -k "$KERNELS" -f -o /tmp/prof_$TAG python3 tools/profile_fa4.py profile $LIBS \
          > $T/ncu_log_$TAG.txt 2>&1
      tail -5 $T/ncu_log_$TAG.txt
      R=/tmp/prof_$TAG.ncu-rep
      ncu --import $R --page details --csv > $T/details_$TAG.csv 2> $T/details_$TAG.err
      ncu --import $R --page raw --csv --print-units base > $T/raw_$TAG.csv 2> $T/raw_$TAG.err
      ncu --import $R --page source --csv --print-source sass \
          > $T/source_sass_$TAG.csv 2> $T/source_$TAG.err
      ncu --import $R --page raw --csv --metrics \
          gpu__time_duration.sum,launch__registers_per_thread,launch__grid_size,launch__block_size \
          2>&1 | cut -c1-400
      cp $R "$OUT/" 2>/dev/null  # 19-23 MB each
      log ncu done ;;
    ncubase)
      ncu --profile-from-start off -k "$KERNELS" --metrics \
          gpu__time_duration.sum,sm__cycles_elapsed.avg.per_second,sm__cycles_elapsed.max \
          --csv python3 tools/profile_fa4.py profile $LIBS > $T/ncu_base_clock_$TAG.csv 2>&1
      grep -c gpu__time $T/ncu_base_clock_$TAG.csv
      log ncubase done ;;
    sass)
      mkdir -p $T/sass
      for f in $(find $TRITON_CACHE_DIR /root/cutedump /root/fa4cache -name '*.cubin' \
                 2>/dev/null); do
        n=$(basename $(dirname $f))_$(basename $f .cubin)
        $CUOBJDUMP -sass $f > $T/sass/$n.sass 2>&1
        $CUOBJDUMP -res-usage $f > $T/sass/$n.res 2>&1
      done
      ls -la $T/sass | head -40
      log sass done ;;
    pack)
      (cd $OUT && tar cf - txt | xz -6 -T0 > profile_text_$TAG.tar.xz && rm -rf txt)
      ls -la $OUT ;;
  esac
done
