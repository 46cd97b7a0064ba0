"""A rollout batch's wall time under tool latency: the per-sample agent loop against the turn barrier.

See docs/benchmarks.md#async_rollout."""

from __future__ import annotations

import argparse
import asyncio
import functools
import hashlib
import math
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import fastapi
import httpx
import uvicorn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import SMOKE_VOCAB_RANKS, add_vocab_ranks_argument, parse_args  # noqa: E402
from bench.rollout import SHAPES, BenchEngine, describe, make_agent_loop, prepare_assets, prompt_items  # noqa: E402


def query_latency_s(query: str, max_latency_s: float, model: str) -> float:
    """A fixed latency per query text: uniform over [0, max_latency_s], or exponential with the same mean."""
    fraction = int.from_bytes(hashlib.blake2b(query.encode(), digest_size=4).digest(), "little") / 2**32
    if model == "exponential":
        return -math.log(1.0 - fraction) * max_latency_s / 2
    return fraction * max_latency_s


def ideal_ratio(trajectories, latency_s) -> float:
    """per_sample / turn_barrier wall time if generation and HTTP were free: the barrier waits for each turn's
    slowest search, per-sample for the trajectory whose searches add up to the most."""
    per_trajectory = [[latency_s(call.query) for call in t.dispatched_calls] for t in trajectories]
    turns = max(len(latencies) for latencies in per_trajectory)
    barrier = sum(max((lat[turn] for lat in per_trajectory if turn < len(lat)), default=0.0) for turn in range(turns))
    return max(sum(latencies) for latencies in per_trajectory) / barrier if barrier else 1.0


@contextmanager
def latency_proxy(retriever_url: str, latency_s) -> Iterator[str]:
    """A local HTTP server that forwards ``POST /retrieve`` to the retriever after the queries' latency."""
    app = fastapi.FastAPI()
    client = httpx.AsyncClient(timeout=60.0)

    @app.post("/retrieve")
    async def retrieve(request: fastapi.Request) -> fastapi.Response:
        body = await request.json()
        await asyncio.sleep(max(latency_s(q) for q in body["queries"]))
        answer = await client.post(f"{retriever_url}/retrieve", json=body)
        return fastapi.Response(answer.content, status_code=answer.status_code, media_type="application/json")

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError("the latency proxy did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


# single-token words of the toy corpus: the searcher's queries (7 of them single tokens in a vocabulary of the first
# 16,384 ranks, the smoke run's)
QUERIES = [" " + word for word in (
    "inventor town machine river device born built workshop grain rope rival mayor founded invented bridge tower"
).split()]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    parser.add_argument("--policy", choices=("searcher", "random"), default="searcher",
                        help="searcher: a search every turn; random: the random model with bench/rollout.py's bias")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--turns", type=int, default=6, help="rollout.max_turns of the searcher")
    parser.add_argument("--max-latency-ms", type=float, default=200.0,
                        help="per-query tool latency: 0 to this (uniform), or mean half of it (exponential)")
    parser.add_argument("--latency", choices=("uniform", "exponential"), default="uniform")
    parser.add_argument("--repeats", type=int, default=2, help="timed runs per loop; the best counts")
    parser.add_argument("--out", default="outputs/bench", help="where the random model and toy data are kept")
    add_vocab_ranks_argument(parser)
    return parser


def report(args: argparse.Namespace, seconds: dict[str, float], trajectories: list, latency_s) -> None:
    """per_sample's wall time against turn_barrier's, and the ideal ratio with free generation."""
    ratio = seconds["per_sample"] / seconds["turn_barrier"]
    latency = (f"0-{args.max_latency_ms:g} ms uniform" if args.latency == "uniform"
               else f"exponential, mean {args.max_latency_ms / 2:g} ms")
    print(f"per_sample / turn_barrier wall time, {args.policy} policy, tool latency {latency} (ideal with free "
          f"generation {ideal_ratio(trajectories, latency_s):.2f}; goal <= 0.6): {ratio:.2f}")


def run(args: argparse.Namespace) -> tuple[dict[str, float], list, functools.partial]:
    """Both agent loops over the same items: (the best wall seconds of each, the last trajectories, the latency)."""
    from safetensors.torch import load_file

    from rlsearch.data.tiny_model import search_automaton_weights
    from rlsearch.tools import RetrieverProcess

    out = Path(args.out)
    model_path, toy = prepare_assets(out, args.shape, args.vocab_ranks)
    items = prompt_items(toy, args.prompts, args.group_size)
    rollout = {}
    if args.policy == "searcher":
        rollout = dict(max_turns=args.turns, max_response_tokens=256 * args.turns, max_tokens_per_turn=16,
                       logit_bias={})
    step = 1
    seconds: dict[str, float] = {}
    latency_s = functools.partial(query_latency_s, max_latency_s=args.max_latency_ms / 1000, model=args.latency)
    with RetrieverProcess(str(toy.corpus), cache_dir=str(out / "bm25-cache")) as retriever, \
            latency_proxy(retriever.url, latency_s) as proxy_url:
        print("starting the engine ...", flush=True)
        host = BenchEngine(model_path, max_model_len=512 + 256 * args.turns)
        try:
            if args.policy == "searcher":
                state = load_file(str(model_path / "model.safetensors"))
                tokenizer = host.engine.tokenizer
                queries = [query for query in QUERIES if len(tokenizer.encode(query, add_special_tokens=False)) == 1]
                host.load_weights(search_automaton_weights(state, tokenizer, queries))
            for agent_loop in ("turn_barrier", "per_sample"):
                loop = make_agent_loop(host.engine, proxy_url, agent_loop, **rollout)
                host.run(loop.run(items[: args.group_size], step + 1))  # warm-up
                best = float("inf")
                for _ in range(args.repeats):
                    host.run(host.engine.reset_prefix_cache())
                    started = time.perf_counter()
                    trajectories = host.run(loop.run(items, step))
                    best = min(best, time.perf_counter() - started)
                loop.tools.close()
                seconds[agent_loop] = best
                tool_s = sum(t.tool_s for t in trajectories) / len(trajectories)
                generate_s = sum(t.generate_s for t in trajectories) / len(trajectories)
                print(f"{agent_loop:<12}: {best:6.2f} s for {len(items)} trajectories ({describe(trajectories)}; "
                      f"each waited {generate_s:.2f} s on the engine and {tool_s:.2f} s on searches)", flush=True)
        finally:
            host.close()
    return seconds, trajectories, latency_s


def main() -> None:
    args = parse_args(_parser(), dict(prompts=2, group_size=2, turns=2, repeats=1, vocab_ranks=SMOKE_VOCAB_RANKS))
    report(args, *run(args))



if __name__ == "__main__":
    main()
