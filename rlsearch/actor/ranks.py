"""ActorRanks: TP x PP x DP Megatron ranks as Ray actors, driven as one."""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Sequence
from functools import partial

import ray
import torch

from ..algo import LOG_RATIO_BINS, Objective, grpo_objective, histogram_quantile, sft_objective
from ..ray_setup import start_named_actor, stop_named_actors
from .batch import TrainSample
from .distribution import MODEL_DISTRIBUTION, SamplingDistribution
from .worker import ActorWorkerSpec, MegatronActorWorker, RankInfo

RANK_NAME_PREFIX = "actor-rank-"  # a detached rank's Ray name: the prefix, the layout key and the rank
RANK_GROUP_PREFIX = "actor-ranks-"  # their placement group's: the prefix and the layout key
ADOPT_TIMEOUT_S = 60.0  # for the ranks of the previous driver to reset


class _DetachedNames:
    """The Ray names of a detached group of `world_size` ranks of `bundle` each and of its placement group."""

    def __init__(self, world_size: int, bundle: dict[str, float]) -> None:
        key = hashlib.sha256(repr((world_size, sorted(bundle.items()))).encode()).hexdigest()[:12]
        self.world_size, self.key = world_size, key
        self.group = f"{RANK_GROUP_PREFIX}{key}"

    def rank(self, rank: int) -> str:
        return f"{RANK_NAME_PREFIX}{self.key}-{rank}"

    def all(self) -> set[str]:
        return {self.group, *(self.rank(rank) for rank in range(self.world_size))}


def stop_detached_ranks(keep: set[str] = frozenset()) -> int:
    """Stop the detached actor ranks (and free their placement groups) that drivers left in this Ray namespace, but
    those named in `keep`; returns how many ranks were stopped."""
    return stop_named_actors(RANK_NAME_PREFIX, RANK_GROUP_PREFIX, keep)


