"""`rlsearch` command line: one entry, a subcommand per user task."""

from __future__ import annotations

import argparse
import os
import sys

from .tools.server_process import add_retriever_arguments

DESCRIPTION = """\
rlsearch trains LLM search agents with reinforcement learning (GRPO): a Megatron-core actor,
vLLM rollout engines with multi-turn tool use, a local retrieval server, all orchestrated by Ray.

Quick start (tiny model + generated corpus on CPU):
  bash examples/run_search_grpo.sh     # train
  bash examples/run_search_eval.sh     # score a model as a search agent (eval only)
"""


def _train(args: argparse.Namespace) -> int:
    from .config import ConfigError, load_train_config
    from .data import DatasetError
    from .trainer import GRPOTrainer

    try:
        config = load_train_config(args.config, args.overrides)
        trainer = GRPOTrainer(config)
    except (ConfigError, DatasetError) as err:
        print(f"rlsearch train: {err}", file=sys.stderr)
        return 2
    summary = trainer.train()
    print(summary.render(), flush=True)
    return 0


def _eval(args: argparse.Namespace) -> int:
    from .config import ConfigError, load_eval_config
    from .data import DatasetError
    from .eval import run_eval

    try:
        config = load_eval_config(args.config, args.overrides)
        summary = run_eval(config)
    except (ConfigError, DatasetError) as err:
        print(f"rlsearch eval: {err}", file=sys.stderr)
        return 2
    print(summary.render(), flush=True)
    return 0


def _make_tiny_model(args: argparse.Namespace) -> int:
    from .data.tiny_model import TinyModelSpec, make_tiny_model

    spec = TinyModelSpec(
        hidden_size=args.hidden_size, num_layers=args.num_layers, num_attention_heads=args.num_heads,
        num_key_value_heads=args.num_kv_heads, intermediate_size=args.intermediate_size,
        tie_word_embeddings=args.tie_word_embeddings, seed=args.seed,
    )
    out = make_tiny_model(args.out, spec)
    print(f"tiny Qwen2 model written to {out}")
    return 0


def _make_toy_data(args: argparse.Namespace) -> int:
    from .data import make_toy_data

    paths = make_toy_data(args.out, seed=args.seed, num_entities=args.num_entities)
    print(f"toy corpus: {paths.corpus}\ntrain: {paths.train}\ntest: {paths.test}")
    return 0


def _serve_retriever(args: argparse.Namespace) -> int:
    from .tools import serve_retriever

    serve_retriever(
        args.corpus, host=args.host, port=args.port, cache_dir=args.cache_dir, backend=args.backend,
        encoder=args.encoder,
    )
    return 0


def _serve_mcp(args: argparse.Namespace) -> int:
    from .tools import serve_mcp

    serve_mcp(args.corpus, args.host, args.port, args.cache_dir, args.backend, args.encoder)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rlsearch", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    train = commands.add_parser(
        "train", help="GRPO training of a search agent",
        description="Train with GRPO. Settings come from a YAML config; any key can be overridden on the command "
        "line as section.key=value, e.g. trainer.total_steps=3 actor.lr=1e-5. Unknown keys are errors.",
    )
    train.add_argument("--config", help="YAML config (see examples/configs/search_grpo_tiny.yaml)")
    train.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted config overrides")
    train.set_defaults(func=_train)

    evaluate = commands.add_parser(
        "eval", help="score a HuggingFace model as a search agent (eval-only, no training)",
        description="Run the agent loop (same protocol, tools and rewards as training) with an HF model in vLLM over "
        "eval files and write summary.json (EM, F1, substring EM, turns, tool calls, invalid-call rate, answer rate, "
        "response tokens, time per data_source), trajectories.jsonl and, with log_dir, TensorBoard scalars. "
        "Re-running into the same output_dir resumes. Keys are overridden as key=value, e.g. output_dir=/tmp/eval "
        "model.path=/ckpt/hf eval.max_examples=50.",
    )
    evaluate.add_argument("--config", help="YAML config (see examples/configs/eval_search.yaml)")
    evaluate.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted config overrides")
    evaluate.set_defaults(func=_eval)

    tiny = commands.add_parser(
        "make-tiny-model", help="write a random-init tiny Qwen2 with the real Qwen2 tokenizer (offline)"
    )
    tiny.add_argument("--out", required=True, help="output HuggingFace model dir")
    tiny.add_argument("--hidden-size", type=int, default=128)
    tiny.add_argument("--num-layers", type=int, default=2)
    tiny.add_argument("--num-heads", type=int, default=4, help="head size = hidden / heads must be >= 32")
    tiny.add_argument("--num-kv-heads", type=int, default=2)
    tiny.add_argument("--intermediate-size", type=int, default=256)
    tiny.add_argument("--tie-word-embeddings", action="store_true")
    tiny.add_argument("--seed", type=int, default=0)
    tiny.set_defaults(func=_make_tiny_model)

    toy = commands.add_parser(
        "make-toy-data", help="generate a corpus about invented entities and a QA set over it"
    )
    toy.add_argument("--out", required=True, help="output dir (corpus.jsonl, train.jsonl, test.jsonl)")
    toy.add_argument("--seed", type=int, default=0)
    toy.add_argument("--num-entities", type=int, default=200)
    toy.set_defaults(func=_make_toy_data)

    serve = commands.add_parser(
        "serve-retriever", help="retrieval server (BM25, dense or hybrid) with Search-R1's POST /retrieve API"
    )
    add_retriever_arguments(serve)
    serve.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    serve.set_defaults(func=_serve_retriever)

    serve_mcp = commands.add_parser(
        "serve-mcp", help="MCP server (streamable HTTP at /mcp) with search and browse over a local corpus",
        description="Serve the corpus over MCP, fully offline: `search` (the local retriever) and `browse` (a whole "
        "document by the URL or id search results show). Agents reach it with tools.mcp.servers: [{url: "
        "http://127.0.0.1:PORT/mcp}], or the trainer starts one itself with tools.mcp.start_local=true.",
    )
    add_retriever_arguments(serve_mcp)
    serve_mcp.add_argument("--port", type=int, default=8001, help="0 picks a free port")
    serve_mcp.set_defaults(func=_serve_mcp)
    return parser


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
