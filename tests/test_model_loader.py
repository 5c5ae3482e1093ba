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
    build_tiny,
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


# --- memory at load, and the errors a broken JSON file gets ----------------------------------


def _forward_logits(loaded_model: torch.nn.Module, dtype: torch.dtype) -> torch.Tensor:
    from headroom.engine.attention import TorchBackend, allocate_layer_cache

    cfg = loaded_model.config  # type: ignore[attr-defined]
    caches = [
        allocate_layer_cache(4, 16, cfg.num_kv_heads, cfg.head_dim, dtype)
        for _ in range(cfg.num_layers)
    ]
    ids = list(range(10, 30))
    batch = build_forward_batch([(ids, 0, list(range(16, 36)), [1, 2])], [])
    hidden = loaded_model(batch, caches, TorchBackend())
    logits: torch.Tensor = loaded_model.compute_logits(hidden)  # type: ignore[operator]
    return logits


@pytest.mark.parametrize("tied", [False, True])
def test_a_bf16_load_never_allocates_fp32_weights(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tied: bool
) -> None:
    # Materializing the model in fp32 and casting after held 2x a bf16 model's weights at the
    # peak: a 47 GB bf16 checkpoint needed ~94 GB on an 80 GB GPU.
    from headroom.engine.model.llama import LlamaForCausalLM
    from headroom.engine.model.loader import iter_weights, parse_config

    torch.manual_seed(1)
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        tie_word_embeddings=tied, rope_scaling={"rope_type": "llama3", "factor": 8.0,
        "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    )  # fmt: skip
    transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(tmp_path)
    _tokenizer_json(tmp_path)
    materialized: list[set[torch.dtype]] = []
    to_empty = torch.nn.Module.to_empty

    def recording(self: torch.nn.Module, *args: object, **kwargs: object) -> torch.nn.Module:
        out = to_empty(self, *args, **kwargs)  # type: ignore[arg-type]
        materialized.append({p.dtype for p in out.parameters()})
        return out

    monkeypatch.setattr(torch.nn.Module, "to_empty", recording)
    loaded = load_model(str(tmp_path), dtype="bfloat16")
    monkeypatch.undo()
    assert materialized == [{torch.bfloat16}]
    model = loaded.model
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    # The rotary frequencies stay the fp32 ones, and the logits are the old loader's, which
    # cast after materializing in fp32.
    assert model._inv_freq.dtype == torch.float32
    with torch.device("meta"):
        old = LlamaForCausalLM(parse_config(tmp_path))
    old = old.to_empty(device="cpu").to(torch.bfloat16)
    if tied:
        old.lm_head.weight = old.model.embed_tokens.weight
    old.load_weights(iter_weights(weight_files(tmp_path)))
    assert torch.equal(model._inv_freq, old._inv_freq)
    assert torch.equal(_forward_logits(model, torch.bfloat16), _forward_logits(old, torch.bfloat16))


def test_a_broken_json_file_is_named_in_one_line(
    sharded: tuple[Path, object], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from headroom.engine.model.loader import load_failure

    path, _ = sharded
    index = "model.safetensors.index.json"
    cfg = json.loads((path / "config.json").read_text())
    cases = {
        "config_not_json": ("config.json", "{oops", "config.json: not valid JSON: Expecting"),
        "config_list": ("config.json", "[]", "config.json: expected a JSON object, got list"),
        "config_deep": ("config.json", "[" * 100_000 + "]" * 100_000, "nested too deeply"),
        "config_zero_layers": ("config.json", json.dumps({**cfg, "num_hidden_layers": 0}),
                               "config.json: num_layers: Input should be greater than or equal"),
        "config_no_vocab": ("config.json", json.dumps({k: v for k, v in cfg.items()
                            if k != "vocab_size"}), "config.json: not a model config this reads"),
        "index_not_json": (index, "{oops", f"{index}: not valid JSON"),
        "index_list": (index, "[1]", f"{index}: expected a JSON object, got list"),
        "index_bad_map": (index, '{"weight_map": [1]}', f"{index}: weight_map must map"),
    }  # fmt: skip
    for name, (file, text, says) in cases.items():
        bad = _copy_dir(path, tmp_path / name)
        (bad / file).write_text(text)
        with pytest.raises(ValueError) as info:
            load_model(str(bad))
        line = load_failure(info.value)
        assert line.startswith(str(bad / file)) and says in line, (name, line)
        assert "\n" not in line and "http" not in line, (name, line)
    # generation_config.json is optional (transformers loads without it): warn and go on.
    gen = _copy_dir(path, tmp_path / "gen")
    (gen / "generation_config.json").write_text("{oops")
    with caplog.at_level("WARNING", logger="headroom.engine.model.loader"):
        loaded = load_model(str(gen))
    assert set(loaded.tokenizer.eos_token_ids) >= {2, 5}  # config.json's ids still apply
    warned = [r.getMessage() for r in caplog.records if "generation_config.json" in r.getMessage()]
    assert len(warned) == 1 and "not valid JSON" in warned[0] and "ignoring it" in warned[0]


def test_a_bad_chat_template_answers_chat_with_400_while_completions_serve(
    sharded: tuple[Path, object], tmp_path: Path
) -> None:
    # It used to end `headroom serve` in a traceback after the whole weight load.
    import openai
    from engine_process import ServerProcess

    path, _ = sharded
    model = _copy_dir(path, tmp_path / "bad_template")
    (model / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": "{% for m in messages %}{{ m.content }}"})
    )
    with ServerProcess("--model", str(model), "--num-blocks", "64") as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        name = model.name
        assert client.completions.create(model=name, prompt="t1 t2", max_tokens=2).choices
        with pytest.raises(openai.BadRequestError, match="does not compile") as info:
            client.chat.completions.create(
                model=name, messages=[{"role": "user", "content": "t1"}], max_tokens=2
            )
        assert info.value.code == "chat_template_error"
    assert "tokenizer_config.json (chat_template) does not compile: line 1" in srv.output
    assert "Traceback" not in srv.output


def _hf_windows(cfg: dict[str, object]) -> tuple[int | None, ...]:
    """Per-layer windows as transformers' own config class derives them."""
    kind = str(cfg["model_type"])
    cls = transformers.AutoConfig.for_model(kind).__class__
    hf = cls(**{k: v for k, v in cfg.items() if k not in ("architectures", "model_type")})
    window = getattr(hf, "sliding_window", None)
    if kind == "llama" or window is None:
        return ()
    types = getattr(hf, "layer_types", None)
    if kind == "mistral" or types is None:  # Mistral's attention windows every layer
        types = ["sliding_attention"] * hf.num_hidden_layers
    windows = tuple(window if t == "sliding_attention" else None for t in types)
    return windows if any(w is not None for w in windows) else ()


_SHAPE = {
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 6,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 4096,
}
WINDOW_CONFIGS: dict[str, dict[str, object]] = {
    # Mistral-7B-v0.1: a window and no use_sliding_window key: every layer slides.
    "mistral_v01": {"model_type": "mistral", "architectures": ["MistralForCausalLM"],
                    "sliding_window": 4096},
    "mistral_v02": {"model_type": "mistral", "sliding_window": None},
    # Qwen2: use_sliding_window defaults to False; True slides the layers >= max_window_layers.
    "qwen2_default": {"model_type": "qwen2", "sliding_window": 4096, "max_window_layers": 2},
    "qwen2_off": {"model_type": "qwen2", "use_sliding_window": False, "sliding_window": 4096,
                  "max_window_layers": 2},
    "qwen2_on": {"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 64,
                 "max_window_layers": 2},
    "qwen2_on_all": {"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 64,
                     "max_window_layers": 0},
    "qwen2_layer_types": {"model_type": "qwen2", "use_sliding_window": True,
                          "sliding_window": 64, "layer_types": ["sliding_attention",
                          "full_attention"] * 3},
    "qwen3_on": {"model_type": "qwen3", "use_sliding_window": True, "sliding_window": 64,
                 "max_window_layers": 4},
    # Gemma 2 alternates local and global layers; layer_types, where listed, decide.
    "gemma2": {"model_type": "gemma2", "sliding_window": 4096},
    "gemma2_layer_types": {"model_type": "gemma2", "sliding_window": 512, "layer_types":
                           ["full_attention"] * 5 + ["sliding_attention"]},
    # transformers' Llama has no sliding window: a stray key changes nothing.
    "llama_stray_window": {"model_type": "llama", "architectures": ["LlamaForCausalLM"],
                           "sliding_window": 4096},
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(WINDOW_CONFIGS))
def test_plan_and_engine_count_windowed_layers_as_transformers(name: str) -> None:
    from headroom.contract.budget import from_hf_dict as arch_from_hf_dict

    cfg = {**_SHAPE, **WINDOW_CONFIGS[name]}
    want = _hf_windows(cfg)
    arch = arch_from_hf_dict(cfg)
    slid = [w for w in want if w is not None]
    assert arch.num_sliding_window_layers == len(slid), name
    assert arch.sliding_window == (min(slid) if slid else None), name
    if cfg["model_type"] in ("llama", "mistral", "qwen2"):  # what the engine runs
        engine = from_hf_dict(cfg)
        assert engine.sliding_windows == want, name
        assert engine.num_sliding_window_layers == arch.num_sliding_window_layers, name
        assert engine.sliding_window == arch.sliding_window, name
        # Without model_type, the architecture names the family.
        by_arch = {k: v for k, v in cfg.items() if k != "model_type"}
        family = str(cfg["model_type"])
        by_arch.setdefault("architectures", [f"{family.capitalize()}ForCausalLM"])
        assert from_hf_dict(by_arch).sliding_windows == want, name
        assert arch_from_hf_dict(by_arch).num_sliding_window_layers == len(slid), name


def test_the_mistral_preset_still_windows_every_layer() -> None:
    from headroom.contract.budget import from_hf_dict as arch_from_hf_dict
    from headroom.contract.budget import model_preset

    preset = model_preset("mistral-7b")
    cfg = {"model_type": "mistral", "architectures": ["MistralForCausalLM"], "vocab_size": 32000,
           "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
           "num_attention_heads": 32, "num_key_value_heads": 8, "sliding_window": 4096,
           "max_position_embeddings": 32768}  # fmt: skip
    arch = arch_from_hf_dict(cfg)
    assert (arch.sliding_window, arch.num_sliding_window_layers) == (4096, 32)
    assert (preset.sliding_window, preset.num_sliding_window_layers) == (4096, 32)
    assert from_hf_dict(cfg).sliding_windows == (4096,) * 32


# --- what the loader decides without a GPU: dtypes, token ids, unexpected weights -----------


def test_auto_dtype_on_cuda_is_the_checkpoints_and_bf16_needs_a_gpu_that_has_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On CUDA "auto" runs the checkpoint's dtype (torch or contract name; bf16 when unknown),
    and bfloat16 alone is refused on a GPU without it (a V100), naming the GPU."""
    cuda = torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: True)
    for checkpoint, want in (("float16", torch.float16), ("fp16", torch.float16),
                             ("fp32", torch.float32), ("bf16", torch.bfloat16),
                             ("int4", torch.bfloat16)):  # fmt: skip
        assert resolve_dtype("auto", cuda, checkpoint) == want, checkpoint
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla V100")
    with pytest.raises(UnsupportedDtype, match="bfloat16 is not supported on Tesla V100"):
        resolve_dtype("auto", cuda, "bfloat16")
    assert resolve_dtype("float16", cuda) == torch.float16
    assert resolve_dtype("float32", cuda) == torch.float32


def test_config_json_ids_win_and_generation_config_adds_eos(tmp_path: Path) -> None:
    """As transformers merges them: config.json's bos stands, generation_config.json's bos
    fills a missing one, and its eos ids join config.json's (an EOS either names stops)."""
    from headroom.engine.model.loader import load_tokenizer

    _tokenizer_json(tmp_path)
    base = {"architectures": ["LlamaForCausalLM"], "vocab_size": VOCAB, "hidden_size": 8,
            "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2}  # fmt: skip
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"bos_token_id": 7, "eos_token_id": [9, 2, None]})
    )
    tok = load_tokenizer(tmp_path, from_hf_dict({**base, "bos_token_id": 1, "eos_token_id": 2}))
    assert (tok.bos_token_id, tok.eos_token_ids) == (1, {2, 9})
    tok = load_tokenizer(tmp_path, from_hf_dict(base))
    assert (tok.bos_token_id, tok.eos_token_ids) == (7, {9, 2})
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 4}))
    tok = load_tokenizer(tmp_path, from_hf_dict(base))
    assert (tok.bos_token_id, tok.eos_token_ids) == (None, {4})


