#!/usr/bin/env bash
# What one H200 session runs once the model and wheels are staged under /tmp (see
# bench/README.md): `bash bench/h200_session.sh cluster` (GPU tests + the two-GPU cluster,
# CLUSTER_ARGS e.g. "--set transfer.ipc_across_gpus=true --kill-decode";
# `gputests`: the GPU tests alone, GPU_TESTS narrows them; `isolated`: each in its own
# process),
# `bash bench/h200_session.sh bench` (the figures; FIG3_TRACE=1 adds figure 3's dynamic-K
# step traces, BENCH_ARGS more arguments of bench.suite), `bash bench/h200_session.sh ucx` (the UCX
# sweep, two GPUs; SWEEP_ONLY=a,b narrows it), `bash bench/h200_session.sh pull` (one GPU: the
# kvtransfer GPU tests and the push and pull paths against UCX messages and a copy; PULL_BLOCKS,
# PULL_PROGRESS), `bash bench/h200_session.sh steady` (the step
# profile under figure 3's steady load, PROFILE_CONC / PROFILE_VARIANTS narrow it),
# `bash bench/h200_session.sh ab` (the interleaved steady A/B: no-spec, K=0, dynamic, and both
# with admission taking the drain; AB_CONC / AB_ADMISSION / AB_REPS narrow it, AB_ADMISSION=
# (empty) leaves the drain out, AB_FIXED_K=2,5 adds engines held at those K), `bash
# bench/h200_session.sh loops` (bench.loop_copies; LOOPS_REPS repetitions), `bash
# bench/h200_session.sh policy` (bench.policy_ab; POLICY_REPS repetitions), `TRAIN_STAGE=data
# bash bench/h200_session.sh train` then `bash bench/h200_session.sh train` (a new EAGLE-3
# head on the extended prompt set: records to /tmp in one call, training and bench.head_ab
# against the shipped head in the next; TRAIN_ARGS e.g. "--init assets/... --epochs 6",
# TRAIN_SECONDS caps the training; HEADS_REPS=0 leaves head_ab to a TRAIN_STAGE=ab call;
# TRAIN_IGNORE_EOS=1 self-distils every answer past EOS to its full length, as figure 1 runs;
# TRAIN_NAME_SPLIT=1 trains on no prompt sharing a documented name with a held-out one;
# TRAIN_SAMPLED=T self-distils every training prompt once more, its answer sampled at T;
# TRAIN_DETACH=1 starts the fit in the background and returns, for trainings longer than one
# call: `bash bench/h200_session.sh trainwait` in the calls right after waits for it, then
# TRAIN_STAGE=ab runs head_ab; the fit writes its head at every log, so what it archives
# holds the head so far; TRAIN_RECORDS=none self-distils and fits in one process),
# `bash bench/h200_session.sh hostprof` (bench.step_profile's burst under py-spy, staged as a
# wheel; PROFILE_VARIANTS / PROFILE_CONC / PROFILE_TOKENS narrow it), `SET_B="module.NAME=VALUE
# ..." bash bench/h200_session.sh setab` (figure 3 in two processes, the second with those
# settings), `bash bench/h200_session.sh oracle` (bench.draft_oracle in bf16: figure 1's answers
# replayed under each draft rule and priced; ORACLE_ARGS more arguments), `bash
# bench/h200_session.sh specab` (bench.spec_ab: figure 1 under SpecConfig variants in turns;
# SPEC_VARIANTS, SPECAB_REPS, SPECAB_TRACES=1, SPECAB_ARGS e.g. "--head DIR").
# Results
# land in $OUT/<part>.tgz (over 16 MB: in 15 MB parts, <part>.tgz.00, .01, ...).
set -u
part=${1:-bench}
M=${MODEL:-/tmp/models/SmolLM2-135M-Instruct.Q4_1.gguf}
R=/tmp/results/$part
[ "$part" = trainwait ] && R=/tmp/results/train  # what it waits for is the training's
mkdir -p "$R"
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 UCX_WARN_UNUSED_ENV_VARS=n
export RAY_USAGE_STATS_ENABLED=0
nvidia-smi -L > "$R/gpus.txt"
if [ "$part" = pull ]; then  # one GPU: the pull path's tests, and its transfer beside UCX
  # messages and a same-device copy, sender and receiver processes on the one GPU (a proxy
  # for figure 4, which needs two)
  timeout 300 python3 -m pytest -q -m gpu tests/kvtransfer -p no:cacheprovider \
    > "$R/gputests.log" 2>&1
  tail -5 "$R/gputests.log"
  # PULL_PROGRESS: ucxx progress modes to compare (thread-polling: ~130 against ~330 us a
  # round trip between two host processes, for a core spinning in each)
  for progress in ${PULL_PROGRESS:-thread}; do
  for blocks in ${PULL_BLOCKS:-8 128 512}; do  # 16 MiB, 256 MiB, 1 GiB of 8B-shaped KV
    for path in push pull off; do  # push: the sender copies; pull: the receiver; off: UCX
      f="$R/bench_${progress}_${blocks}_$path"
      ipc=auto; push=auto; [ "$path" = off ] && ipc=off; [ "$path" = pull ] && push=off
      timeout 120 python3 -m kvtransfer.bench --device cuda --layers 32 --kv-heads 8 \
        --head-dim 128 --dtype bfloat16 --blocks "$blocks" --chunks 1 --direct auto \
        --ipc "$ipc" --push "$push" --raw --trace --reps 10 --copy --progress "$progress" \
        > "$f.jsonl" 2> "$f.err"
      python3 -c "import json,sys; [print({k: v for k, v in json.loads(l).items() if k not in
        ('traces', 'ms')}) for l in open(sys.argv[1])]" "$f.jsonl"
    done
  done
  done
