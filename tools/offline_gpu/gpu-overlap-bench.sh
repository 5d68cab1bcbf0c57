#!/usr/bin/env bash
# On the GPU machine, after tools/offline_gpu/gpu-install.sh: BASTION's adaptive policy without and with SGLang's overlap
# scheduler, beside plain decoding (ar, SGLang's own scheduler setting), on the same held-out MT-Bench prompts, at
# batch 1 and batch 8. One `bastion bench` per (overlap, concurrency): each prints its table and writes
# $OUT/overlap-<off|on>-c<N>/bench.json; the decode tokens/s of adaptive, off vs on, at the same concurrency
# is the measurement (ar is the same Engine in both, a check of the machine's drift).
#   tools/offline_gpu/gpu-overlap-bench.sh                 # all four runs
#   tools/offline_gpu/gpu-overlap-bench.sh off 1           # one overlap setting and concurrency (fits a 10-minute call)
# TARGET / DRAFTER: the model pair (default: the demo pair, `bastion demo setup --print-path` and
# models/smollm2-135m-instruct-dflash); OUT: the results folder (default bench-overlap). A GPU machine lacks the
# demo target's package: after tools/offline_gpu/gpu-pair-bench.sh run on the same machine, the converted target is at
# TARGET=/tmp/bastion-cache/smollm2-135m-instruct.
set -euo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH=${PYTHONPATH:-/tmp/sglang-src} SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK=1
target=${TARGET:-$(bastion demo setup --print-path)}
drafter=${DRAFTER:-models/smollm2-135m-instruct-dflash}
out=${OUT:-bench-overlap}
overlaps=${1:-off on}
concurrencies=${2:-1 8}
for overlap in $overlaps; do
    for concurrency in $concurrencies; do
        bastion bench --model-path "$target" --draft-model-path "$drafter" --prompts mtbench \
            --num-prompts 16 --max-new-tokens 256 --ignore-eos --temperatures 0 \
            --policies ar,adaptive --repeats 2 --concurrency "$concurrency" \
            --bastion-overlap-schedule "$overlap" --out "$out/overlap-$overlap-c$concurrency"
    done
done
