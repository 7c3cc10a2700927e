"""DeepSeek-V4 MoE: sqrt-softplus router (or a frozen token-id hash for the first layers),
routed experts through grouped GEMMs, plus one shared expert."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.models.deepseek_v4.config import HASH_MOE, ModelConfig

_grouped_mm = getattr(F, "grouped_mm", None) or torch._grouped_mm


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    # The gate is clipped from above only, the up projection on both sides.
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


class SharedExpert(torch.nn.Module):
    def __init__(self, hidden: int, inter: int, limit: float) -> None:
        super().__init__()
        self.w1 = torch.nn.Linear(hidden, inter, bias=False)  # gate
        self.w2 = torch.nn.Linear(inter, hidden, bias=False)  # down
        self.w3 = torch.nn.Linear(hidden, inter, bias=False)  # up
        self.limit = limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(clamped_swiglu(self.w1(x), self.w3(x), self.limit))


class RoutedExperts(torch.nn.Module):
    """All experts' weights stacked, run as two grouped GEMMs over tokens sorted by expert.

    Shapes are fixed by the token count alone (no host sync), so decode steps stay
    capturable in CUDA graphs.
    """

    def __init__(self, num_experts: int, hidden: int, inter: int, limit: float) -> None:
        super().__init__()
        self.w13 = torch.nn.Parameter(
            torch.zeros(num_experts, 2 * inter, hidden)
        )  # [E, gate|up, hidden]
        self.w2 = torch.nn.Parameter(torch.zeros(num_experts, hidden, inter))  # [E, hidden, inter]
        self.inter, self.limit = inter, limit

    def forward(
        self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """x [T, hidden], expert_ids/weights [T, k] -> [T, hidden]."""
        k = expert_ids.shape[1]
        flat = expert_ids.reshape(-1)
        order = torch.argsort(flat, stable=True)  # [T*k] grouped by expert
        token = torch.div(order, k, rounding_mode="floor")
        counts = torch.zeros(self.w13.shape[0], dtype=torch.int64, device=x.device)
        counts.scatter_add_(0, flat, torch.ones_like(flat))
        offsets = counts.cumsum(0).to(torch.int32)  # [E] end row of each group
        gate_up = _grouped_mm(x[token], self.w13.transpose(1, 2), offs=offsets)  # [T*k, 2*inter]
        hidden = clamped_swiglu(gate_up[:, : self.inter], gate_up[:, self.inter :], self.limit)
        out = _grouped_mm(hidden, self.w2.transpose(1, 2), offs=offsets)  # [T*k, hidden]
        out = out * weights.reshape(-1)[order].unsqueeze(-1)
        return torch.zeros_like(x).index_add_(0, token, out.to(x.dtype))


class Gate(torch.nn.Module):
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
        logits = F.linear(x, self.weight)
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
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        inter, limit = cfg.moe_intermediate_size, cfg.swiglu_limit
        self.gate = Gate(cfg, hashed=cfg.mlp_layer_types[layer] == HASH_MOE)
        self.experts = RoutedExperts(cfg.num_experts, cfg.hidden_size, inter, limit)
        self.shared_experts = SharedExpert(cfg.hidden_size, inter, limit)

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        ids, weights = self.gate(x, token_ids)
        return self.experts(x, ids, weights) + self.shared_experts(x)
