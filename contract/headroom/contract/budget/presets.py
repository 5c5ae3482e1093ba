"""Published architecture numbers for common models, and GPU memory sizes.

Model figures are copied from each model's config.json on its publisher's hub page; parameter
counts from the safetensors metadata or model card. GPU memory is what `nvidia-smi` reports as
total (MiB), which is what an engine can actually allocate from.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from headroom.contract.budget.arch import ModelArch

_L31 = {"vocab_size": 128256, "max_position_embeddings": 131072, "num_kv_heads": 8}

MODEL_PRESETS: dict[str, ModelArch] = {
    m.name: m
    for m in (
        ModelArch(name="llama-3.1-8b", num_layers=32, num_attention_heads=32, head_dim=128,
                  hidden_size=4096, intermediate_size=14336, num_parameters=8_030_261_248,
                  **_L31),
        ModelArch(name="llama-3.1-70b", num_layers=80, num_attention_heads=64, head_dim=128,
                  hidden_size=8192, intermediate_size=28672, num_parameters=70_553_706_496,
                  **_L31),
        ModelArch(name="llama-3.1-405b", num_layers=126, num_attention_heads=128, head_dim=128,
                  hidden_size=16384, intermediate_size=53248, num_parameters=405_853_388_800,
                  **_L31),
        ModelArch(name="llama-3.2-1b", num_layers=16, num_attention_heads=32, head_dim=64,
                  hidden_size=2048, intermediate_size=8192, num_parameters=1_235_814_400,
                  **_L31),
        ModelArch(name="llama-3.2-3b", num_layers=28, num_attention_heads=24, head_dim=128,
                  hidden_size=3072, intermediate_size=8192, num_parameters=3_212_749_824,
                  **_L31),
        # Mistral-7B-v0.1: every layer uses a 4,096-token sliding window.
        ModelArch(name="mistral-7b", num_layers=32, num_attention_heads=32, num_kv_heads=8,
                  head_dim=128, hidden_size=4096, intermediate_size=14336, vocab_size=32000,
                  max_position_embeddings=32768, num_parameters=7_241_732_096,
                  sliding_window=4096, num_sliding_window_layers=32),
        ModelArch(name="mixtral-8x7b", num_layers=32, num_attention_heads=32, num_kv_heads=8,
                  head_dim=128, hidden_size=4096, intermediate_size=14336, vocab_size=32000,
                  max_position_embeddings=32768, num_parameters=46_702_792_704),
        ModelArch(name="qwen2.5-7b", num_layers=28, num_attention_heads=28, num_kv_heads=4,
                  head_dim=128, hidden_size=3584, intermediate_size=18944, vocab_size=152064,
                  max_position_embeddings=32768, num_parameters=7_615_616_512),
        ModelArch(name="qwen2.5-72b", num_layers=80, num_attention_heads=64, num_kv_heads=8,
                  head_dim=128, hidden_size=8192, intermediate_size=29568, vocab_size=152064,
                  max_position_embeddings=32768, num_parameters=72_706_203_648),
        # Gemma 2 alternates local (4,096-token window) and global attention layers.
        ModelArch(name="gemma-2-9b", num_layers=42, num_attention_heads=16, num_kv_heads=8,
                  head_dim=256, hidden_size=3584, intermediate_size=14336, vocab_size=256000,
                  max_position_embeddings=8192, num_parameters=9_241_705_984,
                  sliding_window=4096, num_sliding_window_layers=21),
        ModelArch(name="gemma-2-27b", num_layers=46, num_attention_heads=32, num_kv_heads=16,
                  head_dim=128, hidden_size=4608, intermediate_size=36864, vocab_size=256000,
                  max_position_embeddings=8192, num_parameters=27_227_128_320,
                  sliding_window=4096, num_sliding_window_layers=23),
        # DeepSeek-V3 ships fp8 weights; MLA caches a 512-d latent + a 64-d rope key per layer.
        ModelArch(name="deepseek-v3", num_layers=61, num_attention_heads=128,
                  num_kv_heads=128, head_dim=192, hidden_size=7168, intermediate_size=18432,
                  vocab_size=129280, max_position_embeddings=163840,
                  num_parameters=671_026_419_200, weight_dtype="fp8", kv_lora_rank=512,
                  qk_rope_head_dim=64),
    )
}  # fmt: skip

# The Hugging Face class each preset's config.json names (`architectures`), and the classes the
# headroom engine implements (with the family name its decoder uses): a preset whose class is
# not one of them runs only under engine.runtime vllm or sglang.
PRESET_ARCHITECTURES: dict[str, str] = {
    "llama-3.1-8b": "LlamaForCausalLM",
    "llama-3.1-70b": "LlamaForCausalLM",
    "llama-3.1-405b": "LlamaForCausalLM",
    "llama-3.2-1b": "LlamaForCausalLM",
    "llama-3.2-3b": "LlamaForCausalLM",
    "mistral-7b": "MistralForCausalLM",
    "mixtral-8x7b": "MixtralForCausalLM",
    "qwen2.5-7b": "Qwen2ForCausalLM",
    "qwen2.5-72b": "Qwen2ForCausalLM",
    "gemma-2-9b": "Gemma2ForCausalLM",
    "gemma-2-27b": "Gemma2ForCausalLM",
    "deepseek-v3": "DeepseekV3ForCausalLM",
}
HEADROOM_ENGINE_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}
# Presets the headroom engine cannot load, in the order MODEL_PRESETS lists them.
NOT_HEADROOM_ENGINE_PRESETS: tuple[str, ...] = tuple(
    name for name, cls in PRESET_ARCHITECTURES.items() if cls not in HEADROOM_ENGINE_ARCHITECTURES
)


class GPU(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    memory_bytes: int = Field(ge=1)
    fp8: bool = Field(description="native fp8 tensor cores (Hopper, Ada, Blackwell)")

    @property
    def memory_gib(self) -> float:
        return self.memory_bytes / 2**30


_MIB = 2**20
GPU_PRESETS: dict[str, GPU] = {
    g.name: g
    for g in (
        GPU(name="h100-80gb", memory_bytes=81559 * _MIB, fp8=True),
        GPU(name="h200-141gb", memory_bytes=143771 * _MIB, fp8=True),
        GPU(name="a100-40gb", memory_bytes=40960 * _MIB, fp8=False),
        GPU(name="a100-80gb", memory_bytes=81920 * _MIB, fp8=False),
        GPU(name="l40s-48gb", memory_bytes=46068 * _MIB, fp8=True),
        GPU(name="l4-24gb", memory_bytes=23034 * _MIB, fp8=True),
        GPU(name="b200-192gb", memory_bytes=183359 * _MIB, fp8=True),
    )
}
# Short names people type.
GPU_ALIASES = {"h100": "h100-80gb", "h200": "h200-141gb", "a100": "a100-80gb",
               "l40s": "l40s-48gb", "l4": "l4-24gb", "b200": "b200-192gb"}  # fmt: skip


class UnknownPreset(KeyError):
    """A model or GPU name that is not a preset; the message lists the known names."""

    def __str__(self) -> str:
        return str(self.args[0])


def model_preset(name: str) -> ModelArch:
    """Look up a model preset by name (case-insensitive)."""
    try:
        return MODEL_PRESETS[name.lower()]
    except KeyError:
        known = ", ".join(sorted(MODEL_PRESETS))
        raise UnknownPreset(f"unknown model {name!r}; known models: {known}") from None


def gpu_preset(name: str) -> GPU:
    """Look up a GPU preset by name or short alias (case-insensitive)."""
    key = name.lower()
    key = GPU_ALIASES.get(key, key)
    try:
        return GPU_PRESETS[key]
    except KeyError:
        known = ", ".join(sorted(GPU_PRESETS))
        raise UnknownPreset(f"unknown GPU {name!r}; known GPUs: {known}") from None
