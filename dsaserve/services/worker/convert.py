"""Between the wire contract (services/rpc) and the engine's types."""

from __future__ import annotations

import dataclasses

from dsaserve.engine.load import Load
from dsaserve.engine.logprobs import TokenLogprobs
from dsaserve.engine.sampling_params import SamplingParams
from dsaserve.services.rpc import pb

FINISH_REASONS = {
    None: pb.FINISH_REASON_UNSPECIFIED,
    "stop": pb.FINISH_REASON_STOP,
    "length": pb.FINISH_REASON_LENGTH,
    "abort": pb.FINISH_REASON_ABORT,
}


def sampling_from_proto(p: pb.SamplingParams) -> SamplingParams:
    """Apply the proto's documented defaults; raises ValueError for invalid values."""
    return SamplingParams(
        max_tokens=p.max_tokens if p.HasField("max_tokens") else None,
        temperature=p.temperature if p.HasField("temperature") else 1.0,
        top_p=p.top_p if p.HasField("top_p") else 1.0,
        top_k=p.top_k if p.HasField("top_k") else 0,
        seed=p.seed if p.HasField("seed") else None,
        stop=list(p.stop),
        stop_token_ids=list(p.stop_token_ids),
        ignore_eos=p.ignore_eos,
        logprobs=p.logprobs if p.HasField("logprobs") else None,
        grammar=p.grammar if p.HasField("grammar") else None,
        prompt_logprobs=p.prompt_logprobs if p.HasField("prompt_logprobs") else None,
        cache_salt=p.cache_salt if p.HasField("cache_salt") else None,
        min_tokens=p.min_tokens,
        presence_penalty=p.presence_penalty if p.HasField("presence_penalty") else 0.0,
        frequency_penalty=p.frequency_penalty if p.HasField("frequency_penalty") else 0.0,
        repetition_penalty=p.repetition_penalty if p.HasField("repetition_penalty") else 1.0,
        min_p=p.min_p if p.HasField("min_p") else 0.0,
        logit_bias=dict(p.logit_bias),
        bad_words=list(p.bad_words),
        allowed_token_ids=list(p.allowed_token_ids) or None,
    )


def stop_reason_to_proto(reason: str | int | None) -> pb.StopReason | None:
    """vLLM's stop_reason on the wire (None: EOS, or not stopped)."""
    if reason is None:
        return None
    if isinstance(reason, str):
        return pb.StopReason(stop_string=reason)
    return pb.StopReason(stop_token_id=reason)


def logprobs_to_proto(logprobs: list[TokenLogprobs]) -> list[pb.TokenLogprob]:
    return [
        pb.TokenLogprob(logprob=lp.logprob, top_token_ids=lp.top_ids, top_logprobs=lp.top_logprobs)
        for lp in logprobs
    ]


def load_response(load: Load) -> pb.LoadResponse:
    return pb.LoadResponse(**dataclasses.asdict(load))
