#!/usr/bin/env bash
# GRPO on GSM8K with Qwen2.5-0.5B-Instruct on ONE GPU: trainer and engine colocated, taking turns.
#
#   bash examples/gsm8k_qwen2.5_0.5b/run.sh                 # from the repository root, inside the venv
#   MODEL_DIR=/path/to/Qwen2.5-0.5B-Instruct DATA_DIR=/path/to/gsm8k NUM_ROLLOUT=200 bash examples/...
#
# Needs (see README.md next to this file): the model in MODEL_DIR and GSM8K as parquet in DATA_DIR
# (train.parquet / test.parquet with a "messages" prompt column and a "label" answer column).
set -euo pipefail

MODEL_DIR=${MODEL_DIR:-$HOME/models/Qwen2.5-0.5B-Instruct}
DATA_DIR=${DATA_DIR:-$HOME/datasets/gsm8k}
OUTPUT_DIR=${OUTPUT_DIR:-outputs/gsm8k_qwen2.5_0.5b}
NUM_ROLLOUT=${NUM_ROLLOUT:-200}

for path in "$MODEL_DIR/config.json" "$DATA_DIR/train.parquet" "$DATA_DIR/test.parquet"; do
  [ -e "$path" ] || { echo "missing $path (see examples/gsm8k_qwen2.5_0.5b/README.md)" >&2; exit 2; }
done

MODEL_ARGS=(--hf-checkpoint "$MODEL_DIR" --ref-load "$MODEL_DIR")
DATA_ARGS=(--prompt-data "$DATA_DIR/train.parquet" --input-key messages --label-key label
           --apply-chat-template --rollout-shuffle)
ROLLOUT_ARGS=(--rm-type gsm8k --num-rollout "$NUM_ROLLOUT" --rollout-batch-size 32 --n-samples-per-prompt 8
              --rollout-max-response-len 1024 --rollout-temperature 1.0
              --over-sampling-batch-size 48
              --dynamic-sampling-filter-path clawrl.rollout.filters.check_reward_nonzero_std)
EVAL_ARGS=(--eval-interval 20 --eval-prompt-data gsm8k "$DATA_DIR/test.parquet"
           --n-samples-per-eval-prompt 1 --eval-max-response-len 1024 --eval-top-k 1)
TRAIN_ARGS=(--global-batch-size 256 --use-dynamic-batch-size --max-tokens-per-gpu 16384
            --lr 1e-6 --lr-decay-style constant --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.98
            --clip-grad 1.0)
ALGO_ARGS=(--advantage-estimator grpo --use-kl-loss --kl-loss-coef 0.0 --kl-loss-type low_var_kl
           --eps-clip 0.2 --eps-clip-high 0.28)
RESOURCE_ARGS=(--colocate --actor-num-nodes 1 --actor-num-gpus-per-node 1 --rollout-num-gpus 1)
CHECKPOINT_ARGS=(--save "$OUTPUT_DIR/ckpt" --save-interval 50 --load "$OUTPUT_DIR/ckpt")
LOG_ARGS=(--output-dir "$OUTPUT_DIR" --run-name gsm8k_qwen2.5_0.5b --use-tensorboard)

clawrl train "${MODEL_ARGS[@]}" "${DATA_ARGS[@]}" "${ROLLOUT_ARGS[@]}" "${EVAL_ARGS[@]}" "${TRAIN_ARGS[@]}" \
  "${ALGO_ARGS[@]}" "${RESOURCE_ARGS[@]}" "${CHECKPOINT_ARGS[@]}" "${LOG_ARGS[@]}" "$@"
clawrl report "$OUTPUT_DIR"
