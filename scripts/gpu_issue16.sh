#!/usr/bin/env bash
# Issue 16's remaining GPU checks, one device call each (the results so far and what they settled are in
# docs/BENCHMARKS.md, "Issue 16 on a GPU" and the sessions after it). The default run ("all", ~6.5 min) measures what
# the ninth device session left open: captured growth levels (grow "captured", the GPU default at a fixed budget
# since that session) under the automatic budget, the CLI's default, against "ahead" levels (the automatic budget's
# growth until this is measured), on code and on prose, each grow in its own process with a fixed-budget run beside
# its auto run. "levels" (~6 min) repeats the ninth session's first call: ahead / captured / captured-ahead x 128 /
# 32-row levels on bitsandbytes' int8 kernel, then the fused int8 and NF4 kernels at 32 rows, then the kernels
# alone (specexec.formats.lowbit_mm). "accel" (~4 min) a 70B bf16 target and a 70B NF4 one beside accelerate device_map in
# one run (the issue's "x accelerate, end to end" in one format on one machine). "s7" repeats session 7's first call
# (spread against leading resident layers, bounded overlap on code and prose, the 8B NF4 draft); "int8" session 7's
# int8 kernel runs; "fill" and "profile" earlier sessions' runs. The runs that matter most come first, each under
# its own time limit; "calib" (~2.5 min) calibrated tree scores (TreeConfig.calibrate, built in the tenth session, which had no
# GPU) against the draft's raw log-probs at a fixed budget, code and prose, one process each; every log line goes into $OUT/session.log and each benchmark's JSON into $OUT (written after
# every run, so a cut-off step keeps what it measured). bitsandbytes travels as a wheel in .whl/ (see the device
# README).
#
#   bash scripts/gpu_issue16.sh            # ~6.5 min, on the device machine, from the repo root; OUT defaults to bench_out
#   bash scripts/gpu_issue16.sh calib      # ~2.5 min
#   bash scripts/gpu_issue16.sh levels     # ~6 min
#   bash scripts/gpu_issue16.sh accel      # ~4 min
#   bash scripts/gpu_issue16.sh s7         # ~7 min
#   bash scripts/gpu_issue16.sh int8       # ~5 min ("int8 quick": end to end only; BUDGETS=256,1024 sets the budgets)
#   bash scripts/gpu_issue16.sh fill       # ~3 min
#   bash scripts/gpu_issue16.sh profile    # ~3 min: where the draft phase's time goes (host vs GPU), CUDA tests
set -u
WHAT=${1:-all}
case "$WHAT" in
    all | calib | levels | accel | s7 | int8 | fill | profile) ;;
    *) echo "usage: bash scripts/gpu_issue16.sh [all|calib|levels|accel|s7|int8 [quick]|fill|profile]" >&2; exit 2 ;;
