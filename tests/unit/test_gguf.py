"""`rlsearch convert gguf-to-hf` and `make-real-model` on small GGUFs the tests write with the `gguf` package, as
llama.cpp's converter does: a random HF model's tensors under their GGUF names (Llama's q/k rows permuted), a byte-level
BPE tokenizer of 262 tokens, a ChatML template. Nothing is downloaded."""

import hashlib
import json
import zipfile
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from rlsearch.checkpoint.convert import ConversionError
from rlsearch.checkpoint.gguf import CONVERSION_RECORD, GGUFError, gguf_to_hf
from rlsearch.cli import main
from rlsearch.data.real_model import WheelModel, make_real_model
from rlsearch.data.tiny_model import CHATML_TEMPLATE

Q = gguf.GGMLQuantizationType

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
MERGES = ("Ġ t", "h e", "Ġt he")  # " the" is one token
SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
             max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=10000.0)


def byte_level_tokens() -> list[str]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    merged = [merge.replace(" ", "") for merge in MERGES]
    return [*bytes_to_unicode().values(), *merged, *SPECIAL_TOKENS]


TOKENS = byte_level_tokens()
EOS_ID, PAD_ID = TOKENS.index("<|im_end|>"), TOKENS.index("<|endoftext|>")


def random_hf_model(architecture: str, qwen3_head_dim: int = 128):
    """A random model of the tiny shape; Llama with tied embeddings (as SmolLM2), Qwen3 with heads of 128 (every
    Qwen3's, and the only size transformers' GGUF loader builds)."""
    import transformers

    config_class = {"llama": "LlamaConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config"}[architecture]
    extra = {"llama": dict(tie_word_embeddings=True), "qwen2": dict(tie_word_embeddings=False),
             "qwen3": dict(tie_word_embeddings=False, head_dim=qwen3_head_dim)}[architecture]
    config = getattr(transformers, config_class)(vocab_size=len(TOKENS), eos_token_id=EOS_ID, pad_token_id=PAD_ID,
                                                 bos_token_id=None, **SHAPE, **extra)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).float()
    with torch.no_grad():  # norms away from their init of ones, biases away from zero, so their mapping shows
        for name, parameter in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                parameter.copy_(torch.randn_like(parameter) * 0.1 + ("norm" in name))
    return model


def llama_cpp_permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py reorders Llama's q/k rows from HF's rotary halves to interleaved pairs."""
    return (weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def gguf_tensors(model, architecture: str) -> dict[str, np.ndarray]:
    """The model's tensors under their GGUF names, in the layout llama.cpp writes."""
    arch = next(key for key, name in gguf.MODEL_ARCH_NAMES.items() if name == architecture)
    name_map = gguf.get_tensor_name_map(arch, model.config.num_hidden_layers)
    tensors = {}
    for key, tensor in model.state_dict().items():
        if key == "lm_head.weight" and model.config.tie_word_embeddings:
            continue
        module, _, kind = key.rpartition(".")
        array = tensor.numpy().copy()
        if architecture == "llama" and module.endswith(("q_proj", "k_proj")):
            heads = model.config.num_attention_heads if module.endswith("q_proj") else model.config.num_key_value_heads
            array = llama_cpp_permute(array, heads)
        tensors[f"{name_map.get_name(module)}.{kind}"] = array
    return tensors


