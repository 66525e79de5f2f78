#!/usr/bin/env bash
# Head v2's training call on a lent GPU machine (device tool), run from the repository root there, after the calls
# that copied the target's first two parts to /tmp/parts (scripts/pack_gpu.py packs them and prints every call).
# It joins and checks the target, installs the gguf wheel and this package, trains for MINUTES (exit 75: work is
# left, rerun it while the machine is warm) and copies the head, the answers and the log to $OUT.
#   usage: bash scripts/gpu_train_v2.sh MINUTES [more scripts/train_smollm2.py --v2 --online options, e.g. --self]
set -uo pipefail
minutes=${1:?usage: bash scripts/gpu_train_v2.sh MINUTES [train_smollm2.py options]}
shift
out=${OUT:-/tmp/out}
run=runs/smollm2-v2
mkdir -p "$out" /tmp/parts
cp .gpu/m3/smol.part2 /tmp/parts/ || exit 2
if [ ! -f /tmp/parts/smol.part0 ] || [ ! -f /tmp/parts/smol.part1 ]; then
    echo "error: /tmp/parts lacks smol.part0 or smol.part1: run the carry calls scripts/pack_gpu.py printed first" >&2
    exit 2
fi
name=$(awk '{print $2}' .gpu/m3/target.sha256)  # the target's own file name (the head is named after it)
mkdir -p /tmp/target
cat /tmp/parts/smol.part0 /tmp/parts/smol.part1 /tmp/parts/smol.part2 > "/tmp/target/$name"
(cd /tmp/target && sha256sum -c --quiet "$OLDPWD/.gpu/m3/target.sha256") ||
    { echo "error: the joined target differs" >&2; exit 2; }
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --upgrade --target /tmp/site \
    .gpu/m3/*.whl . || exit 2
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null | tee "$out/train.log"
PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 python3 scripts/train_smollm2.py --v2 --online --target "/tmp/target/$name" \
    --budget-minutes "$minutes" "$@" 2>&1 | tee -a "$out/train.log"
rc=${PIPESTATUS[0]}
for f in "$run"/*.gguf "$run"/v2_summary*.json "$run"/self*.npz "$run"/vocab*.npz "$run"/train*/answers.json; do
    [ -f "$f" ] && cp "$f" "$out/"
done
exit "$rc"