def wait_for_ranks(refs: list, timeout_s: float | None = None, what: str = "") -> list:
    """Results of one call per rank. The first failure is raised at once: when a rank dies its peers may wait at a
    collective until the process-group timeout, and nobody should wait for them. Past `timeout_s` (None: no limit)
    a TimeoutError names `what`."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    pending = list(refs)
    while pending:
        remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
        ready, pending = ray.wait(pending, num_returns=1, timeout=remaining)
        if not ready:
            raise TimeoutError(f"{what or 'a call on the actor ranks'} did not finish within {timeout_s:g} s")
        ray.get(ready)
    return ray.get(refs)


class ActorRanks:
    """Ranks are placed by a placement group, one bundle (a CPU, and a GPU when given) per rank, packed onto as
    few nodes as possible so tensor-parallel peers share a node. Rank order follows Megatron's: TP fastest.

    ``placement_group`` (trainer.placement=split): a group the caller reserved whose bundle ``bundle_index`` holds
    every rank (a CPU, and a GPU when given, per rank), so all ranks share that bundle's node. The group becomes
    this one's: ``shutdown`` removes it, with anything else placed in it (the trainer's rollout worker).

    ``workers``: started rank processes (MegatronActorWorker actors, one per rank, placed by whoever started them)
    to `reset` into this group instead of starting new ones; `release` hands them back for the next group.

    ``detached`` (a supervised run, `rlsearch train --restarts`, whose supervisor owns Ray): the ranks and their
    placement group are named, detached Ray actors that outlive the driver, as the rollout engines are
    (`EnginePool`). The next driver's group of the same size and devices takes the live ones over (`reset` into its
    spec and worker environment: a process's imports, ~8 s of CPU on a CPU host, and its CUDA start-up on a GPU are
    paid once), ``adopted`` lists them, and ranks of another size or devices are stopped first. A graceful
    `shutdown` resets them (their models and optimizer freed) and leaves them running; after a rank died every rank
    is stopped.

    ``beside`` (a critic's ranks beside the actor's): this group's rank r goes into the bundle of that group's rank
    r mod its size, taking no CPU of its own and `gpu_share` of the bundle's GPUs, as that group's ranks take the
    rest; it never removes that group's placement group."""

    def __init__(
        self, spec: ActorWorkerSpec, num_gpus_per_rank: float = 0.0, placement_group=None, bundle_index: int = 0,
        workers: Sequence[ray.actor.ActorHandle] = (), detached: bool = False, gpu_share: float = 1.0,
        beside: ActorRanks | None = None,
    ) -> None:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.spec = spec
        self.last_tokens_per_expert: torch.Tensor | None = None  # MoE: the last step's [layers, experts] counts
        actor = spec.actor
        self.world_size = actor.world_size
        self.dp_size = actor.dp
        self.placement_group = None
        self.owns_placement_group = beside is None
        self.bundle_of = lambda rank: rank  # the bundle of its placement group each rank is in
        self.detached = detached
        self.adopted: list[int] = []  # ranks taken over from the driver before (``detached``)
        bundle = {"CPU": 1.0, **({"GPU": num_gpus_per_rank} if num_gpus_per_rank else {})}
        self._names = _DetachedNames(self.world_size, bundle) if detached else None
        if workers:
            if detached:
                raise ValueError("started ranks (workers) are the caller's: they cannot be detached")
            if len(workers) != self.world_size:
                raise ValueError(f"{len(workers)} started ranks for a layout of {self.world_size}")
            self.workers = list(workers)
            self._reset_all()
        else:
            if beside is not None:
                if detached:
                    raise ValueError("ranks beside another group are placed in its placement group: not detached")
                placement_group = beside.placement_group
                self.bundle_of = lambda rank: beside.bundle_of(rank % beside.world_size)
            reserved = placement_group is not None  # by the caller: every rank in its bundle `bundle_index`
            if beside is None and reserved:
                self.bundle_of = lambda rank: bundle_index
            if detached and reserved:
                raise ValueError("detached ranks reserve their own placement group")
            if self._names is not None:  # another layout's ranks hold the resources this one needs
                stop_detached_ranks(keep=self._names.all())
            if not reserved:
                placement_group = self._reserve(bundle)
            self.placement_group = placement_group
            ray.get(self.placement_group.ready(), timeout=600)
            remote_cls = ray.remote(MegatronActorWorker)
            place = PlacementGroupSchedulingStrategy

            def start(rank: int) -> ray.actor.ActorHandle:
                options = dict(num_cpus=0 if beside else 1, num_gpus=num_gpus_per_rank * gpu_share,
                               scheduling_strategy=place(self.placement_group,
                                                         placement_group_bundle_index=self.bundle_of(rank)))
                if self._names is None:
                    return remote_cls.options(**options).remote(spec, rank, self.world_size)
                options.update(name=self._names.rank(rank), lifetime="detached")
                return start_named_actor(lambda: remote_cls.options(**options).remote(spec, rank, self.world_size))

            taken = self._adopt() if self._names is not None else {}
            self.workers = [taken[rank] if rank in taken else start(rank) for rank in range(self.world_size)]
        rendezvous = self._open_rendezvous()
        self.infos: list[RankInfo] = ray.get([w.initialize.remote(rendezvous) for w in self.workers])

    def _reserve(self, bundle: dict[str, float]):
        """A bundle per rank, packed; ``detached``: the named group an earlier driver's ranks of this layout left, or
        a new one that outlives this driver."""
        from ray.util.placement_group import placement_group

        bundles = [dict(bundle) for _ in range(self.world_size)]
        if self._names is None:
            return placement_group(bundles, strategy="PACK")
        try:
            group = ray.util.get_placement_group(self._names.group)
            if ray.util.placement_group_table(group).get("state") != "REMOVED":
                return group
        except ValueError:
            pass
        return placement_group(bundles, strategy="PACK", name=self._names.group, lifetime="detached")

    def _adopt(self) -> dict[int, ray.actor.ActorHandle]:
        """The live ranks an earlier driver left under this layout's names, `reset` into this group with this
        driver's worker environment; one that does not answer in time (a killed driver may have left it inside a
        collective) or fails to reset is stopped, and started anew by the caller."""
        from ..ray_setup import worker_environment

        found = {}
        for rank in range(self.world_size):
            try:
                found[rank] = ray.get_actor(self._names.rank(rank))
            except ValueError:
                continue
        environment = worker_environment()
        resets = {rank: worker.reset.remote(self.spec, rank, self.world_size, environment)
                  for rank, worker in found.items()}
        if resets:
            ray.wait(list(resets.values()), num_returns=len(resets), timeout=ADOPT_TIMEOUT_S)
        taken = {}
        for rank, reset in resets.items():
            try:
                ray.get(reset, timeout=0)
                taken[rank] = found[rank]
            except Exception as error:  # dead, hung or failing: a new process instead
                print(f"[rlsearch] the detached actor rank {rank} could not be taken over ({type(error).__name__}); "
                      "starting a new one", flush=True)
                ray.kill(found[rank], no_restart=True)
        self.adopted = sorted(taken)
        if taken:
            ranks = ", ".join(map(str, self.adopted))
            print(f"[rlsearch] actor rank {ranks} outlived the previous driver and was taken over" if len(taken) == 1
                  else f"[rlsearch] actor ranks {ranks} outlived the previous driver and were taken over", flush=True)
        return taken

    def _open_rendezvous(self) -> str:
        """Rank 0 opens the ranks' store on its node, listening from now on (rlsearch.rendezvous): its address."""
        return ray.get(self.workers[0].open_rendezvous.remote("actor"))

    def _shards(self, samples: Sequence[TrainSample]) -> list[list[TrainSample]]:
        """Contiguous, balanced data-parallel shards (their concatenation is the input order)."""
        base, extra = divmod(len(samples), self.dp_size)
        shards, start = [], 0
        for dp_rank in range(self.dp_size):
            end = start + base + (1 if dp_rank < extra else 0)
            shards.append(list(samples[start:end]))
            start = end
        return shards

    def _on_every_rank(self, method: str, samples: Sequence[TrainSample], *args, **kwargs) -> list:
        """`method` on every rank with its data-parallel shard of `samples` first; the results in rank order."""
        shards = self._shards(samples)
        return wait_for_ranks([
            getattr(worker, method).remote(shards[info.dp_rank], *args, **kwargs)
            for worker, info in zip(self.workers, self.infos)
        ])

    def named_workers(self) -> list[tuple[str, ray.actor.ActorHandle]]:
        """(name for messages, actor handle) per rank."""
        role = "critic" if self.spec.value_model else "actor"
        return [
            (f"{role} rank {info.rank} (tp {info.tp_rank}, pp {info.pp_rank}, cp {info.cp_rank}, dp {info.dp_rank})",
             worker)
            for worker, info in zip(self.workers, self.infos)
        ]

    def _output_by_dp_rank(self, results: list) -> list:
        outputs = {info.dp_rank: result for info, result in zip(self.infos, results) if info.is_output_rank}
        return [outputs[dp_rank] for dp_rank in range(self.dp_size)]

    def compute_logprobs(
        self, samples: Sequence[TrainSample], reference: bool = False, distribution: SamplingDistribution | None = None
    ) -> list[list[float]]:
        """Per-sample logprobs of the response tokens under `distribution` (default: the rollout's)."""
        results = self._on_every_rank("compute_logprobs", samples, reference, distribution)
        return [row for shard in self._output_by_dp_rank(results) for row in shard]

    def score_continuations(self, prompt: list[int], continuations: Sequence[list[int]]) -> list[list[float]]:
        """The logprobs of each continuation's tokens after `prompt`, under the rollout's distribution."""
        return self.compute_logprobs([
            TrainSample(prompt + token_ids, response_start=len(prompt), loss_mask=[1] * len(token_ids))
            for token_ids in continuations
        ])

    def compute_logprobs_and_routing(
        self, samples: Sequence[TrainSample]
    ) -> tuple[list[list[float]], list[torch.Tensor]]:
        """`compute_logprobs` of the trained MoE model, and the routing of each sample in that pass: [tokens, layers,
        top-k] expert ids (algo.routing_replay=old: `TrainSample.routed_experts`)."""
        results = self._on_every_rank("compute_logprobs_and_routing", samples)
        logprobs = [row for shard in self._output_by_dp_rank([r[0] for r in results]) for row in shard]
        # every stage's tensor-parallel rank 0 recorded its own layers (-1 in the others'): merged per sample
        by_dp: dict[int, list[torch.Tensor]] = {}
        for info, (_, routing) in zip(self.infos, results):
            if routing is not None:
                merged = by_dp.setdefault(info.dp_rank, routing)
                if merged is not routing:
                    by_dp[info.dp_rank] = [torch.maximum(a, b) for a, b in zip(merged, routing)]
        return logprobs, [row for dp_rank in range(self.dp_size) for row in by_dp[dp_rank]]

    def _train(
        self, samples: Sequence[TrainSample], objective: Objective, distribution: SamplingDistribution | None = None
    ) -> tuple[list[dict[str, float]], float]:
        """One optimizer step on every rank: the output ranks' results by DP rank, and whether it was skipped."""
        results = self._on_every_rank("train_step", samples, self.dp_size, objective, distribution)
        skipped = {result["skipped_nonfinite"] for result in results}
        if len(skipped) != 1:  # the worker's all-reduce makes this impossible unless a rank broke the protocol
            flags = [result["skipped_nonfinite"] for result in results]
            raise RuntimeError(f"actor ranks disagree on skipping a non-finite step (per rank: {flags})")
        return self._output_by_dp_rank(results), skipped.pop()

    def sft_step(self, samples: Sequence[TrainSample]) -> dict[str, float]:
        """One supervised step: the mean negative log-likelihood of the loss-masked tokens (token weights sum to 1)."""
        per_dp, skipped = self._train(samples, sft_objective, MODEL_DISTRIBUTION)
        tokens = max(sum(r["tokens"] for r in per_dp), 1.0)
        return {
            "sft/loss": sum(r["nll_sum"] for r in per_dp) / tokens,
            "sft/tokens": tokens,
            "actor/grad_norm": per_dp[0]["grad_norm"],
            "actor/lr": per_dp[0]["lr"],
            "actor/skipped_nonfinite": skipped,
            **self._expert_load(per_dp[0]),
        }

    def _expert_load(self, result: dict) -> dict[str, float]:
        """MoE: the step's expert-load metrics (moe/*: every rank's result holds them, reduced over all ranks); the
        tokens per expert [layers, experts] stay in `last_tokens_per_expert`."""
        if "moe_tokens_per_expert" in result:
            self.last_tokens_per_expert = result["moe_tokens_per_expert"]
        return {key: value for key, value in result.items() if key.startswith("moe/")}

    def train_step(self, samples: Sequence[TrainSample], objective: Objective | None = None) -> dict[str, float]:
        """One optimizer step of `objective` (default: GRPO with the group's algo config) over `samples`."""
        per_dp, skipped = self._train(samples, objective or partial(grpo_objective, algo=self.spec.algo))
        summed = {key: sum(r[key] for r in per_dp) for key in (
            "policy_loss", "kl_loss", "clip_tokens", "approx_kl_sum", "rollout_drift_sum", "tis_weight_sum",
            "tis_capped_tokens", "correction_masked_tokens", "sequences", "capped_sequences", "masked_sequences",
            "entropy_sum", "tokens", *LOG_RATIO_BINS,
        )}
        tokens = max(summed["tokens"], 1.0)
        sequences = max(summed["sequences"], 1.0)
        return {
            "actor/policy_loss": summed["policy_loss"],
            "actor/kl_loss": summed["kl_loss"],
            "actor/clip_fraction": summed["clip_tokens"] / tokens,
            "actor/approx_kl": summed["approx_kl_sum"] / tokens,
            # of the distribution trained against (the rollout's), per trained token
            "actor/entropy": summed["entropy_sum"] / tokens,
            "rollout/actor_logprob_diff_mean": summed["rollout_drift_sum"] / tokens,
            # the rollout correction's (algo.rollout_correction) weight and what it did, per trained token or
            # sequence (a trained sample; sequence-level corrections only)
            "actor/tis_weight_mean": summed["tis_weight_sum"] / tokens,
            "actor/tis_capped_fraction": summed["tis_capped_tokens"] / tokens,
            "actor/correction_masked_fraction": summed["correction_masked_tokens"] / tokens,
            "actor/seq_capped_fraction": summed["capped_sequences"] / sequences,
            "actor/seq_masked_fraction": summed["masked_sequences"] / sequences,
            # pi_old / pi_rollout over the trained tokens, approximate (counts per bin of its log: rlsearch.algo)
            **{f"rollout/actor_ratio_p{round(100 * q):02d}": math.exp(histogram_quantile(summed, q))
               for q in (0.01, 0.5, 0.99)},
            "actor/grad_norm": per_dp[0]["grad_norm"],
            "actor/lr": per_dp[0]["lr"],
            "actor/update_ok": per_dp[0]["update_ok"],
            # 1.0: the loss or grad norm was NaN/inf, every rank skipped the optimizer step (weights unchanged)
            "actor/skipped_nonfinite": skipped,
            **self._expert_load(per_dp[0]),
        }

    def stage_workers(self) -> list[list]:
        """Per pipeline stage, in stage order: the ranks of data-parallel replica 0 and context-parallel rank 0 in TP
        order, then (MoE with expert parallelism) the other data-parallel ranks holding the rest of the experts.
        The first is the stage's weight sender; the weight path leaves the other ranks alone (their weights are
        the same)."""
        stages: list[list] = [[] for _ in range(max(info.pp_rank for info in self.infos) + 1)]
        for worker, info in sorted(zip(self.workers, self.infos), key=lambda pair: (pair[1].dp_rank, pair[1].tp_rank)):
            if info.cp_rank == 0 and (info.dp_rank == 0 or info.expert_dp_rank == 0):
                stages[info.pp_rank].append(worker)
        return stages

    def offload(self) -> int:
        """Every rank's weights, gradients and optimizer states into host memory, their device memory freed until
        the next call that uses them (critic.offload); returns the bytes released over the ranks."""
        return sum(wait_for_ranks([worker.offload.remote() for worker in self.workers]))

    def save_checkpoint(self, path: str, timeout_s: float | None = None) -> None:
        wait_for_ranks([worker.save_checkpoint.remote(path) for worker in self.workers], timeout_s,
                       f"saving the checkpoint {path}")

    def load_checkpoint(self, path: str, restore_rng: bool) -> int:
        """Load model, optimizer and scheduler (and RNG states when the layout is the one that saved them);
        returns the scheduler's step count."""
        return wait_for_ranks([worker.load_checkpoint.remote(path, restore_rng) for worker in self.workers])[0]

    def hf_state_dict(self) -> dict:
        return wait_for_ranks([worker.hf_state_dict.remote() for worker in self.workers])[0]

    def shutdown(self, graceful: bool = True) -> None:
        """Stop every rank: a clean process-group teardown first when ``graceful`` (not after a rank died: its peers
        may be stuck at a collective), then the actors are killed. ``detached``: the placement group stays for the
        next driver's ranks, and when ``graceful`` the ranks are reset and left running for it instead (killed when
        a reset fails)."""
        from ray.util.placement_group import remove_placement_group

        if self.detached and graceful:
            try:
                self._reset_all(timeout_s=60)
                return
            except Exception:  # a rank that cannot be reset is stopped with the others
                pass
        try:
            if graceful:
                ray.get([worker.shutdown.remote() for worker in self.workers], timeout=30)
        finally:
            for worker in self.workers:
                ray.kill(worker)
            if self.placement_group is not None and self.owns_placement_group and not self.detached:
                remove_placement_group(self.placement_group)

    def release(self) -> list[ray.actor.ActorHandle]:
        """The rank processes of a group made of started ones (``workers``), alive and `reset` (out of its groups,
        their models and optimizers freed), for the next group."""
        if self.placement_group is not None:
            raise ValueError("release is for a group of started ranks (workers); this one started its own: shutdown")
        self._reset_all(timeout_s=60)
        return self.workers

    def _reset_all(self, timeout_s: float | None = None) -> None:
        """Every rank `reset` into this group's spec and rank: out of its groups, its models and optimizer freed."""
        ray.get([worker.reset.remote(self.spec, rank, self.world_size) for rank, worker in enumerate(self.workers)],
                timeout=timeout_s)
