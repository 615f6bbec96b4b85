#!/usr/bin/env bash
# What one GPU session runs once the model and wheels are staged under /tmp (bench/README.md,
# "On a GPU machine"). Usage: `bash bench/h200_session.sh PART`, PART one of
#   bench     (default) the figures: FIGS (default 1,2,3,4), FIG3_TRACE=1 adds figure 3's
#             dynamic-K step traces, BENCH_ARGS more arguments of bench.suite
#   setab     figure 3 in two processes, the second with SET_B's settings
#             (space-separated module.NAME=VALUE); SETAB_FIGS other figures, SETAB_ARGS
#             their arguments (default --fig3-trace)
#   pull      one GPU: the kvtransfer GPU tests and the push and pull paths against UCX
#             messages and a same-device copy (PULL_BLOCKS, PULL_PROGRESS)
#   gputests  the GPU tests (GPU_TESTS narrows them)
#   isolated  the GPU tests, each in its own process (a crash takes only that one down)
#   cluster   the GPU tests, then the two-GPU cluster (cluster.gpu_check; CLUSTER_ARGS, e.g.
#             "--set transfer.ipc_across_gpus=true --kill-decode")
#   train     a new EAGLE-3 head: TRAIN_STAGE=data self-distils the records to /tmp, then
#             the default stage fits (TRAIN_ARGS, TRAIN_SECONDS; TRAIN_RECORDS=none does both
#             in one process) and runs figure 1 with the new head (HEADS=0 skips it);
#             TRAIN_STAGE=fig1 runs figure 1 with a head fitted earlier
#   domains   the shipped head's recipe, resumable: `tandem train-eagle3 --domains` (DOMAINS,
#             default code,chat,json,summarize,math,general:3000) from the shipped head, state
#             in /tmp/domains_head; each call runs TRAIN_STOP seconds (default 480) and ends
#             with exit status 3 until done: call it again on the same (warm) machine; once
#             done, figure 1 with the new head (HEADS=0 skips it) and the head in $OUT
#   soak      `tandem soak` on one GPU: 16 streams for 3 minutes (SOAK_MINUTES), SOAK_REPLICAS
#             (2) prefill and decode actors each in bf16 sharing the GPU (--gpu-share), the
#             first decode and prefill actor killed (SOAK_ARGS: more flags);
#             needs ray and ucxx: run every .stage_ray/N/assemble and .stage_ucx/one/assemble
# Results land in $OUT/<part>.tgz (over 16 MB: in 15 MB parts, <part>.tgz.00, .01, ...).
set -u
part=${1:-bench}
M=${MODEL:-/tmp/models/SmolLM2-135M-Instruct.Q4_1.gguf}
R=/tmp/results/$part
mkdir -p "$R"
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 UCX_WARN_UNUSED_ENV_VARS=n
export TANDEM_TEST_MODEL=${TANDEM_TEST_MODEL:-$M}  # the GPU tests that load SmolLM2
export RAY_USAGE_STATS_ENABLED=0
nvidia-smi -L > "$R/gpus.txt"

figure1_with_head() {  # figure 1 with the head at $1 (no HF compile: the heads are compared)
  timeout "${HEADS_TIMEOUT:-300}" python3 -m bench.suite --model "$M" --figures 1 \
    --head "$1" --no-hf-compile --out "$R/fig1_head" > "$R/fig1_head.log" 2>&1
  grep "figure 1 goals" "$R/fig1_head.log" | cut -c1-300
}

if [ "$part" = pull ]; then  # sender and receiver processes on one GPU (a proxy of figure 4)
  timeout 300 python3 -m pytest -q -m gpu tests/kvtransfer -p no:cacheprovider \
    > "$R/gputests.log" 2>&1
  tail -5 "$R/gputests.log"
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
elif [ "$part" = soak ]; then  # every actor books 1 / (2 x replicas) of the GPU (--gpu-share)
  timeout "${SOAK_TIMEOUT:-560}" python3 -m cluster.cli soak --streams 16 \
    --minutes "${SOAK_MINUTES:-3}" --replicas "${SOAK_REPLICAS:-2}" --faults decode,prefill \
    --device cuda --model "$M" --out "$R/soak_gpu.json" ${SOAK_ARGS:-} > "$R/soak.log" 2>&1
  grep -q " streams in " "$R/soak.log" && sed -n '/ streams in /,$p' "$R/soak.log" ||
    tail -30 "$R/soak.log"
