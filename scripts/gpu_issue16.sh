#!/usr/bin/env bash
# Issue 16's GPU checks in one device call (~9 min on an H100/H200): the runs that matter most first, each under its
# own time limit, every log line into $OUT/session.log and each benchmark's JSON into $OUT (written after every run,
# so a cut-off step keeps what it measured). bitsandbytes travels as a wheel in .whl/ (see the device README).
#
#   bash scripts/gpu_issue16.sh            # on the device machine, from the repo root; OUT defaults to bench_out
set -u
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

    step "70B NF4 at 24 GB, code agreement: honest AR, dynamic, ahead, overlap auto (+early stop), reuse, auto"
    run 235 python3 scripts/bench_gpu.py --settings 70b-nf4@24 --no-accelerate --no-ar-loaded --prompts 2 \
        --new-tokens 48 --ar-tokens 8 --budgets 256 \
        --modes "ahead,ahead+overlap auto,ahead+overlap auto+early stop,dynamic+reuse" \
        --out "$OUT/gpu_70b_nf4.json"

    step "CUDA tests (graphs, overlap on a side stream, streamed layers, NF4, self drafts)"
    run 75 python3 -m pytest -m cuda -q -p no:cacheprovider tests/test_fixed_grow.py tests/test_graphs.py \
        tests/test_offload.py tests/test_sampling.py tests/test_scripts.py tests/test_self_draft.py

    step "32B NF4 at 24 GB and 8B bf16 at 8 GB: honest AR, dynamic 256, overlap auto + early stop, auto"
    run 105 python3 scripts/bench_gpu.py --settings 32b-nf4@24,8b-bf16@8 --no-accelerate --no-ar-loaded \
        --prompts 1 --new-tokens 48 --ar-tokens 8 --budgets 256 --budgets-other 256 --modes-other \
        --modes "ahead+overlap auto+early stop" --out "$OUT/gpu_32b_8b.json"

    step "70B NF4 at 24 GB, prose agreement: dynamic 256 against overlap auto + early stop"
    run 80 python3 scripts/bench_gpu.py --settings 70b-nf4@24 --domain prose --no-accelerate --no-ar-loaded \
        --no-auto --prompts 1 --new-tokens 48 --ar-tokens 8 --budgets 256 \
        --modes "ahead+overlap auto+early stop" --out "$OUT/gpu_70b_nf4_prose.json"

    step "draft pass per weight format (7B-shaped; a 20-layer q3 partial 70B self draft)"
    run 55 python3 scripts/bench_draft_pass.py --drafts 7b-bf16,7b-int8,7b-nf4,7b-q4,7b-q3,7b-q2,70b20-q3 \
        --rows 1,64 --repeats 5 --out "$OUT/draft_pass.json"
    step done
} 2>&1 | tee "$LOG"
