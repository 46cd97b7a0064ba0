"""Many rollout engines: `rollout.num_engines` RolloutWorker Ray actors, each a vLLM engine split over
`rollout.tensor_parallel_size` workers, fed GRPO groups from one queue.

A group (every PromptItem of one group_id) is the unit of dispatch: all of its samples run on one engine, in one
``generate`` call (they share the prompt's prefix cache). The first groups are dealt round robin, up to
``rollout.groups_per_engine`` per engine; after that an engine gets the next queued group as soon as one of its own
finishes, so a slow engine never holds a fast one idle. Sampling seeds are per (step, group, sample, turn) and the
same on every engine, so the trajectories do not depend on how many engines there are or which one ran a group.
"""

from __future__ import annotations

import dataclasses
import hashlib
import socket
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from ..config import RolloutConfig, ToolsConfig
from ..ray_setup import UNAVAILABLE_RETRIES, cluster_has_gpus, start_named_actor, stop_named_actors
from ..trajectory import Trajectory
from .agent_loop import PromptItem
from .engine import EngineSpec
from .worker import RolloutWorker

SPREAD_LIMIT = 64  # groups in flight per engine when rollout.groups_per_engine is 0 (one actor thread each)
CONTROL_SLOTS = 4  # actor threads beside the generate calls: weight syncs, probes, stats, pings
PORT_WINDOW = 100  # VLLM_PORT of engine i: base + PORT_WINDOW * i
# vLLM picks its internal ports by binding and closing them: one taken meanwhile fails the engine's start, which then
# starts again in a new port window, at most this many times in all
START_ATTEMPTS = 3
ADOPT_TIMEOUT_S = 120.0  # for an engine a restarted driver takes over to cancel the old driver's rollouts
ENGINE_NAME_PREFIX = "rollout-engine-"  # a detached engine's Ray name: the prefix, its index and the settings key
GROUP_NAME_PREFIX = "rollout-engines-"  # its placement group's: the prefix and the settings key
KEPT_METRICS = 8  # steps whose rollout metrics last_metrics(step) still answers


class NoEngineLeftError(RuntimeError):
    """Every rollout engine of the pool died."""


def new_rollout_worker(
    engine_spec: EngineSpec, rollout: RolloutConfig, tools: ToolsConfig, seed: int,
    ray_options: dict[str, Any] | None = None, worker_cls: type = RolloutWorker,
) -> Any:
    """A rollout worker over the started tools (`tools` with the servers' URLs filled in): in this process when
    `ray_options` is None, else a Ray actor with those options (its handle). `seed` is the run's seed, which the
    agent loop's per-request sampling seeds derive from; ``engine_spec.seed`` is vLLM's own."""
    args = (engine_spec, rollout, tools.retriever, tools.retriever.url, seed)
    if ray_options is None:
        return worker_cls(*args, tools=tools)
    import ray

    return ray.remote(worker_cls).options(**ray_options).remote(*args, tools=tools)


@dataclass
class DispatchResult:
    trajectories: list[Trajectory]  # in item order, each stamped with the engine that ran it
    groups: dict[int, int] = field(default_factory=dict)  # engine -> groups it finished
    busy_s: dict[int, float] = field(default_factory=dict)  # engine -> seconds with at least one group in flight
    wall_s: float = 0.0
    redispatched: int = 0  # groups sent again after their engine died or could not be reached
    died: list[int] = field(default_factory=list)  # engines that died during the dispatch
    unavailable: int = 0  # calls Ray could not deliver for the moment (ActorUnavailableError), sent again


