"""Loading checkpoints from disk (sharded safetensors, tokenizer.json), config parsing, the tiny
model and tokenizers, and the errors a bad model directory gets."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers

from headroom.engine.model import (
    ByteTokenizer,
    IncrementalDetokenizer,
    ModelFilesError,
    UnsupportedDtype,
    UnsupportedModel,
    build_forward_batch,
    from_hf_dict,
    load_model,
    resolve_dtype,
)
from headroom.engine.model.loader import weight_files

VOCAB = 300


def _tokenizer_json(path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path / "tokenizer.json"))


@pytest.fixture(scope="module")
def sharded(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object]:
    """A random Llama saved in several safetensors shards with an index file."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        eos_token_id=[2, 5],
        attn_implementation="eager",
    )
    hf = transformers.LlamaForCausalLM(cfg).eval()
    path = tmp_path_factory.mktemp("sharded")
    hf.save_pretrained(path, max_shard_size="60KB")
    _tokenizer_json(path)
    return path, hf


def test_sharded_checkpoint_loads_and_matches(sharded: tuple[Path, object]) -> None:
    path, hf = sharded
    assert (path / "model.safetensors.index.json").is_file()
    assert len(weight_files(path)) > 1
    loaded = load_model(str(path))
    assert loaded.dtype == torch.float32
    assert set(loaded.tokenizer.eos_token_ids) >= {2, 5}
    assert loaded.tokenizer.encode("t7 t12 t299") == [7, 12, 299]
    from headroom.engine.attention import TorchBackend, allocate_layer_cache

    cfg = loaded.config
    caches = [
        allocate_layer_cache(4, 16, cfg.num_kv_heads, cfg.head_dim, torch.float32)
        for _ in range(cfg.num_layers)
    ]
    ids = list(range(10, 30))
    batch = build_forward_batch([(ids, 0, list(range(16, 36)), [1, 2])], [])
    logits = loaded.model.compute_logits(loaded.model(batch, caches, TorchBackend()))
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]  # type: ignore[operator]
    assert float((logits - ref).abs().max() / ref.abs().max()) < 1e-4


def _copy_dir(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def test_missing_files_get_clear_errors(sharded: tuple[Path, object], tmp_path: Path) -> None:
    path, _ = sharded
    with pytest.raises(ModelFilesError, match="does not exist"):
        load_model(str(tmp_path / "nowhere"))
    no_tok = _copy_dir(path, tmp_path / "no_tok")
    (no_tok / "tokenizer.json").unlink()
    with pytest.raises(ModelFilesError, match=r"no tokenizer\.json"):
        load_model(str(no_tok))
    no_shard = _copy_dir(path, tmp_path / "no_shard")
    next(no_shard.glob("model-*.safetensors")).unlink()
    with pytest.raises(ModelFilesError, match="missing shards"):
        load_model(str(no_shard))
    no_weights = tmp_path / "no_weights"
    no_weights.mkdir()
    (no_weights / "config.json").write_text((path / "config.json").read_text())
    (no_weights / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(ModelFilesError, match=r"\.bin checkpoints are not supported"):
        load_model(str(no_weights))
    (no_weights / "config.json").unlink()
    with pytest.raises(ModelFilesError, match=r"no config\.json"):
        load_model(str(no_weights))


def test_a_broken_checkpoint_fails_serve_and_kv_check_with_one_line(tmp_path: Path,
        sharded: tuple[Path, object]) -> None:  # fmt: skip
    # A truncated shard raises safetensors' own error, a linear RoPE without its factor a
    # KeyError: each used to end `headroom serve` in a traceback, and `kv-check` in exit 1,
    # which that command means as "quantized KV unsafe".
    path, _ = sharded
    cut = _copy_dir(path, tmp_path / "cut")
    shard = next(cut.glob("model-*.safetensors"))
    shard.write_bytes(shard.read_bytes()[:100])
    rope = _copy_dir(path, tmp_path / "rope")
    cfg = json.loads((rope / "config.json").read_text())
    cfg.pop("rope_scaling", None)
    cfg["rope_parameters"] = {"rope_type": "linear", "rope_theta": 10000.0}
    (rope / "config.json").write_text(json.dumps(cfg))
    cli = [sys.executable, "-m", "headroom.contract.cli"]
    for model, says in ((cut, "SafetensorError"), (rope, "rope 'linear' needs a number factor")):
        # A subprocess with a timeout: a model that loads after all would serve forever.
        proc = subprocess.run([*cli, "serve", "--model", str(model), "--port", "0"],
                              capture_output=True, text=True, timeout=120)  # fmt: skip
        assert proc.returncode == 1, proc.stderr
        assert "model failed to load: " in proc.stderr and says in proc.stderr, proc.stderr
        assert "Traceback" not in proc.stderr
    docs = tmp_path / "docs.jsonl"
    docs.write_text('{"text": "t1 t2 t3"}\n')
    argv = ["kv-check", "--model", str(cut), "--prompts", str(docs), "--kv-cache-dtype", "int8"]
    proc = subprocess.run([*cli, *argv, "--device", "cpu", "--quiet"], capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 2 and "cannot load model" in proc.stderr, proc.stderr


def test_wrong_weights_are_named(sharded: tuple[Path, object], tmp_path: Path) -> None:
    path, _ = sharded
    bad = _copy_dir(path, tmp_path / "bad")
    cfg = json.loads((bad / "config.json").read_text())
    cfg["intermediate_size"] = 80
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"gate_proj\.weight has shape"):
        load_model(str(bad))
    cfg["intermediate_size"] = 96
    cfg["num_hidden_layers"] = 3
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"lacks weights: \['model\.layers\.2\."):
        load_model(str(bad))


def test_unsupported_architecture_and_dtype() -> None:
    with pytest.raises(UnsupportedModel, match="GPT2LMHeadModel"):
        from_hf_dict({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})
    base = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 10,
        "hidden_size": 8,
        "intermediate_size": 16,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
    }
    with pytest.raises(UnsupportedModel, match="yarn"):
        from_hf_dict({**base, "rope_scaling": {"type": "yarn", "factor": 4.0}})
    with pytest.raises(UnsupportedModel, match="hidden_act"):
        from_hf_dict({**base, "hidden_act": "gelu"})
    for quant in ({"quant_method": "fp8"}, {"quant_method": "mystery"}, "gptq"):
        with pytest.raises(UnsupportedModel, match=r"quantized weights .* vllm or sglang"):
            from_hf_dict({**base, "quantization_config": quant})
    with pytest.raises(UnsupportedDtype, match="float16 is not supported on CPU"):
        resolve_dtype("float16", torch.device("cpu"))
    with pytest.raises(UnsupportedDtype, match="not one of"):
        resolve_dtype("int4", torch.device("cpu"))
    assert resolve_dtype("auto", torch.device("cpu"), "bfloat16") == torch.float32
    assert resolve_dtype("bfloat16", torch.device("cpu")) == torch.bfloat16


