#!/usr/bin/env bash
# Issue 16's remaining GPU checks in one device call (~8 min on an H200; the H200 results so far and what they
# settled are in docs/BENCHMARKS.md, "Issue 16 on a GPU" and its second session; this run re-measures the auto
# budget after its fixes, the n-gram branches now merged into every GPU tree (their cost on random prompts, their
# gain on prompts that repeat), prose, and the 8B-shaped draft at 16 GB): the runs that matter most first, each under its
# own time limit, every log line into $OUT/session.log and each benchmark's JSON into $OUT (written after every run,
# so a cut-off step keeps what it measured). bitsandbytes travels as a wheel in .whl/ (see the device README).
#
#   bash scripts/gpu_issue16.sh            # on the device machine, from the repo root; OUT defaults to bench_out
#   bash scripts/gpu_issue16.sh profile    # ~3 min: where the draft phase's time goes (host vs GPU), CUDA tests
set -u
WHAT=${1:-all}
OUT=${OUT:-bench_out}
mkdir -p "$OUT"
LOG="$OUT/session.log"
export PYTHONUNBUFFERED=1
t0=$(date +%s)
step() { echo; echo "===== [$(($(date +%s) - t0)) s] $*"; }
run() {  # run LIMIT_S CMD...: the command's output into the log, its exit status reported
    local lim=$1; shift
    timeout -k 5 "$lim" "$@"
    echo "----- exit $? ($(($(date +%s) - t0)) s)"
}
{
    step setup
    if ls .whl/*.whl >/dev/null 2>&1; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
            .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
    fi
    nvidia-smi --query-gpu=name,memory.total,driver_version,pcie.link.gen.max,pcie.link.width.max --format=csv
    free -g | head -2
    python3 -c "import torch, bitsandbytes as b; print('torch', torch.__version__, 'bnb', b.__version__, \
torch.cuda.get_device_name())"

    if [ "$WHAT" = profile ]; then
        step "profile: 70B NF4 at 24 GB, bf16 7B draft: the default (ahead + early stop) and dynamic, traced"
        run 120 python3 scripts/bench_gpu.py --settings 70b-nf4@24 --no-accelerate --no-ar-loaded \
            --no-auto --prompts 1 --new-tokens 48 --ar-tokens 4 --budgets 256 --modes dynamic \
            --profile "$OUT/traces" --out "$OUT/prof_bf16.json"
        step "profile: 70B NF4 at 24 GB, NF4 7B draft, traced"
        run 60 python3 scripts/bench_gpu.py --settings 70b-nf4@24 --draft-dtype nf4 --no-accelerate --no-ar-loaded \
            --no-auto --prompts 1 --new-tokens 48 --ar-tokens 4 --budgets 256 --modes "" \
            --profile "$OUT/traces_nf4" --out "$OUT/prof_nf4.json"
        step "CUDA tests"
        run 70 python3 -m pytest -m cuda -q -p no:cacheprovider tests/test_fixed_grow.py tests/test_graphs.py \
            tests/test_offload.py tests/test_sampling.py tests/test_scripts.py tests/test_self_draft.py
        step done
        exit 0
    fi
    step "CUDA tests (graphs, fused draft norm, threaded overlap, streamed layers, NF4, self drafts, noise, n-grams)"
    run 75 python3 -m pytest -m cuda -q -p no:cacheprovider tests/test_fixed_grow.py tests/test_graphs.py \
        tests/test_offload.py tests/test_sampling.py tests/test_scripts.py tests/test_self_draft.py tests/test_ngram.py

    step "70B NF4 at 24 GB, int8 7B draft (what --draft-dtype auto picks there), code, 3 prompts: 256, 1024, auto"
    run 160 python3 scripts/bench_gpu.py --settings 70b-nf4@24 --draft-dtype int8 --no-accelerate --no-ar-loaded \
        --prompts 3 --new-tokens 64 --ar-tokens 4 --budgets 256,1024 --modes "" --out "$OUT/gpu_70b_int8.json"

    step "the same with prompts that hold their own continuation (the default n-gram branches on a GPU), 256"
    run 50 python3 scripts/bench_gpu.py --settings 70b-nf4@24 --draft-dtype int8 --echo --no-accelerate \
        --no-ar-loaded --no-auto --prompts 1 --new-tokens 64 --ar-tokens 4 --budgets 256 --modes "" \
        --out "$OUT/gpu_70b_int8_echo.json"

    step "the same, prose, 2 prompts: 256 and auto"
    run 80 python3 scripts/bench_gpu.py --settings 70b-nf4@24 --draft-dtype int8 --domain prose --no-accelerate \
        --no-ar-loaded --prompts 2 --new-tokens 48 --ar-tokens 4 --budgets 256 --modes "" \
        --out "$OUT/gpu_70b_int8_prose.json"

    step "an 8B-shaped draft (Llama-3 70B / 8B) in int8 and NF4 at 16 GB"
    for d in int8 nf4; do
        run 75 python3 scripts/bench_gpu.py --settings 70b3-nf4@16 --draft-dtype $d --no-accelerate --no-ar-loaded \
            --no-auto --prompts 1 --new-tokens 48 --ar-tokens 4 --budgets 256 --modes "" --out "$OUT/gpu_70b3_$d.json"
    done
    step done
} 2>&1 | tee "$LOG"