def write_gguf(path: Path, architecture: str, tensors: dict[str, np.ndarray], storage=Q.F32, fields=None,
               raw: dict[str, tuple[np.ndarray, object]] | None = None, qwen3_head_dim: int = 128) -> Path:
    """A GGUF of the tiny shape: matrices stored as `storage` (norms and biases F32, as llama.cpp keeps them),
    `raw` tensors as given bytes of a given type, extra metadata `fields` (key suffix -> value)."""
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_block_count(SHAPE["num_hidden_layers"])
    writer.add_context_length(SHAPE["max_position_embeddings"])
    writer.add_embedding_length(SHAPE["hidden_size"])
    writer.add_feed_forward_length(SHAPE["intermediate_size"])
    writer.add_head_count(SHAPE["num_attention_heads"])
    writer.add_head_count_kv(SHAPE["num_key_value_heads"])
    writer.add_rope_freq_base(SHAPE["rope_theta"])
    writer.add_layer_norm_rms_eps(SHAPE["rms_norm_eps"])
    if architecture == "llama":
        writer.add_vocab_size(len(TOKENS))
        writer.add_rope_dimension_count(SHAPE["hidden_size"] // SHAPE["num_attention_heads"])
    if architecture == "qwen3":
        writer.add_key_length(qwen3_head_dim)
        writer.add_value_length(qwen3_head_dim)
    for key, value in (fields or {}).items():
        writer.add_string(f"{architecture}.{key}", value)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt2")
    writer.add_token_list(TOKENS)
    writer.add_token_types([3 if token in SPECIAL_TOKENS else 1 for token in TOKENS])  # 3: control, 1: normal
    writer.add_token_merges(list(MERGES))
    writer.add_eos_token_id(EOS_ID)
    writer.add_pad_token_id(PAD_ID)
    writer.add_chat_template(CHATML_TEMPLATE)
    for name, array in tensors.items():
        if array.ndim == 2 and storage != Q.F32:
            writer.add_tensor(name, gguf.quants.quantize(array, storage), raw_dtype=storage)
        else:
            writer.add_tensor(name, array.astype(np.float32))
    for name, (data, tensor_type) in (raw or {}).items():
        writer.add_tensor(name, data, raw_dtype=tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def stored(array: np.ndarray, storage) -> torch.Tensor:
    """What a matrix stored as `storage` dequantises to: quantisation works on blocks along a row, so it commutes
    with llama.cpp's row permutation and the HF-layout weight can be quantised directly."""
    if storage == Q.F32 or array.ndim == 1:
        return torch.from_numpy(array)
    return torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(array, storage), storage))


@pytest.mark.parametrize("storage_name", ["F32", "Q8_0"])
@pytest.mark.parametrize("architecture", ["llama", "qwen2", "qwen3"])
def test_gguf_converts_to_the_model_it_was_written_from(tmp_path: Path, architecture, storage_name) -> None:
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    storage = Q[storage_name]
    model = random_hf_model(architecture)
    path = write_gguf(tmp_path / "tiny.gguf", architecture, gguf_tensors(model, architecture), storage)
    lines = []
    result = gguf_to_hf(path, tmp_path / "hf", progress=lines.append)

    assert result.max_logit_diff == 0.0  # the written dir's logits equal transformers' own GGUF load, bit for bit
    assert len(lines) == 4 and lines[0].startswith("read tiny.gguf: ")
    written = load_file(tmp_path / "hf" / "model.safetensors")
    expected = {key: stored(tensor.numpy(), storage) for key, tensor in model.state_dict().items()
                if key in written}  # a tied lm_head is saved once, as the embedding
    assert sorted(written) == sorted(expected)
    assert all(torch.equal(written[key], expected[key]) for key in written)
    if storage == Q.Q8_0:
        q_proj = "model.layers.0.self_attn.q_proj.weight"
        assert 0 < (written[q_proj] - model.state_dict()[q_proj]).abs().max() < 1e-3  # quantised, then dequantised
    assert result.num_parameters == model.num_parameters()
    assert result.num_bytes == 4 * model.num_parameters()
    matrices = sum(tensor.ndim == 2 for tensor in gguf_tensors(model, architecture).values())
    vectors = len(gguf_tensors(model, architecture)) - matrices
    assert result.tensor_types == ({"F32": matrices + vectors} if storage == Q.F32
                                   else {storage.name: matrices, "F32": vectors})

    config = AutoConfig.from_pretrained(tmp_path / "hf")
    assert config.model_type == architecture and config.dtype == torch.float32
    for key, value in SHAPE.items():
        written_value = config.rope_parameters["rope_theta"] if key == "rope_theta" else getattr(config, key)
        assert written_value == pytest.approx(value, rel=1e-7), key  # rms_norm_eps is float32 in a GGUF
    assert config.tie_word_embeddings == model.config.tie_word_embeddings
    assert getattr(config, "head_dim", None) == getattr(model.config, "head_dim", None)
    assert config.vocab_size == len(TOKENS)
    assert not hasattr(config, "quantization_config")

    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert tokenizer.encode(" the", add_special_tokens=False) == [TOKENS.index("Ġthe")]
    assert tokenizer.eos_token == "<|im_end|>"
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                           tokenize=False)
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert GenerationConfig.from_pretrained(tmp_path / "hf").eos_token_id == EOS_ID

    record = json.loads((tmp_path / "hf" / CONVERSION_RECORD).read_text())
    assert record["gguf_sha256"] == hashlib.sha256(path.read_bytes()).hexdigest() == result.gguf_sha256
    assert record["tensor_types"] == result.tensor_types and record["max_logit_diff"] == 0.0


