#!/usr/bin/env bash
# The reference-engine bench of the demo pair on a GPU machine with no network: every policy of the CPU
# bench's table (ar, chain, fixed:1..256, adaptive) at T = 0 and 0.7, decode tokens/s, adaptive against the
# best fixed budget. The demo target does not fit one call beside the repository, so it goes in several (two or
# three, as the repository grows past about 18.4 MiB; `pack` prints them):
#   tools/offline_gpu/gpu-pair-bench.sh pack                       # here: .gpu-carry/call-1, call-2, .., sizes printed
#   tools/offline_gpu/gpu-pair-bench.sh stash .gpu-carry/call-1    # there, one call per folder but the last, carrying it
#   tools/offline_gpu/gpu-pair-bench.sh run .gpu-carry/call-2      # there, the last folder, next call on the same machine
#   tools/offline_gpu/gpu-pair-bench.sh prepare .gpu-carry/call-2  # or: only join and convert; prints the target's path
# `run` stashes its folder too, installs the carried wheels and this package into $CARRY_SITE, joins and
# checks the GGUF (offline_gpu.gpu_carry), converts it (`bastion demo setup --gguf`) and runs
# benchmarks/reference_gpu.py into $OUT/pair (default results/pair), its log beside the JSON. Arguments after
# the folder go to reference_gpu.py after the defaults below, so they override them (e.g. --pair-repeats 2).
set -euo pipefail
cd "$(dirname "$0")/../.."
stash=${CARRY_STASH:-/tmp/bastion-carry}
site=${CARRY_SITE:-/tmp/bastion-site}
out=${OUT:-results}/pair
usage="usage: $0 pack [gpu_carry pack flags] | stash CALL_FOLDER | prepare CALL_FOLDER | run CALL_FOLDER [reference_gpu.py flags]"
command=${1:-}
[ -n "$command" ] || { echo "$usage" >&2; exit 2; }
shift
if [ "$command" = pack ]; then
    python=.venv/bin/python
    [ -x "$python" ] || python=python3
    PYTHONPATH=tools exec "$python" -m offline_gpu.gpu_carry pack "$@"
fi
case $command in stash | prepare | run) ;; *) echo "$usage" >&2; exit 2 ;; esac
folder=${1:?$usage}
shift
[ -f "$folder/carry.json" ] || { echo "error: $folder has no carry.json (run '$0 pack' here first)" >&2; exit 2; }
mkdir -p "$stash"
cp -r "$folder"/. "$stash"/
echo "stashed $folder in $stash: $(ls "$stash" | tr '\n' ' ')" >&2
[ "$command" != stash ] || exit 0

pip=(python3 -m pip install --quiet --no-index --no-deps --no-cache-dir --upgrade --target "$site")
"${pip[@]}" --no-compile "$stash"/wheels/*.whl
"${pip[@]}" --no-build-isolation .
export PYTHONPATH=$site PYTHONUNBUFFERED=1
gguf=$(PYTHONPATH=tools:$site python3 -m offline_gpu.gpu_carry join --stash "$stash")
target=$(python3 -m bastion_sglang.cli demo setup --cache-dir /tmp/bastion-cache --gguf "$gguf" --print-path)
if [ "$command" = prepare ]; then
    echo "$target"
    exit 0
fi
mkdir -p "$out"
python3 benchmarks/reference_gpu.py --out "$out" --target "$target" \
    --draft models/smollm2-135m-instruct-dflash --prompts "$stash/prompts.jsonl" --num-prompts 4 \
    --max-new-tokens 48 --temperatures 0,0.7 --pair-repeats 3 --repeats 3 "$@" 2>&1 | tee "$out/log.txt"
