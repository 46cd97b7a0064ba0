"""Agent-loop throughput against bare generation of the same tokens, on the same engine, in one run.

See docs/benchmarks.md#rollout."""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from bench.common import SHAPES, SMOKE_VOCAB_RANKS, add_vocab_ranks_argument, build_model, parse_args  # noqa: E402

# the tool path on a random model (as the tests' TEST_ROLLOUT), with room for several turns
ROLLOUT = dict(
    max_turns=4, max_response_tokens=512, max_tokens_per_turn=48, assistant_prefix="<search>",
    logit_bias={"</search>": 12.0},
)


class BenchEngine:
    """One rollout engine on its own event loop thread, as a rollout worker holds it."""

    def __init__(self, model_path: Path, max_model_len: int) -> None:
        from rlsearch.loop_thread import LoopThread
        from rlsearch.rollout import EngineSpec, VLLMEngine, fork_vllm_processes_in_this_process

        fork_vllm_processes_in_this_process()  # a bench's process holds nothing but the bench
        self.events = LoopThread("bench-engine")

        async def start():
            return VLLMEngine(EngineSpec(str(model_path), kv_cache_gib=0.25, max_model_len=max_model_len))

        self.engine = self.events.run(start())

    def run(self, coroutine: Coroutine[Any, Any, Any]) -> Any:
        return self.events.run(coroutine)

    def load_weights(self, state: dict) -> None:
        """Replace the engine's weights (HF names) through the weight-sync path."""
        from rlsearch.weights.bucket import pack_bucket

        async def load() -> None:
            await self.engine.weights.begin()
            await self.engine.weights.load_bucket(pack_bucket(list(state.items())))
            await self.engine.weights.finish()

        self.run(load())

    def close(self) -> None:
        self.run(self.engine.shutdown())
        self.events.stop()


def prepare_assets(out: Path, shape: str, vocab_ranks: int):
    """The random model (cached under ``out``) and the toy data."""
    from rlsearch.data import make_toy_data

    return build_model(shape, out, vocab_ranks=vocab_ranks), make_toy_data(out / "toy", seed=0)


def prompt_items(toy, prompts: int, group_size: int) -> list:
    from rlsearch.data import load_qa_dataset
    from rlsearch.rollout import PromptItem

    examples = load_qa_dataset(toy.train)[:prompts]
    return [PromptItem(e.id, e.question, group_id=g, sample_index=s) for g, e in enumerate(examples)
            for s in range(group_size)]


def make_agent_loop(engine, retriever_url: str, agent_loop: str, seed: int = 1, **rollout):
    """The agent loop of a rollout worker (search tool over HTTP, Search-R1 protocol) on ``engine``; ``rollout``
    overrides the ROLLOUT settings."""
    from rlsearch.config import RetrieverConfig, RolloutConfig, ToolsConfig
    from rlsearch.rollout import AgentLoop
    from rlsearch.tools import build_registry, make_protocol

    tools = build_registry(ToolsConfig(), RetrieverConfig(topk=3, timeout_s=60.0), retriever_url)
    protocol = make_protocol("search_r1", tools.specs)
    return AgentLoop(engine, protocol, tools, RolloutConfig(**{**ROLLOUT, **rollout}, agent_loop=agent_loop), seed)


def describe(trajectories) -> str:
    n = len(trajectories)
    turns = sum(len(t.turns) for t in trajectories) / n
    calls = sum(len(t.tool_calls) for t in trajectories) / n
    observation = sum(len(t.loss_mask) - sum(t.loss_mask) for t in trajectories) / n
    return f"{turns:.2f} turns, {calls:.2f} tool calls, {observation:.0f} observation tokens per trajectory"


def bare_generate_params(loop, trajectories, step: int) -> list:
    """Per trajectory: the agent loop's sampling (seed of its first turn), for all of its sampled tokens, no stops."""
    from vllm import SamplingParams

    from rlsearch.rollout import request_seed

    config = loop.config
    return [
        SamplingParams(
            max_tokens=sum(t.loss_mask), ignore_eos=True, temperature=config.temperature, top_p=config.top_p,
            logprobs=0, logit_bias=loop.logit_bias, seed=request_seed(loop.seed, step, t.group_id, t.sample_index, 0),
        )
        for t in trajectories
    ]


