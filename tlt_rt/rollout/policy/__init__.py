"""The SD policy: per decode step, plain decoding or which strategy, and what it learns to decide that.

`sd_policy` decides (`SDPolicy`); `costs` holds the measured step costs (`CostTable`) and `profiling` measures
them; `accept_stats` the accept lengths (`AcceptStats`); `catchup` prices the drafter rows a plain stretch
leaves behind; `state` is what the policy reports and saves.
"""

from tlt_rt.rollout.policy.accept_stats import AcceptStats
from tlt_rt.rollout.policy.sd_policy import SDPolicy

__all__ = ["AcceptStats", "SDPolicy"]
