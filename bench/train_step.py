"""Training throughput of the Megatron actor's train step against HF transformers, same model and batch.

See docs/benchmarks.md#train_step."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from bench.common import (  # noqa: E402
    SMOKE_VOCAB_RANKS,
    add_vocab_ranks_argument,
    build_random_model,
    count_params,
    parse_args,
    random_tokens,
    vocab_suffix,
)
from bench.common.memory import memory_mib, pickle_by_value_for_ray, reset_peak_memory  # noqa: E402
from rlsearch.actor.batch import TrainSample  # noqa: E402
from rlsearch.devices import cpu_cores  # noqa: E402

CLIP_RATIO = 0.2
LR = 1e-5
CLIP_GRAD = 1.0
TEMPERATURE = 1.0


# ---- the batch ----------------------------------------------------------------------------------------------------

def make_samples(count: int, min_len: int, max_len: int, seed: int, vocab_ranks: int = 0, group_size: int = 1
                 ) -> list[TrainSample]:
    """Search-agent-like trajectories: a prompt of 60-160 tokens, then alternating model turns (20-80 tokens,
    trained) and tool observations (60-160 tokens, loss-masked), ending on a model turn. Random token ids of the
    model's vocabulary (`vocab_ranks` as --vocab-ranks), old logprobs near a random model's (-log vocab) with noise so
    PPO ratios vary, advantages in [-1.5, 1.5]. `group_size` > 1: GRPO groups of that many, each sample taking its
    group's first prompt (the actor trains it once, actor.merge_prefixes; the HF side pads every sample)."""
    from rlsearch.algo import loss_token_weights

    ids_below, random_logprob = random_tokens(vocab_ranks)

    rng = random.Random(seed)
    generator = torch.Generator().manual_seed(seed)
    samples = []
    for _ in range(count):
        length = rng.randint(min_len, max_len)
        prompt = rng.randint(min(60, length // 3), min(160, length // 3))
        mask = response_mask(rng, length - prompt)
        ids = torch.randint(0, ids_below, (length,), generator=generator).tolist()
        old = (random_logprob + 0.3 * torch.randn(len(mask), generator=generator)).tolist()
        samples.append(TrainSample(ids, prompt, mask, advantage=rng.uniform(-1.5, 1.5), old_logprobs=old))
    if group_size > 1:
        samples = [_in_group(sample, samples[i - i % group_size], i // group_size) for i, sample in enumerate(samples)]
    for sample, weights in zip(samples, loss_token_weights([s.loss_mask for s in samples], "token_mean")):
        sample.token_weights = weights
    return samples


def response_mask(rng: random.Random, length: int) -> list[int]:
    """The loss mask of a search agent's response of `length` tokens: model turns of 20-80 tokens (1) and tool
    observations of 60-160 (0) in turn, ending on a model turn of up to 20 tokens (the final answer)."""
    mask: list[int] = []
    while len(mask) < length:
        mask += [1] * rng.randint(20, 80)
        mask += [0] * rng.randint(60, 160)
    mask = mask[:length]
    mask[-min(20, len(mask)):] = [1] * min(20, len(mask))
    return mask


def _in_group(sample: TrainSample, first: TrainSample, group: int) -> TrainSample:
    """`sample`'s response after the prompt of its group's `first` sample."""
    prompt = first.token_ids[: first.response_start]
    return dataclasses.replace(sample, token_ids=prompt + sample.token_ids[sample.response_start:],
                               response_start=len(prompt), prompt_group=group)


# ---- the HF side --------------------------------------------------------------------------------------------------

class HFTrainer:
    """AutoModelForCausalLM trained as a user of transformers would: padded micro-batches, attention mask, gradient
    accumulation, clip_grad_norm_, AdamW. Runs as a Ray actor (its own process, like the Megatron rank)."""

    def __init__(self, model_path: str, dtype: str, num_threads: int, micro_batch: int, layout: str) -> None:
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(num_threads)
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).to(self.device)
        self.model.config.use_cache = False
        self.autocast = dtype == "bfloat16"  # fp32 master weights + bf16 autocast (Trainer's bf16=True)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=LR, betas=(0.9, 0.999), weight_decay=0.0)
        self.micro_batch = micro_batch
        self.layout = layout
        self.pad_id = self.model.config.pad_token_id or 0

    def threads(self) -> int:
        return torch.get_num_threads()

    def attention(self) -> str:
        return str(self.model.config._attn_implementation)

    def collate(self, samples: Sequence[TrainSample]) -> dict[str, Any]:
        """One padded micro-batch. Per-token tensors are [B, C] over the logit columns kept (zero where padded)."""
        if self.layout == "trl":
            prompt_len = max(s.response_start for s in samples)
            response_len = max(s.response_len for s in samples)
            width, columns = prompt_len + response_len, response_len
        else:
            width = max(len(s.token_ids) for s in samples)
            columns = width - 1
        ids = torch.full((len(samples), width), self.pad_id, dtype=torch.long)
        attention = torch.zeros(len(samples), width, dtype=torch.long)
        labels = torch.zeros(len(samples), columns, dtype=torch.long)
        weights, old, advantages = (torch.zeros(len(samples), columns) for _ in range(3))
        for row, s in enumerate(samples):
            # `first`: where the sequence starts in its row; `col`: the logit column predicting its first response token
            first = prompt_len - s.response_start if self.layout == "trl" else 0
            col = 0 if self.layout == "trl" else s.response_start - 1
            ids[row, first : first + len(s.token_ids)] = torch.tensor(s.token_ids)
            attention[row, first : first + len(s.token_ids)] = 1
            span = slice(col, col + s.response_len)
            labels[row, span] = torch.tensor(s.token_ids[s.response_start :])
            weights[row, span] = torch.tensor(s.token_weights)
            old[row, span] = torch.tensor(s.old_logprobs)
            advantages[row, span] = s.advantage
        position_ids = (attention.cumsum(1) - 1).clamp(min=0)
        batch = dict(
            input_ids=ids, attention_mask=attention, position_ids=position_ids, labels=labels, weights=weights,
            old=old, advantages=advantages,
        )
        batch = {key: value.to(self.device) for key, value in batch.items()}
        batch["logits_to_keep"] = columns + 1 if self.layout == "trl" else 0
        return batch

    def padding(self, samples: Sequence[TrainSample]) -> tuple[int, int, int]:
        """(micro-batches, padded token slots, logit rows) of a step over `samples`."""
        slots = rows = 0
        chunks = [samples[i : i + self.micro_batch] for i in range(0, len(samples), self.micro_batch)]
        for chunk in chunks:
            batch = self.collate(chunk)
            slots += batch["input_ids"].numel()
            rows += batch["labels"].numel()
        return len(chunks), slots, rows

    def train_step(self, samples: Sequence[TrainSample]) -> dict[str, float]:
        from rlsearch.algo import ppo_clip_terms

        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        policy_loss = 0.0
        for start in range(0, len(samples), self.micro_batch):
            batch = self.collate(samples[start : start + self.micro_batch])
            with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
                logits = self.model(
                    input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                    position_ids=batch["position_ids"], logits_to_keep=batch["logits_to_keep"],
                ).logits[:, :-1]
            scaled = logits.float() / TEMPERATURE
            labels = batch["labels"]
            logprobs = -torch.nn.functional.cross_entropy(
                scaled.reshape(-1, scaled.shape[-1]), labels.reshape(-1), reduction="none"
            ).view(labels.shape)
            terms = ppo_clip_terms(logprobs, batch["old"], batch["advantages"], CLIP_RATIO, CLIP_RATIO)
            loss = (terms.per_token_loss * batch["weights"]).sum()
            loss.backward()
            policy_loss += float(loss.detach())
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), CLIP_GRAD)
        self.optimizer.step()
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        return {"policy_loss": policy_loss, "grad_norm": float(grad_norm)}

    def reset_peak_memory(self) -> None:
        reset_peak_memory()

    def memory_mib(self) -> tuple[float, float]:
        return memory_mib()


# ---- driver -------------------------------------------------------------------------------------------------------

def build_model(args: argparse.Namespace) -> Path:
    """--model's HF dir, or a random-init model of the model options (built once into --out)."""
    if args.model:
        return Path(args.model)
    from rlsearch.data.tiny_model import TinyModelSpec

    spec = TinyModelSpec(
        hidden_size=args.hidden, num_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads, intermediate_size=args.intermediate or args.hidden * 3,
        tie_word_embeddings=args.tie_embeddings, architecture=args.architecture, num_experts=args.experts,
        expert_intermediate_size=args.intermediate or args.hidden, vocab_ranks=args.vocab_ranks,
    )
    tag = f"h{spec.hidden_size}-l{spec.num_layers}-a{spec.num_attention_heads}-kv{spec.num_key_value_heads}"
    if spec.architecture != "qwen2":
        tag += f"-e{spec.num_experts}"
    return build_random_model(spec, Path(args.out) / (f"{spec.architecture}-{tag}-i{spec.intermediate_size}"
                                                      f"{'-tied' if spec.tie_word_embeddings else ''}"
                                                      f"{vocab_suffix(spec.vocab_ranks)}"))


def describe_model(model_path: Path, args: argparse.Namespace) -> str:
    config = json.loads((model_path / "config.json").read_text())
    experts = f", {args.experts} experts top-2" if config["model_type"] != "qwen2" and not args.model else ""
    return (f"{config['model_type']} hidden {config['hidden_size']}, {config['num_hidden_layers']} layers, "
            f"{config['num_attention_heads']} heads ({config['num_key_value_heads']} kv){experts}, vocabulary "
            f"{config['vocab_size']:,}")


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """The model options (`build_model`'s): an HF dir, or the shape of a random-init one."""
    model = parser.add_argument_group("model (random-init, the real Qwen vocabulary of 151,680 rows unless "
                                      "--vocab-ranks)")
    model.add_argument("--model", "--model-path", dest="model", default="", metavar="DIR",
                       help="a HuggingFace model dir to time instead of a random-init one (its vocabulary; the "
                            "other model options are ignored), e.g. outputs/assets/smollm2-135m-instruct")
    model.add_argument("--architecture", choices=("qwen2", "qwen3_moe", "qwen2_moe"), default="qwen2")
    model.add_argument("--experts", type=int, default=8, help="MoE: routed experts per layer (top-2)")
    model.add_argument("--hidden", type=int, default=512, help="hidden size")
    model.add_argument("--layers", type=int, default=4)
    model.add_argument("--heads", type=int, default=8, help="attention heads (head dim = hidden / heads >= 32)")
    model.add_argument("--kv-heads", type=int, default=2)
    model.add_argument("--intermediate", type=int, default=0,
                       help="MLP size; 0: 3 x hidden (MoE: each expert's, 0: hidden)")
    model.add_argument("--tie-embeddings", action="store_true", help="share the input embedding and output layer")
    add_vocab_ranks_argument(model)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser)
    batch = parser.add_argument_group("batch")
    batch.add_argument("--sequences", type=int, default=6, help="trajectories per training step")
    batch.add_argument("--min-len", type=int, default=150, help="shortest trajectory (prompt + response tokens)")
    batch.add_argument("--max-len", type=int, default=600, help="longest trajectory")
    batch.add_argument("--seed", type=int, default=0)
    batch.add_argument("--group-size", type=int, default=1,
                       help="GRPO groups of this many trajectories sharing a prompt, which the actor trains once")
    run = parser.add_argument_group("run")
    run.add_argument("--steps", type=int, default=2, help="timed training steps per side")
    run.add_argument("--warmup", type=int, default=1, help="untimed training steps per side first")
    run.add_argument("--threads", type=int, default=0, help="torch threads of each side; 0: RLSEARCH_CPU_CORES or all")
    run.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                     help="auto: CUDA when available (the actor's auto backend and layer spec), else CPU")
    run.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    run.add_argument("--max-tokens-per-microbatch", type=int, default=2048,
                     help="Megatron packing budget (actor.max_tokens_per_microbatch; the config default is 4096): "
                          "2048 holds about as many tokens as an HF micro-batch of 4 and bounds the logits memory")
    run.add_argument("--hf-micro-batch", type=int, default=4, help="sequences per HF micro-batch")
    run.add_argument("--hf-layout", choices=("trl", "right"), default="trl",
                     help="trl: left-padded prompts, logits only for response columns; right: right-padded, all logits")
    run.add_argument("--ep", default="1", help="expert-parallel sizes to time the Megatron actor at, e.g. 1,2 (MoE)")
    run.add_argument("--lora-rank", type=int, default=0,
                     help="also time a Megatron actor training rank-R LoRA adapters on every linear layer (alpha 2R, "
                          "10x the learning rate) on the same batch: its step against full training's")
    run.add_argument("--out", default="outputs/bench", help="where the random model is cached")
    return parser