def bench_endpoint(args, host: BenchEngine, retriever_url: str, items: list, step: int) -> None:
    """The built-in loop and the Search-R1 agent through the session endpoint, on the same batch and engine."""
    from examples.agents.search_r1 import agent
    from rlsearch.rollout.session import AgentRunner, SessionEndpoint

    loop = make_agent_loop(host.engine, retriever_url, args.agent_loop)
    endpoint = SessionEndpoint(host.engine, loop.tools, loop.config, loop.seed, loop.logit_bias)
    runner = AgentRunner(endpoint, agent, loop.prompt_messages, loop.config)
    try:
        timings = {}
        for name, driver in (("built-in loop", loop), ("endpoint agent", runner)):
            driver_s, trajectories = timed(host, driver, items, step, args.repeats)
            timings[name] = (driver_s, trajectories)
            sampled = sum(sum(t.loss_mask) for t in trajectories)
            print(f"{name}: {len(items)} trajectories, {describe(trajectories)}; {sampled} sampled tokens in "
                  f"{driver_s:.2f} s = {sampled / driver_s:.0f} tokens/s", flush=True)
        (loop_s, builtin), (endpoint_s, agents) = timings.values()
        same = all(a.token_ids == b.token_ids and a.loss_mask == b.loss_mask for a, b in zip(builtin, agents))
        print(f"token ids and loss masks identical: {same}")
    finally:
        host.run(endpoint.stop())
        runner.stop()
        loop.tools.close()
    ratio = loop_s / endpoint_s  # the same tokens either way (checked above)
    print(f"endpoint tokens/s / built-in loop tokens/s (goal >= 0.9): {ratio:.2f}")


def timed(host: BenchEngine, driver, items: list, step: int, repeats: int) -> tuple[float, list]:
    """Best wall time of ``repeats`` runs of ``driver`` (after a warm-up), and the trajectories."""
    host.run(driver.run(items[:4], step + 1))
    best, trajectories = float("inf"), []
    for _ in range(repeats):
        host.run(host.engine.reset_prefix_cache())
        started = time.perf_counter()
        trajectories = host.run(driver.run(items, step))
        best = min(best, time.perf_counter() - started)
    return best, trajectories


def run_pool(model_path: Path, retriever_url: str, items: list, args, engines: int, tp: int):
    """The rollout of ``items`` through a pool of ``engines`` x TP ``tp`` (best of --repeats after a warm-up):
    (seconds, trajectories, last_metrics of the best run)."""
    from rlsearch.config import ModelConfig, RetrieverConfig, RolloutConfig, ToolsConfig
    from rlsearch.rollout import EnginePool, EngineSpec

    rollout = RolloutConfig(**ROLLOUT, agent_loop=args.agent_loop, num_engines=engines, tensor_parallel_size=tp,
                            groups_per_engine=args.groups_per_engine, cpu_threads_bind=args.cpu_threads_bind)
    tools = ToolsConfig(retriever=RetrieverConfig(url=retriever_url, topk=3, timeout_s=60.0))
    print(f"starting {engines} engine(s) x TP{tp} ...", flush=True)
    spec = EngineSpec.from_config(ModelConfig(path=str(model_path)), rollout, seed=1)
    pool = EnginePool(spec, rollout, tools, seed=1)
    try:
        pool.generate(items[: args.group_size * engines], 2)  # warm-up: a group per engine
        best_s, trajectories, metrics = float("inf"), [], {}
        for _ in range(args.repeats):
            started = time.perf_counter()
            run = pool.generate(items, 1)
            elapsed = time.perf_counter() - started
            if elapsed < best_s:
                best_s, trajectories, metrics = elapsed, run, pool.last_metrics()
    finally:
        pool.shutdown()
    return best_s, trajectories, metrics