esac
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
    if [ "$WHAT" = int8 ]; then
        if [ "${2:-}" != quick ]; then
            step "CUDA tests: the fused int8 kernel (rows 1-300, in a graph), int8/NF4 self drafts"
            run 60 python3 -m pytest -m cuda -q -p no:cacheprovider tests/test_lowbit_mm.py tests/test_self_draft.py
        fi
        for kern in triton bnb; do
            step "70B NF4 at 24 GB, int8 7B draft on the $kern kernel: code, ${BUDGETS:-1024}"
            run 70 python3 scripts/bench_gpu.py --settings 70b-nf4@24 --draft-dtype int8 --int8-kernel $kern \
                --no-accelerate --no-ar-loaded --no-auto --prompts 2 --new-tokens 64 --ar-tokens 4 \
                --budgets "${BUDGETS:-1024}" --modes "" --out "$OUT/gpu_int8_$kern.json"
        done
        [ "${2:-}" = quick ] && exit 0
        step "the linears alone: 16-bit vs bitsandbytes vs the fused kernels, int8 and NF4 (and alternative tiles)"
        run 100 python3 scripts/bench_lowbit_mm.py --shapes 7b --rows 16,32,64,128,256 \
            --tiles "128,64,128,8,3;64,128,64,4,4" --out "$OUT/lowbit_mm.json"
        step done
        exit 0
    fi
    if [ "$WHAT" = fill ]; then
        step "an 8B-shaped draft (Llama-3 70B / 8B) in int8 at 12 GB (the one cell of item 2's table not measured)"
        run 110 python3 scripts/bench_gpu.py --settings 70b3-nf4@12 --draft-dtype int8 --no-accelerate --no-ar-loaded \
            --no-auto --prompts 1 --new-tokens 48 --ar-tokens 4 --budgets 256 --modes "" --out "$OUT/gpu_70b3_int8_12.json"
        step "32B NF4 at 24 GB (resident, compute-bound): verify at 32 and 96 nodes (what 64 n-gram nodes cost)"
        run 70 python3 scripts/bench_gpu.py --settings 32b-nf4@24 --ngram-nodes 0 --no-accelerate --no-ar-loaded \
            --no-auto --prompts 1 --new-tokens 48 --ar-tokens 4 --budgets 32,96 --modes "" --out "$OUT/gpu_32b_ngram_cost.json"
        step done
        exit 0
    fi
    tests=yes; { [ "$WHAT" = accel ] || [ "$WHAT" = calib ]; } && tests=no  # after "all", which ran them
    [ $tests = no ] || step "CUDA tests (graphs, fused draft norm, bounded overlap thread, streamed layers, NF4, self drafts, noise, n-grams, fit-first load, fused int8/NF4)"
    [ $tests = no ] || run 100 python3 -m pytest -m cuda -q -p no:cacheprovider tests/test_fixed_grow.py tests/test_graphs.py \
        tests/test_offload.py tests/test_sampling.py tests/test_scripts.py tests/test_self_draft.py tests/test_ngram.py \
        tests/test_sizes.py tests/test_lowbit_mm.py tests/test_captured.py
    if [ "$WHAT" = all ]; then
        for dom in code prose; do
            b=1024 n=64; [ $dom = prose ] && b=256 n=48
            for g in captured ahead; do
                step "70B NF4 at 24 GB, int8 7B draft (bitsandbytes), $dom: $g levels at $b and under the automatic budget"
                run 110 python3 scripts/bench_gpu.py --settings 70b-nf4@24 --draft-dtype int8 --int8-kernel bnb \
                    --domain $dom --no-accelerate --no-ar-loaded --prompts 2 --new-tokens $n --ar-tokens 4 \
                    --warmup-tokens 32 --budgets $b --grows $g --modes "" --out "$OUT/gpu_auto_${dom}_$g.json"
            done
        done
        step done
        exit 0
    fi
    if [ "$WHAT" = calib ]; then
        for dom in code prose; do
            b=1024 n=64; [ $dom = prose ] && b=256 n=48
            step "70B NF4 at 24 GB, int8 7B draft (bitsandbytes), $dom $b: raw draft log-probs, then calibrated scores"
            run 110 python3 scripts/bench_gpu.py --settings 70b-nf4@24 --draft-dtype int8 --int8-kernel bnb \
                --domain $dom --no-accelerate --no-ar-loaded --no-auto --prompts 2 --new-tokens $n --ar-tokens 4 \
                --warmup-tokens 32 --budgets $b --calibrate off,on --modes "" --out "$OUT/gpu_calib_${dom}.json"
        done
        step done
        exit 0
    fi
    if [ "$WHAT" = levels ]; then
        step "70B NF4 at 24 GB, int8 7B draft (bitsandbytes), code 1024: ahead / captured / captured-ahead x 128 / 32 rows"
        run 170 python3 scripts/bench_gpu.py --settings 70b-nf4@24 --draft-dtype int8 --int8-kernel bnb \
            --no-accelerate --no-ar-loaded --no-auto --prompts 2 --new-tokens 64 --ar-tokens 4 --warmup-tokens 32 \
            --budgets 1024 --grows auto,captured,captured-ahead --max-beams 128,32 --modes "" \
            --out "$OUT/gpu_int8_bnb_levels.json"
        for fmt in int8 nf4; do
            step "70B NF4 at 24 GB, $fmt 7B draft on the fused kernel, code 1024, 32-row levels: ahead / captured"
            run 100 python3 scripts/bench_gpu.py --settings 70b-nf4@24 --draft-dtype $fmt --$fmt-kernel triton \
                --no-accelerate --no-ar-loaded --no-auto --prompts 2 --new-tokens 64 --ar-tokens 4 \
                --warmup-tokens 32 --budgets 1024 --grows auto,captured --max-beams 32 --modes "" \
                --out "$OUT/gpu_${fmt}_triton_levels.json"
        done
        step "the linears alone: 16-bit vs bitsandbytes vs the fused kernels, int8 and NF4"
        run 45 python3 scripts/bench_lowbit_mm.py --shapes 7b --rows 16,32,128 --out "$OUT/lowbit_mm.json"
        step done
        exit 0
    fi
    if [ "$WHAT" = accel ]; then
        step "70B bf16 and 70B NF4 at 24 GB (int8 7B draft, code, 1024) beside accelerate device_map: x accelerate in one format"
        run 240 python3 scripts/bench_gpu.py --settings 70b-bf16@24,70b-nf4@24 --draft-dtype int8 --no-ar-loaded \
            --no-auto --prompts 1 --new-tokens 48 --ar-tokens 3 --budgets 1024 --modes "" --out "$OUT/gpu_bf16_accelerate.json"
        step done
        exit 0
    fi

    step "resident layers spread among the streamed ones (the plan since session 6) against leading ones: code, 1024 + auto"
    for order in spread leading; do
        flag=""; [ $order = leading ] && flag="--leading-resident"
        run 90 python3 scripts/bench_gpu.py --settings 70b-nf4@24 --draft-dtype int8 --no-accelerate --no-ar-loaded \
            --prompts 2 --new-tokens 64 --ar-tokens 4 --budgets 1024 --modes "" $flag --out "$OUT/gpu_resident_$order.json"
    done

    step "bounded overlapped growth (a few levels ahead, none after the target's pass) with the target prioritised: code, 1024"
    run 150 python3 scripts/bench_gpu.py --settings 70b-nf4@24 --draft-dtype int8 --no-accelerate --no-ar-loaded \
        --prompts 2 --new-tokens 64 --ar-tokens 4 --budgets 1024 --mode-budget 1024 --no-auto \
        --modes "ahead+overlap auto+early stop,auto+overlap auto,ahead+overlap 32+early stop,ahead+overlap 32+early stop+normal priority" \
        --out "$OUT/gpu_overlap_code.json"

    step "the same, prose, 256"
    run 110 python3 scripts/bench_gpu.py --settings 70b-nf4@24 --draft-dtype int8 --domain prose --no-accelerate \
        --no-ar-loaded --prompts 2 --new-tokens 48 --ar-tokens 4 --budgets 256 --mode-budget 256 --no-auto \
        --modes "ahead+overlap auto+early stop,auto+overlap auto" --out "$OUT/gpu_overlap_prose.json"

    step "the 8B-shaped draft in NF4 at 24 GB (the last cell of item 2's table) and accelerate device_map again"
    run 120 python3 scripts/bench_gpu.py --settings 70b3-nf4@24 --draft-dtype nf4 --no-ar-loaded \
        --no-auto --prompts 1 --new-tokens 48 --ar-tokens 4 --budgets 256 --modes "" --out "$OUT/gpu_70b3_nf4_24.json"
    step done
} 2>&1 | tee "$LOG"