def test_weights_the_architecture_lacks_are_named() -> None:
    """A checkpoint with tensors this decoder has no place for (a Qwen3 q_norm, say) is
    refused naming the first five, not loaded with those weights dropped."""
    model, _ = build_tiny()
    extra = {f"model.layers.{i}.self_attn.q_norm.weight": torch.ones(32) for i in range(4)}
    extra["lm_head.bias"] = torch.zeros(model.config.vocab_size)
    extra["norm.weight"] = torch.ones(1)
    with pytest.raises(ValueError, match="lacks: ") as info:
        model.load_weights([("model.norm.weight", torch.ones(128)), *extra.items()])
    assert str(info.value).split("lacks: ")[1] == repr(list(extra)[:5])


class _NoWindowBackend:
    """The torch backend as one without sliding-window support (the CUDA one) is called: its
    attention takes no `sliding_window`."""

    name = "no-window"

    def __init__(self) -> None:
        from headroom.engine.attention import TorchBackend

        self.inner = TorchBackend()

    def write_kv(self, *args: object) -> None:
        self.inner.write_kv(*args)  # type: ignore[arg-type]

    def prefill(self, *args: object) -> torch.Tensor:
        return self.inner.prefill(*args)  # type: ignore[arg-type]

    def decode(self, *args: object) -> torch.Tensor:
        return self.inner.decode(*args)  # type: ignore[arg-type]


