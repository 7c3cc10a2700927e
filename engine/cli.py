"""The engine's CLI verbs: `dsaserve generate` (offline) and `dsaserve make-tiny-model`."""

from __future__ import annotations

import argparse
import json
import sys


def add_generate_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="model directory (default: the built-in tiny model, made on first use)")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", action="append", help="prompt text (repeat for several prompts)")
    source.add_argument("--prompt-token-ids", action="append", help="comma-separated token ids (repeatable)")
    source.add_argument("--chat", help='messages as JSON, e.g. \'[{"role": "user", "content": "Hi"}]\'')
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--seed", type=int)
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--ignore-eos", action="store_true")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--json", action="store_true", help="print one JSON object per prompt")


def run_generate(args: argparse.Namespace) -> None:
    from engine import LLM, SamplingParams
    from engine.tiny_model import default_tiny_model_dir
    from engine.tokenizer import ChatTemplateError

    llm = LLM(args.model or default_tiny_model_dir(), device=args.device, dtype=args.dtype)
    if args.chat is not None:
        try:
            prompts = [llm.tokenizer.encode_chat(json.loads(args.chat))]
        except (json.JSONDecodeError, ChatTemplateError) as e:
            sys.exit(f"--chat: {e}")
    elif args.prompt_token_ids:
        prompts = [[int(t) for t in p.split(",") if t.strip()] for p in args.prompt_token_ids]
    else:
        prompts = args.prompt
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed, stop=args.stop, ignore_eos=args.ignore_eos)
    for result in llm.generate(prompts, params):
        if args.json:
            print(json.dumps({"token_ids": result.token_ids, "text": result.text,
                              "finish_reason": result.finish_reason}), flush=True)
        else:
            print(result.text, flush=True)


def add_make_tiny_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dir", help="output directory")
    parser.add_argument("--seed", type=int, default=0)


def run_make_tiny_model(args: argparse.Namespace) -> None:
    from engine.tiny_model import make_tiny_model

    print(make_tiny_model(args.dir, seed=args.seed))
