"""One Megatron-core rank of the policy (logprobs, GRPO training steps, weight export, checkpoints) or of its critic
(`ActorWorkerSpec.value_model`: values and value-loss steps, checkpoints).

`ActorRanks` (ranks.py) runs TP x PP x DP of these as Ray actors. Every method that runs megatron code is a
collective: the group calls it on all ranks at once. Results come back from the "output ranks" (last
pipeline stage, tensor-parallel rank 0), one per data-parallel shard.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch
import torch.distributed as dist

from ..algo import Objective
from ..config import ActorConfig, AlgoConfig
from ..devices import cpu_threads_each, local_device
from ..lifetime import forked_children_die_with_this_process
from ..megatron.cpu_compat import cuda_available
from ..megatron.lora import adapters_off, install_adapters
from ..megatron.model import (
    ActivationMemory,
    MoESettings,
    build_model_chunks,
    export_hf_named,
    load_value_model,
    make_bridge,
    resolve_transformer_impl,
)
from ..megatron.offload import release, restore, training_storages
from ..megatron.parallel import PROCESS_GROUP_TIMEOUT_S, init_megatron_parallel
from ..megatron.training import build_training_model, load_training_state, save_training_state
from ..rendezvous import Rendezvous
from ..runlog import redirect_worker_output
from ..weights import shm
from ..weights.bucket import WeightBucket
from ..weights.delta import DeltaBucket
from ..weights.export import export_stage_adapters, export_stage_weights
from ..weights.gather import ShardGathers
from .batch import MicroBatch, Packing, TrainSample, collate, pack_micro_batches
from .distribution import SamplingDistribution
from .logits import token_logprobs
from .moe import MoERouters, expert_load_metrics
from .senders import BroadcastSender, ShmSender, export_bytes, take_part

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _unwrap(chunk: torch.nn.Module) -> torch.nn.Module:
    return getattr(chunk, "module", chunk)


@dataclass
class RankInfo:
    rank: int
    tp_rank: int
    pp_rank: int
    dp_rank: int
    cp_rank: int
    # rank among the data-parallel replicas of this rank's experts: with actor.ep, the ranks of replica 0 hold every
    # expert between them (the weight path's expert-parallel peers)
    expert_dp_rank: int
    is_output_rank: bool  # last pipeline stage, tensor- and context-parallel rank 0: holds losses and logprobs
    transformer_impl: str  # the layer spec built: local | transformer_engine (checkpoint keys depend on it)

    @property
    def is_stage_sender(self) -> bool:
        """Whether this rank sends its pipeline stage's weights to the engines (tensor-, data- and context-parallel
        rank 0); its TP and EP peers take part in the gathers."""
        return self.tp_rank == 0 and self.dp_rank == 0 and self.cp_rank == 0


@dataclass
class ActorWorkerSpec:
    model_path: str
    dtype: str
    actor: ActorConfig
    algo: AlgoConfig
    sampling: SamplingDistribution  # what the rollout engines sample from: logprobs, the loss and the KL use it
    total_steps: int
    seed: int
    # a critic's rank (algo.advantage=gae): model_path's transformer with a value head instead of the output layer
    value_model: bool = False
    # rollout.async_steps > 0: the engines roll out while the ranks train, so the ranks take half of their node's
    # cores (the engines the other half) where actor.num_threads does not say
    trains_beside_rollout: bool = False


class MegatronActorWorker:
    def __init__(self, spec: ActorWorkerSpec, rank: int, world_size: int) -> None:
        redirect_worker_output(f"{'critic' if spec.value_model else 'actor'}-rank{rank}")
        # Megatron's checkpoint writers are forked: one that outlived a killed rank would hide its death from Ray
        forked_children_die_with_this_process()
        self.spec = spec
        self.rank = rank
        self.world_size = world_size
        self._rendezvous: dict[str, Rendezvous] = {}
        self._shard_gathers = ShardGathers()  # its TP and EP shards' way to the stage's sender
        # the weight transports' senders (rlsearch.actor.senders): each holds what the rank keeps between syncs
        self.shm_sender = ShmSender()
        self.broadcast_sender = BroadcastSender()

    def open_rendezvous(self, purpose: str, timeout_s: float = PROCESS_GROUP_TIMEOUT_S) -> str:
        """Open, on this rank's node, the store of a group (`purpose`: "actor" for the ranks' own, "weights-K" for
        stage K's broadcast group) and keep it while this rank lives or until the group is left; returns its
        "host:port", already listening (rlsearch.rendezvous). RLSEARCH_NODE_IP names the node's address without Ray."""
        host = os.environ.get("RLSEARCH_NODE_IP")
        if not host:
            import ray

            host = ray.util.get_node_ip_address()
        rendezvous = self._rendezvous[purpose] = Rendezvous(host, timeout_s)
        return rendezvous.address

    def node_id(self) -> str:
        """The Ray node this rank runs on (the trainer reports the placement at start-up)."""
        import ray

        return ray.get_runtime_context().get_node_id()

    def initialize(self, rendezvous: str) -> RankInfo:
        """Join the ranks' process group at `rendezvous`, then `build` this rank's part of the actor."""
        actor = self.spec.actor
        torch.set_num_threads(actor.num_threads or cpu_threads_each(
            self.world_size * (2 if self.spec.trains_beside_rollout else 1)))
        init_megatron_parallel(
            self.rank, self.world_size, rendezvous, tp=actor.tp, pp=actor.pp, cp=actor.cp, ep=actor.ep,
            virtual_pipeline_stages=actor.virtual_pipeline_stages, backend=actor.backend, seed=self.spec.seed,
        )
        return self.build()

    def build(self) -> RankInfo:
        """This rank's models, optimizer and MoE routers, in the process group `initialize` joined. A test may build
        actors of several configs with the same layout in one group (one after another)."""
        from megatron.core import parallel_state as ps

        actor = self.spec.actor
        self.transformer_impl = resolve_transformer_impl(actor.transformer_impl)
        dtype = _DTYPES[self.spec.dtype]
        # mbridge's HF <-> Megatron mapper (rlsearch.weights is the weight path that uses it)
        value_model = self.spec.value_model
        moe = MoESettings(
            dispatcher=actor.moe_dispatcher, aux_loss_coef=actor.moe_aux_loss_coef, z_loss_coef=actor.moe_z_loss_coef,
            record_routing=self.spec.algo.routing_replay == "old" and not value_model,
        )
        activations = ActivationMemory(
            recompute=actor.recompute, recompute_method=actor.recompute_method,
            recompute_num_layers=actor.recompute_num_layers, recompute_modules=tuple(actor.recompute_modules),
            offload=actor.activation_offload,
        )
        self.mbridge = make_bridge(self.spec.model_path, dtype, self.transformer_impl, not cuda_available(), moe,
                                   activations, value_model=value_model, model_dropout=actor.dropout == "model")
        chunks = self._build_chunks()
        self.training = build_training_model(chunks, self.spec.actor, self.spec.total_steps)
        self.model = self.training.chunks
        self._host_copies: list | None = None  # what `offload` released, until the next use restores it
        self.reference = None
        # with actor.lora the reference policy is the trained model with its adapters off (`compute_logprobs`)
        if self.spec.algo.kl_coef > 0 and not value_model and not actor.lora.rank:
            self.reference = self._build_chunks()
            for chunk in self.reference:
                chunk.requires_grad_(False)
        self._logit_index: torch.Tensor | None = None
        self._install_logit_selection(self.model + (self.reference or []))
        config = chunks[0].config
        # MoE: expert-load counts and router replay on the trained model's routers (every rank, even a stage without
        # MoE layers: the counts are reduced over all ranks)
        self.routers = MoERouters(self.model, config.num_layers, config.num_moe_experts, config.moe_router_topk) if (
            config.num_moe_experts) else None
        self._recorded_routing: dict[int, torch.Tensor] | None = None
        cp_rank = ps.get_context_parallel_rank()
        merge = actor.merge_prefixes and self.transformer_impl == "local"
        if actor.merge_prefixes and not merge and self.rank == 0:
            print("[rlsearch] actor.merge_prefixes: Transformer Engine's fused attention takes no prefix-tree mask; "
                  "the segments of a trajectory train one by one (transformer_impl=local merges them)", flush=True)
        self.packing = Packing(merge_prefixes=merge, cp=actor.cp, cp_rank=cp_rank)
        self.info = RankInfo(
            rank=self.rank,
            tp_rank=ps.get_tensor_model_parallel_rank(),
            pp_rank=ps.get_pipeline_model_parallel_rank(),
            dp_rank=ps.get_data_parallel_rank(),
            cp_rank=cp_rank,
            expert_dp_rank=ps.get_expert_data_parallel_rank(),
            is_output_rank=ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0 and cp_rank == 0,
            transformer_impl=self.transformer_impl,
        )
        return self.info

    def _build_chunks(self) -> list[torch.nn.Module]:
        """This rank's model chunks with the HF weights; on the local spec its attention applies the rotary
        embeddings (rlsearch.megatron.attention). With actor.lora the policy's weights are frozen under adapters
        (rlsearch.megatron.lora)."""
        from ..megatron.attention import take_over_rotary

        stages = self.spec.actor.virtual_pipeline_stages
        if self.spec.value_model:
            chunks = build_model_chunks(self.mbridge, stages, value_head_seed=self.spec.seed)
            load_value_model(self.mbridge, chunks, self.spec.model_path)
        else:
            chunks = build_model_chunks(self.mbridge, stages)
            self.mbridge.load_weights(chunks, self.spec.model_path)
        if self.transformer_impl == "local":
            for chunk in chunks:
                take_over_rotary(chunk)
        lora = self.spec.actor.lora
        if lora.rank and not self.spec.value_model:
            for chunk in chunks:
                install_adapters(chunk, lora, self.spec.seed)
        return chunks

    # ---- forward passes -------------------------------------------------------------------------------

    def _token_logprobs(
        self, hidden: torch.Tensor, head: tuple, labels: torch.Tensor, distribution: SamplingDistribution | None,
        with_entropy: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """log p(label) per selected position under `distribution` (default: the rollout's, `spec.sampling`), and
        optionally the distribution's entropy, from the hidden states [1, n, h] the output layer would project: in
        chunks of actor.logits_chunk_tokens positions over the vocab-parallel logits (rlsearch.actor.logits)."""
        output_layer, weight = head
        return token_logprobs(
            hidden[0], output_layer, weight, labels, distribution or self.spec.sampling,
            self.spec.actor.logits_chunk_tokens, with_entropy=with_entropy,
        )

    def _install_logit_selection(self, chunks: list[torch.nn.Module]) -> None:
        """The output layer hands back the hidden states at the positions a micro-batch needs (response tokens)
        instead of projecting them: the loss function projects them chunk by chunk (`_token_logprobs`), so the
        logits of a whole sequence never exist."""

        def selected_hidden(hidden, weight=None, runtime_gather_output=None):
            return hidden.reshape(-1, hidden.shape[-1]).index_select(0, self._logit_index).unsqueeze(1), None

        for chunk in chunks:
            module = _unwrap(chunk)
            if module.post_process:
                module.output_layer.project = module.output_layer.forward  # what `_token_logprobs` calls
                module.output_layer.forward = selected_hidden

    @staticmethod
    def _output_head(chunk: torch.nn.Module) -> tuple:
        """(the output layer's projection, the tied embedding weight it projects with or None) of a last-stage
        chunk."""
        module = _unwrap(chunk)
        if not module.post_process:
            return None, None
        tied = module.share_embeddings_and_output_weights
        return module.output_layer.project, module.shared_embedding_or_output_weight() if tied else None

    def _run_pipeline(self, model, samples: Sequence[TrainSample], loss_fn, forward_only: bool, routed: bool = True
                      ) -> list[dict]:
        """Megatron's pipeline schedule over packed micro-batches; the loss dicts of the last stage, in order. A
        training pass (not `forward_only`) takes logits only at trained positions, whose weights are the only
        non-zero ones; a forward pass gives every response token its logprob. `routed`: the trained model's MoE
        routers count and replay (not in a reference pass)."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        from ..megatron.attention import rotary_table

        self._on_device()
        micro_batches = pack_micro_batches(
            samples, self.spec.actor.max_tokens_per_microbatch, min_micro_batches=self.spec.actor.pp,
            trained_only=not forward_only, packing=self.packing,
        )
        micro_batches += self._idle_micro_batches(len(micro_batches), trained_only=not forward_only)
        # the interleaved schedule reads micro-batches once per model chunk
        batches = iter(micro_batches) if len(model) == 1 else [iter(micro_batches) for _ in model]

        routed = routed and self.routers is not None and model is self.model

        def forward_step(data_iterator, chunk):
            mb: MicroBatch = next(data_iterator)
            if self.transformer_impl == "local":
                mb.layout.rotary = rotary_table(_unwrap(chunk), mb.layout.positions)
            if routed:
                self.routers.route(chunk, record=self._recorded_routing is not None, replay=mb.routed_experts)
            self._logit_index = mb.projected_rows
            try:
                with self.routers.forward_pass() if routed else contextlib.nullcontext():
                    output = chunk(mb.tokens, mb.position_ids, None, packed_seq_params=mb.packed_seq_params())
            finally:
                self._logit_index = None
            if routed and self._recorded_routing is not None:
                self._keep_recorded_routing(chunk, mb)
            return output, partial(loss_fn, mb, len(micro_batches), self._output_head(chunk))

        try:
            outputs = get_forward_backward_func()(
                forward_step_func=forward_step, data_iterator=batches, model=model,
                num_microbatches=len(micro_batches), seq_length=max(mb.num_tokens for mb in micro_batches),
                micro_batch_size=1, forward_only=forward_only,
            )
            if routed:
                self.routers.check_replayed()  # before the caller steps the optimizer on these gradients
            return outputs
        finally:
            if routed:
                for chunk in model:
                    self.routers.free(chunk)

    def _idle_micro_batches(self, count: int, trained_only: bool) -> list[MicroBatch]:
        """With expert parallelism every micro-batch's MoE layers exchange tokens with the other ranks of the
        expert-parallel group, so each rank runs as many micro-batches as the busiest one: this rank's share of
        one-token micro-batches with no weight in the loss (sample index -1) to make up the difference."""
        from megatron.core import parallel_state as ps

        if ps.get_expert_model_parallel_world_size() == 1:
            return []
        counts = torch.tensor([count], device=local_device() if dist.get_backend() == "nccl" else "cpu")
        dist.all_reduce(counts, op=dist.ReduceOp.MAX, group=ps.get_expert_model_parallel_group())
        idle = self._stand_in_sample()
        return [collate([idle], [-1], trained_only, packing=self.packing).to(local_device())
                for _ in range(int(counts.item()) - count)]

    def _keep_recorded_routing(self, chunk: torch.nn.Module, mb: MicroBatch) -> None:
        """The routing `chunk`'s layers just recorded for `mb`, into each of its samples' routing."""
        for layer, indices in self.routers.recorded(chunk):
            indices = indices.to("cpu", torch.int16)
            for sample_index, rows in zip(mb.sample_indices, mb.sample_rows):
                if sample_index >= 0:  # not an idle micro-batch's
                    self._recorded_routing[sample_index][:, layer] = indices[rows]

    def _whole_selection(self, values: torch.Tensor, mb: MicroBatch) -> torch.Tensor:
        """With context parallelism, per-position values of all the micro-batch's selected positions (each CP rank
        holds some): summed over the CP group into place. The values themselves otherwise."""
        if mb.selection is None:
            return values
        from megatron.core import parallel_state as ps

        whole = values.new_zeros(sum(mb.response_lens))
        whole[mb.selection] = values
        dist.all_reduce(whole, group=ps.get_context_parallel_group())
        return whole

    def compute_logprobs(
        self, samples: Sequence[TrainSample], reference: bool = False, distribution: SamplingDistribution | None = None,
    ) -> list[list[float]] | None:
        """Per-sample logprobs of the response tokens (under the rollout's sampled distribution unless given), of the
        reference policy with `reference`. None off the output ranks."""

        def logprobs(hidden, head, mb):
            return self._token_logprobs(hidden, head, mb.projected_labels, distribution)[0]

        if not reference:
            return self._forward_per_token(self.model, samples, logprobs)
        if self.spec.algo.kl_coef == 0:
            raise RuntimeError("reference logprobs requested but algo.kl_coef is 0 (no reference model)")
        if self.reference is not None:
            return self._forward_per_token(self.reference, samples, logprobs)
        with adapters_off(self.model):  # actor.lora: the base model under the adapters
            return self._forward_per_token(self.model, samples, logprobs, routed=False)

    def compute_values(self, samples: Sequence[TrainSample]) -> list[list[float]] | None:
        """A critic's values at every response token of each sample (the value of the state before the token is
        generated). None off the output ranks."""
        if not self.spec.value_model:
            raise RuntimeError("values are a critic's (ActorWorkerSpec.value_model); this rank is the policy's")
        return self._forward_per_token(self.model, samples, lambda hidden, head, mb: self._values(hidden, head))

    def _forward_per_token(self, model, samples: Sequence[TrainSample], per_pair, routed: bool = True
                           ) -> list[list[float]] | None:
        """A forward pass of `model` over `samples`: per sample, the figure at each of its response tokens (logprobs,
        a critic's values), in order, from `per_pair(hidden, head, mb)`'s figure of each projected (row, label) pair.
        None off the output ranks."""
        if not samples and self.spec.actor.ep == 1:
            # an empty data-parallel shard: a forward pass has no collectives across replicas (with expert
            # parallelism it has: the shard runs idle micro-batches)
            return [] if self.info.is_output_rank else None

        def loss_fn(mb: MicroBatch, _num_micro_batches: int, head: tuple, hidden: torch.Tensor):
            figures = self._whole_selection(mb.per_position(per_pair(hidden, head, mb)).detach(), mb)
            per_sample = [chunk.tolist() for chunk in figures.split(mb.response_lens)]
            return figures.new_zeros(()), {"per_sample": per_sample, "indices": mb.sample_indices}

        for chunk in model:
            chunk.eval()
        with torch.no_grad():
            outputs = self._run_pipeline(model, samples, loss_fn, forward_only=True, routed=routed)
        if not self.info.is_output_rank:
            return None
        by_index = {index: row for out in outputs for index, row in zip(out["indices"], out["per_sample"])}
        return [by_index[index] for index in range(len(samples))]

    @staticmethod
    def _values(hidden: torch.Tensor, head: tuple) -> torch.Tensor:
        """A critic's value per selected position, from the hidden states [n, 1, h] its value head projects."""
        output_layer, _ = head
        return output_layer(hidden)[0].reshape(-1)

    def compute_logprobs_and_routing(
        self, samples: Sequence[TrainSample],
    ) -> tuple[list[list[float]] | None, list[torch.Tensor] | None]:
        """`compute_logprobs` of the trained MoE model (algo.routing_replay=old), and each sample's routing in that
        pass: [tokens, layers, top-k] expert ids of this rank's layers (-1 elsewhere), from tensor-parallel rank 0 of
        every stage (None on the other ranks)."""
        if self.routers is None or self.spec.algo.routing_replay != "old":
            raise ValueError("routing is recorded for the trained MoE model with algo.routing_replay=old only")
        shape = (self.routers.num_layers, self.routers.topk)
        self._recorded_routing = {i: torch.full((len(s.token_ids), *shape), -1, dtype=torch.int16)
                                  for i, s in enumerate(samples)}
        try:
            logprobs = self.compute_logprobs(samples)
            routing = [self._recorded_routing[i] for i in range(len(samples))]
        finally:
            self._recorded_routing = None
        return logprobs, routing if self.info.tp_rank == 0 else None

    def train_step(
        self, samples: Sequence[TrainSample], dp_size: int, objective: Objective,
        distribution: SamplingDistribution | None = None,
    ) -> dict[str, float]:
        """One optimizer step over `samples` (this rank's data-parallel shard), minimising `objective` (an
        `rlsearch.algo` objective: loss and stats from the logprobs under `distribution`, default the rollout's). When
        the loss or the gradients are NaN/inf on any rank, every rank skips the optimizer and LR-scheduler steps
        instead (`skipped_nonfinite` 1.0, `update_ok` 0.0, `grad_norm` NaN): nothing changes but zeroed gradients."""
        if not samples:
            # an empty shard still joins the gradient all-reduce and the optimizer step: a zero-weight token
            samples = [self._stand_in_sample()]

        def loss_fn(mb: MicroBatch, num_micro_batches: int, head: tuple, hidden: torch.Tensor):
            if self.spec.value_model:  # a critic: the objective of its values
                loss, stats = objective(mb.per_position(self._values(hidden, head)), mb)
            else:
                logprobs, entropy = self._token_logprobs(hidden, head, mb.projected_labels, distribution,
                                                         with_entropy=True)
                loss, stats = objective(mb.per_position(logprobs), mb)
                stats["entropy_sum"] = (mb.per_position(entropy) * mb.loss_mask).sum()
            # the schedule divides by the number of micro-batches and DDP averages over DP ranks; the token
            # weights already normalise over the whole global batch, so undo both. (With context parallelism the
            # schedule multiplies by the CP size and DDP averages over it too: the CP ranks' gradients add up.)
            return loss * num_micro_batches * dp_size, stats

        return self._optimizer_step(samples, loss_fn)

    def _stand_in_sample(self) -> TrainSample:
        """A one-token sample of zero loss weight with what this rank's objective reads (an empty data-parallel
        shard's, or an idle expert-parallel micro-batch's)."""
        if self.spec.value_model:
            return TrainSample([0, 0], 1, [0], token_weights=[0.0], returns=[0.0], old_values=[0.0])
        reference = [0.0] if self.spec.algo.kl_coef else None
        return TrainSample([0, 0], 1, [0], token_weights=[0.0], ref_logprobs=reference)

    def _optimizer_step(self, samples: Sequence[TrainSample], loss_fn) -> dict[str, float]:
        self._on_device()
        for chunk in self.model:
            chunk.train()
            chunk.zero_grad_buffer()
        self.training.optimizer.zero_grad()
        if self.routers is not None:
            self.routers.start_counting()
        outputs = self._run_pipeline(self.model, samples, loss_fn, forward_only=False)
        totals = self._reduce_over_cp({key: sum(out[key] for out in outputs) for key in outputs[0]}) if outputs else {}
        if self.routers is not None:
            tokens_per_expert, routed_tokens = self.routers.stop_counting()
            totals.update(expert_load_metrics(tokens_per_expert, routed_tokens, self.routers.topk),
                          moe_tokens_per_expert=tokens_per_expert)
        skipped = self._any_rank_nonfinite(totals.get("loss", 0.0))
        if skipped:
            # weights, optimizer moments and step count, and the LR schedule stay as they were; every rank agrees
            for chunk in self.model:
                chunk.zero_grad_buffer()
            self.training.optimizer.zero_grad()
            update_ok, grad_norm = False, None
        else:
            update_ok, grad_norm, _ = self.training.optimizer.step()
            self.training.scheduler.step(increment=1)
        totals.update(
            grad_norm=float(grad_norm) if grad_norm is not None else float("nan"),
            update_ok=float(bool(update_ok)),
            skipped_nonfinite=float(skipped),
            lr=float(self.training.optimizer.param_groups[0]["lr"]),
        )
        return totals

    def _reduce_over_cp(self, sums: dict[str, torch.Tensor]) -> dict[str, float]:
        """Per-step sums of the last stage's micro-batches; with context parallelism each CP rank summed over its own
        positions, so they are added up over the CP group."""
        if self.spec.actor.cp == 1:
            return {key: float(value) for key, value in sums.items()}
        from megatron.core import parallel_state as ps

        keys = sorted(sums)
        values = torch.stack([torch.as_tensor(sums[key], dtype=torch.float64) for key in keys]).to(local_device())
        dist.all_reduce(values, group=ps.get_context_parallel_group())
        return dict(zip(keys, values.tolist()))

    def _any_rank_nonfinite(self, loss: float) -> bool:
        """Whether the step's loss or gradients are NaN/inf on any rank (a collective over all TP x PP x DP ranks,
        so they all skip or all step). The loss is that of this rank's micro-batches (0 off the last stage); the
        gradients are this rank's reduced DDP grad buffers, whose norm is finite exactly when the step's grad norm
        is (the optimizer's norm is computed from these same buffers)."""
        grads = [
            param.main_grad for chunk in self.model for param in chunk.parameters()
            if getattr(param, "main_grad", None) is not None
        ]
        local_norm = torch.nn.utils.get_total_norm(grads).item() if grads else 0.0
        on_nccl = dist.get_backend() == "nccl"
        device = local_device() if on_nccl else torch.device("cpu")
        flag = torch.tensor([float(not (np.isfinite(loss) and np.isfinite(local_norm)))], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    # ---- weights --------------------------------------------------------------------------------------

    def offload(self) -> int:
        """This rank's weights, gradients and optimizer states (and the reference model's weights) into host memory,
        their device memory released (critic.offload: the other model's turn on the device); returns the bytes
        released (0 when they were already). Whatever uses them next brings them back first."""
        if self._host_copies is not None:
            return 0
        self._host_copies = release(training_storages(self.model + (self.reference or []), self.training.optimizer))
        return sum(host.numel() for _, host in self._host_copies)

    def _on_device(self) -> None:
        """The model and optimizer back where `offload` took them from (nothing when they are there)."""
        if self._host_copies is not None:
            restore(self._host_copies)
            self._host_copies = None

    def export_hf_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """HF-named full tensors (PP gathered, TP merged) on every rank, each name once. A collective over all ranks:
        for checkpoint export; weight syncs use the rank-local `export_weight_buckets` / `broadcast_weights`."""
        self._on_device()
        return export_hf_named(self.mbridge, self.model)

    def hf_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The whole HF state dict on global rank 0 (None elsewhere). A collective."""
        state = {name: tensor.cpu().clone() for name, tensor in self.export_hf_weights()}
        return state if self.rank == 0 else None

    def stage_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """HF-named full tensors of this rank's pipeline stage, as a weight sync exports them (yielded on the stage's
        TP rank 0; its TP peers take part in the gathers). A collective over the stage's TP group."""
        self._on_device()
        return export_stage_weights(self.mbridge, self.model, self._shard_gathers)

    def stage_adapters(self) -> dict[str, torch.Tensor]:
        """actor.lora.sync=adapter: this pipeline stage's adapters, whole, under PEFT's names (on the stage's sender;
        {} on its TP peers, which send it their shards). A collective over the stage's TP group."""
        self._on_device()
        return {name: tensor.cpu() for name, tensor in
                export_stage_adapters(self.mbridge, self.model, self._shard_gathers).items()}

    def export_weight_buckets(self, plan: shm.ExportPlan) -> Iterator[WeightBucket | DeltaBucket | dict]:
        """This pipeline stage's weights in buckets (shm transport, `ShmSender`), yielded by the stage's sender; its
        TP peers (and, with expert parallelism, the ranks holding the other experts) take part in the gathers and
        yield nothing. Called on the ranks of `ActorRanks.stage_workers` only."""
        yield from self.shm_sender.buckets(self.stage_weights(), plan, self.info.is_stage_sender)

    def delta_base_id(self) -> str | None:
        """The sync id of the weights this stage's sender last sent under weights.delta (None: none kept)."""
        return self.shm_sender.delta_base_id

    def export_bytes(self) -> int:
        """Bytes the weight path exports from this rank's weights: its TP shards and experts, and, on the stage's
        sender, the tensors every TP rank holds whole. Summed over a stage's `ActorRanks.stage_workers`: the bytes of
        the stage (a tied embedding counted on both ends)."""
        return export_bytes(self.model, self.info.dp_rank == 0, self.info.is_stage_sender)

    def send_phases(self) -> dict[str, float]:
        """Seconds per phase of this rank's last `export_weight_buckets` (rlsearch.weights.clock)."""
        return self.shm_sender.phases()

    def export_weights_as_peer(self) -> None:
        """A TP peer's part of its stage sender's `broadcast_weights`: its shards, gathered to the sender."""
        take_part(self.stage_weights())

    def join_weight_group(self, address: str, world_size: int, timeout_s: float) -> None:
        """As the stage's sender, rank 0 of the stage's broadcast group with every engine worker (replacing the one it
        was in)."""
        self.broadcast_sender.join(address, world_size, self.info.pp_rank, timeout_s)

    def leave_weight_groups(self) -> None:
        self.broadcast_sender.leave()
        rendezvous = self._rendezvous.pop(f"weights-{self.info.pp_rank}", None)
        if rendezvous is not None:
            rendezvous.close()

    def broadcast_weights(self, stage: int, engines: list, bucket_bytes: int, timeout_s: float) -> dict[str, int]:
        """As the stage's sender: this stage's weights broadcast into every engine (broadcast transport)."""
        return self.broadcast_sender.send(self.stage_weights(), stage, engines, bucket_bytes, timeout_s)

    def save_checkpoint(self, path: str) -> None:
        """Model, optimizer, LR scheduler and this rank's RNG states into an existing empty dir. A collective."""
        self._on_device()
        save_training_state(self.training, path)

    def load_checkpoint(self, path: str, restore_rng: bool) -> int:
        """Load a checkpoint of `save_checkpoint` from any TP/PP/DP layout; returns the scheduler's step count. A
        collective."""
        self._on_device()
        return load_training_state(self.training, path, restore_rng)

    def shutdown(self) -> None:
        """Leave every group this rank is in (its weight group too) and close the stores it opened."""
        self.broadcast_sender.leave()
        for rendezvous in self._rendezvous.values():
            rendezvous.close()
        self._rendezvous.clear()
        self.shm_sender.close()
        self._shard_gathers.close()
        if dist.is_initialized():
            dist.destroy_process_group()

    def reset(self, spec: ActorWorkerSpec, rank: int, world_size: int, environment: dict[str, str] | None = None,
              ) -> None:
        """This process as a new rank `rank` of `world_size` for `spec`, as if just started: it leaves its groups and
        drops its models, optimizer and Megatron's parallel state; `initialize` follows. A started process costs
        seconds of imports, so a run of many short-lived actors (the test suite) re-uses its ranks this way, and so
        does a driver that takes over the detached ranks of the one before it, whose worker `environment`
        (`rlsearch.ray_setup`: its logs dir, its RLSEARCH_* settings) the rank takes."""
        import ctypes
        import gc

        from megatron.core import parallel_state as ps

        from ..ray_setup import take_worker_environment

        self.shutdown()
        if environment is not None:
            take_worker_environment(environment)
        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
        self.__dict__.clear()
        gc.collect()
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # the freed model and optimizer back to the system, not kept by malloc
        self.__init__(spec, rank, world_size)
