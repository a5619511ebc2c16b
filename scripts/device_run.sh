#!/usr/bin/env bash
# One device call: build the CUDA module, run the GPU tests, run the benchmarks. Logs go to
# $OUT (or ./device-out). Each stage has its own time limit so the whole fits one call.
#   bash scripts/device_run.sh [stages...]   stages: build ops ops-off gen cache attn generate profile san pytests
#     prefill-profile failsafe vmm-probe vmm-san soak serving prefill-bench serve serve-prefix serve-http issue20
#     issue20-gen engine-step branch-prebuild branch (BRANCH_TESTS, BRANCH_CMD) vmm-san-each
#     batch-invariant batch-invariant-trained batch-invariant-cost
# SERVE_ARGS passes options to bench/serve.py (e.g. "--profile 30").
# GEN_MODELS, GEN_BATCH, GEN_TOKENS, GEN_IMPLS, GEN_TIMEOUT set bench/generate.py's run.
# ATTN_ARGS passes options to bench/attention.py (e.g. "--decode-kernel auto,simt"), ATTN_TIMEOUT
# its time limit in seconds (200); PROF_ARGS / PROF_TIMEOUT the same for bench/step_profile.py;
# The device's copy of .git can be stale: pass JAX_KV_COMMIT=$(git rev-parse --short HEAD) from
# the checkout so the benchmarks' JSON names the tree that ran.
set -uo pipefail
OUT=${OUT:-device-out}
mkdir -p "$OUT"
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
# Wheels the device image lacks (gguf, for the model tests' helpers), carried in .whl/.
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
STAGES=${*:-build ops gen cache attn generate}
branch_build() {
  mkdir -p /tmp/branch && tar xzf branch.tgz -C /tmp/branch
  (cd /tmp/branch && JAX_KV_CUDA=ON python3 -m pip install -q --no-build-isolation --no-deps \
    --target /tmp/branch_site . > "$OUT/build_branch.log" 2>&1) || tail -20 "$OUT/build_branch.log"
}
# Issue 20's two trees (0cf8012, carried as before.tgz: `git archive 0cf8012 | gzip >
# before.tgz`, untracked; and this one), each built into its own --target directory once per
# call; the editable install would shadow either, so it is removed.
issue20_build() {
  [ -n "${ISSUE20_BUILT:-}" ] && return
  python3 -m pip uninstall -y -q jax_kv >/dev/null 2>&1
  mkdir -p /tmp/before /tmp/after && tar xzf before.tgz -C /tmp/before && tar --exclude=./.git --exclude=./build --exclude=./before.tgz --exclude=./.whl -cf - . | tar x -C /tmp/after
  for t in before after; do (cd /tmp/$t && JAX_KV_CUDA=ON python3 -m pip install -q --no-build-isolation \
    --no-deps --target /tmp/${t}_site . > "$OUT/build_$t.log" 2>&1 || echo "issue20: the $t tree failed to build") & done; wait
  ISSUE20_BUILT=1
}
T0=$(date +%s)
stage() { echo "=== $1 (t=$(( $(date +%s) - T0 ))s)"; }
for s in $STAGES; do
  case $s in
    build)
      stage build
      (time JAX_KV_CUDA=ON python3 -m pip install -q --no-build-isolation --no-deps -e .) \
        > "$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
      tail -3 "$OUT/build.log"
      nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader ;;
    ops)
      stage "ops (command buffers forced on)"
      XLA_FLAGS=--xla_gpu_graph_min_graph_size=1 timeout -k 10 240 python3 -m pytest -m gpu \
        tests/ops -q -p no:cacheprovider -p no:benchmark -n 4 2>&1 | tee "$OUT/ops_graphs_on.log" | tail -4 ;;
    ops-off)
      stage "ops (command buffers off)"
      XLA_FLAGS=--xla_gpu_enable_command_buffer= timeout -k 10 240 python3 -m pytest -m gpu \
        tests/ops -q -p no:cacheprovider -p no:benchmark -n 4 2>&1 | tee "$OUT/ops_graphs_off.log" | tail -4 ;;
    gen)
      stage "generator"
      timeout -k 10 ${GEN_TEST_TIMEOUT:-200} python3 -m pytest -m gpu tests/decode -q -p no:cacheprovider -p no:benchmark -s 2>&1 \
        | tee "$OUT/generator.log" | tail -15 ;;
    cache)
      stage "cache + memory"
      timeout -k 10 ${CACHE_TIMEOUT:-150} python3 -m pytest -m gpu tests/cache tests/memory -q -p no:cacheprovider -p no:benchmark 2>&1 \
        | tee "$OUT/cache.log" | tail -3 ;;
    attn)
      stage "bench/attention.py"
      timeout -k 10 ${ATTN_TIMEOUT:-200} python3 bench/attention.py --out "$OUT" ${ATTN_ARGS:-} 2>&1 \
        | grep -v -i -E "constant.fold|isn't necessarily|file a bug|^$|operation took" \
        | tee "$OUT/attention.log" | tail -40 ;;
    generate)
      stage "bench/generate.py"
      timeout -k 10 ${GEN_TIMEOUT:-150} python3 bench/generate.py --out "$OUT" \
        --models ${GEN_MODELS:-smollm2-135m,qwen2.5-0.5b} --batch ${GEN_BATCH:-1,32} \
        --new-tokens ${GEN_TOKENS:-256} ${GEN_IMPLS:+--impls $GEN_IMPLS} 2>&1 | grep -v -E "^\s*$|WARNING" \
        | tee "$OUT/generate.log" | tail -30 ;;
    profile)
      stage "bench/step_profile.py"
      timeout -k 10 ${PROF_TIMEOUT:-330} python3 bench/step_profile.py --out "$OUT/profile" ${PROF_ARGS:-} 2>&1 \
        | tee "$OUT/profile.log" | tail -12 ;;
    san)
      stage "compute-sanitizer memcheck"
      timeout -k 10 120 compute-sanitizer --tool memcheck --print-limit 20 python3 -m pytest -m gpu \
        tests/ops/test_gpu_ops.py -q -p no:cacheprovider -p no:benchmark -k "(decode_head_dims and bfloat16 and SEQ) or (prefill_head_dims and bfloat16 and HEAD) or prefill_many_query_blocks or status_out_of_range or decode_many_splits" \
        2>&1 | tee "$OUT/sanitizer.log" | tail -8 ;;
    failsafe)
      stage "fail-safe tests on the GPU backend (unfiltered: the CPU-written cases run on CUDA + VMM)"
      timeout -k 10 ${FS_TIMEOUT:-200} python3 -m pytest tests/decode/test_generator_failsafe.py \
        tests/ops/test_committed_bound.py tests/memory/test_zero_granule.py -q -p no:cacheprovider \
        -p no:benchmark -rs 2>&1 | tee "$OUT/failsafe.log" | tail -12 ;;
    vmm-probe)
      # bench/experiments/sanitizer_multimap.py (no build needed): the arena's VMM patterns with
      # cuda-python and CuPy only, natively, then under compute-sanitizer with each option set;
      # the last step a run printed names the pattern the tool did not survive.
      stage "VMM patterns under compute-sanitizer, without jax_kv"
      P=bench/experiments/sanitizer_multimap.py
      timeout -k 5 60 python3 $P > "$OUT/vmm_probe_native.log" 2>&1; echo "native: exit $?, last: $(tail -1 "$OUT/vmm_probe_native.log")"
      for opts in "" "--check-api-memory-access no" "--force-blocking-launches"; do
        log="$OUT/vmm_probe_san_$(echo "${opts:-default}" | tr -c 'a-z' _).log"
        timeout -k 5 ${VPROBE_TIMEOUT:-90} compute-sanitizer --tool memcheck --report-api-errors no $opts python3 $P > "$log" 2>&1
        echo "sanitizer [${opts:-default}]: exit $?, last: $(grep -v '^=========' "$log" | tail -1)"
      done ;;
    vmm-san)
      # --report-api-errors no: cuda-python probes driver symbols through cuGetProcAddress and
      # the misses are reported as API errors (20 per process), not memory errors.
      # VSAN_XLA_FLAGS (default: XLA's autotuning and command buffers off) spares the tool
      # hundreds of candidate GEMMs and graph capture. VSAN_FILTER (e.g. "--kernel-name
      # kns=Gqa") checks only matching kernels. VSAN_OPTS: more options. compute-sanitizer
      # 2025.3.1 segfaulted in its own process a few seconds into every engine test on the H100
      # (2026-12-06, fifth session); with "--check-api-memory-access no" and the Gqa filter the
      # 2-slot prefix test ran clean in 7.7 s, the 4-slot one still crashed it;
      # "--force-blocking-launches" is the next try. Output goes to a file, not a pipe (at the
      # limit the Python the tool launched outlived it and held tee's pipe); leftovers are
      # killed after it. VSAN_STACKS=S: the tests' Python prints its threads' stacks every S s.
      stage "compute-sanitizer memcheck: VMM (zero granule), committed bound"
      pp=${PYTHONPATH:-}
      if [ -n "${VSAN_STACKS:-}" ]; then
        mkdir -p /tmp/stacks && printf 'import faulthandler, sys\nfaulthandler.dump_traceback_later(%s, repeat=True, file=sys.stderr)\n' \
          "$VSAN_STACKS" > /tmp/stacks/sitecustomize.py && pp=/tmp/stacks${pp:+:$pp}
      fi
      PYTHONPATH=$pp XLA_FLAGS=${VSAN_XLA_FLAGS:---xla_gpu_autotune_level=0 --xla_gpu_enable_command_buffer=} timeout -k 10 ${VSAN_TIMEOUT:-150} compute-sanitizer --tool memcheck ${VSAN_FILTER:-} ${VSAN_OPTS:-} --report-api-errors no --print-limit 20 \
        python3 -m pytest -m gpu ${VSAN_TESTS:-tests/memory/test_zero_granule.py tests/ops/test_committed_bound.py} \
        -q -p no:cacheprovider -p no:benchmark --tb=short -rf -k "not cost" --durations=0 > "$OUT/vmm_sanitizer.log" 2>&1
      echo "vmm-san: exit $?"; pkill -9 -f "pytest -m gpu" 2>/dev/null; tail -30 "$OUT/vmm_sanitizer.log" ;;
    vmm-san-each)
      # One compute-sanitizer process per GPU test (VSAN_TESTS, default the prefix and shared-
      # granule tests), XLA's autotuning and command buffers off: on the H100 (tree a3f8f46)
      # the tool segfaulted after the first test whenever pytest ran several in one process,
      # and ran each alone to the end (0 errors). VSAN_EACH_TIMEOUT bounds the whole stage.
      stage "compute-sanitizer memcheck, one process per test"
      mkdir -p "$OUT/vsan"
      python3 -m pytest -m gpu -q -p no:cacheprovider --collect-only ${VSAN_TESTS:-tests/memory/test_shared_granules.py \
        tests/engine/test_engine_gpu.py} -k "${VSAN_K:-prefix or share}" 2>/dev/null | grep "::" > "$OUT/vsan/ids.txt"
      end=$(( $(date +%s) + ${VSAN_EACH_TIMEOUT:-300} ))
      for t in $(cat "$OUT/vsan/ids.txt"); do
        left=$(( end - $(date +%s) )); n=${t##*::}
        if [ $left -lt 20 ]; then echo "not run (stage limit): $t"; continue; fi
        XLA_FLAGS="--xla_gpu_autotune_level=0 --xla_gpu_enable_command_buffer=" timeout -k 5 $(( left < 150 ? left : 150 )) \
          compute-sanitizer --tool memcheck --report-api-errors no --print-limit 30 python3 -m pytest -m gpu -q \
          -p no:cacheprovider -p no:benchmark "$t" > "$OUT/vsan/$n.log" 2>&1
        echo "exit $? $t: $(grep -E ' passed| failed|ERROR SUMMARY' "$OUT/vsan/$n.log" | tr '\n' ' ')"
      done ;;
    soak)
      stage "bench/soak.py"
      timeout -k 10 ${SOAK_TIMEOUT:-200} python3 bench/soak.py --steps ${SOAK_STEPS:-20000} --out "$OUT" 2>&1 \
        | tee "$OUT/soak.log" | tail -14 ;;
    pytests)
      # PYTESTS names the tests (GPU-marked ones only), PYTEST_TIMEOUT the limit: one test's
      # traceback, without the whole stage it failed in.
      stage "pytest -m gpu $PYTESTS"
      timeout -k 10 ${PYTEST_TIMEOUT:-120} python3 -m pytest -m gpu $PYTESTS -q -p no:cacheprovider \
        -p no:benchmark -s -rs --tb=long 2>&1 | tee "$OUT/pytests.log" | tail -60 ;;
    serving)
      stage "GPU tests of the serving stack (slot cache, shared granules, packed prefill, engine)"
      timeout -k 10 ${SERVING_TIMEOUT:-330} python3 -m pytest -m gpu tests/cache/test_slots.py \
        tests/memory/test_shared_granules.py tests/memory/test_held_granules.py tests/memory/test_zero_blocks.py \
        tests/memory/test_cuda_driver_threads.py \
        tests/ops/test_gqa_prefill_packed.py \
        tests/ops/test_committed_bound.py tests/engine tests/test_stubs.py -q -p no:cacheprovider \
        -p no:benchmark -s -rs --tb=short 2>&1 | tee "$OUT/serving_tests.log" | tail -20 ;;
    prefill-bench)
      stage "bench/prefill.py (issue 30)"
      timeout -k 10 ${PREFILL_TIMEOUT:-240} python3 bench/prefill.py --out "$OUT" ${PREFILL_ARGS:-} 2>&1 \
        | grep -v -E "^\s*$|WARNING|gpu_hlo_schedule|rematerialization" | tee "$OUT/prefill.log" | tail -20 ;;
    serve)
      # Issue 21's table, sized to a device call: SERVE_REQUESTS requests of the mixed workload.
      stage "bench/serve.py, mixed workload"
      timeout -k 10 ${SERVE_TIMEOUT:-420} python3 bench/serve.py --model ${SERVE_MODEL:-llama-3-8b} \
        --dtype bfloat16 --slots ${SERVE_SLOTS:-64} --max-len ${SERVE_MAX_LEN:-32768} \
        --requests ${SERVE_REQUESTS:-200} --rates ${SERVE_RATES:-inf} \
        --engines ${SERVE_ENGINES:-jax_kv,dense,static} --dense-slots ${SERVE_DENSE_SLOTS:-0} \
        --static-requests ${SERVE_STATIC:-64} --out "$OUT" ${SERVE_ARGS:-} 2>&1 \
        | grep -v -E "^\s*$|WARNING|gpu_hlo_schedule|rematerialization" | tee "$OUT/serve.log" | tail -30 ;;
    engine-step)
      stage "bench/engine_step.py: the Engine's decode step taken apart, against the Generator's"
      timeout -k 10 ${ESTEP_TIMEOUT:-240} python3 bench/engine_step.py --out "$OUT" ${ESTEP_ARGS:-} 2>&1 \
        | grep -v -E "^\s*$|WARNING|gpu_hlo_schedule|rematerialization" | tee "$OUT/engine_step.log" | tail -12 ;;
    batch-invariant)
      # The batch-invariant mode (bench/NOTES.md, "The batch-invariant mode"), ~360 s: the
      # fixed split plan's op tests, then the probe that names the first op where a decode row
      # alone parts from its batch (trained weights with JAX_KV_TEST_GGUF, else random ones).
      stage "batch-invariant mode: op tests"
      timeout -k 10 ${BI_OPS_TIMEOUT:-240} python3 -m pytest -m gpu tests/ops/test_gpu_ops.py -q \
        -p no:cacheprovider -p no:benchmark -s -k "fixed_splits or splits16" 2>&1 \
        | tee "$OUT/batch_invariant_ops.log" | tail -8
      stage "batch-invariant mode: probe"
      JAX_KV_BATCH_INVARIANT=1 timeout -k 10 120 python3 bench/experiments/batch_invariance_probe.py \
        2>&1 | grep -v WARNING | tee "$OUT/batch_invariance_probe.log" | tail -12 ;;
    batch-invariant-trained)
      # Issue 21's trained-weights test in the mode (needs JAX_KV_TEST_GGUF), ~100-300 s.
      stage "batch-invariant mode: trained weights"
      timeout -k 10 ${BI_TEST_TIMEOUT:-300} python3 -m pytest -m gpu tests/engine/test_engine_gpu.py \
        -q -p no:cacheprovider -s -k batch_invariant_mode 2>&1 | tee "$OUT/batch_invariant_trained.log" | tail -8 ;;
    batch-invariant-cost)
      # The mode's cost: the same bench/engine_step.py run (ESTEP_ARGS) with it off, then on.
      for mode in 0 1; do
        stage "batch-invariant mode $mode: bench/engine_step.py"
        JAX_KV_BATCH_INVARIANT=$mode timeout -k 10 ${ESTEP_TIMEOUT:-240} python3 bench/engine_step.py \
          --out "$OUT/bi$mode" ${ESTEP_ARGS:-} 2>&1 | grep -v -E "^\s*$|WARNING|gpu_hlo_schedule|rematerialization" \
          | tee "$OUT/engine_step_bi$mode.log" | tail -8
      done ;;
    serve-prefix)
      # Issue 23's workload 2: PREFIX_GROUPS x PREFIX_PER_GROUP (64 x 16), PREFIX_RATES (inf),
      # PREFIX_ARGS more options for bench/serve.py.
      stage "bench/serve.py, shared-prefix workload"
      timeout -k 10 ${SERVE_TIMEOUT:-540} python3 bench/serve.py --model ${SERVE_MODEL:-llama-3-8b} \
        --dtype bfloat16 --slots ${SERVE_SLOTS:-64} --max-len ${SERVE_MAX_LEN:-32768} \
        --workload shared-prefix --groups ${PREFIX_GROUPS:-64} --per-group ${PREFIX_PER_GROUP:-16} \
        --engines jax_kv,jax_kv-noprefix --rates ${PREFIX_RATES:-inf} --out "$OUT" ${PREFIX_ARGS:-} 2>&1 | grep -v -E "^\s*$|WARNING|gpu_hlo_schedule|rematerialization" \
        | tee "$OUT/serve_prefix.log" | tail -20 ;;
    serve-http)
      # HTTP_SWITCH_S sets sys.setswitchinterval in the bench and the server (a sitecustomize
      # on PYTHONPATH): how long a thread that wants the GIL waits before it asks the holder.
      # HTTP_ARGS passes options (e.g. --engine-in-process), HTTP_TAG names the run's files.
      stage "bench/serve_http.py${HTTP_SWITCH_S:+ (switch interval $HTTP_SWITCH_S s)}"
      tag=serve_http${HTTP_SWITCH_S:+_switch$HTTP_SWITCH_S}${HTTP_TAG:+_$HTTP_TAG} pp=${PYTHONPATH:-}
      if [ -n "${HTTP_SWITCH_S:-}" ]; then
        mkdir -p /tmp/switch && echo "import sys; sys.setswitchinterval($HTTP_SWITCH_S)" > /tmp/switch/sitecustomize.py
        pp=/tmp/switch${pp:+:$pp}
      fi
      PYTHONPATH=$pp timeout -k 10 ${HTTP_TIMEOUT:-300} python3 bench/serve_http.py --random-weights llama-3-8b \
        --dtype bfloat16 --max-slots 64 --max-len 4096 --clients 200 --out "$OUT/$tag" ${HTTP_ARGS:-} 2>&1 \
        | grep -v -E "^\s*$|WARNING|gpu_hlo_schedule|rematerialization" | tee "$OUT/$tag.log" | tail -20 ;;
    issue20)
      # Issue 20's before/after: the tree before the consolidation against this one
      # (issue20_build).
      stage "issue 20: bench/attention.py decode + bench/generate.py B=1, before and after"
      issue20_build
      for t in before after; do (cd /tmp/$t && PYTHONPATH=/tmp/${t}_site:${PYTHONPATH:-} timeout -k 10 150 \
        python3 bench/attention.py --out "$OUT/$t" --parts decode 2>&1 | tail -25); done | tee "$OUT/issue20_attention.log"
      for t in before after; do (cd /tmp/$t && PYTHONPATH=/tmp/${t}_site:${PYTHONPATH:-} timeout -k 10 150 \
        python3 bench/generate.py --out "$OUT/$t" --models qwen2.5-0.5b --batch 1 --new-tokens 256 \
        --impls jax_kv-seq,jax_kv-seq@8,plain-jax 2>&1 | grep -v -E "^\s*$|WARNING" | tail -12); done \
        | tee "$OUT/issue20_generate.log" ;;
    issue20-gen)
      # bench/generate.py B=1 of both trees in alternating processes (after, before, x3): the
      # one-token step's host time moved between processes of one tree by up to 30% before.
      stage "issue 20: bench/generate.py B=1, the trees alternating"
      issue20_build
      for i in 1 2 3; do for t in after before; do (cd /tmp/$t && PYTHONPATH=/tmp/${t}_site:${PYTHONPATH:-} \
        timeout -k 10 100 python3 bench/generate.py --out "$OUT/gen_${t}_$i" --models qwen2.5-0.5b --batch 1 \
        --new-tokens 256 --impls jax_kv-seq,jax_kv-seq@8 2>&1 | grep "B=1 jax_kv" \
        | sed -E "s/^/$t $i: /; s/,? ?'(replays|invalidations|growth_events|growth_keeps|kv_bytes_moved|committed_bytes|compile_s|arena)': [^,}]+//g"); done; done \
        | tee "$OUT/issue20_gen.log" ;;
    branch-prebuild)
      # An experiment's branch (carried as branch.tgz: `git archive BRANCH | gzip > branch.tgz`,
      # untracked) builds in the background while the stages after this one run (put it first:
      # `branch-prebuild build serve branch`); `branch` waits for it.
      stage "branch: building in the background"
      rm -rf /tmp/branch_done /tmp/branch /tmp/branch_site; BR_PREBUILT=1
      (branch_build; touch /tmp/branch_done) > /dev/null 2>&1 & ;;
    branch)
      # The branch built into its own --target directory (the editable install is removed
      # first: its import hook would shadow it), then its GPU tests BRANCH_TESTS and the
      # command BRANCH_CMD, run in its tree ($OUT is this call's). Main's side of a comparison
      # runs in the same call, before this stage. `python3 -P`: `-m` would put the source tree
      # (no compiled modules) first on sys.path.
      stage "branch: GPU tests and BRANCH_CMD"
      python3 -m pip uninstall -y -q jax_kv >/dev/null 2>&1
      if [ -n "${BR_PREBUILT:-}" ]; then
        while [ ! -e /tmp/branch_done ]; do sleep 2; done
      else
        branch_build
      fi
      tail -3 "$OUT/build_branch.log"
      if [ -n "${BRANCH_TESTS:-}" ]; then
        (cd /tmp/branch && PYTHONPATH=/tmp/branch_site:${PYTHONPATH:-} timeout -k 10 ${BR_TEST_TIMEOUT:-200} \
          python3 -P -m pytest -m gpu $BRANCH_TESTS -q -p no:cacheprovider -p no:benchmark -rs \
          --tb=short 2>&1 | tail -12) | tee "$OUT/branch_tests.log"
      fi
      (cd /tmp/branch && OUT="$OUT" PYTHONPATH=/tmp/branch_site:${PYTHONPATH:-} timeout -k 10 ${BR_TIMEOUT:-400} \
        bash -c "${BRANCH_CMD:-true}" 2>&1 | grep -v -E "^\s*$|WARNING|gpu_hlo_schedule|rematerialization" \
        | tail -40) | tee "$OUT/branch.log" ;;
    prefill-profile)
      # No package build needed: bench/prefill_profile.cu links the prefill kernels alone.
      stage "bench/prefill_profile.cu (+ ncu on the default wgmma kernel)"
      nvcc -O3 -std=c++17 -I. -arch=sm_90a -lineinfo -DJKV_PREFILL_ALL_CONFIGS -o /tmp/prefill_profile \
        bench/prefill_profile.cu cuda/gqa_prefill.cu cuda/gqa_prefill_wgmma.cu cuda/device_info.cu 2>&1 | tail -3
      for args in "1024 0" "4096 0" "16384 0" "512 8192"; do timeout -k 5 60 /tmp/prefill_profile $args; done 2>&1 \
        | tee "$OUT/prefill_profile.log"
      timeout -k 5 120 ncu --set full --import-source yes -k regex:GqaPrefillWgmma -c 1 -o /tmp/prefill_prof \
        /tmp/prefill_profile 16384 0 1 > "$OUT/ncu_prefill_run.log" 2>&1
      ncu --import /tmp/prefill_prof.ncu-rep --page details > "$OUT/ncu_prefill_details.txt" 2>&1
      grep -E "Duration|SM Frequency|Issue Slots Busy|Warp Cycles Per Issued|No Eligible|Tensor" \
        "$OUT/ncu_prefill_details.txt" | head -20 ;;
  esac
done
stage done
# At most 8 files come back from a device call: everything else travels in one archive.
tar czf /tmp/logs.tgz -C "$OUT" . 2>/dev/null && mv /tmp/logs.tgz "$OUT/logs.tgz"