def test_windowed_layers_attend_within_their_window_and_only_where_the_backend_can() -> None:
    """Past the window a windowed layer's logits differ from full attention's; a backend
    without windows gets none passed (the engine caps max_model_len to the window there)."""
    from headroom.engine.attention import TorchBackend, allocate_layer_cache
    from headroom.engine.model import ModelConfig, tiny_config

    shape = tiny_config().model_dump(exclude={"sliding_window", "num_sliding_window_layers"})
    windowed, _ = build_tiny(config=ModelConfig(**{**shape, "sliding_windows": (4,) * 4}))
    full, _ = build_tiny()

    def logits(model: torch.nn.Module, backend: object) -> torch.Tensor:
        cfg = model.config  # type: ignore[attr-defined]
        caches = [allocate_layer_cache(2, 16, cfg.num_kv_heads, cfg.head_dim, torch.float32)
                  for _ in range(cfg.num_layers)]  # fmt: skip
        batch = build_forward_batch([(list(range(10, 22)), 0, list(range(16, 28)), [1])], [])
        return model.compute_logits(model(batch, caches, backend))  # type: ignore[operator]

    slid, whole = logits(windowed, TorchBackend()), logits(full, TorchBackend())
    assert torch.equal(slid[:4], whole[:4])  # within the window: the same attention
    assert not torch.allclose(slid[4:], whole[4:])
    assert torch.equal(logits(windowed, _NoWindowBackend()), whole)