def test_convert_gguf_to_hf_command_prints_each_step_and_the_check(tmp_path: Path, capsys) -> None:
    path = write_gguf(tmp_path / "tiny.gguf", "qwen2", gguf_tensors(random_hf_model("qwen2"), "qwen2"), Q.Q8_0)
    assert main(["convert", "gguf-to-hf", "--gguf", str(path), "--out", str(tmp_path / "hf")]) == 0
    lines = capsys.readouterr().out.splitlines()
    # 2 layers of 7 matrices + embedding and head; 2 layers of 2 norms and 3 biases + the final norm
    assert lines[0] == "  read tiny.gguf: qwen2, 27 tensors (16 Q8_0, 11 F32)"
    assert lines[1] == "  dequantising to float32 with transformers' GGUF loader"
    assert lines[-1].startswith(f"rlsearch convert: wrote HuggingFace model {tmp_path / 'hf'}: qwen2, ")
    assert "(GGUF tensors: 16 Q8_0, 11 F32); verify: max |logit diff| vs transformers' GGUF load 0 in " in lines[-1]

    assert main(["convert", "gguf-to-hf", "--gguf", str(path), "--out", str(tmp_path / "hf")]) == 2
    assert "exists and is not empty; choose a new directory or remove it" in capsys.readouterr().err


