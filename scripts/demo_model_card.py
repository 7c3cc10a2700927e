"""The demo model's card (README.md) and loss plot, rendered from train_demo_model.py's log."""

from __future__ import annotations

from pathlib import Path


def write_loss_png(path: Path, log: dict) -> str:
    """Train loss and held-out bits per byte against steps; needs matplotlib (else raises)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6), dpi=100)
    train = log["train"]
    ax.plot(
        [e["step"] for e in train], [e["train_bpb"] for e in train], label="train (running mean)"
    )
    evals = log["evals"]
    ax.plot([e["step"] for e in evals], [e["heldout_bpb"] for e in evals], "o-", label="held-out")
    ax.set_xlabel("step")
    ax.set_ylabel("bits per byte")
    ax.set_ylim(bottom=0, top=min(9.0, max([e["heldout_bpb"] for e in evals] + [1.0]) + 0.5))
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title(
        f"{log['model']}: {log['params']['total'] / 1e6:.1f} M params, {log['steps']} steps"
    )
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path.name


def _curve_rows(log: dict) -> list[str]:
    by_step = {e["step"]: e for e in log["train"]}
    rows = []
    for ev in log["evals"]:
        prior = [s for s in by_step if s <= ev["step"]]
        tr = by_step[max(prior)] if prior else None
        loss = f"{tr['train_loss']:.3f}" if tr else "—"
        rows.append(f"| {ev['step']} | {loss} | {ev['heldout_bpb']:.3f} |")
    return rows


def _architecture_rows(cfg: dict, params: dict, seq_len: int) -> list[str]:
    kinds = {
        "sliding_attention": "sliding",
        "compressed_sparse_attention": "CSA",
        "heavily_compressed_attention": "HCA",
    }
    rates = cfg["compress_rates"]
    rope_dim = int(cfg["head_dim"] * cfg["partial_rotary_factor"])
    rows = [
        (
            "layers",
            f"{cfg['num_hidden_layers']}: "
            + ", ".join(
                f"{kinds[a]} + {'hash MoE' if m == 'hash_moe' else 'routed MoE'}"
                for a, m in zip(cfg["layer_types"], cfg["mlp_layer_types"], strict=True)
            ),
        ),
        ("hidden size", cfg["hidden_size"]),
        (
            "attention",
            f"{cfg['num_attention_heads']} query heads x {cfg['head_dim']} "
            f"(last {rope_dim} RoPE), one shared K=V head, q rank {cfg['q_lora_rank']}, "
            f"output {cfg['o_groups']} groups x rank {cfg['o_lora_rank']}, per-head sinks",
        ),
        ("sliding window", cfg["sliding_window"]),
        (
            "CSA",
            f"1 entry per {rates['compressed_sparse_attention']} tokens (overlapping windows); "
            f"lightning indexer {cfg['index_n_heads']} heads x {cfg['index_head_dim']}, "
            f"top-{cfg['index_topk']}",
        ),
        ("HCA", f"1 entry per {rates['heavily_compressed_attention']} tokens, all visible"),
        (
            "MoE",
            f"{cfg['n_routed_experts']} routed experts (top-{cfg['num_experts_per_tok']}, "
            "sqrtsoftplus, aux-loss-free bias balancing) + 1 shared, "
            f"intermediate {cfg['moe_intermediate_size']}; "
            f"first {cfg['mlp_layer_types'].count('hash_moe')} layers hash-routed",
        ),
        (
            "mHC",
            f"{cfg['hc_mult']} residual streams, {cfg['hc_sinkhorn_iters']} Sinkhorn iterations",
        ),
        (
            "RoPE",
            f"sliding: theta {cfg['rope_theta']:g}; "
            f"CSA/HCA: theta {cfg['compress_rope_theta']:g} + YaRN "
            f"(factor {cfg['rope_parameters']['compress'].get('factor')})",
        ),
        ("vocabulary", f"{cfg['vocab_size']} (256 bytes + bos, eos and 4 chat tokens)"),
        (
            "context",
            f"{cfg['max_position_embeddings']} positions (trained on {seq_len}-token windows)",
        ),
        (
            "parameters",
            f"{params['total']:,} ({params['active_per_token']:,} active per token; "
            f"indexer {params['indexer']:,}, untrained)",
        ),
    ]
    return [f"| {k} | {v} |" for k, v in rows]


def write_card(path: Path, log: dict) -> None:
    args, data, final = log["args"], log["data"], log["final"]
    cfg = log["config"]
    epochs = log["tokens"] / data["train_bytes"]
    env = log["environment"]
    lines = [
        f"# {log['model']}",
        "",
        "dsaserve's built-in demo model: a small DeepSeek-V4 "
        "(every layer kind of the architecture) trained for a",
        "few minutes on Shakespeare, so that `dsaserve up` answers with text rather than noise. "
        "It is a demo of the",
        "serving stack, not a useful language model: it continues plays byte by byte, "
        "and follows no instructions.",
        "",
        "## Data",
        "",
        f"`data/tinyshakespeare.txt` from this repository ({data['bytes']:,} bytes, "
        f"sha256 `{data['sha256'][:16]}…`;",
        "Shakespeare's plays, public domain, from karpathy/char-rnn), one token per byte. "
        "The first",
        f"{data['train_bytes']:,} bytes train; "
        f"the last 5% (bytes {data['heldout_from_byte']:,} to the end,",
        f"{data['heldout_bytes']:,} bytes) are held out and only evaluated.",
        "",
        "## Architecture",
        "",
        "| | |",
        "|---|---|",
        *_architecture_rows(cfg, log["params"], args["seq_len"]),
        "",
        "**The lightning indexer is untrained.** Its top-k choice of compressed entries "
        "has no gradient (DeepSeek",
        "trains it with a separate distillation loss against the attention scores), "
        "so its weights are frozen at",
        "their random initialization; "
        "the rest of the model learned to use whatever entries it selects.",
        "",
        "## Training",
        "",
        "HF transformers' `DeepseekV4ForCausalLM` "
        "(the reference implementation of the architecture) trained by",
        "`scripts/train_demo_model.py`:",
        "",
        f"- {log['steps']} steps of {args['batch_size']} windows x {args['seq_len']} tokens "
        f"(bos + bytes from a random offset): {log['tokens']:,} tokens, "
        f"{epochs:.1f} passes over the training bytes",
        f"- AdamW (betas 0.9/0.95, weight decay {args['weight_decay']} on matrices), "
        f"peak LR {args['lr']:g}, {args['warmup_steps']}-step warmup, "
        f"cosine to {args['min_lr_ratio']:g} x peak, gradient clip {args['grad_clip']:g}",
        f"- {'bf16 autocast, fp32 master weights' if args['device'].startswith('cuda') else 'fp32'}"
        f" on {env['device']}; seed {args['seed']}",
        f"- {log['train_seconds']:.0f} s of training, "
        f"{log['wall_seconds']:.0f} s for the whole run "
        f"(torch {env['torch']}, transformers {env['transformers']})",
        "",
        "## Results",
        "",
        f"**Held-out: {final['heldout_bpb']:.3f} bits per byte** "
        f"(all {final['heldout_bytes']:,} held-out bytes in {final['window']}-byte windows, "
        "each scored from bos; the exported bf16 weights computed in fp32). A",
        "model that knows nothing scores 8 bits per byte.",
        "",
        *(
            [
                f"Periodic evaluations below used the first {args['eval_bytes']:,} held-out bytes, "
                "in bf16 where the training ran in bf16.",
                "",
            ]
            if args.get("eval_bytes")
            else [
                "Periodic evaluations below used all held-out bytes, in the training precision.",
                "",
            ]
        ),
        "| step | train loss (nats/byte, running mean) | held-out bits/byte |",
        "|---:|---:|---:|",
        *_curve_rows(log),
        "",
    ]
    if isinstance(log.get("loss_png"), str) and log["loss_png"].endswith(".png"):
        lines += ["![loss curve](loss.png)", ""]
    check = log.get("engine_check") or {}
    if "engine_bpb" in check:
        lines += [
            f"dsaserve's engine (fp32, CPU) scores the first {check['windows']} held-out windows "
            f"at {check['engine_bpb']:.4f} bits per byte, HF transformers at {check['hf_bpb']:.4f} "
            f"(relative difference {check['rel_diff']:.1e}; logits of the first window differ by "
            f"{check['logits_rel_err']:.1e} relative).",
            "",
        ]
    sample = log.get("sample") or {}
    if "text" in sample:
        lines += [
            f"## Sample (prompt `ROMEO:`, temperature {sample['temperature']}, "
            f"seed {sample['seed']})",
            "",
            "```text",
            sample["text"].replace("```", "'''"),
            "```",
            "",
        ]
    lines += [
        "## Use",
        "",
        "The chat template renders a conversation as a scene: system text opens it, "
        "user turns are ROMEO's",
        "speeches, assistant turns JULIET's (a message's `name` renames the speaker), "
        "and the reply is prompted",
        "with `JULIET:`. The model never learned to end a turn (its data has no eos): "
        "a reply runs to",
        '`max_tokens` unless the request stops it, e.g. with `"stop": ["\\n\\n"]`.',
        "",
        *_mtp_section(log.get("mtp")),
        *_dspark_section(log.get("dspark")),
        "## Limitations",
        "",
        f"- Trained on {args['seq_len']}-token windows: "
        "text far beyond that length is out of distribution.",
        "- Only ASCII Shakespeare: other bytes and languages are noise to it.",
        "- Untrained indexer (above); "
        + ("" if log.get("mtp") else "no multi-token-prediction layer; ")
        + "no quantization.",
        "",
        "## Reproduce",
        "",
        "```",
        "python3 scripts/train_demo_model.py " + " ".join(_cli_args(args)),
        "```",
        "",
        "`train_log.json` holds every logged step and evaluation.",
    ]
    path.write_text("\n".join(lines) + "\n")


def _mtp_section(mtp: dict | None) -> list[str]:
    """The MTP layer: how it was trained, and what speculative decoding gets from it (the
    acceptance bench/spec_decode.py measured, when recorded under mtp.acceptance)."""
    if not mtp:
        return []
    held = mtp["heldout"][-1]["agrees_with_main"] if mtp.get("heldout") else []
    data = mtp.get("data", {})
    lines = [
        "## Multi-token prediction (speculative decoding)",
        "",
        "One MTP layer (`mtp.0.*`, sliding-window attention, score-routed MoE) trained on the",
        "frozen model by `scripts/demo_mtp.py` to draft what speculative decoding accepts: the",
        "model's own greedy token t+2 (from the model's last-layer streams at t and the embedding",
        "of token t+1; cross-entropy to that token plus the KL to the model's distribution), on",
        f"{data.get('sequences', '?')} greedy continuations by the model of "
        f"{data.get('prompt_bytes', '?')}-byte training-text prompts,",
        "and the second draft (the layer applied again, fed its own streams) unrolled as the",
        f"engine runs it: {_mtp_steps(mtp)}. On {data.get('heldout_sequences', '?')} "
        "continuations held apart the first draft then agrees",
        f"with the model's greedy token {held[0] if held else 0:.0%} of the time"
        + (f", the second (after a right first) {held[1]:.0%}." if len(held) > 1 else "."),
        '`--speculative-config \'{"method": "mtp", "num_speculative_tokens": K}\'` drafts with it.',
        "",
    ]
    acc = mtp.get("acceptance")
    if acc:
        lines += [
            f"Greedy continuations of held-out text ({acc['command']}): mean acceptance length "
            "(tokens a",
            "verifying step emits) and decode steps per output token, tokens identical to K = 0:",
            "",
            "| K | acceptance length | acceptance by position | decode steps per token |",
            "|---|---|---|---|",
            *[
                f"| {k} | {row['mean_acceptance_length']:.2f} | "
                f"{', '.join(f'{a:.2f}' for a in row['acceptance_per_position'])} | "
                f"{row['decode_steps_per_output_token']:.2f} |"
                for k, row in acc["rows"].items()
            ],
            "",
        ]
    return lines


def _dspark_section(dspark: dict | None) -> list[str]:
    """The DSpark head of dsaserve-demo-v4-dspark: how it was trained, and what speculative
    decoding gets from it beside the MTP layer (bench/spec_decode.py's rows, when recorded)."""
    if not dspark:
        return []
    a, held, data = dspark["args"], dspark["heldout"], dspark["data"]
    lines = [
        "## DSpark (block drafting, `dsaserve-demo-v4-dspark`)",
        "",
        "`dsaserve-demo-v4-dspark` beside this model is the same model with a DSpark head "
        "instead of the MTP layer",
        "(both live under `mtp.*`, as DeepSeek ships V4-Flash-0731 beside V4-Flash): "
        f"{a['layers']} sliding-window draft layer(s)",
        f"reading layers {dspark['taps']} of the model, blocks of {a['gamma']} (the anchor and "
        f"noise token {dspark['noise_token_id']}), a rank-{a['rank']} Markov head and a",
        "confidence head, trained on the frozen model by `scripts/demo_dspark.py` on a shared "
        f"2-core CPU ({dspark['steps']} steps, {dspark['train_s']:.0f} s in "
        f"{len(dspark.get('runs', [])) or 1} runs of about 5 minutes, each going on from the "
        "last) on",
        f"{data['sequences']} greedy continuations by the model of {a['prompt_bytes']}-byte "
        "training-text prompts: each block row scored on the model's",
        "greedy token (cross-entropy plus the KL to its distribution), the Markov head fed the "
        "accepted prefix, the confidence head",
        "on whether the row's draft is that token. Anchoring a block at every generated token "
        f"of {data['heldout_sequences']} continuations held apart, drafting as the engine does,",
        f"the mean acceptance length is {held['mean_acceptance_length']:.2f} (by position: "
        f"{', '.join(f'{v:.2f}' for v in held['acceptance_per_position'])}); decoding anchors "
        "its blocks where the last one's",
        "run ended, more often at a hard token, so a decode's acceptance is lower (the table).",
        '`--speculative-config \'{"method": "dspark"}\'` drafts with it (gamma 5, or '
        "`num_speculative_tokens` up to 5).",
        "",
    ]
    acc = dspark.get("acceptance")
    if acc:
        lines += [
            f"Greedy continuations of held-out text ({acc['command']}), both heads, tokens "
            "identical to no speculation:",
            "",
            "| drafting | acceptance length | acceptance by position | decode steps per token |",
            "|---|---|---|---|",
            *[
                f"| {name} | {row['mean_acceptance_length']:.2f} | "
                f"{', '.join(f'{v:.2f}' for v in row['acceptance_per_position'])} | "
                f"{row['decode_steps_per_output_token']:.2f} |"
                for name, row in acc["rows"].items()
            ],
            "",
        ]
    return lines


def _mtp_steps(mtp: dict) -> str:
    """The MTP layer's steps, and how many of them its last run took when it went on from an
    earlier one's layer (whose training may have been another: train_log.json says)."""
    runs = mtp.get("runs", [])
    if len(runs) > 1 and runs[-1].get("resumed"):
        return (
            f"{mtp['steps']} steps, the last {runs[-1]['steps']} of them so (the run went on "
            f"from the layer of {len(runs) - 1} earlier runs: train_log.json, mtp.runs)"
        )
    return f"{mtp.get('steps', '?')} steps"


def _cli_args(args: dict) -> list[str]:
    shown = ["device", "steps", "batch_size", "seq_len", "time_budget_s", "lr", "seed", "smoke"]
    out = []
    for key in shown:
        value = args.get(key)
        if value is None or value is False:
            continue
        flag = "--" + key.replace("_", "-")
        out.append(
            flag
            if value is True
            else f"{flag} {value:g}"
            if isinstance(value, float)
            else f"{flag} {value}"
        )
    out.append("--out dsaserve-demo-v4")
    return out