def bench_pool(args, model_path: Path, retriever_url: str, items: list) -> None:
    """--engines / --tp: 1 engine x TP1, then --engines x --tp, in this run."""
    from rlsearch.ray_setup import init_ray

    init_ray(num_cpus=max(args.engines * args.tp, 1))
    one_s, one, _ = run_pool(model_path, retriever_url, items, args, 1, 1)
    many_s, many, metrics = run_pool(model_path, retriever_url, items, args, args.engines, args.tp)
    sampled = sum(sum(t.loss_mask) for t in one)
    print(f"1 engine x TP1: {len(one)} trajectories, {describe(one)}; {sampled} sampled tokens in {one_s:.2f} s = "
          f"{sampled / one_s:.0f} tokens/s")
    many_sampled = sum(sum(t.loss_mask) for t in many)
    print(f"{args.engines} engine(s) x TP{args.tp}: {many_sampled} sampled tokens in {many_s:.2f} s = "
          f"{many_sampled / many_s:.0f} tokens/s")
    for engine in range(args.engines):
        key = f"rollout/engine{engine}"
        print(f"  engine {engine}: {metrics[f'{key}/groups']:.0f} groups, {metrics[f'{key}/trajectories']:.0f} "
              f"trajectories, {metrics[f'{key}/sampled_tokens']:.0f} sampled tokens, busy "
              f"{metrics[f'{key}/busy_fraction']:.0%}")
    same = all(a.response_ids == b.response_ids for a, b in zip(one, many, strict=True))
    print(f"trajectories identical to 1 engine x TP1: {same}")
    ratio = (many_sampled / many_s) / (sampled / one_s)
    print(f"{args.engines} x TP{args.tp} tokens/s / 1 x TP1 tokens/s: {ratio:.2f}")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--agent-loop", choices=("per_sample", "turn_barrier"), default="per_sample")
    parser.add_argument("--repeats", type=int, default=2, help="timed runs per side; the best counts")
    parser.add_argument("--out", default="outputs/bench", help="where the random model and toy data are kept")
    parser.add_argument("--endpoint", action="store_true", help="bench the user-agent endpoint path (see above)")
    parser.add_argument("--engines", type=int, default=0, help="bench an EnginePool of this many engines (see above)")
    parser.add_argument("--tp", type=int, default=1, help="tensor_parallel_size of each pooled engine")
    parser.add_argument("--groups-per-engine", type=int, default=0, help="rollout.groups_per_engine of the pool")
    parser.add_argument("--cpu-threads-bind", default="", help="rollout.cpu_threads_bind of TP engines, e.g. '0|1'")
    add_vocab_ranks_argument(parser)
    return parser


def agent_and_bare(args: argparse.Namespace, host: BenchEngine, retriever_url: str, items: list,
                   step: int) -> tuple[int, float, int, float]:
    """The agent loop's best time, then bare generation's of the same tokens: (sampled, agent s, generated, bare s)."""
    loop = make_agent_loop(host.engine, retriever_url, args.agent_loop)
    host.run(loop.run(items[: args.group_size], step + 1))  # warm-up
    agent_s, trajectories = float("inf"), []
    for _ in range(args.repeats):
        host.run(host.engine.reset_prefix_cache())
        started = time.perf_counter()
        trajectories = host.run(loop.run(items, step))
        agent_s = min(agent_s, time.perf_counter() - started)
    sampled = sum(sum(t.loss_mask) for t in trajectories)
    print(f"agent ({args.agent_loop}): {len(items)} trajectories, {describe(trajectories)}; "
          f"{sampled} sampled tokens in {agent_s:.2f} s = {sampled / agent_s:.0f} tokens/s", flush=True)

    prompts = [t.prompt_ids for t in trajectories]
    bare_s = float("inf")
    for _ in range(args.repeats):
        params = bare_generate_params(loop, trajectories, step)
        host.run(host.engine.reset_prefix_cache())
        started = time.perf_counter()
        outputs = host.run(host.engine.generate(prompts, params))
        bare_s = min(bare_s, time.perf_counter() - started)
    generated = sum(len(output.outputs[0].token_ids) for output in outputs)
    assert generated == sampled, f"bare generate gave {generated} tokens for {sampled} asked"
    print(f"bare generate: the same {generated} tokens in {bare_s:.2f} s = {generated / bare_s:.0f} tokens/s",
          flush=True)
    loop.tools.close()
    return sampled, agent_s, generated, bare_s


def main() -> None:
    args = parse_args(_parser(), dict(prompts=2, group_size=2, repeats=1, vocab_ranks=SMOKE_VOCAB_RANKS))

    from rlsearch.tools import RetrieverProcess

    out = Path(args.out)
    model_path, toy = prepare_assets(out, args.shape, args.vocab_ranks)
    items = prompt_items(toy, args.prompts, args.group_size)
    step = 1
    with RetrieverProcess(str(toy.corpus), cache_dir=str(out / "bm25-cache")) as retriever:
        if args.engines or args.tp > 1:
            args.engines = max(args.engines, 1)
            bench_pool(args, model_path, retriever.url, items)
            return
        print("starting the engine ...", flush=True)
        host = BenchEngine(model_path, max_model_len=1024)
        if args.endpoint:
            try:
                bench_endpoint(args, host, retriever.url, items, step)
            finally:
                host.close()
            return
        try:
            sampled, agent_s, generated, bare_s = agent_and_bare(args, host, retriever.url, items, step)
        finally:
            host.close()
    ratio = (sampled / agent_s) / (generated / bare_s)
    print(f"agent-loop tokens/s / bare generate tokens/s (goal >= 0.85): {ratio:.2f}")


if __name__ == "__main__":
    main()
