#!/usr/bin/env bash
# Issue 54's lent GPU call (device tool), run from the repository root there with carry ['.gpu/scale'] (packed by
# scripts/pack_scale.py), in one command of at most 10 minutes: check the pack, install its wheels, unpack the
# CUDA llama-cpp-python that scripts/cuda_wheel.py built off the device where the pack holds it and it loads there,
# else build one for the card (in the background, time-boxed) while the synthetic models are made, then run
# scripts/bench_scale.py on Llama-3.1-8B's shape in Q4_K_M, then in F16, then in Q4_0, at the
# vllm-8b profile (the goals'), within the budget (its --budget: no prompt starts that would end past it), and last
# the first shape's target under exactness-probe variants (scripts/exact_variants.py); results.md / results.json are
# rewritten after every prompt, so a cut run keeps what finished; the first shape's profile (bench_scale --profile)
# follows its prompts. Everything lands in $OUT, at most 6 files (a call brings 8 back): results.md, results.json,
# profile-SHAPE-TYPE.txt, exact-variants.md, scale.log (this script's log, the models' lines in it) and build.log
# (its tail, where it built).
#   usage: bash scripts/gpu_scale.sh [--dry-run] [--budget SECONDS] [--shapes SHAPE:TYPE,...]
# --dry-run: the same steps on this machine's CPU without the pack or a build (the installed llama-cpp-python and
# gguf), the tiny shape (tests/test_scale.py runs it); $PYTHON names the interpreter (default python3), $SCALE_PACK
# the folder holding smollm2-vocab.gguf (default .gpu/scale), $SCALE_SITE the build's folder (default /tmp/site).
# A call that follows on a machine still warm reuses the build a call before it finished there (its folder holds
# .built-ok): the first lent call of 2026-11-27 lost 250 s of its second try to building again.
set -uo pipefail
dry=0
budget=570  # seconds: the call's 600 less the time to copy the logs
shapes=""
usage="usage: bash scripts/gpu_scale.sh [--dry-run] [--budget SECONDS] [--shapes SHAPE:TYPE,...]"
while [ $# -gt 0 ]; do
    case "$1" in
        --dry-run) dry=1 ;;
        --budget) budget=${2:?--budget SECONDS}; shift ;;
        --shapes) shapes=${2:?--shapes SHAPE:TYPE,...}; shift ;;
        *) echo "error: unknown argument $1 ($usage)" >&2
           exit 2 ;;
    esac
    shift
done
start=$(date +%s)
# the synthetic head's matrices: every run drafts with the first (convert's default), Parts times the head in each
head_types=q8_0,f16,q4_0
left() { echo $(( budget - ($(date +%s) - start) )); }
out=${OUT:-/tmp/out}
pack=${SCALE_PACK:-.gpu/scale}
py=${PYTHON:-python3}
site=${SCALE_SITE:-/tmp/site}
work=$(mktemp -d /tmp/scale-work.XXXXXX)
mkdir -p "$out"
log="$out/scale.log"
say() { echo "[$(( $(date +%s) - start )) s] $*" | tee -a "$log"; }
finish() {  # the build log's tail into $OUT, whatever happened (make.log's lines are in scale.log)
    [ -f "$work/build.log" ] && tail -c 200000 "$work/build.log" > "$out/build.log"
    rm -rf "$work"
}
trap finish EXIT
: > "$log"

if [ ! -f "$pack/smollm2-vocab.gguf" ]; then
    echo "error: $pack lacks smollm2-vocab.gguf: run python scripts/pack_scale.py first (or set SCALE_PACK)" >&2
    exit 2
fi
make_path=${PYTHONPATH:-}
if [ "$dry" = 1 ]; then
    shapes=${shapes:-tiny:q4_k_m,tiny:q4_0}
    bench=(--tiny --shapes "$shapes" --profiles vllm-8b,shipped --head-types "$head_types")
    jobs=2
    say "dry run: the CPU, the installed llama-cpp-python ($("$py" -c 'import llama_cpp; print(llama_cpp.__version__)'))"