def report(args: argparse.Namespace, on_gpu: bool, tokens: int, sides: dict, seconds: dict[str, list[float]],
           resident: dict[str, float], peaks: dict[str, float], groups: dict) -> None:
    """Each side's tokens/s and memory, and each Megatron actor's tokens/s against HF's."""
    unit = "CUDA allocated" if on_gpu else "RSS"
    rates = {name: tokens * len(times) / sum(times) for name, times in seconds.items()}
    for name in sides:
        print(
            f"{name:8s}: {rates[name]:7.0f} tokens/s over {args.steps} steps "
            f"(mean {sum(seconds[name]) / args.steps:.2f} s/step); {unit} {resident[name]:.0f} MiB after warm-up "
            f"(first rank), peak {peaks[name]:.0f} MiB in the timed steps (+{peaks[name] - resident[name]:.0f} MiB)"
        )
    print(f"load average at the end: {' '.join(f'{load:.1f}' for load in os.getloadavg())} (1, 5, 15 min)")
    for name in groups:
        print(
            f"{name} / hf training tokens/s (all {tokens} prompt + response tokens per step, padding excluded; "
            f"goal >= 1.0): {rates[name] / rates['hf']:.2f}x"
        )
    if "mg-lora" in groups and "megatron" in groups:
        print(
            f"mg-lora / megatron step time (goal <= 0.8): {rates['megatron'] / rates['mg-lora']:.2f}x; peak {unit} "
            f"{peaks['mg-lora']:.0f} vs {peaks['megatron']:.0f} MiB ({peaks['mg-lora'] / peaks['megatron']:.2f}x)"
        )