elif [ "$part" = ucx ]; then  # two GPUs: figure 4's transfer under many UCX settings
  timeout "${SWEEP_TIMEOUT:-200}" python3 -m bench.ucx_sweep --out "$R" --budget "${SWEEP_BUDGET:-185}" \
    ${SWEEP_ONLY:+--only "$SWEEP_ONLY"} > "$R/sweep.log" 2>&1
  tail -15 "$R/sweep.log"
elif [ "$part" = steady ]; then  # where a step's time goes with streams replaced as they finish
  timeout "${PROFILE_TIMEOUT:-300}" python3 -m bench.step_profile --model "$M" --steady --out "$R" \
    --concurrency "${PROFILE_CONC:-64,8}" \
    --variants "${PROFILE_VARIANTS:-no_spec,eagle3_k0,eagle3_dynamic_k7}" > "$R/profile.log" 2>&1
  grep -o '"variant": "[a-z0-9_]*", "concurrency": [0-9]*, "steady": true, "tokens_per_s": [0-9.]*' \
    "$R/profile.log"
elif [ "$part" = hostprof ]; then  # bench.step_profile's burst under py-spy, one process a variant
  # (py-spy staged as a wheel: the step's host Python with the real device and tokenizer;
  # the summary keeps the samples of the clean timed run, bench/step_profile.py's `work()`)
  line=$(grep -n "toks = work()" bench/step_profile.py | cut -d: -f1)
  for v in $(echo "${PROFILE_VARIANTS:-no_spec,eagle3_k5,eagle3_dynamic_k7}" | tr , ' '); do
    timeout "${PROFILE_TIMEOUT:-150}" /tmp/site/bin/py-spy record -r 1000 --nonblocking --idle \
      -f raw -o "$R/$v.raw" -- python3 -m bench.step_profile --model "$M" --out "$R/$v" \
      --concurrency "${PROFILE_CONC:-64}" --tokens "${PROFILE_TOKENS:-512}" --variants "$v" \
      > "$R/$v.log" 2>&1
    python3 -m bench.pyspy_summary "$R/$v.raw" --under "step_profile.py:$line)" --by-function \
      --json "$R/${v}_summary.json" > "$R/${v}_summary.txt" 2>&1
    head -3 "$R/$v.log" | cut -c1-300; head -40 "$R/${v}_summary.txt"
  done
elif [ "$part" = ab ]; then  # admission beside the step in flight against the drain
  # (~45 s to load, then per concurrency each engine's captures and warm run: 5 engines at
  # 16/32/64 took 235 s; 4 at 32/64 did not finish in 165 s.)
  timeout "${AB_TIMEOUT:-420}" python3 -m bench.fused_costs --model "$M" --out "$R" --batches "" \
    --ab "${AB_CONC:-16,32,64}" --ab-reps "${AB_REPS:-2}" \
    --ab-admission "${AB_ADMISSION-2:16:drain}" --ab-fixed-k "${AB_FIXED_K:-}" \
    > "$R/ab.log" 2>&1
  grep '"concurrency"' "$R/ab.log"
elif [ "$part" = loops ]; then  # figure 1's context variants, copies continued and cut, in turns
  timeout "${LOOPS_TIMEOUT:-300}" python3 -m bench.loop_copies --model "$M" --reps "${LOOPS_REPS:-2}" \
    --out "$R/loop_copies.json" > "$R/loop_copies.log" 2>&1
  grep '\[bench' "$R/loop_copies.log" | tail -16