def dispatch_groups(
    items: Sequence[PromptItem], engines: Sequence[int], submit: Callable[[int, list[PromptItem]], Future],
    groups_per_engine: int, timeout_s: float,
) -> DispatchResult:
    """Run `items` group by group on `engines` (engine ids; `submit(engine, group_items)` starts one generate call
    and returns its future). An engine whose call fails with Ray's RayActorError is dead: its unfinished groups go
    to the others. One Ray cannot reach for the moment (ActorUnavailableError: a dropped connection) gets the group
    again, and is dead only when unreachable more than `UNAVAILABLE_RETRIES` times in a row. Raises
    NoEngineLeftError when none is left, TimeoutError when no group finishes in `timeout_s`; any other error of a
    call is raised as it is."""
    from ray.exceptions import ActorUnavailableError, RayActorError

    started = time.perf_counter()
    positions: dict[int, list[int]] = {}  # group_id -> item positions, groups in order of first appearance
    for position, item in enumerate(items):
        positions.setdefault(item.group_id, []).append(position)
    queue = deque(positions)
    live = list(engines)
    limit = groups_per_engine if groups_per_engine > 0 else SPREAD_LIMIT
    load = dict.fromkeys(live, 0)
    unreachable = dict.fromkeys(live, 0)  # engine -> its calls unavailable in a row
    in_flight: dict[Future, tuple[int, int, float]] = {}  # future -> (engine, group_id, submitted at)
    finished_at: dict[Future, float] = {}
    spans: dict[int, list[tuple[float, float]]] = {engine: [] for engine in live}
    result = DispatchResult(trajectories=[None] * len(items), groups=dict.fromkeys(live, 0))  # type: ignore[list-item]

    def stamp(future: Future) -> None:
        finished_at[future] = time.perf_counter()

    def deal() -> None:
        """Round robin over the live engines with room, one group each per round, until the queue is empty or
        every engine is full."""
        while queue:
            dealt = False
            for engine in live:
                if queue and load[engine] < limit:
                    group_id = queue.popleft()
                    future = submit(engine, [items[p] for p in positions[group_id]])
                    in_flight[future] = (engine, group_id, time.perf_counter())
                    future.add_done_callback(stamp)
                    load[engine] += 1
                    dealt = True
            if not dealt:
                return

    deal()
    while in_flight:
        done, _ = wait(list(in_flight), timeout=timeout_s, return_when=FIRST_COMPLETED)
        if not done:
            waiting = {}
            for engine, group_id, _ in in_flight.values():
                waiting.setdefault(engine, []).append(group_id)
            raise TimeoutError(
                f"no rollout group finished within {timeout_s:.0f} s; groups in flight per engine: {waiting}"
            )
        for future in sorted(done, key=lambda f: (in_flight[f][0], in_flight[f][1])):
            engine, group_id, submitted = in_flight.pop(future)
            load[engine] -= 1
            spans[engine].append((submitted, finished_at.get(future, time.perf_counter())))
            try:
                trajectories = future.result()
            except RayActorError as error:
                if isinstance(error, ActorUnavailableError) and unreachable[engine] < UNAVAILABLE_RETRIES:
                    unreachable[engine] += 1
                    result.unavailable += 1
                    queue.appendleft(group_id)
                    result.redispatched += 1
                    continue
                if engine in live:
                    live.remove(engine)
                    result.died.append(engine)
                queue.appendleft(group_id)
                result.redispatched += 1
                continue
            unreachable[engine] = 0
            _place(result.trajectories, positions[group_id], trajectories, items, engine)
            result.groups[engine] += 1
        if queue and not live:
            raise NoEngineLeftError(
                f"every rollout engine died (engines {sorted(result.died)} during this rollout); "
                f"{len(queue)} group(s) were left unfinished"
            )
        deal()
    result.wall_s = time.perf_counter() - started
    result.busy_s = {engine: _covered(engine_spans) for engine, engine_spans in spans.items()}
    return result


def _place(
    out: list[Trajectory], positions: list[int], trajectories: list[Trajectory], items: Sequence[PromptItem],
    engine: int,
) -> None:
    if len(trajectories) != len(positions):
        raise RuntimeError(f"engine {engine} returned {len(trajectories)} trajectories for {len(positions)} items")
    for position, trajectory in zip(positions, trajectories):
        item = items[position]
        if (trajectory.example_id, trajectory.sample_index) != (item.example_id, item.sample_index):
            raise RuntimeError(
                f"engine {engine} returned trajectory ({trajectory.example_id}, {trajectory.sample_index}) for item "
                f"({item.example_id}, {item.sample_index}): trajectories must come back in item order"
            )
        trajectory.engine = engine
        out[position] = trajectory


