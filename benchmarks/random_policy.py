"""Write a randomly initialised policy folder with SmolLM2's tokenizer, for scale-out runs whose shape the
embedded model cannot take (SmolLM2-135M has 9 query / 3 KV heads: no tensor-parallel degree of 2 divides them).

    python benchmarks/random_policy.py --out DIR [--layers 12 --hidden 768 --heads 12 --kv-heads 4]

Its generations are noise (rewards near 0); what such a run measures is the machinery: lockstep TP engines,
the sharded learner, the weight handoff and spot drafter training, end to end on real GPUs.
"""

from __future__ import annotations

import argparse

import torch

from tlt_rt.models import save_target
from tlt_rt.models.arch import ArchConfig
from tlt_rt.models.default import load_tokenizer
from tlt_rt.models.llama import CausalLM


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--intermediate", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    if a.hidden % a.heads or a.heads % a.kv_heads:
        raise SystemExit(f"--hidden {a.hidden} must divide by --heads {a.heads}, --heads by --kv-heads {a.kv_heads}")
    tok = load_tokenizer(None)
    arch = ArchConfig(model_type="llama", vocab_size=len(tok), hidden_size=a.hidden, intermediate_size=a.intermediate,
                      num_hidden_layers=a.layers, num_attention_heads=a.heads, num_key_value_heads=a.kv_heads,
                      head_dim=a.hidden // a.heads, tie_word_embeddings=True, max_position_embeddings=4096,
                      bos_token_id=tok.bos_token_id, eos_token_ids=(tok.eos_token_id,))  # fmt: skip
    torch.manual_seed(a.seed)
    model = CausalLM(arch)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.fill_(1.0) if name.endswith("norm.weight") else p.normal_(0, 0.02)
    print(f"wrote {save_target(model, a.out, tok)} ({sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params)")


if __name__ == "__main__":
    main()
