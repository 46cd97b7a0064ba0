"""The agent loop at long horizon: tokens/s against bare vLLM, prefix-cache hits, loop overhead, memory.

See docs/benchmarks.md#long_horizon."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import hashlib
import json
import math
import os
import random
import re
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from bench.common import SHAPES, SMOKE_VOCAB_RANKS, add_vocab_ranks_argument, build_model, parse_args  # noqa: E402
from bench.common.memory import peak_rss_gib  # noqa: E402
from bench.common.table import print_table  # noqa: E402
from bench.rollout import BenchEngine  # noqa: E402
from rlsearch.tools import Document, Tool, ToolCall, ToolResult, ToolSpec  # noqa: E402

CHOICES = 4  # candidate words per query position
DOCS, DOC_WORDS = 2, 10  # what a search returns
BUCKET = 8  # turns per row of the prefix-cache table
GPU_BLOCK = 16  # vLLM's default KV block size on GPU, for the block bound of a GPU engine
STEP = 1
RUN_COLUMNS = [("run", "<22"), ("wall s", ">7.2f"), ("sampled", ">8"), ("tok/s", ">7.0f"), ("tool-only s", ">11.2f"),
               ("tok/s excl tools", ">16.0f"), ("engine wait s", ">13.2f"), ("tool wait s", ">11.2f"),
               ("overhead ms/turn", ">16.2f"), ("CPU s", ">6.1f")]
MAX_POSITIONS = 16384  # the tiny shapes' 4096 positions hold about 45 turns of 24 tokens with their observations


def single_token_words(tokenizer, count: int, seed: int) -> list[str]:
    """``count`` distinct lowercase words that are one token each after a space, drawn with ``seed``."""
    words = []
    for token_id in range(1000, 40000):
        text = tokenizer.decode([token_id])
        if re.fullmatch(r" [a-z]{4,9}", text) and not any(tag in text for tag in ("search", "answer", "inform")):
            if tokenizer.encode(text, add_special_tokens=False) == [token_id]:
                words.append(text)
    if len(words) < count:
        raise ValueError(f"only {len(words)} single-token words; {count} needed")
    return random.Random(seed).sample(words, count)


def searcher_weights(state: dict, tokenizer, query_words: list[list[str]]) -> dict:
    """The tiny model's weights (HF names, untied) rewired into a policy that writes ``<search>`` then one word of
    each ``query_words[i]`` in turn then ``</search>``, and ``<search>`` again after an observation.

    With the attention and MLP outputs zeroed the hidden state is the last token's embedding (a basis direction per
    state), and the output rows of that state's successors point along it, so each token's successor is a table.
    """
    import torch

    def token(text: str) -> int:
        ids = tokenizer.encode(text, add_special_tokens=False)
        if len(ids) != 1:
            raise ValueError(f"{text!r} is {len(ids)} tokens; the policy needs single tokens")
        return ids[0]

    positions = [list(words) for words in query_words]
    # (source tokens, successors): "<search>" -> w1 -> ... -> wk -> "</search>"; ">\n\n" (end of observation) -> "<"
    table = [((">",), positions[0])]
    table += [(tuple(positions[i]), positions[i + 1]) for i in range(len(positions) - 1)]
    table += [(tuple(positions[-1]), ["</"]), (("</", "<"), ["search"]), (("search",), [">"]), ((">\n\n",), ["<"])]
    state = {name: tensor.clone() for name, tensor in state.items()}
    embed, head = state["model.embed_tokens.weight"], state["lm_head.weight"]
    if len(table) > embed.shape[1]:
        raise ValueError(f"{len(table)} states do not fit hidden size {embed.shape[1]}: fewer tokens per turn")
    for name, tensor in state.items():
        if name.endswith(("self_attn.o_proj.weight", "mlp.down_proj.weight")):
            tensor.zero_()
    for direction, (sources, successors) in enumerate(table):
        basis = torch.zeros(embed.shape[1], dtype=embed.dtype)
        basis[direction] = 1.0
        for source in sources:
            embed[token(source)] = basis
        for successor in successors:
            head[token(successor)] = 4.0 * basis
    return state


class FakeSearch(Tool):
    """``search`` answered in-process after a lognormal latency; documents and latency are functions of the query."""

    def __init__(self, words: list[str], median_s: float, sigma: float, seed: int) -> None:
        self.spec = ToolSpec("search", "search a toy corpus")
        self.words, self.median_s, self.sigma, self.seed = words, median_s, sigma, seed
        self.enabled = True  # False: answer at once
        self.intervals: list[tuple[float, float]] = []  # (start, end) of every batch, perf_counter
        self._lock = threading.Lock()

    def _rng(self, query: str) -> random.Random:
        digest = hashlib.blake2b(f"{self.seed}/{query}".encode(), digest_size=8).digest()
        return random.Random(int.from_bytes(digest, "little"))

    def latency_s(self, query: str) -> float:
        fraction = min(max(self._rng("latency/" + query).random(), 1e-9), 1 - 1e-9)
        return self.median_s * math.exp(self.sigma * statistics.NormalDist().inv_cdf(fraction))

    def documents(self, query: str) -> list[Document]:
        rng = self._rng(query)
        return [
            Document(text=" ".join(rng.choice(self.words).strip() for _ in range(DOC_WORDS)),
                     title=rng.choice(self.words).strip().title(), id=f"d{rank}")
            for rank in range(DOCS)
        ]

    def run_batch(self, calls: list[ToolCall]) -> list[ToolResult]:
        started = time.perf_counter()
        if self.enabled:
            time.sleep(max(self.latency_s(call.query) for call in calls))
        results = [ToolResult(documents=self.documents(call.query)) for call in calls]
        with self._lock:
            self.intervals.append((started, time.perf_counter()))
        return results


@dataclasses.dataclass
class Request:
    seed: int
    context: int  # prompt tokens
    sampled: list[int]
    cached: int  # RequestOutput.num_cached_tokens
    start: float
    end: float


class RecordingEngine:
    """The rollout engine, recording every request (the loop drops vLLM's RequestOutput after its turn)."""

    def __init__(self, engine) -> None:
        self._engine = engine
        self.requests: list[Request] = []

    def __getattr__(self, name: str):
        return getattr(self._engine, name)

    async def generate(self, prompts: list[list[int]], sampling_params: list) -> list:
        started = time.perf_counter()
        outputs = await self._engine.generate(prompts, sampling_params)
        ended = time.perf_counter()
        for prompt, params, output in zip(prompts, sampling_params, outputs):
            self.requests.append(Request(params.seed, len(prompt), list(output.outputs[0].token_ids),
                                         output.num_cached_tokens or 0, started, ended))
        return outputs


@dataclasses.dataclass
class Run:
    name: str
    wall_s: float
    sampled: int
    requests: list[Request]
    tool_intervals: list[tuple[float, float]]
    start: float
    per_turn: dict  # (trajectory, turn) -> Request
    overhead_ms: float  # mean loop time per turn outside engine and tool waits
    waits: list[tuple[float, float]]  # per trajectory (engine wait s, tool wait s)
    cpu_s: float = 0.0  # CPU seconds of this process and the engine's over the run

    @property
    def tokens_per_s(self) -> float:
        return self.sampled / self.wall_s

    @property
    def tool_only_s(self) -> float:
        """Time some tool call ran while no request was on the engine."""
        tools = union(self.tool_intervals)
        engine = union([(r.start, r.end) for r in self.requests])
        return measure(tools) - measure(intersect(tools, engine))

    @property
    def tokens_per_s_excl_tools(self) -> float:
        return self.sampled / (self.wall_s - self.tool_only_s)


def union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def intersect(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Intersection of two disjoint sorted interval lists."""
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if start < end:
            out.append((start, end))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def measure(intervals: list[tuple[float, float]]) -> float:
    return sum(end - start for start, end in intervals)


def cpu_seconds() -> float:
    """CPU seconds (user + system) used so far by this process and its descendants (the engine core)."""
    import psutil

    total = 0.0
    for process in [psutil.Process(), *psutil.Process().children(recursive=True)]:
        try:
            times = process.cpu_times()
            total += times.user + times.system
        except psutil.Error:
            pass
    return total


def seed_map(loop_seed: int, trajectories: int, turns: int, step: int) -> dict[int, tuple[int, int]]:
    from rlsearch.rollout import request_seed

    seeds = {request_seed(loop_seed, step, i, 0, turn): (i, turn) for i in range(trajectories) for turn in range(turns)}
    assert len(seeds) == trajectories * turns, "request seeds collide: choose another --seed"
    return seeds


def run_agent(name: str, host: BenchEngine, recorder: RecordingEngine, loop, tool: FakeSearch, items, turns: int,
              profile=None) -> tuple[Run, list]:
    host.run(host.engine.reset_prefix_cache())
    recorder.requests, tool.intervals = [], []

    async def rollout():
        if profile is not None:
            profile.enable()  # the event loop's thread: the loop, vLLM's output handling, the engine client
        try:
            return await loop.run(items, STEP)
        finally:
            if profile is not None:
                profile.disable()

    trajectories, start, wall, cpu = timed(host, rollout())
    waits = [(trajectory.generate_s, trajectory.tool_s) for trajectory in trajectories]
    per_turn, overhead_ms = turn_overheads(loop, recorder, trajectories, turns, start, [sum(w) for w in waits])
    sampled = sum(sum(t.loss_mask) for t in trajectories)
    run = Run(name, wall, sampled, list(recorder.requests), list(tool.intervals), start, per_turn, overhead_ms,
              waits, cpu)
    return run, trajectories


def timed(host: BenchEngine, coroutine) -> tuple:
    """(the coroutine's result on the engine's loop, its start on the perf counter, wall seconds, CPU seconds)."""
    cpu, start = cpu_seconds(), time.perf_counter()
    result = host.run(coroutine)
    return result, start, time.perf_counter() - start, cpu_seconds() - cpu


def turn_overheads(loop, recorder: RecordingEngine, trajectories, turns: int, start: float,
                   waited: list[float]) -> tuple[dict, float]:
    """The run's requests by (trajectory, turn), and the mean per-turn time of a trajectory outside the waits in
    `waited` (its generate and tool seconds), in ms: from the run's start to its last request's end."""
    seeds = seed_map(loop.seed, len(trajectories), turns, STEP)
    per_turn = {seeds[r.seed]: r for r in recorder.requests}
    overheads = []
    for index, trajectory in enumerate(trajectories):
        end = max(r.end for (i, _), r in per_turn.items() if i == index)
        overheads.append((end - start - waited[index]) / len(trajectory.turns))
    return per_turn, 1000 * statistics.fmean(overheads)


def run_bare(host: BenchEngine, recorder: RecordingEngine, loop, agent: Run, trajectories,
             turns: int) -> tuple[Run, int]:
    """The agent run's requests replayed: per trajectory turn after turn, trajectories concurrently. Returns the run
    and how many turns sampled other tokens than the agent's."""
    host.run(host.engine.reset_prefix_cache())
    recorder.requests = []
    plans = []
    for index, trajectory in enumerate(trajectories):
        ids = trajectory.token_ids
        plan = [(agent.per_turn[(index, turn)]) for turn in range(len(trajectory.turns))]
        plans.append((ids, plan))
    mismatched = 0

    async def replay(ids: list[int], plan: list[Request]) -> float:
        nonlocal mismatched
        waited = 0.0
        for request in plan:
            params = loop.sampling_params(len(request.sampled), request.seed, ignore_eos=True)
            started = time.perf_counter()
            (output,) = await recorder.generate([ids[: request.context]], [params])
            waited += time.perf_counter() - started
            mismatched += list(output.outputs[0].token_ids) != request.sampled
        return waited

    async def replay_all():
        return await asyncio.gather(*(replay(ids, plan) for ids, plan in plans))

    waited, start, wall, cpu = timed(host, replay_all())
    per_turn, overhead_ms = turn_overheads(loop, recorder, trajectories, turns, start, waited)
    sampled = sum(len(r.sampled) for r in recorder.requests)
    run = Run("bare vLLM replay", wall, sampled, list(recorder.requests), [], start, per_turn, overhead_ms,
              [(w, 0.0) for w in waited], cpu)
    return run, mismatched


def ceilings(run: Run) -> dict[tuple[int, int], int]:
    """Per request, the trajectory's tokens the engine had seen before it: the previous request's prompt and samples."""
    out = {}
    for index, turn in run.per_turn:
        previous = run.per_turn.get((index, turn - 1))
        out[(index, turn)] = previous.context + len(previous.sampled) if previous else 0
    return out


def block_bound(ceiling: int, block: int) -> int:
    """The most a request can hit: whole blocks of the ceiling's tokens whose KV was computed (not the last one)."""
    return max(ceiling - 1, 0) // block * block


def cache_table(agent: Run, bare: Run, turns: int, block: int) -> list[dict]:
    ceiling = ceilings(agent)
    rows = []
    for first in [*range(0, turns, BUCKET), None]:
        keys = [k for k in agent.per_turn if first is None or first <= k[1] < first + BUCKET]
        top = sum(ceiling[k] for k in keys)
        hit = sum(min(agent.per_turn[k].cached, ceiling[k]) for k in keys)
        bare_hit = sum(min(bare.per_turn[k].cached, ceiling[k]) for k in keys if k in bare.per_turn)
        bound = sum(block_bound(ceiling[k], block) for k in keys)
        gpu_bound = sum(block_bound(ceiling[k], GPU_BLOCK) for k in keys)
        rows.append({
            "turns": "all" if first is None else f"{first + 1}-{min(first + BUCKET, turns)}",
            "requests": len(keys),
            "mean_context": statistics.fmean(agent.per_turn[k].context for k in keys),
            "mean_ceiling": top / len(keys),
            "cached_tokens": sum(agent.per_turn[k].cached for k in keys),
            "ceiling_tokens": top,
            "hit_of_ceiling": hit / top if top else float("nan"),
            "bare_hit_of_ceiling": bare_hit / top if top else float("nan"),
            "block_bound_of_ceiling": bound / top if top else float("nan"),
            "hit_of_block_bound": hit / bound if bound else float("nan"),
            "gpu_block_bound_of_ceiling": gpu_bound / top if top else float("nan"),
        })
    return rows


def check_loop_records(agent: Run, trajectories) -> str:
    """The loop's own per-turn cache figures (Turn.context_tokens / cached_tokens / cache_ceiling) against the
    engine's, where the loop records them."""
    from rlsearch.trajectory import Turn

    fields = {f.name for f in dataclasses.fields(Turn)}
    if not {"context_tokens", "cached_tokens", "cache_ceiling"} <= fields:
        return "the loop records no per-turn cache figures (Turn.cached_tokens absent): measured from the engine only"
    turns = [(index, number, turn) for index, t in enumerate(trajectories) for number, turn in enumerate(t.turns)]
    if not any(turn.context_tokens for _, _, turn in turns):
        return "Turn.cached_tokens exists but the loop leaves it 0: measured from the engine only"
    ceiling = ceilings(agent)
    ceiling_mismatch = 0
    for index, number, turn in turns:
        request = agent.per_turn[(index, number)]
        assert turn.context_tokens == request.context, (index, number, turn.context_tokens, request.context)
        assert turn.cached_tokens == request.cached, (index, number, turn.cached_tokens, request.cached)
        ceiling_mismatch += turn.cache_ceiling != ceiling[(index, number)]
    line = f"the loop's Turn.context_tokens and cached_tokens agree with the engine's on all {len(turns)} turns"
    if ceiling_mismatch:
        line += f"; its cache_ceiling differs from the bench's on {ceiling_mismatch} turns"
    else:
        line += ", and its cache_ceiling with the bench's"
    try:
        from rlsearch.trainer.metrics import trajectory_metrics

        rate = trajectory_metrics(trajectories).get("rollout/prefix_cache_hit_rate")
        if rate is not None:
            line += f"; rollout/prefix_cache_hit_rate = {rate:.4f}"
    except Exception as error:  # the metric is someone else's work in progress: report, do not fail the bench
        line += f"; rollout/prefix_cache_hit_rate not computed ({type(error).__name__}: {error})"
    return line


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--turns", type=int, default=64, help="rollout.max_turns: every turn searches (default 64)")
    parser.add_argument("--trajectories", type=int, default=8, help="trajectories run concurrently (default 8)")
    parser.add_argument("--tokens-per-turn", type=int, default=24,
                        help="sampled tokens of a turn (rollout.max_tokens_per_turn; >= 7; default 24)")
    parser.add_argument("--tool-latency-ms", type=float, default=50.0, help="median search latency (default 50)")
    parser.add_argument("--tool-latency-sigma", type=float, default=0.5,
                        help="sigma of the lognormal latency (default 0.5: p90 1.9x the median)")
    parser.add_argument("--seed", type=int, default=1, help="sampling, query words, documents and latencies")
    untied = sorted(name for name, shape in SHAPES.items() if not shape.get("tie_word_embeddings", False))
    parser.add_argument("--shape", choices=untied, default="tiny", help="random model shape (bench/common)")
    parser.add_argument("--out", default="outputs/bench", help="where the random model is kept")
    parser.add_argument("--json", default="", help="write the figures to this JSON file")
    parser.add_argument("--repeats", type=int, default=2,
                        help="no-latency agent runs and bare replays, alternated; the best wall time of each counts")
    parser.add_argument("--profile", action="store_true",
                        help="an extra no-latency run under cProfile (event loop thread)")
    add_vocab_ranks_argument(parser)
    return parser


def report(args: argparse.Namespace, m: Measured) -> None:
    """The runs' table, the prefix cache's table, peak memory, the profile, the ratios; the figures to --json."""
    (agent, trajectories, fast, fast_trajectories, bare, mismatched, pairs,
     profile, profiled, memory, records_line, records_line_fast, block, tool) = (
        m.agent, m.trajectories, m.fast, m.fast_trajectories, m.bare, m.mismatched, m.pairs,
        m.profile, m.profiled, m.memory, m.records_line, m.records_line_fast, m.block, m.tool)
    same = all(a.token_ids == b.token_ids for a, b in zip(trajectories, fast_trajectories))
    turns = [len(t.turns) for t in trajectories]
    calls = [len(t.dispatched_calls) for t in trajectories]
    observation = statistics.fmean(len(t.loss_mask) - sum(t.loss_mask) for t in trajectories) / statistics.fmean(turns)
    latencies = [tool.latency_s(c.query) * 1000 for t in trajectories for c in t.dispatched_calls]
    print()
    print(f"{args.trajectories} trajectories x {statistics.fmean(turns):.1f} turns ({min(turns)}-{max(turns)}; finish: "
          f"{sorted({t.finish_reason for t in trajectories})}), {statistics.fmean(calls):.1f} searches each; "
          f"{args.tokens_per_turn} sampled tokens a turn (the first {args.tokens_per_turn - 3}), "
          f"{observation:.1f} observation tokens a turn; final context {max(len(t.token_ids) for t in trajectories)} "
          f"tokens; tool latency median {statistics.median(latencies):.0f} ms, p90 "
          f"{sorted(latencies)[int(0.9 * len(latencies))]:.0f} ms over {len(latencies)} searches")
    print(f"no-latency run gave the same token ids: {same}; bare replay sampled other tokens on {mismatched} of "
          f"{len(bare.requests)} turns")
    print()
    print_table(RUN_COLUMNS, [
        (run.name, run.wall_s, run.sampled, run.tokens_per_s, run.tool_only_s, run.tokens_per_s_excl_tools,
         statistics.fmean(w for w, _ in run.waits), statistics.fmean(t for _, t in run.waits), run.overhead_ms,
         run.cpu_s)
        for run in (agent, fast, bare)
    ])
    print("(engine / tool wait: per trajectory, mean; overhead: (trajectory wall - engine wait - tool wait) / turns; "
          "CPU: this process and the engine core, all threads)")
    print()
    rows = cache_table(agent, bare, args.turns, block)
    print("prefix cache, agent run with tool latency (vLLM num_cached_tokens; ceiling: earlier tokens of the "
          "trajectory the engine has seen; bound: whole blocks of them)")
    columns = [("turns", "<7"), ("requests", ">8"), ("context", ">8.0f"), ("ceiling", ">8.0f"),
               ("hit/ceiling", ">11.4f"), ("bare", ">6.3f"), (f"bound B={block}", ">12.4f"), ("hit/bound", ">9.4f"),
               (f"bound B={GPU_BLOCK}", ">11.4f")]
    keys = ("turns", "requests", "mean_context", "mean_ceiling", "hit_of_ceiling", "bare_hit_of_ceiling",
            "block_bound_of_ceiling", "hit_of_block_bound", "gpu_block_bound_of_ceiling")
    print_table(columns, [[row[key] for key in keys] for row in rows])
    print(records_line)
    if records_line_fast != records_line:
        print(f"(no-latency run: {records_line_fast})")
    print()
    print("peak RSS: " + ", ".join(f"{name} {gib:.2f} GiB" for name, gib in memory.items()))
    if profile is not None:
        import io
        import pstats

        text = io.StringIO()
        stats = pstats.Stats(profile, stream=text)
        stats.sort_stats("tottime").print_stats(25)
        print(f"\ncProfile of the event loop thread, an extra no-latency run ({profiled.wall_s:.2f} s wall, "
              f"{profiled.cpu_s:.1f} CPU s), by own time:")
        print("\n".join(text.getvalue().splitlines()[:45]))
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats("cumulative").print_stats(r"rlsearch", 25)
        print("\nthe same, rlsearch functions by cumulative time:")
        print("\n".join(text.getvalue().splitlines()[:45]))

    ratio = fast.tokens_per_s / bare.tokens_per_s
    ratio_excl = agent.tokens_per_s_excl_tools / bare.tokens_per_s
    ratio_wall = agent.tokens_per_s / bare.tokens_per_s
    overall = rows[-1]
    print()
    print(f"agent loop with {args.tool_latency_ms:g} ms tools / bare vLLM tokens/s: wall {ratio_wall:.2f}, excluding "
          f"tool-only time {ratio_excl:.2f} (tool latency shrinks the engine's batch; not the loop's cost)")
    print(f"prefix cache hit / ceiling overall: {overall['hit_of_ceiling']:.4f} (goal >= 0.95: "
          f"{'met' if overall['hit_of_ceiling'] >= 0.95 else 'not met'}); of the {block}-token block bound "
          f"{overall['hit_of_block_bound']:.4f}; worst bucket {min(r['hit_of_ceiling'] for r in rows):.4f}")
    print(f"loop overhead per turn: {agent.overhead_ms:.2f} ms (tool latency run), {fast.overhead_ms:.2f} ms "
          f"(no latency), bare replay {bare.overhead_ms:.2f} ms")
    print(f"CPU seconds, bare vLLM / agent loop (no tool latency), the same tokens: {bare.cpu_s / fast.cpu_s:.2f}")
    pair_ratios = [bare_s / agent_s for agent_s, bare_s in pairs]
    print(f"per repeat (agent run, then bare replay): {', '.join(f'{r:.2f}' for r in pair_ratios)}; median "
          f"{statistics.median(pair_ratios):.2f} (load on a shared machine changes between runs: best of each counts)")
    print(f"agent loop (no tool latency) tokens/s / bare vLLM tokens/s, the same tokens, best of {args.repeats} each "
          f"(goal >= 0.9): {ratio:.2f}")

    if args.json:
        results = {
            "date": time.strftime("%Y-%m-%d"), "args": vars(args), "block_size": block, "cpu_count": os.cpu_count(),
            "turns_mean": statistics.fmean(turns), "searches_mean": statistics.fmean(calls),
            "observation_tokens_per_turn": observation, "same_tokens_no_latency": same,
            "bare_mismatched_turns": mismatched,
            "runs": {run.name: {"wall_s": run.wall_s, "sampled_tokens": run.sampled, "tokens_per_s": run.tokens_per_s,
                                "tool_only_s": run.tool_only_s, "tokens_per_s_excl_tools": run.tokens_per_s_excl_tools,
                                "overhead_ms_per_turn": run.overhead_ms, "cpu_s": run.cpu_s}
                     for run in (agent, fast, bare)},
            "ratio_no_latency": ratio, "cpu_ratio_bare_over_agent": bare.cpu_s / fast.cpu_s,
            "ratio_per_repeat": pair_ratios, "ratio_excl_tool_wait": ratio_excl, "ratio_wall": ratio_wall,
            "prefix_cache": rows, "loop_records": records_line, "peak_rss_gib": memory,
        }
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(results, indent=2))
        print(f"figures written to {args.json}")


@dataclasses.dataclass
class Measured:
    """What the runs gave: the agent run with tool latency, the best no-latency and bare runs (and the profiled one)."""

    agent: Run
    trajectories: list
    fast: Run
    fast_trajectories: list
    bare: Run
    mismatched: int  # turns the bare replay sampled other tokens on
    pairs: list[tuple[float, float]]  # (agent wall s, bare wall s) per repeat
    profile: object  # cProfile.Profile or None
    profiled: Run | None
    memory: dict[str, float]
    records_line: str
    records_line_fast: str
    block: int  # the engine's KV block size
    tool: FakeSearch


def run_all(args: argparse.Namespace, host: BenchEngine, model_path: Path, config, items: list) -> Measured:
    """The runs on one engine: the agent with tool latency, then no-latency agent runs and bare replays alternated
    (--repeats), and with --profile a profiled one."""
    from safetensors.torch import load_file

    from rlsearch.rollout import AgentLoop
    from rlsearch.tools import ToolRegistry, make_protocol

    query_len = args.tokens_per_turn - 6
    tokenizer = host.engine.tokenizer
    words = single_token_words(tokenizer, query_len * CHOICES + 64, args.seed)
    positions = [words[i * CHOICES:(i + 1) * CHOICES] for i in range(query_len)]
    state = load_file(str(model_path / "model.safetensors"))
    host.load_weights(searcher_weights(state, tokenizer, positions))
    block = host.engine.llm.vllm_config.cache_config.block_size

    tool = FakeSearch(words[query_len * CHOICES:], args.tool_latency_ms / 1000, args.tool_latency_sigma, args.seed)
    registry = ToolRegistry([tool])
    recorder = RecordingEngine(host.engine)
    loop = AgentLoop(recorder, make_protocol("search_r1", registry.specs), registry, config, args.seed)

    # warm-up: a short rollout of another step (a full one measured the same as the timed runs after it)
    warm = AgentLoop(recorder, loop.protocol, registry, dataclasses.replace(config, max_turns=4), args.seed)
    host.run(warm.run(items[:2], STEP + 1))

    print(f"agent loop, tool latency median {args.tool_latency_ms:g} ms ...", flush=True)
    agent, trajectories = run_agent("agent, tool latency", host, recorder, loop, tool, items, args.turns)
    print(f"  {agent.wall_s:.2f} s", flush=True)
    tool.enabled = False
    fast = bare = None
    pairs = []  # (agent wall s, bare wall s) of each repeat: run back to back, they see similar load
    # alternated, best wall time of each: the machine is shared, and load comes and goes
    for repeat in range(args.repeats):
        print(f"agent loop, no tool latency ({repeat + 1}/{args.repeats}) ...", flush=True)
        run, run_trajectories = run_agent("agent, no latency", host, recorder, loop, tool, items, args.turns)
        print(f"  {run.wall_s:.2f} s", flush=True)
        if fast is None or run.wall_s < fast.wall_s:
            fast, fast_trajectories = run, run_trajectories
        print(f"bare vLLM replay ({repeat + 1}/{args.repeats}) ...", flush=True)
        pairs.append((run.wall_s, 0.0))
        run, mismatched = run_bare(host, recorder, loop, agent, trajectories, args.turns)
        print(f"  {run.wall_s:.2f} s", flush=True)
        pairs[-1] = (pairs[-1][0], run.wall_s)
        if bare is None or run.wall_s < bare.wall_s:
            bare = run
    profile = profiled = None
    if args.profile:  # an extra run: the profiler slows the thread it watches
        import cProfile

        print("agent loop, no tool latency, profiled ...", flush=True)
        profile = cProfile.Profile()
        profiled = run_agent("profiled", host, recorder, loop, tool, items, args.turns, profile)[0]
    memory = peak_rss_gib()
    records_line = check_loop_records(agent, trajectories)
    records_line_fast = check_loop_records(fast, fast_trajectories)
    return Measured(agent, trajectories, fast, fast_trajectories, bare, mismatched, pairs, profile, profiled, memory,
                    records_line, records_line_fast, block, tool)


def main() -> None:
    parser = _parser()
    args = parse_args(parser, dict(turns=3, trajectories=2, tool_latency_ms=5.0, repeats=1,
                                   vocab_ranks=SMOKE_VOCAB_RANKS))
    if args.tokens_per_turn < 7:
        parser.error("--tokens-per-turn must be >= 7 (<search>, a word, </search>)")

    from rlsearch.config import RolloutConfig
    from rlsearch.rollout import PromptItem

    model_path = build_model(args.shape, Path(args.out), MAX_POSITIONS, args.vocab_ranks)
    # the observation: 2 documents of 10 one-token words plus tags, ~40 tokens; room for 64 of them and the turns
    max_response = args.turns * (args.tokens_per_turn + 64)
    config = RolloutConfig(max_turns=args.turns, max_tokens_per_turn=args.tokens_per_turn, logit_bias={},
                           max_response_tokens=max_response, assistant_prefix="<search>", agent_loop="per_sample")
    if config.window > MAX_POSITIONS:
        parser.error(f"a context window of {config.window} tokens is more than the model's {MAX_POSITIONS}")
    items = [PromptItem(f"q{i}", f"Which workshop in town number {i} built the {i + 3}th bridge over the river?", i, 0)
             for i in range(args.trajectories)]
    print(f"starting the engine (max_model_len {config.max_prompt_tokens + max_response}) ...", flush=True)
    host = BenchEngine(model_path, max_model_len=config.max_prompt_tokens + max_response)
    try:
        m = run_all(args, host, model_path, config, items)
    finally:
        host.close()
    report(args, m)


if __name__ == "__main__":
    main()
