#!/usr/bin/env bash
# verl's own GRPO trainer (`python -m verl.trainer.main_ppo`) with actor_rollout_ref.rollout.name=tlt_rt on one
# GPU: Qwen2.5-Coder-0.5B-Instruct on the project's arithmetic word problems (tlt_rt.integrations.verl_data),
# scored by the project's reward (tlt_rt.integrations.verl_reward), 8 prompts x 4 samples a step, 3 steps,
# responses up to 512 tokens, a greedy validation on 32 held-out problems before and after, console logging only.
#
#   benchmarks/gpu_verl.sh OUT MODEL [OVERRIDE ...]     # run it; OVERRIDEs (Hydra) go after ours and win
#   BACKGROUND=1 benchmarks/gpu_verl.sh OUT MODEL ...   # start it (setsid) and return at once
#   benchmarks/gpu_verl.sh --wait OUT SECONDS [DEST]    # wait up to SECONDS for a background run, print its
#                                                       # progress; DEST gets verl.log and summary.txt
#   benchmarks/gpu_verl.sh --overrides MODEL DATA OUT   # print our Hydra overrides, one a line, and stop
#
# MODEL is an HF folder (config.json, safetensors, tokenizer) or a .gguf file, which is converted first with the
# project's own transformers (tlt_rt.models.default.convert_gguf; a folder under $TLT_CACHE). verl 0.9.1 needs
# transformers < 5.11: its process alone gets the older copy, from $VERL_TF_SITE (put first on its PYTHONPATH).
# On the GPU machine, `source .verl-kit/unpack.sh` first (tools/verl-device-kit.sh): it installs verl and what
# it needs into /tmp/site and the older transformers into /tmp/site-verl-tf, and sets both variables.
#
# Settings: SPEC (the engine's speculative mode, default auto), STEPS (3), VERL_TIMEOUT (seconds verl may run:
# 540 in the foreground, 1500 in the background), RELEASE_ON_SLEEP (false: the engine keeps its cache and
# captured steps over verl's sleep). Written to OUT: data/{train,test}.parquet, verl.log (the
# whole run), verl.rc (its exit status, once it ends), summary.txt (step and validation lines), hydra/.
set -u
# verl's defaults that this run changes, and why:
#   model.use_remove_padding=False + attn_implementation=sdpa: verl's default flash_attention_2 needs the
#     flash-attn package (CUDA-built, not carried); padded sdpa needs nothing beyond torch
#   rollout.tensor_model_parallel_size=1: one engine per replica (tlt_rt's TltReplica)
#   engine_kwargs.tlt_rt: the engine's KV cache sized for 64 sequences of 768 tokens, not half the GPU; kept over
#     verl's sleep after each generation (release_on_sleep=false: ~0.6 GiB for the 0.5B model), so the wake-up
#     before the weight update need not capture the engine's steps again (9.7-10.8 s of update_weights a step
#     with the release, H200, 0c4301e)
#   use_kl_loss=False: no reference model (GRPO's KL term off; the run is about the rollout path)
#   agent / reward workers 1, TransferQueue storage units 2 (of 8): each holds a CPU of Ray's, and 32 samples a
#     step need few; the 16-core machine then keeps CPUs free for the trainer's own actors
overrides() {
  local model=$1 data=$2 out=$3 repo
  repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
  cat <<EOF
algorithm.adv_estimator=grpo
algorithm.use_kl_in_reward=False
data.train_files=$data/train.parquet
data.val_files=$data/test.parquet
data.train_batch_size=8
data.max_prompt_length=256
data.max_response_length=512
data.filter_overlong_prompts=True
data.truncation=error
data.dataloader_num_workers=0
actor_rollout_ref.model.path=$model
actor_rollout_ref.model.use_remove_padding=False
+actor_rollout_ref.model.override_config.attn_implementation=sdpa
actor_rollout_ref.model.enable_gradient_checkpointing=True
actor_rollout_ref.actor.optim.lr=1e-6
actor_rollout_ref.actor.ppo_mini_batch_size=8
actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8
actor_rollout_ref.actor.use_kl_loss=False
actor_rollout_ref.actor.entropy_coeff=0
actor_rollout_ref.rollout.name=tlt_rt
actor_rollout_ref.rollout.mode=async
actor_rollout_ref.rollout.n=4
actor_rollout_ref.rollout.tensor_model_parallel_size=1
actor_rollout_ref.rollout.max_num_seqs=64
actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8
actor_rollout_ref.rollout.agent.num_workers=1
+actor_rollout_ref.rollout.engine_kwargs.tlt_rt.speculative=${SPEC:-auto}
+actor_rollout_ref.rollout.engine_kwargs.tlt_rt.max_context=1024
+actor_rollout_ref.rollout.engine_kwargs.tlt_rt.num_blocks=3072
+actor_rollout_ref.rollout.engine_kwargs.tlt_rt.release_on_sleep=${RELEASE_ON_SLEEP:-false}
reward.num_workers=1
transfer_queue.backend.SimpleStorage.num_data_storage_units=2
reward.custom_reward_function.path=$repo/tlt_rt/integrations/verl_reward.py
reward.custom_reward_function.name=compute_score
trainer.logger=[console]
trainer.project_name=tlt_rt
trainer.experiment_name=verl-grpo-qwen0.5b
trainer.n_gpus_per_node=1
trainer.nnodes=1
trainer.total_training_steps=${STEPS:-3}
trainer.total_epochs=1
trainer.val_before_train=True
trainer.test_freq=${STEPS:-3}
trainer.save_freq=-1
trainer.resume_mode=disable
trainer.default_local_dir=$out/checkpoints
hydra.run.dir=$out/hydra
EOF
}

