"""A vLLM engine for rollouts: token-in/token-out generation, prompt scoring and in-place weight updates.

The engine is vLLM's AsyncLLM (the EngineCore runs in a subprocess): every method is a coroutine and must run on
the event loop the engine was created on (`RolloutWorker` owns that loop). Requests submitted together are
batched by vLLM's scheduler, and a request submitted while others run joins the running batch.

With ``tensor_parallel_size`` > 1 the model is split over that many vLLM worker processes (the ``mp`` executor);
otherwise it runs inside the EngineCore (``uni``). Weight updates are `rlsearch.weights`' business: ``weights`` is
that folder's receiver on this engine; ``weight_version`` counts the updates it finished.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import itertools
import multiprocessing
import multiprocessing.connection
import multiprocessing.context
import os
import signal
import sys
import threading
import time

from ..config import EngineSpec, auto_dtype
from ..devices import CPU_CORES_VARIABLE, cpu_threads_each, local_gpu_index
from ..lifetime import SegmentRecord
from ..runlog import in_ray_actor
from ..weights import VLLM_WORKER_EXTENSION, EngineWeightReceiver


def configure_vllm_environment(spec: EngineSpec) -> None:
    """Settings vLLM reads from the environment. AsyncLLM runs its EngineCore in a child process whatever
    VLLM_ENABLE_V1_MULTIPROCESSING says; with tensor_parallel_size 1 the model runs there too (uni executor),
    otherwise in TP worker processes."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    on_cpu = local_gpu_index() is None
    cores_shared = bool(os.environ.get(CPU_CORES_VARIABLE))
    if on_cpu and (spec.cpu_threads_bind or spec.tensor_parallel_size > 1 or cores_shared):
        # vLLM's default binding wants a NUMA node per worker and asserts on a machine with one; a binding to the
        # machine's cores would take all of them from the runs beside this one. An explicit binding always applies
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = spec.cpu_threads_bind or "nobind"
    if on_cpu and not spec.cpu_threads_bind:
        # an unbound worker runs OMP_NUM_THREADS threads, and a Ray actor's is its num_cpus (one per TP worker): a
        # TP1 engine would decode on one thread of any machine. The workers share the run's cores instead of each
        # taking all of them (measured on 2 cores, TP2: 5x faster)
        os.environ["OMP_NUM_THREADS"] = str(
            spec.cpu_threads or cpu_threads_each(spec.cpu_processes or spec.tensor_parallel_size))
    if spec.vllm_port:
        # engines on one node would otherwise race for the same internal ports (vLLM #39015)
        os.environ["VLLM_PORT"] = str(spec.vllm_port)


def chosen_logprobs(token_ids: list[int], entries) -> list[float]:
    """The logprob of each token in ``token_ids`` from vLLM's per-position ``{token id: Logprob}`` entries."""
    return [entry[token].logprob for token, entry in zip(token_ids, entries)]


class _ForkedVllmProcess(multiprocessing.context.ForkProcess):
    """A vLLM process (EngineCore, TP worker) forked from its parent, which has imported vLLM, where vLLM would spawn
    it (on CPU always), which imports vLLM again: ~10 core-seconds a process. A forked child holds copies of its
    parent's descriptors, a Ray worker's sockets among them, and Ray sees a killed worker die only when every copy is
    closed: the child stops itself as soon as its parent is gone (as a spawned one is stopped)."""

    def start(self) -> None:
        # the child's garbage collections then leave the objects it inherits alone, and their memory stays shared
        # with the parent's instead of being copied page by page
        gc.freeze()
        try:
            super().start()
        finally:
            gc.unfreeze()

    def run(self) -> None:
        import ray._raylet
        import torch

        # vLLM's setproctitle cannot find the title in a forked process (a Ray actor's, which Ray keeps); Ray's can
        ray._raylet.setproctitle(f"VLLM::{self.name}")
        # Python's streams onto file descriptors 1 and 2, as a spawned process's are: a driver keeps its terminal in
        # sys.stdout and sys.stderr and points 1 and 2 at its log file (rlsearch.runlog), where vLLM's output belongs
        sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 (the process's own streams)
        sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
        # the threads a spawned process's OpenMP would start with, where the fork inherits its parent's count
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or len(os.sched_getaffinity(0))))
        threading.Thread(target=_stop_when_parent_dies, args=(multiprocessing.parent_process().sentinel,),
                         name="parent-watch", daemon=True).start()
        _drop_modules_vllm_cannot_scan()
        super().run()


