"""What a serving request brings and gets back: vLLM / SGLang sampling settings, and its samples.

`sampling_params_from` maps a vLLM or SGLang `sampling_params` dict to ours, refusing what it cannot honour
(a penalty we do not apply is an error, not a silent no-op); `RequestOutput` is a request's `n` samples.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from tlt_rt.rollout.params import Completion, SamplingParams

# vLLM / SGLang sampling parameter names -> ours; names that change nothing when left at their neutral value
_ALIASES = {"max_tokens": "max_new_tokens", "sampling_seed": "seed"}
_OURS = {"n", "temperature", "top_p", "top_k", "max_new_tokens", "stop_token_ids", "seed", "return_hidden"}
_NEUTRAL = {
    "repetition_penalty": 1.0, "frequency_penalty": 0.0, "presence_penalty": 0.0, "min_p": 0.0,
    "min_tokens": 0, "min_new_tokens": 0, "best_of": None, "stop": None,
}  # fmt: skip
_IGNORED = {  # about text, logging or the log-probs we always return
    "logprobs", "prompt_logprobs", "skip_special_tokens", "spaces_between_special_tokens", "detokenize",
    "include_stop_str_in_output", "no_stop_trim", "output_kind", "return_logprob", "extra_args", "priority",
}  # fmt: skip


def sampling_params_from(d: dict[str, Any] | None, eos: Iterable[int] = ()) -> SamplingParams:
    """SamplingParams from a vLLM or SGLang style dict; a setting we cannot honour is an error, not a no-op.

    `ignore_eos=True` drops the model's EOS ids from the stop set (explicit `stop_token_ids` still stop)."""
    d = dict(d or {})
    ignore_eos = bool(d.pop("ignore_eos", False))
    kw: dict[str, Any] = {}
    for name, value in d.items():
        ours = _ALIASES.get(name, name)
        if ours in _OURS:
            if ours in kw and kw[ours] != value:
                raise ValueError(f"sampling_params: {name}={value!r} contradicts {ours}={kw[ours]!r}")
            if value is not None or ours == "stop_token_ids":
                kw[ours] = value
        elif name in _NEUTRAL:
            if value not in (_NEUTRAL[name], None, [], ""):
                raise ValueError(f"sampling_params: {name}={value!r} is not supported (only {_NEUTRAL[name]!r})")
        elif name not in _IGNORED:
            raise ValueError(f"sampling_params: unknown setting {name!r}")
    params = SamplingParams(**kw)
    if params.stop_token_ids is None:
        params.stop_token_ids = [] if ignore_eos else list(eos)
    elif not ignore_eos:
        params.stop_token_ids = sorted(set(params.stop_token_ids) | set(eos))
    return params


@dataclass
class RequestOutput:
    """A request's result: its `n` samples (the first one's fields are the request's, as verl reads them)."""

    request_id: str
    outputs: list[Completion]

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def logprobs(self) -> list[float]:
        return self.outputs[0].logprobs

    @property
    def finish_reason(self) -> str:
        return self.outputs[0].finish_reason