elif [ "$part" = specab ]; then  # figure 1 under SpecConfig variants, in turns (bench.spec_ab)
  # SPEC_VARIANTS: space-separated NAME:FIELD=VALUE,... (default: bench.spec_ab's DEFAULT_VARIANTS)
  vs=""
  for v in ${SPEC_VARIANTS:-}; do vs="$vs --variant $v"; done
  timeout "${SPECAB_TIMEOUT:-240}" python3 -m bench.spec_ab --model "$M" --reps "${SPECAB_REPS:-3}" \
    $vs ${SPECAB_TRACES:+--traces} ${SPECAB_ARGS:-} --out "$R/spec_ab.json" > "$R/spec_ab.log" 2>&1
  grep '\[bench' "$R/spec_ab.log" | tail -3
elif [ "$part" = policy ]; then  # figure 1's dynamic K under its rules before and after, in turns
  timeout "${POLICY_TIMEOUT:-300}" python3 -m bench.policy_ab --model "$M" --reps "${POLICY_REPS:-3}" \
    ${POLICY_TRACES:+--traces} --out "$R/policy_ab.json" > "$R/policy_ab.log" 2>&1
  grep '\[bench' "$R/policy_ab.log" | tail -20
elif [ "$part" = train ]; then  # a new EAGLE-3 head: TRAIN_STAGE=data (records to /tmp), fit, ab
  REC=${TRAIN_RECORDS:-/tmp/records_${TRAIN_SET:-extended}.pt}
  recs=(--records "$REC")
  # TRAIN_RECORDS=none: self-distil and fit in one process, the records never written (the
  # extended set's past EOS are ~12 GB, ~40 s to save and load back)
  [ "$REC" = none ] && recs=()
  stage=${TRAIN_STAGE:-fit}
  if [ "$stage" = data ]; then
    timeout "${TRAIN_TIMEOUT:-560}" python3 -m cluster.cli train-eagle3 --model "$M" \
      --prompt-set "${TRAIN_SET:-extended}" ${TRAIN_PROMPTS:+--num-prompts $TRAIN_PROMPTS} \
      ${TRAIN_NAME_SPLIT:+--name-split} ${TRAIN_IGNORE_EOS:+--ignore-eos} ${TRAIN_SAMPLED:+--sampled $TRAIN_SAMPLED} \
      --records "$REC" --data-only --out /tmp/head_unused \
      > "$R/train_data.log" 2>&1
    tail -2 "$R/train_data.log"
  fi
  if [ "$stage" = fit ]; then  # TRAIN_SECONDS caps the training itself (--max-seconds)
    fit=(python3 -m cluster.cli train-eagle3 --model "$M" --prompt-set "${TRAIN_SET:-extended}"
         ${TRAIN_PROMPTS:+--num-prompts $TRAIN_PROMPTS} ${TRAIN_NAME_SPLIT:+--name-split}
         ${TRAIN_IGNORE_EOS:+--ignore-eos} ${TRAIN_SAMPLED:+--sampled $TRAIN_SAMPLED} "${recs[@]}"
         ${TRAIN_SECONDS:+--max-seconds $TRAIN_SECONDS} ${TRAIN_ARGS:-} --out "$R/head")
    if [ -n "${TRAIN_DETACH:-}" ]; then
      # in its own process session, so it outlives this call while the machine stays held:
      # the next calls must follow at once (`trainwait`), or the machine goes back with it
      rm -f "$R/train.done"
      printf '%q ' timeout "${TRAIN_TIMEOUT:-1500}" "${fit[@]}" > /tmp/train_fit.sh
      printf '> %q 2>&1; touch %q\n' "$R/train.log" "$R/train.done" >> /tmp/train_fit.sh
      setsid nohup bash /tmp/train_fit.sh > /dev/null 2>&1 < /dev/null &
      echo "training detached (pid $!): bash bench/h200_session.sh trainwait"
    else
      timeout "${TRAIN_TIMEOUT:-400}" "${fit[@]}" > "$R/train.log" 2>&1
      grep -o '"eval_expected_acceptance": [0-9.]*' "$R/train.log" | tail -3
      grep -A3 '"k": 5' "$R/train.log" | tr -d ' \n'; echo
    fi
  fi
  if [ "$stage" = ab ] || { [ "$stage" = fit ] && [ -z "${TRAIN_DETACH:-}" ] \
       && [ "${HEADS_REPS:-2}" != 0 ]; }; then
    # figure 1 with the shipped head and the new one in turns (bench.head_ab)
    timeout "${HEADS_TIMEOUT:-150}" python3 -m bench.head_ab --model "$M" --other "$R/head" \
      --reps "${HEADS_REPS:-2}" --out "$R/head_ab.json" > "$R/head_ab.log" 2>&1
    grep '\[bench' "$R/head_ab.log" | tail -3
  fi