def _drop_modules_vllm_cannot_scan() -> None:
    """vLLM's CPU kernel registration scans every module in sys.modules and reads the vars() of each value there: a
    value whose __dict__ is not a mapping fails it (llvmlite's library wrappers, which numba brings in, through
    bm25s in a test session). A spawned process holds only vLLM's own imports; a forked one drops the modules with
    such values from its sys.modules, which it never uses."""
    for name, module in list(sys.modules.items()):
        for value in list(getattr(module, "__dict__", {}).values()):
            try:  # what the scan does with each value
                if hasattr(value, "__dict__"):
                    vars(value).get("kernel")
            except Exception:
                del sys.modules[name]
                break


def _stop_when_parent_dies(parent_sentinel: int, grace_s: float = 10.0) -> None:
    multiprocessing.connection.wait([parent_sentinel])
    os.kill(os.getpid(), signal.SIGTERM)  # vLLM's handlers shut an EngineCore and its TP workers down
    time.sleep(grace_s)
    os._exit(1)


class _ForkContext(multiprocessing.context.ForkContext):
    Process = _ForkedVllmProcess


_FORK_IN_THIS_PROCESS = False


def fork_vllm_processes_in_this_process() -> None:
    """Engines made in this process fork vLLM's processes on CPU, as a Ray actor's do (`_vllm_processes_forked`).
    For a process whose state rlsearch knows, rlsearch's CLI, a bench or the test session: a fork copies whatever the
    process set up before (a script's own threads and locks among it), where a spawned process starts clean."""
    global _FORK_IN_THIS_PROCESS
    _FORK_IN_THIS_PROCESS = True


@contextlib.contextmanager
def _vllm_processes_forked():
    """vLLM forks the EngineCore it starts in this block, and the EngineCore its TP workers, unless their OpenMP
    threads are bound to cores (an environment OpenMP reads when it starts, which a fork does not do). On CPU only:
    a process that has used CUDA cannot be forked."""
    import vllm.v1.engine.utils as engine_utils
    import vllm.v1.executor.multiproc_executor as multiproc_executor

    modules = [engine_utils] + ([multiproc_executor] if os.environ.get("VLLM_CPU_OMP_THREADS_BIND") == "nobind" else [])
    chosen_by_vllm = [module.get_mp_context for module in modules]
    for module in modules:
        module.get_mp_context = _ForkContext
    try:
        yield
    finally:
        for module, chosen in zip(modules, chosen_by_vllm):
            module.get_mp_context = chosen


