"""A LoRA run end to end on CPU (actor.lora): the README's command with rank-8 adapters on the actor, synced into the
engine as adapters alone (actor.lora.sync=adapter), the probe check after every sync, and the checkpoint that
`rlsearch convert --peft-adapter` reads."""

import json

from tests.drivers import run_search_grpo


def test_a_lora_run_syncs_only_the_adapters_and_the_engine_samples_from_them(tmp_path, tiny_model_dir, driver_ray):
    from safetensors.torch import load_file
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "run"
    result = run_search_grpo(out, "trainer.total_steps=2", "data.batch_size=2", "actor.lora.rank=8",
                             "actor.lora.sync=adapter", "actor.lr=1e-3", timeout=1200, **driver_ray)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "step 2/2 | reward" in result.stdout
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    for name in ("weights/sync_mib", "weights/logprob_mismatch_max", "weights/time/load", "actor/grad_norm"):
        assert [e.step for e in events.Scalars(name)] == [1, 2], name
    model_mib = sum(t.nbytes for t in load_file(str(tiny_model_dir / "model.safetensors")).values()) / 2**20
    assert all(0 < e.value <= model_mib / 20 for e in events.Scalars("weights/sync_mib"))  # the adapters alone
    assert events.Scalars("actor/grad_norm")[-1].value > 0  # (a step whose groups all tie has no gradient)
    # the engine samples from the adapted model the actor trains: the fp32 probe's limit, as for full-weight runs
    assert max(e.value for e in events.Scalars("weights/logprob_mismatch_max")) < 1e-4
    manifest = json.loads((out / "checkpoints" / "step_000002" / "manifest.json").read_text())
    assert manifest["lora"]["rank"] == 8 and manifest["lora"]["sync"] == "adapter"
