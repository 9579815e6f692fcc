"""The RL step: prompts and rewards, GRPO, the learner, the loop, checkpoints and metrics."""
