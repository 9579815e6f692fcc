"""What a speculative step needs of the KV cache.

L is a sequence's cached target tokens; its pending root x_L sits at position L. The drafter grows its tree
in scratch positions past L (drafting.py), the target verifies the T tree nodes at cache positions
[L, L+T) with rotary positions L+depth, and the accepted path is then moved to [L+1, L+1+a] (the COMMIT
node); the bonus token becomes the next root. The step itself is rollout/step_graph.py.
"""

from __future__ import annotations

from tlt_rt.ir.strategy import Strategy


def scratch_tokens(strategy: Strategy) -> int:
    """Cache positions past L a step needs: the verify tree or the drafter's level scratch, whichever is longer."""
    return max(strategy.verify_tokens, (strategy.depth - 1) * strategy.topk)