def _covered(spans: list[tuple[float, float]]) -> float:
    """Length of the union of the intervals."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(spans):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


class EnginePool:
    """`rollout.num_engines` rollout workers as Ray actors (``engines``: their handles, index = engine id).

    Each engine reserves ``tensor_parallel_size`` CPUs (and as many GPUs with ``gpus_per_rank`` 1) in one bundle of
    a placement group the pool makes, or, given ``placement_group`` and ``bundle_index`` (the trainer's split
    placement), all engines share that bundle. Engines start side by side, each with its own vLLM seed
    (``engine_spec.seed + i``) and VLLM_PORT window (vLLM takes its internal ports by probing from VLLM_PORT up, so
    engines that shared a base would race for them); `seed` (the run's, which
    sampling seeds derive from) is the same for all. `generate` calls may overlap (``rollout.async_steps`` + 1
    rollouts and an eval), and calls to `engines` from outside (weight syncs, probes) may run while they are in
    flight: every actor has a thread for each group it may be running and spare ones for those calls (a weight sync
    pauses generation, so it must never queue behind the groups it paused).

    ``detached`` (a supervised run, `rlsearch train --restarts`, whose supervisor owns Ray): the engines and their
    placement group are named, detached Ray actors that outlive the driver; `close` leaves them running. The next
    driver's pool in the same Ray namespace adopts the live ones of the same engine settings (the vLLM engine: model,
    dtype, length, TP, cache; the number of engines and their concurrency) instead of starting them
    (`RolloutWorker.adopt`: the old driver's rollouts cancelled, the agent loop and tools set up anew for the new
    driver's rollout settings and servers), ``adopted`` lists them, and the driver syncs its weights into them before
    any rollout. Engines of other settings are stopped. Drivers running side by side on one Ray instance need a
    namespace each (RLSEARCH_RAY_NAMESPACE).
    """

    def __init__(
        self, engine_spec: EngineSpec, rollout: RolloutConfig, tools: ToolsConfig, seed: int, *,
        gpus_per_rank: int | None = None, placement_group: Any = None, bundle_index: int = 0,
        group_timeout_s: float = 1800.0, start_timeout_s: float = 900.0, worker_cls: type = RolloutWorker,
        detached: bool = False,
    ) -> None:
        self.engine_spec, self.rollout, self.tools, self.seed = engine_spec, rollout, tools, seed
        self.num_engines, self.tp = rollout.num_engines, engine_spec.tensor_parallel_size
        if gpus_per_rank is None:  # a GPU per TP worker where the cluster has GPUs
            gpus_per_rank = 1 if cluster_has_gpus() else 0
        self.gpus_per_rank = gpus_per_rank
        self.group_timeout_s, self.start_timeout_s = group_timeout_s, start_timeout_s
        self.worker_cls = worker_cls
        self.detached = detached
        self.adopted: list[int] = []  # engines taken over from a driver that died (``detached``)
        self.helpers: list[Any] = []  # frozen engines the tools call (rollout.frozen), stopped with the pool
        self.groups_in_flight = rollout.groups_per_engine if rollout.groups_per_engine > 0 else SPREAD_LIMIT
        # threads of each engine's actor: its groups in flight for every overlapping rollout, and the control calls
        self.max_concurrency = self.groups_in_flight * (rollout.async_steps + 2) + CONTROL_SLOTS
        # an adopted engine must have been started with these settings (its vLLM ports aside); the agent loop's
        # (the rest of `rollout`, `seed`, the tools) are set anew when it is adopted
        settings = repr((dataclasses.replace(engine_spec, vllm_port=0), self.num_engines, gpus_per_rank,
                         self.max_concurrency))
        self._settings_key = hashlib.sha256(settings.encode()).hexdigest()[:12]
        self.base_port = engine_spec.vllm_port or _free_port_window()
        self.engines: list[Any] = []
        self._dead: set[int] = set()
        self._metrics: OrderedDict[int, dict[str, float]] = OrderedDict()  # step -> metrics of its rollout
        self._last_step: int | None = None
        self._submitter = ThreadPoolExecutor(max_workers=rollout.async_steps + 2, thread_name_prefix="engine-pool")
        self._own_group = placement_group is None
        if self.detached:
            self._stop_other_engines()
        if self._own_group:
            placement_group, bundle_index = self._reserve(), None
        self.placement_group, self._shared_bundle = placement_group, bundle_index
        try:
            # side by side, each in its own port window (as verl, NeMo-RL and ArcticInference give each engine on a
            # node its own VLLM_PORT base): N engines start in about the time of one where the node has the cores
            with ThreadPoolExecutor(self.num_engines, thread_name_prefix="engine-start") as starter:
                starts = [starter.submit(self._start_engine, index) for index in range(self.num_engines)]
            self.engines = [start.result() for start in starts if start.exception() is None]
            failures = [start.exception() for start in starts if start.exception() is not None]
            if failures:
                raise failures[0]
            print(self.describe(), flush=True)
        except BaseException:
            self.shutdown()
            raise

    def bundle(self) -> dict[str, float]:
        """The resources of one engine."""
        return {"CPU": float(self.tp), **({"GPU": float(self.tp * self.gpus_per_rank)} if self.gpus_per_rank else {})}

    def _name(self, index: int) -> str:
        return f"{ENGINE_NAME_PREFIX}{index}-{self._settings_key}"

    def _stop_other_engines(self) -> None:
        """Stop the detached engines a driver of other settings left (they hold resources this pool needs)."""
        stop_detached_engines(keep={self._name(index) for index in range(self.num_engines)} | {self._group_name()})

    def _group_name(self) -> str:
        return f"{GROUP_NAME_PREFIX}{self._settings_key}"

    def _reserve(self) -> Any:
        import ray
        from ray.util.placement_group import placement_group

        name = self._group_name() if self.detached else ""
        group = None
        if name:
            try:  # the group of the engines an earlier driver started
                group = ray.util.get_placement_group(name)
            except ValueError:
                pass
        if group is None:
            group = placement_group([self.bundle()] * self.num_engines, strategy="PACK", name=name,
                                    lifetime="detached" if name else None)
        try:
            ray.get(group.ready(), timeout=self.start_timeout_s)
        except ray.exceptions.GetTimeoutError as error:
            ray.util.remove_placement_group(group)
            raise RuntimeError(
                f"the Ray cluster did not free {self.num_engines} bundle(s) of {self.bundle()} for the rollout "
                f"engines within {self.start_timeout_s:.0f} s (rollout.num_engines={self.num_engines}, "
                f"tensor_parallel_size={self.tp}); start Ray with more CPUs/GPUs or use fewer engines"
            ) from error
        return group

    def _start_engine(self, index: int, adopt: bool = True) -> Any:
        """Start engine `index` in its bundle and wait until it is up; an engine whose start failed for a port taken
        under it starts again in a new port window (START_ATTEMPTS in all). ``detached``: first adopt the live engine
        an earlier driver left under its name (unless not `adopt`)."""
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if self.detached and adopt:
            engine = self._adopt(index)
            if engine is not None:
                return engine

        bundle = index if self._shared_bundle is None else self._shared_bundle
        options = {
            "num_cpus": self.tp, "num_gpus": self.tp * self.gpus_per_rank,
            "max_concurrency": self.max_concurrency,
            "scheduling_strategy": PlacementGroupSchedulingStrategy(self.placement_group, bundle),
        }
        if self.detached:
            options.update(name=self._name(index), lifetime="detached")
        port = self.base_port + PORT_WINDOW * index
        for attempt in range(1, START_ATTEMPTS + 1):
            spec = dataclasses.replace(self.engine_spec, seed=self.engine_spec.seed + index, vllm_port=port)
            engine = self._new_worker(spec, options)
            try:
                ray.get(engine.__ray_ready__.remote(), timeout=self.start_timeout_s)
                return engine
            except ray.exceptions.GetTimeoutError as error:
                ray.kill(engine)
                raise RuntimeError(
                    f"rollout engine {index} did not start within {self.start_timeout_s:.0f} s"
                ) from error
            except ray.exceptions.RayActorError as error:
                if attempt == START_ATTEMPTS or not _port_was_taken(error):
                    raise
                print(f"[rlsearch] rollout engine {index}: a port of its window {port} was taken while it started; "
                      "starting it again on new ports", flush=True)
                port = _free_port_window()

    def _new_worker(self, spec: EngineSpec, options: dict[str, Any]) -> Any:
        """The worker's Ray actor; a detached one's name may still be held for a moment by the one it replaces."""
        start = partial(new_rollout_worker, spec, self.rollout, self.tools, self.seed, options, self.worker_cls)
        return start_named_actor(start) if self.detached else start()

    def _adopt(self, index: int) -> Any:
        """The live engine an earlier driver left as engine `index`, taken over (None: none, or one that did not
        answer, which is stopped)."""
        import ray

        try:
            engine = ray.get_actor(self._name(index))
        except ValueError:
            return None
        try:
            cancelled = ray.get(engine.adopt.remote(self.tools, self.rollout, self.seed), timeout=ADOPT_TIMEOUT_S)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as error:
            print(f"[rlsearch] rollout engine {index} of the previous driver did not answer ({type(error).__name__}); "
                  "starting a new one", flush=True)
            ray.kill(engine, no_restart=True)
            return None
        self.adopted.append(index)
        print(f"[rlsearch] rollout engine {index} outlived the previous driver and was taken over ({cancelled} of its "
              "rollouts cancelled)", flush=True)
        return engine

    def describe(self) -> str:
        """Which Ray node each engine runs on, e.g. for the start-up log."""
        import ray

        ips = {node["NodeID"]: node["NodeManagerAddress"] for node in ray.nodes()}
        nodes = self.node_ids()
        where = ", ".join(f"engine {i} on node {node[:8]} ({ips.get(node, '?')})" for i, node in enumerate(nodes))
        return f"[rlsearch] rollout engines: {self.num_engines} x TP{self.tp}; {where}"

    def node_ids(self) -> list[str]:
        import ray

        return ray.get([engine.node_id.remote() for engine in self.engines], timeout=60)

    def live(self) -> list[int]:
        return [index for index in range(len(self.engines)) if index not in self._dead]

    def generate(self, items: Sequence[PromptItem], step: int) -> list[Trajectory]:
        """One finished trajectory per item, in item order (each stamped with its ``engine``); see the module doc."""
        live = self.live()
        if not live:
            raise NoEngineLeftError(f"every rollout engine is dead ({sorted(self._dead)}); restart them first")

        def submit(engine: int, group: list[PromptItem]) -> Future:
            return self.engines[engine].generate.remote(group, step).future()

        result = dispatch_groups(items, live, submit, self.groups_in_flight, self.group_timeout_s)
        self._dead.update(result.died)
        for engine in result.died:
            print(f"[rlsearch] warning: rollout engine {engine} died; its groups ran on the others", flush=True)
        metrics = {"rollout/redispatched_groups": float(result.redispatched),
                   "rollout/unavailable_calls": float(result.unavailable)}
        for engine in range(len(self.engines)):
            ran = [t for t in result.trajectories if t.engine == engine]
            metrics[f"rollout/engine{engine}/groups"] = float(result.groups.get(engine, 0))
            metrics[f"rollout/engine{engine}/trajectories"] = float(len(ran))
            metrics[f"rollout/engine{engine}/sampled_tokens"] = float(sum(sum(t.loss_mask) for t in ran))
            busy = result.busy_s.get(engine, 0.0)
            metrics[f"rollout/engine{engine}/busy_fraction"] = busy / result.wall_s if result.wall_s > 0 else 0.0
        self._metrics[step] = metrics
        self._metrics.move_to_end(step)
        while len(self._metrics) > KEPT_METRICS:
            self._metrics.popitem(last=False)
        self._last_step = step
        return result.trajectories

    def submit(self, items: Sequence[PromptItem], step: int) -> Future:
        """`generate` on a thread of the pool: a future of its trajectories (a rollout that overlaps training)."""
        return self._submitter.submit(self.generate, items, step)

    def last_metrics(self, step: int | None = None) -> dict[str, float]:
        """Per-engine groups, trajectories, sampled tokens and busy fraction of the rollout of `step` (default: the
        last one finished; the last few steps are kept), and the groups it re-dispatched after an engine died."""
        key = self._last_step if step is None else step
        return dict(self._metrics.get(key, {})) if key is not None else {}

    def idle_seconds(self) -> float:
        """Seconds without any rollout in flight since the previous call, averaged over the live engines."""
        idle = self._ask_live_engines("idle_seconds")
        return sum(idle) / max(1, len(idle))

    def tool_stats(self) -> dict[str, int]:
        """Tool requests, retries and failures summed over the live engines."""
        total: dict[str, int] = {}
        for stats in self._ask_live_engines("tool_stats"):
            for key, value in stats.items():
                total[key] = total.get(key, 0) + value
        return total

    def _ask_live_engines(self, method: str, timeout_s: float = 60.0) -> list[Any]:
        """What each live engine's `method` returns. An engine found dead by the call is left out and known dead (it is
        restarted before the next rollout or sync): an engine may die between a sync and the step's metrics. One
        that Ray cannot reach for a moment is asked again first (`ask_actors`); one that does not answer in time is
        left out."""
        from ..ray_setup import NoAnswer, ask_actors

        live = self.live()
        answers = ask_actors([getattr(self.engines[index], method).remote for index in live], timeout_s)
        self._dead.update(index for index, answer in zip(live, answers) if answer is NoAnswer.DEAD)
        return [answer for answer in answers if not isinstance(answer, NoAnswer)]

    def dead_engines(self, timeout_s: float = 10.0) -> list[int]:
        """Engines known dead, and those whose actor does not answer a ping because it is gone (a busy one is not
        dead: a ping that times out leaves it live)."""
        from ..ray_setup import actor_states

        live = self.live()
        states = actor_states([self.engines[index] for index in live], timeout_s)
        self._dead.update(index for index, state in zip(live, states) if state == "dead")
        return sorted(self._dead)

    def restart(self, index: int) -> Any:
        """Replace engine `index` (killed first if still alive) by a new one with the same spec, in the same bundle;
        returns its handle. Its weights are the model's on disk: the caller syncs the current ones into it."""
        import ray

        ray.kill(self.engines[index], no_restart=True)
        self.engines[index] = self._start_engine(index, adopt=False)
        self._dead.discard(index)
        return self.engines[index]

    def close(self) -> None:
        """The driver is done with the engines: a detached pool leaves them running for the next driver (whoever owns
        the Ray instance stops them: the supervisor, at its end); any other pool stops them."""
        if self.detached:
            self._submitter.shutdown(wait=False, cancel_futures=True)
            self.engines = []
        else:
            self.shutdown()

    def shutdown(self, timeout_s: float = 60.0) -> None:
        """Stop every engine (gracefully where it answers within `timeout_s`), then free the placement group."""
        import ray

        self._submitter.shutdown(wait=False, cancel_futures=True)
        stops = [self.engines[index].shutdown.remote() for index in self.live()]
        if stops:
            ray.wait(stops, num_returns=len(stops), timeout=timeout_s)
        for engine in self.engines:
            ray.kill(engine, no_restart=True)
        self.engines = []
        if self.helpers:
            ray.wait([helper.shutdown.remote() for helper in self.helpers], num_returns=len(self.helpers),
                     timeout=timeout_s)
            for helper in self.helpers:
                ray.kill(helper, no_restart=True)
            self.helpers = []
        if self._own_group and self.placement_group is not None:
            ray.util.remove_placement_group(self.placement_group)
            self.placement_group = None


def stop_detached_engines(keep: set[str] = frozenset()) -> int:
    """Stop the detached engines (and free their placement groups) that drivers left in this Ray namespace, but those
    named in `keep`; returns how many engines were stopped."""
    return stop_named_actors(ENGINE_NAME_PREFIX, GROUP_NAME_PREFIX, keep)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _free_port_window() -> int:
    """A base port for VLLM_PORT, spread over 20000-39999 (vLLM takes the first free ports from there)."""
    return 20000 + _free_port() % 20000


def _port_was_taken(error: BaseException) -> bool:
    text = str(error)
    return "Address already in use" in text or "EADDRINUSE" in text
