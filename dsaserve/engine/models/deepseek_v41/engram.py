"""Engram: n-gram hash lookups gated into the mHC streams (DeepSeek-V4.1's layers 1 and 14).

Every position p hashes the n-grams that end at it (n = 2 .. max_ngram_size), each into
`n_heads` prime-sized bucket ranges of the layer's table, and adds the rows it finds to the
streams, gated by how well they match them. Written from DeepSeek's inference/engram.py
(`build_compressed_token_map`, `compute_hash_multipliers`, `EngramLayout.from_args`,
`NgramHashState.forward`) and inference/model.py (`Engram.forward`):

- ids first go through a token map that collapses tokens which normalize alike (NFKC, NFD,
  accents stripped, lowercase, whitespace runs as one space; a lone space kept): its size is the
  config's `engram_compressed_vocab_size`, and every multiplier derives from it, so a tokenizer
  whose map has another size would rehash every table silently: refused at load.
- multipliers: per layer, numpy's default_rng(10007 * layer) draws max_ngram_size integers below
  (int64 max // compressed vocab) // 2, each then 2x + 1 (odd, and id * multiplier never
  overflows int64).
- hash of the n-gram ending at p on layer l: XOR over shifts s < n of id(p - s) * mult[l, s],
  modulo the prime of (l, n, head), plus the offset of that prime's range (the ranges of all
  (n, head) pairs of a layer laid end to end, primes drawn above `engram_vocab_size` in order,
  never reused). A shift that reaches before the sequence's start reads the pad token's id
  (and so does every longer shift).

The ids before a chunk come from the step (RowSpan.lookback, the request's own tokens), so a
chunk boundary, a prefix-cache resume or a PD handoff (the decode worker has the prompt's ids)
hashes exactly what one unchunked pass hashes.
"""

from __future__ import annotations

import numpy as np
import torch
from tokenizers import Regex, normalizers
from tokenizers import Tokenizer as BackendTokenizer

from dsaserve.engine.model_dir import ConfigError
from dsaserve.engine.models.deepseek_v41.config import EngramConfig

_SENTINEL = "\ue000"  # keeps a token that is one space from collapsing to "" under Strip()


def compressed_token_map(backend: BackendTokenizer) -> list[int]:
    """Token id -> compressed id, ids first seen first (inference/engram.py's
    build_compressed_token_map over the raw Rust tokenizer); its size is max + 1."""
    normalizer = normalizers.Sequence(
        [
            normalizers.NFKC(),
            normalizers.NFD(),
            normalizers.StripAccents(),
            normalizers.Lowercase(),
            normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
            normalizers.Replace(Regex(r"^ $"), _SENTINEL),
            normalizers.Strip(),
            normalizers.Replace(_SENTINEL, " "),
        ]
    )
    keys: dict[str, int] = {}
    lookup = []
    for token_id in range(backend.get_vocab_size(with_added_tokens=True)):
        text = backend.decode([token_id], skip_special_tokens=False)
        if "\ufffd" in text:  # part of a UTF-8 character: nothing to normalize
            key = backend.id_to_token(token_id) or text
        else:
            key = normalizer.normalize_str(text) or text
        lookup.append(keys.setdefault(key, len(keys)))
    return lookup


