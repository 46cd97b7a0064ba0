"""What the benchmarks share: random Qwen2 shapes, built once and cached under an output dir, and their options.

bench.common.memory: the peak-memory probe; bench.common.runs: running the trainer and reading its output;
bench.common.table: the table printer."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

TINY = dict(hidden_size=128, num_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=256,
            tie_word_embeddings=False)
SHAPES = {
    # Qwen2.5-0.5B: hidden 896, 24 layers, 14 heads (2 kv), intermediate 4864, tied embeddings
    "0.5b": dict(hidden_size=896, num_layers=24, num_attention_heads=14, num_key_value_heads=2,
                 intermediate_size=4864, tie_word_embeddings=True),
    # Qwen2.5-7B: hidden 3584, 28 layers, 28 heads (4 kv), intermediate 18944, untied (issue 46's one-GPU goal)
    "7b": dict(hidden_size=3584, num_layers=28, num_attention_heads=28, num_key_value_heads=4,
               intermediate_size=18944, tie_word_embeddings=False),
    "tiny": dict(TINY),
    # the tiny width with 4 layers and tied embeddings: learns the toy task's copies (bench/learning.py)
    "tiny-4l": dict(TINY, num_layers=4, tie_word_embeddings=True),
    # bench/memory.py --fit: the tiny shape with one width changed (heads and hidden; kv heads; head size; FFN)
    "fit-heads": dict(TINY, hidden_size=256, num_attention_heads=8),
    "fit-kv": dict(TINY, num_key_value_heads=4),
    "fit-head-dim": dict(TINY, hidden_size=256),
    "fit-ffn": dict(TINY, intermediate_size=1024),
    # a tiny Qwen3-MoE: 8 routed experts, 2 per token (the actor's MoE path: router, token dispatch, experts)
    "moe-tiny": dict(hidden_size=128, num_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     intermediate_size=256, architecture="qwen3_moe", num_experts=8, experts_per_token=2,
                     expert_intermediate_size=128),
}

# the smoke runs' vocabulary, the tests' (tests/models.py): with the whole one a tiny model's embedding and output
# layers are 39M of its parameters, and the LM head, sampler, loss, checkpoints and weight syncs dominate every step
SMOKE_VOCAB_RANKS = 16384


def build_model(shape: str, out_root: Path, max_positions: int = 0, vocab_ranks: int = 0) -> Path:
    """A random-init Qwen2 of the named shape with the real Qwen2 tokenizer (built offline, reused across runs).

    ``max_positions`` above the default 4096 raises its rotary positions (the same weights: the same seed);
    ``vocab_ranks`` N > 0 keeps the first N BPE ranks of the vocabulary only (TinyModelSpec.vocab_ranks)."""
    from rlsearch.data.tiny_model import TinyModelSpec

    spec = TinyModelSpec(**SHAPES[shape], vocab_ranks=vocab_ranks)
    suffix = vocab_suffix(vocab_ranks)
    if max_positions > spec.max_position_embeddings:
        spec = dataclasses.replace(spec, max_position_embeddings=max_positions)
        suffix += f"-pos{max_positions}"
    return build_random_model(spec, out_root / f"qwen2-{shape}-random{suffix}",
                              f"{shape}-shaped Qwen2 (positions up to {spec.max_position_embeddings})")


def build_random_model(spec, path: Path, what: str = "Qwen2") -> Path:
    """The random-init model of a TinyModelSpec in `path`, built there once (`what` names it in the line it prints)."""
    from rlsearch.data.tiny_model import make_tiny_model

    if not (path / "config.json").is_file():
        print(f"building a random {what} in {path} ...", flush=True)
        make_tiny_model(path, spec)
    return path


def count_params(model_path: Path) -> int:
    """The parameters in a model dir's safetensors shards (read from their headers)."""
    from safetensors import safe_open

    total = 0
    for shard in model_path.glob("*.safetensors"):
        with safe_open(str(shard), "pt") as handle:
            total += sum(math.prod(handle.get_slice(name).get_shape()) for name in handle.keys())
    return total


def vocab_suffix(vocab_ranks: int) -> str:
    """What a random model's dir name adds for a small vocabulary, so that a cached model of the whole vocabulary is
    never taken for one of a small one, nor the other way round."""
    return f"-v{vocab_ranks}" if vocab_ranks else ""


def random_tokens(vocab_ranks: int) -> tuple[int, float]:
    """What a bench's batch of random tokens draws from the model's vocabulary (the whole one, or its first
    `vocab_ranks` ranks): (its ids lie below this, a random model's logprob of one, about -log(vocabulary))."""
    return (vocab_ranks, -math.log(vocab_ranks)) if vocab_ranks else (151_000, -11.93)


def add_vocab_ranks_argument(parser) -> None:
    """--vocab-ranks, the random model's vocabulary; a bench's smoke dict sets it to SMOKE_VOCAB_RANKS."""
    parser.add_argument("--vocab-ranks", type=int, default=0, metavar="N",
                        help="the random model's vocabulary: 0, the whole of Qwen2's (151,643 BPE ranks); N, its "
                             "first N ranks only")


def parse_args(parser, smoke: dict[str, object]):
    """`parser.parse_args()` with a --smoke option: a run of seconds on the tiniest settings, `smoke`'s values over
    the defaults (tests/integration/test_bench_smoke.py runs every bench this way, so that none rots unseen)."""
    shown = ", ".join(f"--{key.replace('_', '-')} {value}" for key, value in smoke.items())
    parser.add_argument("--smoke", action="store_true",
                        help=f"a smoke run of seconds, what the test suite runs: {shown or 'the defaults'}")
    args = parser.parse_args()
    if args.smoke:
        for key, value in smoke.items():
            setattr(args, key, value)
    return args
