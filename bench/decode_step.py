"""The rollout engine's decode step against the same forward arithmetic in HF transformers, same model, batch, dtype
and threads, in one run; then the engine again under each --try setting.

See docs/benchmarks.md#decode_step."""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from bench.common import SHAPES, SMOKE_VOCAB_RANKS, add_vocab_ranks_argument, build_model, parse_args  # noqa: E402
from bench.common.table import print_table  # noqa: E402

# --try NAME=VALUE: an engine setting rlsearch controls, as the environment or the EngineSpec field it sets. Threads
# and binding are the spec's: the engine writes OMP_NUM_THREADS and the binding from its spec, over the environment
ENVIRONMENT_SETTINGS = {"kvspace": "VLLM_CPU_KVCACHE_SPACE"}
SPEC_SETTINGS = {"eager": ("enforce_eager", lambda value: value.lower() in ("1", "true", "yes")),
                 "dtype": ("dtype", str), "kv_cache_gib": ("kv_cache_gib", float), "threads": ("cpu_threads", int),
                 "bind": ("cpu_threads_bind", str),
                 # vLLM's LoRA on, a random adapter of this rank on every linear layer loaded as an adapter sync does
                 # it (actor.lora.sync=adapter): every request then runs through the LoRA kernels
                 "lora": ("lora_rank", int)}
ADAPTED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_prompts(count: int, length: int, vocab_ranks: int, seed: int = 0) -> list[list[int]]:
    """`count` prompts of `length` random token ids (below 1000 with the whole vocabulary: ordinary BPE pieces)."""
    below = min(vocab_ranks or 1000, 1000)
    rng = random.Random(seed)
    return [[rng.randrange(10, below) for _ in range(length)] for _ in range(count)]


def engine_step_ms(engine, events, prompts: list[list[int]], tokens: int, repeats: int) -> float:
    """A decode step of the engine at len(prompts) sequences: (a run of `tokens` tokens each - its prefill, a run of
    one token) / (tokens - 1), the best of `repeats`, with the prefix cache emptied before each run."""
    from vllm import SamplingParams

    def best_s(max_tokens: int) -> float:
        params = [SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=1.0, seed=i, logprobs=0)
                  for i in range(len(prompts))]
        best = float("inf")
        for _ in range(repeats):
            events.run(engine.reset_prefix_cache())
            started = time.perf_counter()
            outputs = events.run(engine.generate(prompts, params))
            best = min(best, time.perf_counter() - started)
        assert all(len(output.outputs[0].token_ids) == max_tokens for output in outputs)
        return best

    best_s(tokens)  # warm-up
    return (best_s(tokens) - best_s(1)) / (tokens - 1) * 1e3


def hf_step_ms(model, prompts: list[list[int]], tokens: int, repeats: int) -> float:
    """The same arithmetic in HF transformers: the prompts' prefill into a KV cache, then `tokens - 1` forwards of
    one token per sequence (the logits' argmax: the forward alone, the engine's sampler is its own cost), the best of
    `repeats`, per step."""
    import torch

    ids = torch.tensor(prompts)
    best = float("inf")
    with torch.inference_mode():
        for _ in range(repeats + 1):  # the first a warm-up
            output = model(input_ids=ids, use_cache=True)
            cache, logits = output.past_key_values, output.logits[:, -1]
            started = time.perf_counter()
            for _ in range(tokens - 1):
                token = logits.argmax(-1, keepdim=True)
                output = model(input_ids=token, past_key_values=cache, use_cache=True)
                cache, logits = output.past_key_values, output.logits[:, -1]
            best = min(best, time.perf_counter() - started)
    return best / (tokens - 1) * 1e3


def apply_setting(setting: str, spec_fields: dict) -> None:
    """One --try NAME=VALUE: into the environment the engine's process starts with, or into its EngineSpec."""
    name, _, value = setting.partition("=")
    if name in ENVIRONMENT_SETTINGS:
        os.environ[ENVIRONMENT_SETTINGS[name]] = value
    elif name in SPEC_SETTINGS:
        field, parse = SPEC_SETTINGS[name]
        spec_fields[field] = parse(value)
    else:
        raise SystemExit(f"--try {setting}: NAME is one of {', '.join([*ENVIRONMENT_SETTINGS, *SPEC_SETTINGS])}")


def random_adapter(model_path: Path, rank: int) -> tuple[dict, dict]:
    """PEFT-named factors of rank `rank` (N(0, 0.01) each) on every linear layer of the model's transformer layers,
    and their adapter config."""
    import torch
    from safetensors import safe_open

    from rlsearch.megatron.lora import PEFT_PREFIX, peft_config

    generator = torch.Generator().manual_seed(0)
    tensors = {}
    for path in sorted(model_path.glob("*.safetensors")):
        with safe_open(str(path), "pt") as weights:
            for name in weights.keys():
                module = name.removesuffix(".weight")
                if module.rpartition(".")[2] in ADAPTED and name.endswith(".weight"):
                    out, width = weights.get_slice(name).get_shape()
                    for factor, shape in (("A", (rank, width)), ("B", (out, rank))):
                        tensors[f"{PEFT_PREFIX}{module}.lora_{factor}.weight"] = torch.randn(
                            shape, generator=generator) * 0.01
    return tensors, peft_config(rank, 2.0 * rank, tensors)