def _is_prime(n: int) -> bool:
    """Deterministic Miller-Rabin for n < 3.3e24 (these bases)."""
    if n < 2:
        return False
    bases = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41)
    for p in bases:
        if n % p == 0:
            return n == p
    d, r = n - 1, 0
    while d % 2 == 0:
        d, r = d // 2, r + 1
    for a in bases:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(r - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def bucket_primes(cfg: EngramConfig) -> list[list[int]]:
    """[Engram layer][(n-gram size, head) flattened] primes: each the next unused prime above the
    last of its n-gram size, starting above engram_vocab_size (inference/engram.py's
    EngramLayout.from_args)."""
    seen: set[int] = set()
    out = []
    for _ in cfg.layer_ids:
        layer = []
        for _ in range(cfg.max_ngram_size - 1):
            current = cfg.vocab_size - 1
            for _ in range(cfg.n_heads):
                current += 1
                while not _is_prime(current) or current in seen:
                    current += 1
                seen.add(current)
                layer.append(current)
        out.append(layer)
    return out


def hash_multipliers(cfg: EngramConfig) -> torch.Tensor:
    """[Engram layers, max_ngram_size] int64 (inference/engram.py's compute_hash_multipliers)."""
    bound = max(1, (np.iinfo(np.int64).max // cfg.compressed_vocab_size) // 2)
    rows = [
        np.random.default_rng(10007 * layer).integers(
            0, bound, size=(cfg.max_ngram_size,), dtype=np.int64
        )
        * 2
        + 1
        for layer in cfg.layer_ids
    ]
    return torch.from_numpy(np.stack(rows))


class EngramHasher(torch.nn.Module):
    """Each row's hash ids on every Engram layer: [N, Engram layers, hash_cols] int64, already
    offset into its layer's table. The token map arrives at load (from the tokenizer)."""

    token_map: torch.Tensor  # [vocab] int64 compressed ids (a buffer)
    multipliers: torch.Tensor  # [L, max_ngram_size] int64
    primes: torch.Tensor  # [L, hash_cols] int64
    offsets: torch.Tensor  # [L, hash_cols] int64

    def __init__(self, cfg: EngramConfig, vocab_size: int) -> None:
        super().__init__()
        self.cfg = cfg
        primes = bucket_primes(cfg)
        for layer, rows, ps in zip(cfg.layer_ids, cfg.num_embeddings, primes, strict=True):
            if sum(ps) > rows:
                raise ConfigError(
                    f"config.json field `engram_num_embeddings`: layer {layer}'s table has {rows} "
                    f"rows, fewer than its hash buckets ({sum(ps)})"
                )
        self.pad_id = 0  # the pad token's compressed id (set with the token map)
        self.register_buffer("token_map", torch.zeros(vocab_size, dtype=torch.int64), False)
        self.register_buffer("multipliers", hash_multipliers(cfg), False)
        self.register_buffer("primes", torch.tensor(primes, dtype=torch.int64), False)
        offsets = [np.cumsum([0, *ps[:-1]]) for ps in primes]
        self.register_buffer("offsets", torch.tensor(np.array(offsets), dtype=torch.int64), False)

    def set_token_map(self, lookup: list[int]) -> None:
        """The tokenizer's compressed map (compressed_token_map); ids past it (a padded
        vocabulary's rows, never sampled) map to 0."""
        with torch.no_grad():
            self.token_map.zero_()
            n = min(len(lookup), self.token_map.shape[0])
            self.token_map[:n] = torch.tensor(lookup[:n], dtype=torch.int64)
        self.pad_id = int(lookup[self.cfg.pad_token_id])

    def forward(
        self,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        row_req: torch.Tensor,
        req_past: torch.Tensor,
        req_row0: torch.Tensor,
        lookback: torch.Tensor,
    ) -> torch.Tensor:
        """token_ids, positions, row_req [N]; req_past, req_row0 [B]; lookback [B, K] (StepInputs)
        -> hash ids [N, L, hash_cols] int64. A step's rows of a request are consecutive positions
        from its req_past, so the token at p - s is in the step (row - s) or in its lookback."""
        depth = lookback.shape[1]
        past = req_past[row_req]  # [N]
        ids, blocked = [], torch.zeros_like(positions, dtype=torch.bool)
        for shift in range(self.cfg.max_ngram_size):
            q = positions - shift
            in_step = q >= past
            row = (req_row0[row_req] + q - past).clamp(min=0)
            col = (depth - (past - q)).clamp(0, depth - 1)
            token = torch.where(in_step, token_ids[row], lookback[row_req, col])
            blocked = blocked | (q < 0)
            compressed = self.token_map[token.clamp(0, self.token_map.shape[0] - 1)]
            ids.append(torch.where(blocked, self.pad_id, compressed))
        products = torch.stack(ids, dim=-1)[:, None, :] * self.multipliers  # [N, L, max_ngram]
        rolling, hashes = products[..., 0], []
        heads = self.cfg.n_heads
        for n in range(1, self.cfg.max_ngram_size):  # the (n + 1)-gram ending at each row
            rolling = rolling ^ products[..., n]
            primes = self.primes[:, (n - 1) * heads : n * heads]  # [L, heads]
            hashes.append(rolling[..., None] % primes)
        return torch.cat(hashes, dim=-1) + self.offsets
