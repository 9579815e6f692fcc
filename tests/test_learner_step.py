"""benchmarks/learner_step.py on a CPU: both phases of a config on a tiny random model, one row per variant."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from learner_step import kernel_kinds, main  # noqa: E402


def test_learner_step_reports_each_variant(tmp_path, capsys):
    out = tmp_path / "rows.jsonl"
    small = ["rl.prompts_per_step=2", "rl.group_size=2", "rollout.max_batch=4", "rollout.max_new_tokens=64"]
    code = main(["--shape", "tiny", "--rounds", "2", "--fresh-batches", "--response-median", "20", "--prompt-len", "8",
                 "--decode-tokens", "4", "--out", str(out), "--variants", "rl.activation_checkpointing=true", "",
                 "--", *small])  # fmt: skip
    assert code == 0
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["variant"] for r in rows] == ["rl.activation_checkpointing=true", "(config)"]
    for r in rows:
        assert r["forward_tokens"] > 0 and r["flops"] > 0 and r["seconds"] > 0
        assert r["forecast_learner_gib"] > 0 and r["learner_peak_gib"] is None  # no GPU: nothing measured
    # checkpointed layers keep one hidden row per layer: the forecast of the learner phase is the smaller (the
    # config's own learner keeps every layer's activations)
    assert rows[0]["forecast_learner_gib"] < rows[1]["forecast_learner_gib"]
    text = capsys.readouterr().out
    assert "| (config) | learner |" in text and "| (config) | rollout |" in text


def test_kernel_kinds_sums_time_by_kind():
    table = [
        ("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_TNT", 500.0, 10),
        ("sm90_xmma_gemm_bf16bf16_bf16f32", 300.0, 4),
        ("flash_fwd_kernel", 120.0, 28),
        ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedAdamMathFunctor>", 80.0, 2),
        ("triton_red_fused_add_rms_norm_0", 60.0, 56),
        ("Memcpy DtoD (Device -> Device)", 10.0, 3),
        ("void at::native::vectorized_elementwise_kernel<4, exp>", 5.0, 1),
        ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)", 40.0, 56),
        ("void c10d::symmetric_memory::one_shot_all_reduce_kernel<c10::BFloat16, 16, 2>", 30.0, 56),
    ]
    kinds = kernel_kinds(table)
    assert kinds == {"matmul": 800.0, "attention": 120.0, "optimizer": 80.0, "collectives": 70.0,
                     "triton (fused glue)": 60.0, "copies": 10.0, "other": 5.0}  # fmt: skip
    assert list(kinds) == ["matmul", "attention", "optimizer", "collectives", "triton (fused glue)", "copies", "other"]
