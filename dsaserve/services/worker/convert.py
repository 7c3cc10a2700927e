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
    )


def logprobs_to_proto(logprobs: list[TokenLogprobs]) -> list[pb.TokenLogprob]:
    return [
        pb.TokenLogprob(logprob=lp.logprob, top_token_ids=lp.top_ids, top_logprobs=lp.top_logprobs)
        for lp in logprobs
    ]


def load_response(load: Load) -> pb.LoadResponse:
    return pb.LoadResponse(**dataclasses.asdict(load))