summary() {  # the step lines (without the tqdm noise) and the validation metrics of a log
  grep -aoE "step:[0-9]+ - .*" "$1" | cut -c1-4000
  grep -aE "validation metrics|val-core|val-aux" "$1" | sed 's/^.*\[0m //' | cut -c1-400
}
brief() {  # a few metrics of each step line: reward, lengths, times, how close our log-probs are to the actor's
  grep -aoE "step:[0-9]+ - .*" "$1" | while read -r line; do
    echo "${line%% - *}: $(echo "$line" | grep -oE "(critic/score/mean|val-core/[^:]*acc/mean@1|response_length/mean|\
timing_s/gen|timing_s/update_actor|timing_s/update_weights|timing_s/step|actor/pg_loss|actor/grad_norm|\
training/rollout_probs_diff_mean|rollout_corr/log_ppl_abs_diff):[^ ]*" | tr '\n' ' ')"
  done
}

if [ "${1:-}" = "--overrides" ]; then
  overrides "${2:?MODEL}" "${3:?DATA}" "${4:?OUT}"
  exit 0
fi
if [ "${1:-}" = "--wait" ]; then
  out=${2:?OUT}; limit=${3:?SECONDS}; dest=${4:-}
  t0=$(date +%s)
  while [ ! -f "$out/verl.rc" ] && [ $(( $(date +%s) - t0 )) -lt "$limit" ]; do
    if [ -f "$out/verl.pid" ] && ! kill -0 "$(cat "$out/verl.pid")" 2>/dev/null; then
      sleep 2
      [ -f "$out/verl.rc" ] || { echo "gpu_verl.sh: the run ended without an exit status" >&2; break; }
    fi
    sleep 10
  done
  summary "$out/verl.log" > "$out/summary.txt" 2>/dev/null
  echo "after $(( $(date +%s) - t0 )) s: $( [ -f "$out/verl.rc" ] && echo "ended, rc=$(cat "$out/verl.rc")" || echo "running")"
  brief "$out/verl.log"
  tail -c 3000 "$out/verl.log" | tail -n 12 | cut -c1-300
  [ -n "$dest" ] && mkdir -p "$dest" && cp "$out/verl.log" "$out/summary.txt" "$dest/" 2>/dev/null
  [ -f "$out/verl.rc" ]
  exit $?
fi

out=${1:?OUT}; model=${2:?MODEL (an HF folder or a .gguf file)}; shift 2
mkdir -p "$out"
out=$(cd "$out" && pwd)
rm -f "$out/verl.rc" "$out/verl.pid"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 WANDB_MODE=disabled RAY_AUTH_MODE=disabled
t0=$(date +%s)
if [ -f "$model" ]; then  # a GGUF: converted with the project's transformers, before verl's older one is in the way
  model=$(python -c "import sys; from tlt_rt.models.default import convert_gguf; print(convert_gguf(sys.argv[1]))" \
          "$model" | tail -1) || { echo "gpu_verl.sh: could not convert $model" >&2; exit 1; }
  echo "converted ($(( $(date +%s) - t0 )) s): $model"
fi
python -m tlt_rt.integrations.verl_data "$out/data" --train 256 --test 32 || exit 1
mapfile -t args < <(overrides "$model" "$out/data" "$out")
# verl's process (and the Ray workers it starts, which inherit its environment) sees the older transformers
# first; our backend registers itself through VERL_USE_EXTERNAL_MODULES (tlt_rt is not pip-installed here)
export VERL_USE_EXTERNAL_MODULES=${VERL_USE_EXTERNAL_MODULES:-tlt_rt.integrations.verl}
export PYTHONPATH=${VERL_TF_SITE:+$VERL_TF_SITE:}$PWD${PYTHONPATH:+:$PYTHONPATH}
# what main_ppo and its workers import, at once (a missing wheel shows here, not minutes later in a Ray actor)
python -W ignore -c "import transformers, verl, verl.trainer.main_ppo, verl.trainer.ppo.v1, verl.workers.engine_workers, \
verl.experimental.reward_loop, tlt_rt.integrations.verl; print('verl', verl.__version__, 'transformers', \
transformers.__version__)" 2>&1 | grep -v "WARNING:" ; [ "${PIPESTATUS[0]}" = 0 ] || exit 1
if [ "${BACKGROUND:-0}" = 1 ]; then
  setsid nohup bash -c 'timeout "$1" python -m verl.trainer.main_ppo "${@:3}" > "$2/verl.log" 2>&1; echo $? > "$2/verl.rc"' \
      _ "${VERL_TIMEOUT:-1500}" "$out" "${args[@]}" "$@" < /dev/null > /dev/null 2>&1 &
  echo $! > "$out/verl.pid"
  echo "verl main_ppo started in the background (pid $!, $(( $(date +%s) - t0 )) s in); log: $out/verl.log"
  exit 0
fi
timeout "${VERL_TIMEOUT:-540}" python -m verl.trainer.main_ppo "${args[@]}" "$@" > "$out/verl.log" 2>&1
rc=$?
echo $rc > "$out/verl.rc"
summary "$out/verl.log" > "$out/summary.txt"
echo "verl main_ppo: rc=$rc after $(( $(date +%s) - t0 )) s; log: $out/verl.log"
brief "$out/verl.log"
tail -n 12 "$out/verl.log" | cut -c1-300
exit $rc
