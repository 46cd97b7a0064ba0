"""A GRPO run's checkpoints: the one a run resumes (trainer.resume: auto, none or a checkpoint dir), refused when it
was trained with another trainer.seed, the other actor.use_distributed_optimizer (a refusal SFT's resume makes
too), another model than model.path or other adapters (actor.lora), and a fresh run (none) refused where another
run's files are; the newest one this process saved or resumed from (where dead actor ranks rewind to); a run
checkpoint saved with the trainer state and the manifest info; and the actor state loaded from one.

It may call the checkpoint store (rlsearch.checkpoint) and the actor ranks' save and load; when to save is the loop's
(grpo.py), and what a resume does to the run's progress and the engines' weights actor_side.py's."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..checkpoint import CheckpointError, CheckpointStore, load_run_checkpoint
from ..checkpoint.layout import (
    CRITIC_DIR,
    MODEL_DIR,
    RUBRIC_BUFFER,
    checkpoint_model_shape,
    model_shape,
    shape_differences,
)
from ..config import ActorConfig, ConfigError, TrainConfig, to_dict
from ..reward.evolving import RubricBuffer
from ..runlog import TRAJECTORY_DIR
from ..supervisor import restarted
from .sampler import SamplerState

if TYPE_CHECKING:
    from ..actor import ActorRanks, CriticRanks


@dataclass
class ResumePoint:
    path: Path
    layout: dict[str, int]  # the actor layout that saved it
    step: int
    sampler: SamplerState
    critic_layout: dict[str, int] | None = None  # the critic's layout that saved its state (None: no critic in it)
    rubrics: dict | None = None  # the evolving rubrics' buffer (`RubricBuffer.to_state`; None: not in it)


def checkpoint_to_resume(config: TrainConfig, store: CheckpointStore) -> ResumePoint | None:
    """trainer.resume's checkpoint: none, the newest complete one in the store (auto; None when there is none, with
    a warning per damaged one skipped: its files are checked against their sha256), or the dir it names (ConfigError
    when that is no complete run checkpoint, its files damaged included). A checkpoint of another model than
    model.path is refused (ConfigError) before anything starts."""
    resume = config.trainer.resume
    if resume == "none":
        check_fresh_output_dir(config, store.root.parent)
        return None
    if resume == "auto":
        path, skipped = store.newest_complete(check_contents=True)
        for warning in skipped:
            print(f"[rlsearch] warning: {warning}", flush=True)
        if path is None:
            return None
        if skipped:
            print(f"[rlsearch] resuming from {path}, the newest checkpoint that passed its checks", flush=True)
        manifest, state = load_run_checkpoint(path)
    else:
        path = Path(resume)
        try:
            manifest, state = load_run_checkpoint(path, check_contents=True)
        except CheckpointError as error:
            raise ConfigError(f"'trainer.resume' (auto, none or a checkpoint dir): {error}") from error
    return _resume_point(config, path, manifest, state)


def check_fresh_output_dir(config: TrainConfig, run_dir: Path) -> None:
    """trainer.resume=none starts a run from step 1: refused (ConfigError) where `run_dir` holds another run's
    trajectories or checkpoints, which it would overwrite step by step and mix with its own. A driver the supervisor
    restarts before the first checkpoint finds its own run there."""
    if config.trainer.resume != "none" or restarted():
        return
    trajectories = sorted((run_dir / TRAJECTORY_DIR).glob("*.jsonl"))
    root = CheckpointStore(run_dir).root
    checkpoints = sorted(root.glob("*step_*"))  # half-written ones (.incomplete_step_N) too
    held = [f"{len(found)} {what} ({found[0].parent.name}/{found[0].name}, ...)" for found, what in (
        (trajectories, "trajectory file(s)"), (checkpoints, "checkpoint(s)")) if found]
    if held:
        raise ConfigError(
            f"'trainer.output_dir' ({run_dir}) holds another run: {' and '.join(held)}. trainer.resume=none would "
            "overwrite its files step by step and leave the two runs mixed; give another trainer.output_dir, delete "
            "the dir, or continue that run with trainer.resume=auto")


def newest_own_checkpoint(config: TrainConfig, saved: dict[int, Path]) -> ResumePoint | None:
    """The newest of `saved` (step -> the checkpoints this process saved or resumed from) that is still whole (None:
    none), not one an earlier run left in output_dir (trainer.resume=none)."""
    for _, path in sorted(saved.items(), reverse=True):
        try:
            return _resume_point(config, path, *load_run_checkpoint(path))
        except CheckpointError:
            continue  # removed (trainer.keep_checkpoints) or damaged: an older one
    return None


def _resume_point(config: TrainConfig, path: Path, manifest: dict, state: dict) -> ResumePoint:
    if state["seed"] != config.trainer.seed:
        raise ConfigError(
            f"'trainer.seed' is {config.trainer.seed} but the checkpoint {path} was trained with seed "
            f"{state['seed']}; a resumed run keeps its seed so the data order and sampling continue. Drop the "
            f"override, or start a fresh run with trainer.resume=none"
        )
    check_optimizer_layout(path, state["config"]["actor"].get("use_distributed_optimizer", False), config.actor,
                           "start a fresh run from its weights (rlsearch convert mcore-to-hf, then model.path)")
    differences = shape_differences(checkpoint_model_shape(path, manifest), model_shape(config.model.path))
    if differences:
        raise ConfigError(
            f"'model.path' ({config.model.path}) is another model than the one the checkpoint {path} holds "
            f"({'; '.join(differences)}): a resumed run builds model.path's model and loads the checkpoint into it. "
            f"Set model.path to the model that run trained ({state['config']['model']['path']}), or start a fresh run "
            f"with trainer.resume=none"
        )
    saved_lora = _lora_shape(state["config"]["actor"].get("lora") or {})
    if saved_lora != _lora_shape(asdict(config.actor.lora)):
        raise ConfigError(
            f"'actor.lora' is {_lora_shape(asdict(config.actor.lora))} but the checkpoint {path} was trained with "
            f"{saved_lora}: the adapters are part of its model and of Adam's state. Resume with the same "
            "actor.lora rank, alpha and targets, or start a fresh run from its merged weights (rlsearch convert "
            "mcore-to-hf, then model.path)")
    rubrics = json.loads((path / RUBRIC_BUFFER).read_text()) if (path / RUBRIC_BUFFER).is_file() else None
    return ResumePoint(path, manifest["layout"], state["step"], SamplerState(**state["sampler"]),
                       manifest.get("critic_layout"), rubrics)


def check_optimizer_layout(path: Path, saved: bool, actor: ActorConfig, start_over: str) -> None:
    """A resume from the checkpoint `path`, saved with actor.use_distributed_optimizer `saved`, refused (ConfigError
    naming the key) when `actor` switches it; `start_over` says how to begin a fresh run instead."""
    if saved != actor.use_distributed_optimizer:
        raise ConfigError(
            f"'actor.use_distributed_optimizer' is {str(not saved).lower()} but the checkpoint {path} was written "
            f"with {str(saved).lower()}: the two keep Adam's states in different checkpoint layouts. Resume with "
            f"actor.use_distributed_optimizer={str(saved).lower()} (any actor.dp, tp or pp), or {start_over}"
        )


def _lora_shape(lora: dict) -> str:
    """What of actor.lora a checkpoint's model is made of: "off", or its rank, alpha and targets."""
    if not lora.get("rank"):
        return "off"
    return f"rank {lora['rank']}, alpha {lora['alpha']}, targets {','.join(sorted(lora['targets']))}"