class VLLMEngine:
    """Owns one AsyncLLM; create it on the event loop that will call it."""

    def __init__(self, spec: EngineSpec) -> None:
        configure_vllm_environment(spec)
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        on_gpu = local_gpu_index() is not None
        if on_gpu:
            extra = {"gpu_memory_utilization": spec.gpu_memory_utilization}
            if spec.kv_cache_gib > 0:
                extra["kv_cache_memory_bytes"] = int(spec.kv_cache_gib * 2**30)
        else:
            # after a partial (chunked) prefill vLLM rewinds the request's seeded generator, which a CPU generator
            # cannot do (the EngineCore dies): prefills are scheduled whole instead. The KV cache is host memory the
            # worker fills at start-up: a fraction of a GiB holds a tiny model's rollouts (VLLM_CPU_KVCACHE_SPACE,
            # vLLM's whole-GiB setting, still wins where it is set)
            extra = {"enable_chunked_prefill": False, "max_num_batched_tokens": max(2048, spec.max_model_len),
                     "kv_cache_memory_bytes": int((spec.kv_cache_gib or 1.0) * 2**30)}
        if spec.lora_rank:  # actor.lora.sync=adapter: one adapter, the policy's, loaded by the weight sync
            extra.update(enable_lora=True, max_lora_rank=spec.max_lora_rank, max_loras=1, max_cpu_loras=1)
        SegmentRecord.remove_orphans()  # of engines on this host that were killed
        self._segments = SegmentRecord()
        engine_args = AsyncEngineArgs(
            model=spec.model_path,
            dtype=auto_dtype(spec.dtype, on_gpu),
            seed=spec.seed,
            max_model_len=spec.max_model_len,
            enforce_eager=not on_gpu if spec.enforce_eager == "auto" else spec.enforce_eager,
            enable_prefix_caching=True,
            tensor_parallel_size=spec.tensor_parallel_size,
            distributed_executor_backend="uni" if spec.tensor_parallel_size == 1 else "mp",
            worker_extension_cls=VLLM_WORKER_EXTENSION,
            disable_log_stats=True,
            # a sampled token's logprob under the distribution it was drawn from (logit bias, then temperature,
            # then top-k/top-p), which the actor reproduces; vLLM's default reports the raw model's
            logprobs_mode="processed_logprobs",
            **extra,
        )
        # a fork copies its parent's state: a Ray actor's process holds nothing but this engine; other processes
        # say that theirs can be copied (fork_vllm_processes_in_this_process)
        fork = not on_gpu and (in_ray_actor() or _FORK_IN_THIS_PROCESS)
        with _vllm_processes_forked() if fork else contextlib.nullcontext():
            self.llm = AsyncLLM.from_engine_args(engine_args)
        self._segments.record()
        self.tokenizer = self.llm.get_tokenizer()
        self._request_ids = itertools.count()
        self.weights = EngineWeightReceiver(self.llm)

    @property
    def weight_version(self) -> int:
        """Weight updates finished on this engine."""
        return self.weights.version

    async def generate(self, prompts: list[list[int]], sampling_params: list) -> list:
        """One finished `RequestOutput` per prompt (in order); the requests run concurrently."""
        return list(await asyncio.gather(*(self._generate_one(ids, p) for ids, p in zip(prompts, sampling_params))))

    async def _generate_one(self, prompt_ids: list[int], sampling_params):
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        if sampling_params.output_kind != RequestOutputKind.FINAL_ONLY:
            sampling_params = sampling_params.clone()
            sampling_params.output_kind = RequestOutputKind.FINAL_ONLY
        final = None
        # vLLM keeps a reference to the id list it is given: hand it a copy
        request = TokensPrompt(prompt_token_ids=list(prompt_ids))
        async for output in self.llm.generate(request, sampling_params, request_id=f"r{next(self._request_ids)}",
                                              lora_request=self.weights.lora_request):
            final = output
        return final

    async def score(self, token_ids: list[int]) -> list[float]:
        """Teacher-forced logprob of every token after the first under the raw model distribution (temperature 1,
        no bias: vLLM's prompt logprobs skip the sampling processors, whatever the logprobs mode)."""
        from vllm import SamplingParams

        output = await self._generate_one(token_ids, SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0))
        return chosen_logprobs(token_ids[1:], output.prompt_logprobs[1:])

    async def reset_prefix_cache(self) -> None:
        await self.llm.reset_prefix_cache()

    async def shutdown(self) -> None:
        """Stop the EngineCore process. The engine is unusable afterwards."""
        llm, self.llm, self.weights = self.llm, None, None
        llm.shutdown()
        # dropped now, not at interpreter exit, where AsyncLLM.__del__ fails on torn-down module globals
        del llm
        gc.collect()
        self._segments.release()