def test_config_parsing_old_and_new_spellings() -> None:
    base = {
        "vocab_size": 10,
        "hidden_size": 8,
        "intermediate_size": 16,
        "num_hidden_layers": 4,
        "num_attention_heads": 2,
    }
    old = from_hf_dict(
        {
            **base,
            "architectures": ["LlamaForCausalLM"],
            "rope_theta": 500000.0,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
            "eos_token_id": [128001, 128009],
        }
    )
    assert old.rope.rope_type == "llama3" and old.rope.theta == 500000.0
    assert old.eos_token_ids == (128001, 128009)
    assert old.num_kv_heads == 2 and old.head_dim == 4
    qwen = from_hf_dict(
        {
            **base,
            "architectures": ["Qwen2ForCausalLM"],
            "use_sliding_window": True,
            "sliding_window": 64,
            "max_window_layers": 2,
        }
    )
    assert qwen.qkv_bias and not qwen.o_bias
    assert qwen.sliding_windows == (None, None, 64, 64)
    assert (
        from_hf_dict({**base, "model_type": "mistral", "sliding_window": None}).sliding_windows
        == ()
    )


def test_tiny_model_is_deterministic() -> None:
    a = load_model("tiny")
    b = load_model("tiny")
    for (name, pa), (_, pb) in zip(
        a.model.named_parameters(), b.model.named_parameters(), strict=True
    ):
        assert torch.equal(pa, pb), name
    assert a.config.num_kv_heads < a.config.num_attention_heads  # GQA
    assert isinstance(a.tokenizer, ByteTokenizer)


def test_byte_tokenizer_and_incremental_detokenizer() -> None:
    tok = ByteTokenizer()
    text = "héllo → wörld"
    ids = tok.encode(text)
    assert ids[0] == tok.BOS and tok.decode(ids) == text
    detok = IncrementalDetokenizer(tok, ids[:1])
    deltas = [detok.add(t) for t in ids[1:]]
    # Multi-byte characters appear only once complete: no replacement characters leak out.
    assert "".join(deltas) == text and all("\ufffd" not in d for d in deltas)
    assert deltas.count("") == len(text.encode()) - len(text)
    held = IncrementalDetokenizer(tok, [])
    assert held.add(0xE2) == "" and held.flush() == "\ufffd"