elif [ "$part" = train ]; then
  REC=${TRAIN_RECORDS:-/tmp/records_${TRAIN_SET:-extended}.pt}
  recs=(--records "$REC")
  [ "$REC" = none ] && recs=()  # self-distil and fit in one process, no records written
  common=(--model "$M" --prompt-set "${TRAIN_SET:-extended}"
          ${TRAIN_PROMPTS:+--num-prompts $TRAIN_PROMPTS} ${TRAIN_NAME_SPLIT:+--name-split}
          ${TRAIN_IGNORE_EOS:+--ignore-eos} ${TRAIN_SAMPLED:+--sampled $TRAIN_SAMPLED})
  stage=${TRAIN_STAGE:-fit}
  if [ "$stage" = data ]; then
    timeout "${TRAIN_TIMEOUT:-560}" python3 -m cluster.cli train-eagle3 "${common[@]}" \
      --records "$REC" --data-only --out /tmp/head_unused > "$R/train_data.log" 2>&1
    tail -2 "$R/train_data.log"
  elif [ "$stage" = fit ]; then
    timeout "${TRAIN_TIMEOUT:-400}" python3 -m cluster.cli train-eagle3 "${common[@]}" \
      "${recs[@]}" ${TRAIN_SECONDS:+--max-seconds $TRAIN_SECONDS} ${TRAIN_ARGS:-} \
      --out "$R/head" > "$R/train.log" 2>&1
    grep -o '"eval_expected_acceptance": [0-9.]*' "$R/train.log" | tail -3
    [ "${HEADS:-1}" != 0 ] && figure1_with_head "$R/head"
  else
    figure1_with_head "${HEAD:-$R/head}"
  fi
elif [ "$part" = domains ]; then
  H=/tmp/domains_head
  timeout $(( ${TRAIN_STOP:-480} + 90 )) python3 -m cluster.cli train-eagle3 --model "$M" \
    --domains "${DOMAINS:-code,chat,json,summarize,math,general:3000}" --ignore-eos \
    --init assets/eagle3-smollm2-135m-instruct --draft-vocab 7168 --epochs 30 --batch-size 32 \
    --lr 5e-4 --max-seconds "${TRAIN_SECONDS:-420}" --eval-prompts 16 --log-every 500 \
    --out "$H" --resume --stop-after "${TRAIN_STOP:-480}" ${TRAIN_ARGS:-} >> "$R/train.log" 2>&1
  rc=$?
  echo "train-eagle3 exit $rc (3: call again to go on)"
  grep -v "it/s]" "$R/train.log" | tail -8 | cut -c1-300
  if [ $rc = 0 ]; then
    mkdir -p "$R/head" && cp "$H"/*.json "$H"/*.safetensors "$H"/*.md "$R/head/" 2>/dev/null
    [ "${HEADS:-1}" != 0 ] && figure1_with_head "$H"
  fi
elif [ "$part" = setab ]; then  # figure 3 as it is (a) and with SET_B's --set values (b)
  sets=""
  for x in ${SET_B:?SET_B names the settings of the second process}; do sets="$sets --set $x"; done
  for v in a b; do
    extra=""; [ "$v" = b ] && extra="$sets"
    timeout "${BENCH_TIMEOUT:-250}" python3 -m bench.suite --model "$M" \
      --figures "${SETAB_FIGS:-3}" --out "$R/$v" ${SETAB_ARGS:---fig3-trace} $extra \
      > "$R/$v.log" 2>&1
    grep "goals" "$R/$v.log" | cut -c1-300
  done
elif [ "$part" = isolated ]; then
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
elif [ "$part" = gputests ] || [ "$part" = cluster ]; then
  limit=150; [ "$part" = gputests ] && limit=240
  timeout "${TEST_TIMEOUT:-$limit}" python3 -m pytest -q -m gpu -p no:cacheprovider \
    ${GPU_TESTS:-tests/engine tests/spec tests/kvtransfer} > "$R/gpu_tests.log" 2>&1
  tail -6 "$R/gpu_tests.log"
  if [ "$part" = cluster ]; then
    TANDEM_RAY_LOGS=1 timeout "${CLUSTER_TIMEOUT:-240}" python3 -m cluster.gpu_check --model "$M" \
      --out "$R/cluster_two_gpu.json" ${CLUSTER_ARGS:-} > "$R/cluster.log" 2>&1
    tail -25 "$R/cluster.log"
  fi
else
  timeout "${BENCH_TIMEOUT:-560}" python3 -m bench.suite --model "$M" \
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