def save_run_checkpoint(config: TrainConfig, actor: ActorRanks, store: CheckpointStore, step: int,
                        sampler: SamplerState, critic: CriticRanks | None = None,
                        rubrics: RubricBuffer | None = None) -> Path:
    """The actor state (and the critic's, in CRITIC_DIR beside it) as the checkpoint of `step` with the data position
    `sampler` (and the evolving rubrics `rubrics` in RUBRIC_BUFFER)."""
    state = {
        # where the data stood after the last trained batch (batches already drawn for later steps are drawn
        # again after a resume)
        "sampler": asdict(sampler),
        # rollout sampling seeds are a function of (seed, step, prompt, sample, turn): this and the step are the
        # whole rollout-side state
        "seed": config.trainer.seed,
        "config": to_dict(config),
    }
    architecture = json.loads((Path(config.model.path) / "config.json").read_text()).get("model_type")
    info = {
        "layout": config.actor.layout, "architecture": architecture, "dtype": config.model.dtype,
        "transformer_impl": actor.infos[0].transformer_impl,
        "contents": ["model", "optimizer", "scheduler", "rng"],
    }
    if config.actor.lora.rank:  # the converter builds the adapters the model holds, and merges them
        info["lora"] = asdict(config.actor.lora)
    timeout_s = config.trainer.checkpoint_timeout_s
    if critic is not None:
        info.update(critic_layout=critic.spec.actor.layout, contents=[*info["contents"], "critic"])

    def save(model_dir: str) -> None:
        actor.save_checkpoint(model_dir, timeout_s=timeout_s)
        if critic is not None:  # its dir beside the actor's
            critic_dir = Path(model_dir).parent / CRITIC_DIR
            critic_dir.mkdir()
            critic.save_checkpoint(str(critic_dir), timeout_s=timeout_s)
    state_files = {RUBRIC_BUFFER: rubrics.to_state()} if rubrics is not None else {}
    path = store.save(step, save, state, config.model.path, info, state_files)
    print(f"[rlsearch] checkpoint saved: {path}", flush=True)
    return path


def load_actor_state(actor: ActorRanks, point: ResumePoint, layout: dict[str, int]) -> str:
    """The checkpoint's actor state into `actor`, resharded into `layout` when it was saved in another; returns how
    it was resharded, for the resumed line ("" when the layout is the same)."""
    return _load_state(actor, point.path / MODEL_DIR, point.layout, layout)


def load_critic_state(critic: CriticRanks, point: ResumePoint) -> str:
    """The checkpoint's critic state into `critic` (resharded as the actor's is); what the resumed line says of it.
    A checkpoint without one (a run that trained without a critic) leaves the critic as it started."""
    if point.critic_layout is None:
        return "; the checkpoint has no critic: the critic starts from critic.model.path"
    resharded = _load_state(critic, point.path / CRITIC_DIR, point.critic_layout, critic.spec.actor.layout)
    return f"; the critic resumed with it{resharded}"


def _load_state(ranks: ActorRanks, directory: Path, saved: dict[str, int], layout: dict[str, int]) -> str:
    # checkpoints from before actor.cp and actor.ep had no "cp" and "ep"
    same_layout = {"cp": 1, "ep": 1, **saved} == layout
    ranks.load_checkpoint(str(directory), restore_rng=same_layout)
    return "" if same_layout else (
        f", resharded from tp{saved['tp']} pp{saved['pp']} cp{saved.get('cp', 1)} dp{saved['dp']} (per-rank RNG "
        "states start fresh)"
    )
