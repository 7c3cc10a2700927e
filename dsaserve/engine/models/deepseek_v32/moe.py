"""DeepSeek-V3.2's feed-forward layers: a dense gated MLP in the first layers, then the MoE:
sigmoid scores with a selection bias, grouped top-k (the experts of the best `topk_group` of
`n_group` groups, each group ranked by its two best biased scores), weights normalised over the
chosen experts and scaled by `routed_scaling_factor`, plus the shared experts.

The router runs in fp32 as in the release and HF, whatever the activation dtype; the routed
experts run through engine.layers.experts' grouped GEMMs: dense, or for an FP8 checkpoint
computed as the release does, FP8 (`Fp8Experts`, kernels.fp8_experts).

Tensor parallel: each rank holds a contiguous range of the routed experts (their fp32 sums
all-reduced once a layer); the dense MLP and the shared experts split their intermediate dim
(column parallel, then row parallel: one all-reduce each), as the release splits its MLPs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dsaserve.engine.layers.experts import Fp8Experts, GatedMLP, RoutedExperts
from dsaserve.engine.models.deepseek_v32.config import DENSE, ModelConfig, Quantization
from dsaserve.engine.parallel.group import SINGLE, TensorParallel, shard_experts


class Gate(torch.nn.Module):
    bias: torch.Tensor  # [experts] fp32 (a buffer): added for the selection only

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(cfg.num_experts, cfg.hidden_size))
        self.register_buffer("bias", torch.zeros(cfg.num_experts, dtype=torch.float32))
        self.top_k, self.groups, self.top_groups = (
            cfg.num_experts_per_tok,
            cfg.n_group,
            cfg.topk_group,
        )
        self.normalize, self.scale = cfg.norm_topk_prob, cfg.routed_scaling_factor

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> (expert ids [T, k], weights [T, k] fp32)."""
        scores = torch.sigmoid(F.linear(x.float(), self.weight.float()))  # [T, E]
        biased = scores + self.bias
        grouped = biased.view(x.shape[0], self.groups, -1)  # [T, G, E/G]
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # [T, G]
        best = group_scores.topk(self.top_groups, dim=-1, sorted=False).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
        biased = grouped.masked_fill(~keep[..., None], float("-inf")).flatten(1)
        ids = biased.topk(self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, ids)
        if self.normalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return ids, weights * self.scale


class MoE(torch.nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        quant: Quantization | None = None,
        tp: TensorParallel = SINGLE,
    ) -> None:
        """quant: the checkpoint's formats to keep in memory (None: dense weights); tp: the
        group whose ranks share the routed experts and split the shared ones."""
        super().__init__()
        self.gate = Gate(cfg)
        self.tp, (self.first_expert, stop) = tp, tp.expert_span(cfg.num_experts)
        self.expert_range = (self.first_expert, stop)
        inter, local = cfg.moe_intermediate_size, stop - self.first_expert
        experts: Fp8Experts | RoutedExperts
        if quant is not None:
            experts = Fp8Experts(local, cfg.hidden_size, inter)
        else:
            experts = RoutedExperts(local, cfg.hidden_size, inter, None)
        self.experts = experts
        for param in self.experts.parameters():
            shard_experts(param, self.first_expert, stop)
        shared = tp.local(inter * cfg.num_shared_experts)
        self.shared_experts = GatedMLP(cfg.hidden_size, shared, fp8=quant is not None, split=tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids, weights = self.gate(x)
        # this rank's experts' fp32 sums, summed over the ranks; then the shared experts
        routed = self.tp.routed_experts(self.experts, x, ids, weights, self.expert_range)
        return (routed + self.shared_experts(x)).to(x.dtype)


def feed_forward(
    cfg: ModelConfig, layer: int, quant: Quantization | None, tp: TensorParallel
) -> torch.nn.Module:
    """Layer `layer`'s feed-forward: the dense MLP or the MoE (cfg.mlp_kind)."""
    if cfg.mlp_kind(layer) == DENSE:
        inter = tp.local(cfg.intermediate_size)
        return GatedMLP(cfg.hidden_size, inter, fp8=quant is not None, split=tp)
    return MoE(cfg, quant, tp)