def timed_steps(args: argparse.Namespace, hf, groups: dict, first_ranks: dict, samples: list[TrainSample],
                tokens: int) -> tuple[dict, dict[str, list[float]], dict[str, float]]:
    """--warmup then --steps steps of every side, alternated: (the sides, their timed seconds, their memory after
    the warm-up in MiB)."""
    import ray

    resident: dict[str, float] = {}
    sides = {"hf": lambda: ray.get(hf.train_step.remote(samples))}
    sides.update({name: (lambda group=group: group.train_step(samples)) for name, group in groups.items()})
    seconds: dict[str, list[float]] = {name: [] for name in sides}
    order = list(sides)
    for step in range(args.warmup + args.steps):
        timed = step >= args.warmup
        if step == args.warmup:  # optimizer states exist now: the peak below is the training step's own
            ray.get([hf.reset_peak_memory.remote()] +
                    [rank.__ray_call__.remote(lambda w: reset_peak_memory()) for rank in first_ranks.values()])
            resident = {"hf": ray.get(hf.memory_mib.remote())[0]}
            resident.update({name: ray.get(rank.__ray_call__.remote(lambda w: memory_mib()))[0]
                             for name, rank in first_ranks.items()})
        for name in order:
            started = time.perf_counter()
            stats = sides[name]()
            elapsed = time.perf_counter() - started
            if timed:
                seconds[name].append(elapsed)
            loss = stats.get("policy_loss", stats.get("actor/policy_loss"))
            norm = stats.get("grad_norm", stats.get("actor/grad_norm"))
            print(
                f"{'step' if timed else 'warm-up'} {step + 1 - (args.warmup if timed else 0)} {name:8s}: "
                f"{elapsed:6.2f} s  {tokens / elapsed:7.0f} tokens/s  (loss {loss:+.4f}, grad norm {norm:.3f})",
                flush=True,
            )
        order.reverse()
    return sides, seconds, resident