def engine_steps(args, model_path: Path, settings: list[str], seqs: list[list[list[int]]]) -> list[float]:
    """The engine's decode step (ms) at each batch of `seqs`, under `settings` (the environment restored after)."""
    from rlsearch.loop_thread import LoopThread
    from rlsearch.rollout import EngineSpec, VLLMEngine, fork_vllm_processes_in_this_process

    saved = dict(os.environ)
    fields = dict(dtype=args.dtype, kv_cache_gib=0.25, max_model_len=args.prompt_tokens + args.tokens + 16)
    for setting in settings:
        apply_setting(setting, fields)
    fork_vllm_processes_in_this_process()  # a bench's process holds nothing but the bench
    events = LoopThread("bench-engine")
    print(f"starting the engine ({', '.join(settings) or 'as rlsearch starts it'}) ...", flush=True)

    async def start():
        return VLLMEngine(EngineSpec(str(model_path), **fields))

    engine = events.run(start())
    try:
        if fields.get("lora_rank"):
            events.run(engine.weights.load_adapter(*random_adapter(model_path, fields["lora_rank"])))
        return [engine_step_ms(engine, events, prompts, args.tokens, args.repeats) for prompts in seqs]
    finally:
        events.run(engine.shutdown())
        events.stop()
        os.environ.clear()
        os.environ.update(saved)


def hf_steps(args, model_path: Path, seqs: list[list[list[int]]]) -> tuple[list[float], int]:
    """HF's step (ms) at each batch of `seqs`, on the engine's thread count: (steps, threads)."""
    import torch
    from transformers import AutoModelForCausalLM

    threads = int(os.environ.get("OMP_NUM_THREADS") or len(os.sched_getaffinity(0)))  # the engine process's count
    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, args.dtype)).eval()
    steps = [hf_step_ms(model, prompts, args.tokens, args.repeats) for prompts in seqs]
    del model
    return steps, threads


def report(args, engine: list[float], hf: list[float], threads: int, tried: dict[str, list[float]]) -> None:
    columns = [("seqs", ">5"), ("engine ms/step", ">15.1f"), ("HF ms/step", ">11.1f"), ("engine / HF", ">12.2f"),
               ("engine tokens/s", ">16.0f")]
    print(f"\ndecode step, {args.prompt_tokens}-token prompts, {args.tokens} tokens each, {args.dtype}, "
          f"{threads} threads:")
    print_table(columns, [(n, e, h, e / h, n / e * 1e3) for n, e, h in zip(args.seqs, engine, hf)])
    if 1 in args.seqs and len(args.seqs) > 1:
        one = args.seqs.index(1)
        fixed = engine[one] - hf[one]  # what a step costs the engine beyond the arithmetic at one sequence
        for index, n in enumerate(args.seqs):
            extra = engine[index] - hf[index]
            if n != 1 and extra > 0:
                print(f"at {n} sequences: {extra:.1f} ms a step beyond HF's arithmetic, of which {fixed:.1f} ms is "
                      f"what it is at 1 sequence (scheduling, sampling, Python per step) and {extra - fixed:.1f} ms "
                      "grows with the batch")
    for setting, steps in tried.items():
        print(f"--try {setting}: " + ", ".join(f"{n} seqs {ms:.1f} ms/step ({ms / h:.2f}x HF)"
                                              for n, ms, h in zip(args.seqs, steps, hf)))
    print(f"engine / HF at {args.seqs[-1]} sequences (goal <= 1.5): {engine[-1] / hf[-1]:.2f}")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="", help="an HF model dir (e.g. outputs/assets/smollm2-135m-instruct); "
                        "default: the random Qwen2 of --shape")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    parser.add_argument("--seqs", type=lambda text: [int(n) for n in text.split(",")], default=[1, 16],
                        help="the batch sizes, comma-separated (1 first: what a step costs beyond the arithmetic)")
    parser.add_argument("--tokens", type=int, default=64, help="tokens decoded per sequence (ignore_eos)")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--repeats", type=int, default=2, help="timed runs per measurement; the best counts")
    parser.add_argument("--try", dest="tries", action="append", default=[], metavar="NAME=VALUE[,NAME=VALUE]",
                        help="an engine again under these settings: threads (its EngineSpec.cpu_threads: "
                        "OMP_NUM_THREADS of its workers), bind (EngineSpec.cpu_threads_bind: "
                        "VLLM_CPU_OMP_THREADS_BIND), kvspace (VLLM_CPU_KVCACHE_SPACE, GiB), eager, dtype, "
                        "kv_cache_gib, lora (vLLM's LoRA on and a random adapter of this rank loaded: an adapter "
                        "sync's engine)")
    parser.add_argument("--out", default="outputs/bench", help="where the random model is kept")
    add_vocab_ranks_argument(parser)
    return parser


def main() -> None:
    args = parse_args(_parser(), dict(seqs=[1, 2], tokens=8, prompt_tokens=8, repeats=1,
                                      vocab_ranks=SMOKE_VOCAB_RANKS, tries=["lora=8"]))
    model_path = Path(args.model) if args.model else build_model(args.shape, Path(args.out),
                                                                 vocab_ranks=args.vocab_ranks)
    seqs = [make_prompts(n, args.prompt_tokens, args.vocab_ranks) for n in args.seqs]
    engine = engine_steps(args, model_path, [], seqs)
    hf, threads = hf_steps(args, model_path, seqs)
    tried = {setting: engine_steps(args, model_path, setting.split(","), seqs) for setting in args.tries}
    report(args, engine, hf, threads, tried)


if __name__ == "__main__":
    main()