def test_a_storage_type_the_loader_cannot_dequantise_is_refused_by_name(tmp_path: Path, capsys) -> None:
    model = random_hf_model("llama")
    tensors = gguf_tensors(model, "llama")
    weight = "blk.1.ffn_up.weight"
    rows, columns = tensors.pop(weight).shape
    block_elements, block_bytes = gguf.GGML_QUANT_SIZES[Q.Q8_1]
    q8_1 = np.zeros((rows, columns // block_elements * block_bytes), np.uint8)
    path = write_gguf(tmp_path / "q8_1.gguf", "llama", tensors, raw={weight: (q8_1, Q.Q8_1)})

    assert main(["convert", "gguf-to-hf", "--gguf", str(path), "--out", str(tmp_path / "hf")]) == 2
    error = capsys.readouterr().err
    assert f"stores tensors as Q8_1 (1 tensors, e.g. {weight}), which transformers' GGUF loader cannot dequantise" \
        in error
    assert "Q8_0" in error and "llama-quantize" in error  # what it reads, and how to get there
    assert not (tmp_path / "hf").exists() and not (tmp_path / ".incomplete_hf").exists()


@pytest.mark.parametrize("architecture", ["gemma2", "qwen3moe"])
def test_an_architecture_rlsearch_does_not_train_is_refused(tmp_path: Path, capsys, architecture) -> None:
    writer = gguf.GGUFWriter(str(tmp_path / "other.gguf"), architecture)
    writer.add_block_count(2)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    assert main(["convert", "gguf-to-hf", "--gguf", str(tmp_path / "other.gguf"), "--out", str(tmp_path / "hf")]) == 2
    assert (f"GGUF architecture '{architecture}' is not one rlsearch converts (supported: llama, qwen2, qwen3)"
            in capsys.readouterr().err)
    assert not (tmp_path / "hf").exists()


def test_a_model_field_the_loader_drops_is_refused(tmp_path: Path) -> None:
    model = random_hf_model("llama")
    path = write_gguf(tmp_path / "scaled.gguf", "llama", gguf_tensors(model, "llama"),
                      fields={"rope.scaling.type": "linear"})
    with pytest.raises(GGUFError, match=r"sets llama\.rope\.scaling\.type = 'linear', which transformers' GGUF "
                       "loader does not read"):
        gguf_to_hf(path, tmp_path / "hf")


def test_a_head_size_the_loader_does_not_build_is_refused(tmp_path: Path) -> None:
    model = random_hf_model("qwen3", qwen3_head_dim=64)
    path = write_gguf(tmp_path / "heads64.gguf", "qwen3", gguf_tensors(model, "qwen3"), qwen3_head_dim=64)
    with pytest.raises(GGUFError, match="qwen3.attention.key_length is 64 but transformers' GGUF loader builds heads "
                       "of 128"):
        gguf_to_hf(path, tmp_path / "hf")
    assert not (tmp_path / "hf").exists() and not (tmp_path / ".incomplete_hf").exists()


def test_a_tensor_the_model_has_no_place_for_is_refused(tmp_path: Path) -> None:
    model = random_hf_model("llama")
    tensors = gguf_tensors(model, "llama")
    tensors["rope_freqs.weight"] = np.ones(16, np.float32)  # llama 3's rope scaling travels as a tensor
    path = write_gguf(tmp_path / "rope_freqs.gguf", "llama", tensors)
    with pytest.raises(GGUFError, match="holds tensors rope_freqs.weight that transformers' LlamaForCausalLM has "
                       "no place for"):
        gguf_to_hf(path, tmp_path / "hf")
    assert not (tmp_path / "hf").exists() and not (tmp_path / ".incomplete_hf").exists()


def test_not_a_gguf_is_refused(tmp_path: Path) -> None:
    (tmp_path / "model.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(GGUFError, match="is not a GGUF file the gguf package reads"):
        gguf_to_hf(tmp_path / "model.gguf", tmp_path / "hf")
    with pytest.raises(GGUFError, match="is not a file; pass the .gguf file itself"):
        gguf_to_hf(tmp_path, tmp_path / "hf")


def wheel_model(tmp_path: Path, check_answer: str) -> tuple[WheelModel, Path]:
    """A wheel holding a tiny Llama GGUF, already in the cache dir (so nothing is downloaded), and its pins."""
    gguf_file = write_gguf(tmp_path / "tiny.gguf", "llama", gguf_tensors(random_hf_model("llama"), "llama"),
                           Q.Q8_0)
    cache = tmp_path / "cache"
    (cache / "wheels").mkdir(parents=True)
    wheel = cache / "wheels" / "tiny_model-0.1-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.write(gguf_file, "tiny_model/tiny.gguf")
    model = WheelModel(
        name="tiny", requirement="tiny-model==0.1", wheel=wheel.name,
        wheel_sha256=hashlib.sha256(wheel.read_bytes()).hexdigest(), member="tiny_model/tiny.gguf",
        gguf_sha256=hashlib.sha256(gguf_file.read_bytes()).hexdigest(),
        check_question="What is the capital of France?", check_answer=check_answer,
    )
    return model, cache


def test_make_real_model_builds_from_the_wheel_once_then_reuses_the_dir(tmp_path: Path) -> None:
    model, cache = wheel_model(tmp_path, check_answer="")  # a random model answers anything
    lines = []
    built = make_real_model(tmp_path / "asset", model, cache, progress=lines.append)
    assert not built.reused and built.conversion.max_logit_diff == 0.0 and isinstance(built.check_answer, str)
    assert lines[0] == f"wheel {cache / 'wheels' / model.wheel} (cached)"
    assert lines[1].startswith("extracting tiny_model/tiny.gguf")
    assert (cache / "gguf" / "tiny.gguf").read_bytes() == (tmp_path / "tiny.gguf").read_bytes()
    assert json.loads((tmp_path / "asset" / CONVERSION_RECORD).read_text())["gguf_sha256"] == model.gguf_sha256

    again = make_real_model(tmp_path / "asset", model, cache)
    assert again.reused and again.conversion is None


def test_make_real_model_removes_a_model_that_answers_wrong(tmp_path: Path) -> None:
    model, cache = wheel_model(tmp_path, check_answer="Paris")
    with pytest.raises(ConversionError, match="which does not contain 'Paris', so the conversion is wrong"):
        make_real_model(tmp_path / "asset", model, cache)
    assert not (tmp_path / "asset").exists()