elif [ "$part" = trainwait ]; then  # a TRAIN_DETACH=1 fit: wait for it, WAIT_SECONDS at most
  if [ ! -e "$R/train.log" ]; then  # the machine went back (30 s idle): /tmp went with it
    echo "no training on this machine: a fresh one (the last was given back between calls)"
    exit 3
  fi
  end=$((SECONDS + ${WAIT_SECONDS:-540}))
  while [ ! -e "$R/train.done" ] && [ "$SECONDS" -lt "$end" ]; do sleep 5; done
  tr '\r' '\n' < "$R/train.log" | grep -o '"step": [0-9]*\|"eval_expected_acceptance": [0-9.]*' \
    | paste - - | tail -4
  tr '\r' '\n' < "$R/train.log" | grep '^train:' | tail -1 | cut -c1-120
  if [ -e "$R/train.done" ]; then echo "training done"; else echo "still training"; fi
elif [ "$part" = setab ]; then  # figure 3 twice, as it is and with SET_B's --set values
  # (SET_B: space-separated module.NAME=VALUE, e.g. "engine.spec.policy.WIN_FLOOR=1.2"; each
  # process writes to its own folder; ~150 s a process)
  sets=""
  for x in ${SET_B:?SET_B names the settings of the second process}; do sets="$sets --set $x"; done
  for v in a b; do
    extra=""; [ "$v" = b ] && extra="$sets"
    timeout "${BENCH_TIMEOUT:-250}" python3 -m bench.suite --model "$M" --figures 3 --out "$R/$v" \
      --fig3-trace $extra > "$R/$v.log" 2>&1
    grep "figure 3 goals" "$R/$v.log" | cut -c1-300
  done
elif [ "$part" = oracle ]; then  # bench.draft_oracle on the GPU's own (bf16) answers
  timeout "${ORACLE_TIMEOUT:-200}" python3 -m bench.draft_oracle --model "$M" \
    --out "$R/draft_oracle.json" ${ORACLE_ARGS:-} > "$R/oracle.log" 2>&1
  grep '\[bench' "$R/oracle.log" | tail -8
elif [ "$part" = isolated ]; then  # the GPU tests each in its own process: a crash in one
  # (a segfault under UCX) takes only that one down, and every other still reports
  python3 -m pytest -q --collect-only -m gpu -p no:cacheprovider ${GPU_TESTS:-tests/kvtransfer} \
    2> /dev/null | grep '::' > "$R/ids.txt"
  while read -r id; do
    timeout "${TEST_TIMEOUT:-90}" python3 -X faulthandler -m pytest -q -rA --tb=short \
      -p no:cacheprovider "$id" > "$R/one.log" 2>&1
    rc=$?
    echo "rc=$rc $id" | tee -a "$R/summary.txt"
    { echo "=== rc=$rc $id"; cat "$R/one.log"; } >> "$R/isolated.log"
  done < "$R/ids.txt"
  rm -f "$R/one.log"
elif [ "$part" = gputests ] || [ "$part" = cluster ]; then  # GPU tests (+ the two-GPU cluster)
  # (gputests: the tests alone, no Ray, one GPU is enough; a longer default limit)
  limit=150; [ "$part" = gputests ] && limit=240
  timeout "${TEST_TIMEOUT:-$limit}" python3 -m pytest -q -m gpu -p no:cacheprovider \
    ${GPU_TESTS:-tests/engine tests/spec tests/kvtransfer} > "$R/gpu_tests.log" 2>&1
  tail -6 "$R/gpu_tests.log"
  if [ "$part" = cluster ]; then
    TANDEM_RAY_LOGS=1 timeout "${CLUSTER_TIMEOUT:-240}" python3 bench/cluster_gpu.py --model "$M" \
      --out "$R/cluster_two_gpu.json" ${CLUSTER_ARGS:-} > "$R/cluster.log" 2>&1
    tail -25 "$R/cluster.log"
  fi
else
  timeout "${BENCH_TIMEOUT:-540}" python3 -m bench.suite --model "$M" \
    --figures "${FIGS:-1,2,3,4}" --out "$R" ${FIG3_TRACE:+--fig3-trace} ${BENCH_ARGS:-} \
    > "$R/bench.log" 2>&1
  tail -40 "$R/bench.log"
fi
tar czf "$OUT/$part.tgz" -C "$R" .
# A file over 16 MiB does not come back from the device machine: cut it into parts
# (here: cat PART.tgz.?? > PART.tgz).
if [ "$(stat -c %s "$OUT/$part.tgz")" -gt 16000000 ]; then
  split -b 15000000 -d "$OUT/$part.tgz" "$OUT/$part.tgz." && rm "$OUT/$part.tgz"
  ls "$OUT"
fi