else
    shapes=${shapes:-llama-8b:q4_k_m,llama-8b:f16,llama-8b:q4_0}
    bench=(-ngl all --shapes "$shapes" --profiles vllm-8b --prompts 5 -n 128 --head-types "$head_types")
    jobs=6  # beside a 16-way build: the models are mostly memory traffic
    say "$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1)"
    (cd "$pack" && sha256sum -c --quiet SHA256SUMS) || { say "error: the pack's sha256 differ"; exit 2; }
    # what the image lacks (pack_scale.WHEELS): gguf, and llama-cpp-python's diskcache
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/deps-site \
        "$pack"/*.whl \
        || { say "error: installing the pack's wheels failed"; exit 2; }
    make_path=/tmp/deps-site  # not $site: the build fills it meanwhile
    export PYTHONPATH=$site:/tmp/deps-site
    # the CUDA 13 libraries the prebuilt build links (cudart, cuBLAS), where the loader does not find them already:
    # the image's toolkit first (what a build here links), else its PyTorch's
    if ! ldconfig -p 2>/dev/null | grep -q "libcublas\.so\.13 "; then
        torch_libs=$("$py" -c 'import nvidia, os; print(os.path.join(list(nvidia.__path__)[0], "cu13", "lib"))' \
                     2>/dev/null)
        for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib /usr/local/cuda-13*/lib64 \
                 "$torch_libs"; do
            if [ -n "$d" ] && [ -e "$d/libcublas.so.13" ]; then
                export LD_LIBRARY_PATH=$d${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
                say "CUDA libraries from $d"
                break
            fi
        done
    fi
    probe='import llama_cpp; print(llama_cpp.__version__, "gpu offload", llama_cpp.llama_supports_gpu_offload())'
    build_pid=""
    prebuilt=$pack/cuda/llama_cpp_python-cuda.tar.xz  # cuda_wheel.TREE
    if [ -f "$site/.built-ok" ]; then
        say "reusing the build in $site (a call before this one made it)"
    elif [ -f "$prebuilt" ]; then  # scripts/cuda_wheel.py's, built off the device: seconds instead of minutes
        rm -rf "$site" && mkdir -p "$site"
        if tar -xJf "$prebuilt" -C "$site" && built=$("$py" -c "$probe" 2>&1) && [[ $built == *"gpu offload True"* ]]
        then
            say "unpacked the prebuilt CUDA build ($(cat "$pack/cuda/BUILT")): $built"
            touch "$site/.built-ok"
        else
            say "the prebuilt CUDA build does not serve here ($(echo "${built:-not unpacked}" | tail -1)): building"
        fi
    fi
    if [ ! -f "$site/.built-ok" ]; then
        [ -f "$pack/llama_cpp_python-trimmed.tar.gz" ] || { say "error: no sdist in the pack to build from"; exit 2; }
        rm -rf "$site" /tmp/llama-src && mkdir -p /tmp/llama-src
        tar -xzf "$pack/llama_cpp_python-trimmed.tar.gz" -C /tmp/llama-src --strip-components 1 \
            || { say "error: unpacking the sdist failed"; exit 2; }
        say "building llama-cpp-python with CUDA (sm_90) in the background"
        ( CMAKE_ARGS="-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=90 -DLLAVA_BUILD=OFF -DCMAKE_PROJECT_INCLUDE=$PWD/scripts/amx_guard.cmake" \
          CMAKE_BUILD_PARALLEL_LEVEL=16 timeout 360 "$py" -m pip install -v --no-deps --no-build-isolation --no-cache-dir \
          --target "$site" /tmp/llama-src > "$work/build.log" 2>&1 ) &
        build_pid=$!
    fi
fi

# the synthetic models, all shapes, while the build runs (they need gguf and numpy only)
say "making $shapes"
make_models() {
    local item shape qtype
    for item in ${shapes//,/ }; do
        shape=${item%%:*}; qtype=${item##*:}
        PYTHONPATH=$make_path PYTHONUNBUFFERED=1 "$py" scripts/synthetic.py --shape "$shape" --type "$qtype" --out "$work/models" \
            --tokenizer "$pack/smollm2-vocab.gguf" --jobs "$jobs" --head-types "$head_types" || return 1
    done
}
make_models > "$work/make.log" 2>&1 &
make_pid=$!
if ! wait "$make_pid"; then say "error: making the models failed (make.log)"; exit 1; fi
say "$(tr '\n' ' ' < "$work/make.log")"
if [ "$dry" = 0 ]; then
    if [ -n "$build_pid" ]; then
        wait "$build_pid" || { say "error: the build failed or ran out of time (build.log)"; exit 1; }
        built=$("$py" -c "$probe" 2>&1) || { say "error: the build does not import: $built"; exit 1; }
        say "built: $built"
        touch "$site/.built-ok"
    fi
fi

# shapes in order; results written after every prompt, the run ended by the budget
first=${shapes%%,*}
reserve=75  # seconds kept for the exactness probe's variants on the first shape, below
if [ "$(left)" -lt $(( 60 + reserve )) ]; then reserve=0; fi
if [ "$(left)" -lt 60 ]; then say "error: $(left) s left, too little for a shape"; exit 1; fi
say "bench_scale with $(left) s left, $reserve s of them kept for the exactness variants on $first"
# its own --budget ends it; the timeout (SIGINT: it writes what finished) is for a prompt far slower than the others
PYTHONUNBUFFERED=1 timeout --signal=INT --kill-after=10 "$(( $(left) - reserve - 15 ))" "$py" scripts/bench_scale.py \
    "${bench[@]}" --profile --work "$work/models" --out "$out" --jobs "$jobs" \
    --budget "$(( $(left) - reserve - 30 ))" 2>&1 | tee -a "$log"
rc=${PIPESTATUS[0]}
say "bench_scale exited $rc; $(ls "$out" | tr '\n' ' ')"
# The first shape's target under set-up variants (cache types, n_ubatch, fusion off, flash attention off), each one
# exactness probe naming where its first inexact width parts: which set-up, if any, makes CUDA's verify rows exact
# (bench/scale-gpu/graphs-off answered what the ninth session's call asked of a rerun with CUDA graphs off).
if [ "$reserve" -gt 0 ] && [ "$(left)" -ge 30 ]; then
    say "exactness variants of $first, $(left) s left"
    ngl=all threads=8; [ "$dry" = 1 ] && ngl=0 threads=2
    PYTHONUNBUFFERED=1 timeout --signal=INT --kill-after=10 "$(( $(left) - 10 ))" "$py" scripts/exact_variants.py \
        --target "$work/models/synthetic-${first%%:*}-${first##*:}.gguf" -ngl "$ngl" -t "$threads" \
        --out "$out/exact-variants.md" 2>&1 | tee -a "$log"
    say "exact_variants exited ${PIPESTATUS[0]}"
fi
exit "$rc"
