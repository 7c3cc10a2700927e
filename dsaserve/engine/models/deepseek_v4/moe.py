"""DeepSeek-V4 MoE: sqrt-softplus router (or a frozen token-id hash for the first layers),
routed experts through grouped GEMMs, plus one shared expert.

Routed experts come dense (engine.layers.experts' `RoutedExperts`, torch grouped GEMMs) or,
for the release's FP4 checkpoint computed natively, as `Fp4Experts` (kernels.fp4_experts). The
router and the SwiGLU run in fp32 as in the release, whatever the activation dtype.

Expert parallel, as the release splits it: each rank of a tensor-parallel group holds a
contiguous range of the routed experts and runs only the (token, expert) pairs that land there;
the routed sums (fp32) are all-reduced once per layer, then the shared expert, which every rank
holds whole and computes on all tokens, is added (once, after the sum). With
--enable-expert-parallel the experts split over every rank of the data-parallel group instead,
each pair sent to its expert's owner and back (engine.parallel.expert_parallel).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dsaserve import kernels
from dsaserve.engine.layers.experts import GatedMLP, RoutedExperts
from dsaserve.engine.models.deepseek_v4.config import HASH_MOE, ModelConfig, Quantization
from dsaserve.engine.parallel.group import SINGLE, TensorParallel, shard_experts
from dsaserve.kernels.quant import FP4_BLOCK, narrow_fp4_scales


class Fp4Experts(torch.nn.Module):
    """All experts' FP4 weights in the layout of kernels.fp4_moe (`kernels.stack_fp4_experts`):

        w13 [E, 2I, H/2] int8 (rows 0..I-1: w1 = gate, I..2I-1: w3 = up), s13 [E, 2I, H/32] e8m0
        w2  [E, H, I/2] int8, s2 [E, H, I/32] e8m0

    The loader copies each expert's checkpoint tensors into its slices, so the weights never
    exist in another format. Arithmetic: the release's Expert.forward (FP8 activations, the
    routing weight applied to h before w2, outputs summed in fp32)."""

    def __init__(self, num_experts: int, hidden: int, inter: int, limit: float) -> None:
        super().__init__()

        def param(*shape: int, dtype: torch.dtype) -> torch.nn.Parameter:
            return torch.nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)

        e8m0 = torch.float8_e8m0fnu
        self.w13 = param(num_experts, 2 * inter, hidden // 2, dtype=torch.int8)
        self.s13 = param(num_experts, 2 * inter, hidden // FP4_BLOCK, dtype=e8m0)
        self.w2 = param(num_experts, hidden, inter // 2, dtype=torch.int8)
        self.s2 = param(num_experts, hidden, inter // FP4_BLOCK, dtype=e8m0)
        self.limit = limit
        self.narrow_scales = False  # set once the weights are in (note_scales)

    def note_scales(self) -> None:
        """Record, once the loader has filled the scales, whether the fast FP4 decode applies
        (kernels.quant.narrow_fp4_scales; reads the scales back)."""
        self.narrow_scales = narrow_fp4_scales(self.s13, self.s2)

    def forward(
        self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """x [T, hidden], expert_ids/weights [T, k] -> fp32 [T, hidden]."""
        return kernels.fp4_experts(
            x,
            expert_ids,
            weights,
            self.w13,
            self.s13,
            self.w2,
            self.s2,
            self.limit,
            narrow_scales=self.narrow_scales,
        )


class Gate(torch.nn.Module):
    tid2eid: torch.Tensor  # hashed: [vocab, k] int64 (a buffer)
    bias: torch.Tensor  # scored: [experts] fp32 (a buffer)

    def __init__(self, cfg: ModelConfig, hashed: bool) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(cfg.num_experts, cfg.hidden_size))
        if hashed:  # frozen token-id -> experts table; the scores still weight the experts
            self.register_buffer(
                "tid2eid", torch.zeros(cfg.vocab_size, cfg.num_experts_per_tok, dtype=torch.int64)
            )
        else:  # added for selection only, never to the weights
            self.register_buffer("bias", torch.zeros(cfg.num_experts, dtype=torch.float32))
        self.hashed, self.top_k = hashed, cfg.num_experts_per_tok
        self.scale, self.scoring = cfg.routed_scaling_factor, cfg.scoring_func

    def forward(
        self, x: torch.Tensor, token_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> (expert ids [T, k], weights [T, k])."""
        # fp32 as in the release: bf16 logits can flip the top-k choice
        logits = F.linear(x.float(), self.weight.float())
        scores = (
            F.softplus(logits).sqrt() if self.scoring == "sqrtsoftplus" else torch.sigmoid(logits)
        )
        if self.hashed:
            ids = self.tid2eid[token_ids]
        else:
            ids = torch.topk(scores + self.bias, self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, ids)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return ids, weights * self.scale


class MoE(torch.nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        layer: int,
        quant: Quantization | None = None,
        tp: TensorParallel = SINGLE,
    ) -> None:
        """quant: the checkpoint's formats to keep in memory (None: dense weights). FP8 routed
        experts have no kernel here: they are dequantized at load like a dense checkpoint's.
        tp: the group whose ranks share the routed experts."""
        super().__init__()
        inter, limit = cfg.moe_intermediate_size, cfg.swiglu_limit
        self.gate = Gate(cfg, hashed=cfg.mlp_kind(layer) == HASH_MOE)
        self.tp, (self.first_expert, stop) = tp, tp.expert_span(cfg.num_experts)
        self.expert_range = (self.first_expert, stop)
        experts: Fp4Experts | RoutedExperts
        if quant is not None and quant.expert_dtype == "fp4":
            experts = Fp4Experts(stop - self.first_expert, cfg.hidden_size, inter, limit)
        else:
            experts = RoutedExperts(stop - self.first_expert, cfg.hidden_size, inter, limit)
        for param in experts.parameters():
            shard_experts(param, self.first_expert, stop)
        self.experts = experts
        self.shared_experts = GatedMLP(cfg.hidden_size, inter, fp8=quant is not None, limit=limit)

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        ids, weights = self.gate(x, token_ids)
        # this rank's experts' fp32 sums, summed over the ranks; then the shared expert, as
        # the release adds it
        routed = self.tp.routed_experts(self.experts, x, ids, weights, self.expert_range)
        return (routed + self.shared_experts(x)).to(x.dtype)