def start_actors(args: argparse.Namespace, model_path: Path, expert_parallel: list[int], threads: int,
                 gpu_share: float, groups: dict, hf, samples: list[TrainSample], tokens: int, response: int,
                 num_packed: int) -> dict:
    """A Megatron actor per --ep (and with --lora-rank the LoRA one) into `groups`, each side's batch layout printed:
    the actors' first ranks."""
    import ray

    from rlsearch.actor import ActorRanks, ActorWorkerSpec, SamplingDistribution
    from rlsearch.config import ActorConfig, AlgoConfig
    from rlsearch.config.schema import LoRAConfig

    algo = AlgoConfig(clip_ratio_low=CLIP_RATIO, clip_ratio_high=CLIP_RATIO)
    full = ActorConfig(lr=LR, clip_grad=CLIP_GRAD, max_tokens_per_microbatch=args.max_tokens_per_microbatch)
    # name -> (what it is, its settings, its ranks)
    actors = {("megatron" if expert_parallel == [1] else f"mg-ep{ep}"): (
        f"{ep} data- and expert-parallel ranks",
        dataclasses.replace(full, num_threads=max(1, threads // ep), dp=ep, ep=ep), ep) for ep in expert_parallel}
    if args.lora_rank:
        actors["mg-lora"] = (f"rank-{args.lora_rank} adapters", dataclasses.replace(
            full, num_threads=threads, lr=10 * LR, transformer_impl="local",
            lora=LoRAConfig(rank=args.lora_rank, alpha=2.0 * args.lora_rank)), 1)
    for name, (what, actor, ranks) in actors.items():
        print(f"starting the Megatron actor {name} (TP1PP1, {what}) ...", flush=True)
        spec = ActorWorkerSpec(str(model_path), args.dtype, actor, algo, SamplingDistribution(TEMPERATURE),
                               args.warmup + args.steps, args.seed)
        groups[name] = ActorRanks(spec, num_gpus_per_rank=gpu_share / ranks)
    first_ranks = {name: group.workers[0] for name, group in groups.items()}
    hf_threads = ray.get(hf.threads.remote())
    hf_batches, hf_slots, hf_rows = ray.get(hf.padding.remote(samples))
    for name, group in groups.items():
        mc_threads = ray.get(first_ranks[name].__ray_call__.remote(lambda worker: torch.get_num_threads()))
        print(
            f"{name}: {num_packed} packed micro-batches (<= {args.max_tokens_per_microbatch} tokens, no padding), "
            f"{response} logit rows, layer spec {group.infos[0].transformer_impl}, {mc_threads} threads a rank",
            flush=True,
        )
    print(
        f"hf      : {hf_batches} micro-batches of <= {args.hf_micro_batch} sequences ({args.hf_layout} layout, "
        f"{ray.get(hf.attention.remote())} attention), {hf_slots} token slots, padding fraction "
        f"{1 - tokens / hf_slots:.1%}, {hf_rows} logit rows, {hf_threads} threads", flush=True,
    )
    return first_ranks


def set_up(args: argparse.Namespace, on_gpu: bool, threads: int) -> tuple[Path, list[TrainSample], int, int, int]:
    """The model and the batch, described: (model path, samples, tokens, response tokens, packed micro-batches)."""
    from rlsearch.actor.batch import Packing, pack_micro_batches

    model_path = build_model(args)
    vocabulary = json.loads((model_path / "config.json").read_text())["vocab_size"] if args.model else 0
    samples = make_samples(args.sequences, args.min_len, args.max_len, args.seed, vocabulary or args.vocab_ranks,
                           args.group_size)
    lengths = [len(s.token_ids) for s in samples]
    tokens = sum(lengths)
    response = sum(s.response_len for s in samples)
    trained = sum(sum(s.loss_mask) for s in samples)
    packed = pack_micro_batches(samples, args.max_tokens_per_microbatch, packing=Packing(merge_prefixes=True))
    num_packed, rows = len(packed), sum(mb.num_tokens for mb in packed)
    print(
        f"model: {describe_model(model_path, args)}, "
        f"{count_params(model_path) / 1e6:.0f}M parameters, {args.dtype}, on {'cuda' if on_gpu else 'cpu'}, "
        f"{threads} torch threads per side; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores",
        flush=True,
    )
    print(
        f"batch: {len(samples)} sequences of {min(lengths)}-{max(lengths)} tokens, {tokens} tokens per step "
        f"({response} response, {trained} trained, {response - trained} in masked observations)"
        + (f"; groups of {args.group_size} share their prompt: {rows} rows a step on the local spec "
           f"({rows / tokens:.0%})" if args.group_size > 1 else ""), flush=True,
    )
    return model_path, samples, tokens, response, num_packed


def uses_gpu(parser: argparse.ArgumentParser, args: argparse.Namespace) -> bool:
    """Whether the sides train on the GPU (--device; CUDA hidden from every process with --device cpu)."""
    if args.device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    elif args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda but CUDA is not available")
    return torch.cuda.is_available() and args.device != "cpu"


def main() -> None:
    parser = _parser()
    args = parse_args(parser, dict(hidden=128, layers=1, heads=4, kv_heads=2, sequences=2, min_len=40, max_len=80,
                                   group_size=2, steps=1, warmup=0, vocab_ranks=SMOKE_VOCAB_RANKS, lora_rank=4))

    on_gpu = uses_gpu(parser, args)
    threads = args.threads or cpu_cores()

    import ray

    from rlsearch.actor import ActorRanks
    from rlsearch.trainer import init_ray

    model_path, samples, tokens, response, num_packed = set_up(args, on_gpu, threads)
    expert_parallel = [int(k) for k in args.ep.split(",")]
    if (args.model or args.architecture == "qwen2") and expert_parallel != [1]:
        parser.error("--ep needs an MoE --architecture")
    if args.lora_rank and (args.architecture != "qwen2" or expert_parallel != [1]):
        parser.error("--lora-rank times a dense model's adapters: with --architecture qwen2 and --ep 1")
    init_ray(num_cpus=max(4, 2 + sum(expert_parallel)))
    pickle_by_value_for_ray()
    gpu_share = 0.5 if on_gpu else 0.0
    hf = ray.remote(HFTrainer).options(num_cpus=1, num_gpus=gpu_share).remote(
        str(model_path), args.dtype, threads, args.hf_micro_batch, args.hf_layout
    )
    groups: dict[str, ActorRanks] = {}
    try:
        first_ranks = start_actors(args, model_path, expert_parallel, threads, gpu_share, groups, hf, samples, tokens,
                                   response, num_packed)
        sides, seconds, resident = timed_steps(args, hf, groups, first_ranks, samples, tokens)
        if not args.steps:
            return
        peaks = {"hf": ray.get(hf.memory_mib.remote())[1]}
        peaks.update({name: ray.get(rank.__ray_call__.remote(lambda w: memory_mib()))[1]
                      for name, rank in first_ranks.items()})
    finally:
        for group in groups.values():
            group.shutdown()
        ray.kill(hf)
    report(args, on_gpu, tokens, sides, seconds, resident, peaks, groups)


if __name__ == "__main__":
    main()
