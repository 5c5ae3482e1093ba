"""The InferenceDeployment resource (headroom.dev/v1alpha1): spec and status as pydantic models.

These models are the single source of the CRD schema (`schema.py` turns them into the structural
OpenAPI the API server enforces) and of the operator's own validation, so both agree.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal, get_args

from pydantic import (
    BeforeValidator,
    Field,
    JsonValue,
    StringConstraints,
    WithJsonSchema,
    field_validator,
)

from headroom.contract.budget import GPU_PRESETS, MODEL_PRESETS, KVCacheDtype
from headroom.contract.budget.arch import MAX_PARAMETERS
from headroom.contract.budget.presets import (
    GPU_ALIASES,
    HEADROOM_ENGINE_ARCHITECTURES,
    NOT_HEADROOM_ENGINE_PRESETS,
    PRESET_ARCHITECTURES,
)
from headroom.operator.crd.rules import CRDModel, Rule

GROUP = "headroom.dev"
VERSION = "v1alpha1"
KIND = "InferenceDeployment"
PLURAL = "inferencedeployments"
SINGULAR = "inferencedeployment"
SHORT_NAMES = ("infd",)
CATEGORIES = ("headroom",)

MODEL_PRESET_NAMES = tuple(sorted(MODEL_PRESETS))
GPU_TYPE_NAMES = tuple(sorted(GPU_PRESETS)) + tuple(sorted(GPU_ALIASES))

WeightDtype = Literal["fp32", "bf16", "fp16", "fp8", "int8", "int4"]
# engine.kvCacheDtype: "auto" keeps the weights' precision, else one of the budget's KV element
# types (`KVCacheDtype`, the contract's) that an engine can be told to store.
KVCacheSetting = Literal["auto", "fp8", "int8"]
assert set(get_args(KVCacheSetting)) - {"auto"} <= set(get_args(KVCacheDtype))
AttentionBackend = Literal["auto", "torch", "cuda"]
Runtime = Literal["headroom", "vllm", "sglang"]
ScalingMode = Literal["auto", "advisory"]
MetricsSource = Literal["sidecar", "prometheus"]
ConditionStatus = Literal["True", "False", "Unknown"]

# Kubernetes' name grammars, built once: a DNS label, a subdomain of them, and the name part of
# a qualified name (apimachinery's IsQualifiedName). `[.]`, not an escaped dot: these patterns
# also sit in CEL strings, where `\.` is not an escape.
_DNS_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_SUBDOMAIN = rf"{_DNS_LABEL}([.]{_DNS_LABEL})*"
_NAME_PART = r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?"
_DNS_SUBDOMAIN = rf"^{_SUBDOMAIN}$"
# A value the engine's command line receives as an argument must not read as a flag
# (`model.path: --trust-remote-code` would otherwise render `vllm serve --trust-remote-code`).
# The spaces are spelled out: `\s` is ASCII [\t\n\f\r ] to the API server (Go's RE2) and
# every Unicode space to pydantic (Rust's regex), so with it each accepted what the other refused.
NOT_A_FLAG = r"^[^-\t\n\f\r ]"
# A Kubernetes resource quantity without a sign (the grammar of apimachinery's
# resource.Quantity): 4, 500m, 1.5, 32Gi, 512M, 4e9.
# The exponent has at most two digits: apimachinery expands the exponent digit by digit, and
# one of eight digits (1e99999999) kept kube-apiserver busy for minutes on every Pod that
# carried it, a request the operator's timeout then retried.
QUANTITY_PATTERN = (
    r"^(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))"
    r"(([KMGTPE]i)|[numkMGTPE]|([eE][+-]?[0-9]{1,2}))?$"
)
# An image reference holds no whitespace. Kubernetes refuses a Pod's image with any at its
# ends, but not a Deployment's template: the ReplicaSet would fail every pod it creates. The
# spaces are spelled out (Go's unicode.IsSpace) for the reason NOT_A_FLAG gives.
_SPACES = (
    r"\t\n\v\f\r \x{85}\x{A0}\x{1680}\x{2000}-\x{200A}\x{2028}\x{2029}\x{202F}\x{205F}\x{3000}"
)
IMAGE_PATTERN = rf"^[^{_SPACES}]*$"
_ARCH_FIELDS = (
    "numLayers",
    "numAttentionHeads",
    "numKVHeads",
    "headDim",
    "hiddenSize",
    "vocabSize",
    "parameterCount",
)
_ARCH_OPTIONAL = (
    "intermediateSize",
    "maxPositionEmbeddings",
    "kvLoraRank",
    "qkRopeHeadDim",
    "indexHeadDim",
    "slidingWindow",
    "numSlidingWindowLayers",
)


def _has(obj: object, alias: str) -> bool:
    """CEL `has(self.<alias>)` for a model: the camelCase field is set."""
    cls = type(obj)
    for name, info in cls.model_fields.items():  # type: ignore[attr-defined]
        if info.alias == alias or name == alias:
            return getattr(obj, name) is not None
    raise KeyError(alias)


def _has_all(obj: object, aliases: tuple[str, ...]) -> bool:
    return all(_has(obj, a) for a in aliases)


def _has_any(obj: object, aliases: tuple[str, ...]) -> bool:
    return any(_has(obj, a) for a in aliases)


def _cel_all(aliases: tuple[str, ...]) -> str:
    return " && ".join(f"has(self.{a})" for a in aliases)


def _cel_any(aliases: tuple[str, ...]) -> str:
    return " || ".join(f"has(self.{a})" for a in aliases)


def _integer_quantity(value: Any) -> Any:
    # YAML `cpu: 4` arrives as a number, which the API server keeps (int-or-string): the pod
    # gets the quantity it spells. A negative number then fails the pattern, as it must.
    return str(value) if isinstance(value, int) and not isinstance(value, bool) else value


Quantity = Annotated[
    str,
    # The constraints go before the BeforeValidator: placed after it, max_length is checked
    # as a generic length ("at most 32 items"), not a string's.
    StringConstraints(max_length=32, pattern=QUANTITY_PATTERN),
    BeforeValidator(_integer_quantity),
    WithJsonSchema(
        {
            "x-kubernetes-int-or-string": True,
            # The one union a structural schema allows; pattern and maxLength bind strings,
            # minimum binds integers.
            "anyOf": [{"type": "integer"}, {"type": "string"}],
            "minimum": 0,
            "maxLength": 32,
            "pattern": QUANTITY_PATTERN,
        }
    ),
]

# An extended resource name: a DNS-subdomain prefix, '/', a name (what the device plugin
# advertises); names without a prefix, and kubernetes.io's, are Kubernetes' own resources.
_EXTENDED_RESOURCE = rf"^{_SUBDOMAIN}/{_NAME_PART}$"
# Kubernetes also requires `requests.` + the name to be a qualified name (quota's form of it),
# whose prefix is at most 253 characters: the domain here at most 244.
_MAX_RESOURCE_DOMAIN = 244
# A label value (apimachinery's IsValidLabelValue): nvidia-smi's "NVIDIA H100 80GB HBM3" is not
# one; GPU Feature Discovery writes NVIDIA-H100-80GB-HBM3.
LABEL_VALUE_PATTERN = r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$"
# A label key (apimachinery's IsQualifiedName): [prefix/]name, the prefix a DNS subdomain of at
# most 253 characters. The Python twins fullmatch: Python's `$` also matches before a final
# newline, Go's (and CEL's) does not.
_LABEL_KEY = rf"^({_SUBDOMAIN}/)?{_NAME_PART}$"
# More node labels than any node carries; it also bounds the cost of the CEL rule over the keys,
# which the API server estimates before it accepts the CRD.
MAX_NODE_SELECTOR = 64
NODE_SELECTOR_KEY_MESSAGE = (
    "gpu.nodeSelector keys must be label keys: [prefix/]name, the name at most 63 letters, "
    "digits, '-', '_' or '.' starting and ending with a letter or digit, the prefix a DNS "
    "subdomain of at most 253 characters"
)
# `^[^/]{254}`: a prefix over 253 characters (a key that matches _LABEL_KEY has at most one '/',
# and its name part alone is at most 63).
NODE_SELECTOR_KEY_RULE: dict[str, JsonValue] = {
    "rule": f"self.all(k, k.matches('{_LABEL_KEY}') && !k.matches('^[^/]{{254}}'))",
    "message": NODE_SELECTOR_KEY_MESSAGE,
}


def _label_key(key: str) -> bool:
    """NODE_SELECTOR_KEY_RULE's twin for one key."""
    return re.fullmatch(_LABEL_KEY, key) is not None and len(key.rpartition("/")[0]) <= 253


# The children take the resource's name: the Service (a DNS-1035 label, so no dots and a letter
# first) and the pods' labels (63 characters at most). Checked at the object's root, where CEL
# sees `self.metadata.name`; `name_error` is the operator's twin.
_CHILD_NAME = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"
NAME_RULE = Rule(
    cel=f"size(self.metadata.name) <= 63 && self.metadata.name.matches('{_CHILD_NAME}')",
    message=(
        "metadata.name must be a DNS-1035 label: at most 63 lower-case letters, digits and '-', "
        "starting with a letter and ending with a letter or digit (it names the Service and "
        "labels the pods)"
    ),
    check=lambda obj: (
        len(obj["metadata"]["name"]) <= 63
        and re.fullmatch(_CHILD_NAME, obj["metadata"]["name"]) is not None
    ),
)


def name_error(name: str) -> str | None:
    """Why the children cannot take `name` (NAME_RULE's message), or None when they can."""
    return None if NAME_RULE.check({"metadata": {"name": name}}) else NAME_RULE.message


class ModelSpec(CRDModel):
    """The model: a preset name, or the architecture numbers from its config.json."""

    __rules__ = (
        Rule(
            cel=f"has(self.preset) || ({_cel_all(_ARCH_FIELDS)})",
            message=(
                "model needs either a preset or all of numLayers, numAttentionHeads, numKVHeads, "
                "headDim, hiddenSize, vocabSize and parameterCount"
            ),
            check=lambda m: m.preset is not None or _has_all(m, _ARCH_FIELDS),
        ),
        Rule(
            cel=f"!has(self.preset) || !({_cel_any(_ARCH_FIELDS + _ARCH_OPTIONAL)})",
            message=(
                "model.preset already fixes the architecture: remove the architecture fields "
                "(numLayers, numKVHeads, ...) or the preset"
            ),
            check=lambda m: m.preset is None or not _has_any(m, _ARCH_FIELDS + _ARCH_OPTIONAL),
        ),
        Rule(
            cel=(
                "!has(self.numKVHeads) || !has(self.numAttentionHeads) || "
                "self.numAttentionHeads % self.numKVHeads == 0"
            ),
            message="model.numAttentionHeads must be a multiple of model.numKVHeads",
            check=lambda m: (
                m.num_kv_heads is None
                or m.num_attention_heads is None
                or m.num_attention_heads % m.num_kv_heads == 0
            ),
            field_path=".numKVHeads",
        ),
        Rule(
            cel="has(self.kvLoraRank) == has(self.qkRopeHeadDim)",
            message="an MLA model needs both model.kvLoraRank and model.qkRopeHeadDim",
            check=lambda m: (m.kv_lora_rank is None) == (m.qk_rope_head_dim is None),
        ),
        Rule(
            cel="!has(self.indexHeadDim) || has(self.kvLoraRank)",
            message="model.indexHeadDim (DeepSeek-V3.2's sparse attention) needs model.kvLoraRank",
            check=lambda m: m.index_head_dim is None or m.kv_lora_rank is not None,
            field_path=".indexHeadDim",
        ),
        Rule(
            cel=(
                "!has(self.numSlidingWindowLayers) || self.numSlidingWindowLayers == 0 || "
                "(has(self.slidingWindow) && (!has(self.numLayers) || "
                "self.numSlidingWindowLayers <= self.numLayers))"
            ),
            message=(
                "model.numSlidingWindowLayers needs model.slidingWindow and cannot exceed "
                "model.numLayers"
            ),
            check=lambda m: (
                not m.num_sliding_window_layers
                or (
                    m.sliding_window is not None
                    and (m.num_layers is None or m.num_sliding_window_layers <= m.num_layers)
                )
            ),
        ),
    )

    preset: str | None = Field(
        default=None,
        description="a model whose architecture headroom knows",
        json_schema_extra={"enum": list(MODEL_PRESET_NAMES)},
    )
    served_model_name: str | None = Field(
        default=None,
        max_length=253,
        pattern=NOT_A_FLAG,
        description=(
            "name clients send as `model`; defaults to the preset or the resource name (it is "
            "a command-line argument: it cannot start with '-' or a space)"
        ),
    )
    path: str = Field(
        default="tiny",
        min_length=1,
        max_length=1024,
        pattern=NOT_A_FLAG,
        description=(
            "weights directory inside the pod (or a Hugging Face id), or 'tiny' for the built-in "
            "test model (it is a command-line argument: it cannot start with '-' or a space)"
        ),
    )
    volume_claim_name: str | None = Field(
        default=None,
        max_length=253,
        description="a PersistentVolumeClaim with the weights, mounted read-only at /models",
    )
    weight_dtype: WeightDtype | None = Field(
        default=None, description="weight precision (defaults to the preset's, else bf16)"
    )
    num_layers: int | None = Field(default=None, ge=1, le=1024)
    num_attention_heads: int | None = Field(default=None, ge=1, le=4096)
    num_kv_heads: int | None = Field(default=None, ge=1, le=4096, alias="numKVHeads")
    head_dim: int | None = Field(default=None, ge=1, le=4096)
    hidden_size: int | None = Field(default=None, ge=1, le=1_000_000)
    intermediate_size: int | None = Field(default=None, ge=1, le=10_000_000)
    vocab_size: int | None = Field(default=None, ge=1, le=100_000_000)
    max_position_embeddings: int | None = Field(
        default=None, ge=1, le=100_000_000, description="longest context the model supports"
    )
    parameter_count: int | None = Field(
        default=None, ge=1, le=MAX_PARAMETERS, description="total parameters (all experts for MoE)"
    )
    kv_lora_rank: int | None = Field(
        default=None,
        ge=1,
        le=65536,
        description=(
            "MLA latent width: only for the models vLLM runs as MLA (DeepSeek-V2/V3, Kimi-K2, "
            "LongCat-Flash); MiniCPM3's kv_lora_rank is not MLA: give its full heads instead"
        ),
    )
    qk_rope_head_dim: int | None = Field(default=None, ge=1, le=4096)
    index_head_dim: int | None = Field(
        default=None,
        ge=1,
        le=4096,
        description=(
            "DeepSeek-V3.2's sparse attention (config.json index_head_dim, with index_topk): its "
            "indexer caches an fp8 key this wide per token and layer, and vLLM stores the MLA "
            "latent as fp8_ds_mla; leave it out for V2/V3"
        ),
    )
    sliding_window: int | None = Field(default=None, ge=1, le=100_000_000)
    num_sliding_window_layers: int | None = Field(default=None, ge=0, le=1024)

    @field_validator("preset")
    @classmethod
    def _known_preset(cls, v: str | None) -> str | None:
        if v is not None and v not in MODEL_PRESET_NAMES:
            raise ValueError(f"unknown model {v!r}; known models: {', '.join(MODEL_PRESET_NAMES)}")
        return v


# The image each runtime runs when engine.image is unset (the operator resolves it, so the CRD
# leaves engine.image without a default: a default cannot depend on another field). The stock
# images are pinned: their flags and /metrics names change between releases.
# headroom's two images (the Dockerfile's targets, tagged by scripts/image.sh): `headroom` runs
# the operator and the sidecar and has no torch; `headroom-engine` runs `headroom serve`.
_HEADROOM_REPO = "ghcr.io/headroom-dev/headroom"
HEADROOM_IMAGE = f"{_HEADROOM_REPO}:0.1.0"
HEADROOM_ENGINE_IMAGE = f"{_HEADROOM_REPO}-engine:0.1.0"
RUNTIME_IMAGES: dict[str, str] = {
    "headroom": HEADROOM_ENGINE_IMAGE,
    "vllm": "vllm/vllm-openai:v0.11.0",
    "sglang": "lmsysorg/sglang:v0.5.3",
}
# vLLM's `--block-size` choices (vllm.config.cache.BlockSize: 1, 8, 16, 32, 64, 128) that its
# 0.11 attention backends allocate on SM 8.0 and later: flash_attn.py and triton_attn.py raise
# "Block size must be a multiple of 16" for 1 and 8, and the pod crash-loops.
VLLM_BLOCK_SIZES = (16, 32, 64, 128)


class SecretKeySelector(CRDModel):
    """A key of a Secret in the InferenceDeployment's namespace."""

    __rules__ = (
        # apimachinery's IsConfigMapKey, beyond its characters: a key of `.`, `..` or one
        # starting with `..` is refused in the Deployment's secretKeyRef, so nothing deploys.
        Rule(
            cel="self.key != '.' && !self.key.startsWith('..')",
            message="apiKeySecret.key must not be '.' or start with '..'",
            check=lambda k: k.key != "." and not k.key.startswith(".."),
            field_path=".key",
        ),
    )

    name: str = Field(min_length=1, max_length=253, pattern=_DNS_SUBDOMAIN)
    key: str = Field(default="api-key", min_length=1, max_length=253, pattern=r"^[-._a-zA-Z0-9]+$")


class EngineSpec(CRDModel):
    """How each pod's engine runs: runtime, image, paged-KV policy and limits."""

    __rules__ = (
        Rule(
            cel="self.runtime == 'headroom' || self.attentionBackend == 'auto'",
            message=(
                "engine.attentionBackend is the headroom engine's own: leave it auto with "
                "runtime vllm or sglang (they pick their attention kernels themselves)"
            ),
            check=lambda e: e.runtime == "headroom" or e.attention_backend == "auto",
            field_path=".attentionBackend",
        ),
        Rule(
            cel="self.runtime != 'vllm' || self.kvCacheDtype != 'int8'",
            message=(
                "engine.kvCacheDtype int8 is the headroom engine's own: runtime vllm accepts "
                "auto or fp8 (vLLM --kv-cache-dtype auto|fp8)"
            ),
            check=lambda e: e.runtime != "vllm" or e.kv_cache_dtype != "int8",
            field_path=".kvCacheDtype",
        ),
        Rule(
            cel="self.runtime != 'sglang' || self.kvCacheDtype != 'int8'",
            message=(
                "engine.kvCacheDtype int8 is the headroom engine's own: runtime sglang accepts "
                "auto or fp8 (passed as SGLang --kv-cache-dtype auto|fp8_e4m3)"
            ),
            check=lambda e: e.runtime != "sglang" or e.kv_cache_dtype != "int8",
            field_path=".kvCacheDtype",
        ),
        Rule(
            cel=(
                "self.runtime != 'vllm' || self.blockSize in "
                f"[{', '.join(str(b) for b in VLLM_BLOCK_SIZES)}]"
            ),
            message=(
                "runtime vllm takes engine.blockSize "
                f"{', '.join(str(b) for b in VLLM_BLOCK_SIZES[:-1])} or {VLLM_BLOCK_SIZES[-1]} "
                "(vLLM --block-size)"
            ),
            check=lambda e: e.runtime != "vllm" or e.block_size in VLLM_BLOCK_SIZES,
            field_path=".blockSize",
        ),
        # vLLM refuses to start when the GPU's free memory is below utilization x total
        # (gpu_worker.init_device), which the CUDA context alone makes true at 1.0.
        Rule(
            cel="self.runtime != 'vllm' || self.gpuMemoryUtilization < 1.0",
            message=(
                "runtime vllm needs engine.gpuMemoryUtilization below 1.0: vLLM refuses to "
                "start when less than that fraction of the GPU is free, and its own CUDA "
                "context takes some"
            ),
            check=lambda e: e.runtime != "vllm" or e.gpu_memory_utilization < 1.0,
            field_path=".gpuMemoryUtilization",
        ),
        # vLLM's SchedulerConfig refuses it at start ("must be greater than or equal to
        # max_num_seqs"): every running sequence takes at least one token of a step.
        Rule(
            cel="self.runtime != 'vllm' || self.maxNumBatchedTokens >= self.maxNumSeqs",
            message=(
                "runtime vllm needs engine.maxNumBatchedTokens (vLLM --max-num-batched-tokens) of "
                "at least engine.maxNumSeqs (--max-num-seqs)"
            ),
            check=lambda e: e.runtime != "vllm" or e.max_num_batched_tokens >= e.max_num_seqs,
            field_path=".maxNumBatchedTokens",
        ),
        # SGLang's check_server_args asserts this at start (server_args.py).
        Rule(
            cel="self.runtime != 'sglang' || self.maxNumBatchedTokens % self.blockSize == 0",
            message=(
                "runtime sglang needs engine.maxNumBatchedTokens (SGLang --chunked-prefill-size) "
                "to be a multiple of engine.blockSize (--page-size)"
            ),
            check=lambda e: e.runtime != "sglang" or e.max_num_batched_tokens % e.block_size == 0,
            field_path=".maxNumBatchedTokens",
        ),
        Rule(
            cel=(
                "self.runtime == 'headroom' || !has(self.image) || "
                f"!self.image.startsWith('{_HEADROOM_REPO}')"
            ),
            message=(
                "engine.image is one of headroom's images, which have no vLLM or SGLang "
                "server: name the runtime's image or remove engine.image for its pinned default "
                "(objects created before engine.runtime existed stored the headroom image: "
                "kubectl patch --type json -p "
                '\'[{"op": "remove", "path": "/spec/engine/image"}]\')'
            ),
            check=lambda e: (
                e.runtime == "headroom" or e.image is None or not e.image.startswith(_HEADROOM_REPO)
            ),
            field_path=".image",
        ),
        Rule(
            # The repository bare, by tag or by digest is the same small image.
            cel=(
                "self.runtime != 'headroom' || !has(self.image) || "
                f"!(self.image == '{_HEADROOM_REPO}' || self.image.startsWith('{_HEADROOM_REPO}:')"
                f" || self.image.startsWith('{_HEADROOM_REPO}@'))"
            ),
            message=(
                f"engine.image {_HEADROOM_REPO} is the small image (operator and sidecar, no "
                f"torch): the headroom engine runs from {_HEADROOM_REPO}-engine; name it, or "
                "remove engine.image for the pinned default"
            ),
            check=lambda e: (
                e.runtime != "headroom"
                or e.image is None
                or not (
                    e.image == _HEADROOM_REPO
                    or e.image.startswith((f"{_HEADROOM_REPO}:", f"{_HEADROOM_REPO}@"))
                )
            ),
            field_path=".image",
        ),
    )

    runtime: Runtime = Field(
        default="headroom",
        description=(
            "the engine each pod runs: headroom's own, or a stock vLLM or SGLang server told "
            "the planned KV pool; the sidecar reads its /stats or /metrics"
        ),
    )
    image: str | None = Field(
        default=None,
        min_length=1,
        max_length=512,
        pattern=IMAGE_PATTERN,
        description=(
            f"engine image; defaults by runtime: headroom {RUNTIME_IMAGES['headroom']} (the "
            "operator's --headroom-image repository with -engine appended), vllm "
            f"{RUNTIME_IMAGES['vllm']}, sglang {RUNTIME_IMAGES['sglang']}"
        ),
    )
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"
    sidecar_image: str | None = Field(
        default=None,
        max_length=512,
        pattern=IMAGE_PATTERN,
        description=(
            "defaults to the engine's image with runtime headroom, else to the operator's "
            f"--headroom-image ({HEADROOM_IMAGE} unless the chart names another registry)"
        ),
    )
    block_size: int = Field(default=16, ge=1, le=1024, description="tokens per KV block")
    kv_cache_dtype: KVCacheSetting = Field(
        default="auto",
        description=(
            "auto keeps the weights' precision; fp8/int8 halve KV (int8 only with runtime "
            "headroom; fp8 is fp8_e4m3 on SGLang)"
        ),
    )
    prefix_caching: bool = Field(default=True, description="reuse KV blocks of shared prefixes")
    max_model_len: int | None = Field(
        default=None,
        ge=1,
        le=10_000_000,
        description="longest sequence the engine accepts; defaults to traffic.contextTokens",
    )
    max_num_seqs: int = Field(default=256, ge=1, le=65536, description="batch size cap")
    max_num_batched_tokens: int = Field(default=8192, ge=1, le=1_048_576)
    gpu_memory_utilization: float = Field(
        default=0.9, gt=0.0, le=1.0, description="fraction of GPU memory the engine may use"
    )
    attention_backend: AttentionBackend = Field(
        default="auto", description="the headroom engine's attention kernels (runtime headroom)"
    )
    startup_timeout_seconds: int = Field(
        default=900,
        ge=10,
        le=86400,
        description=(
            "how long the engine may take to load its weights and answer /health before the "
            "kubelet restarts it (the startup probe's failureThreshold x periodSeconds)"
        ),
    )
    cpu: Quantity = Field(default="4", description="CPU request of the engine (a quantity)")
    memory: Quantity = Field(
        default="32Gi", description="memory request and limit (a quantity: 32Gi, 128G, ...)"
    )
    api_key_secret: SecretKeySelector | None = Field(
        default=None,
        description=(
            "a Secret key holding the API key clients must send (Authorization: Bearer): it "
            "reaches the engine as an environment variable, never as a literal argument; "
            "/health, /metrics and the sidecar's reads stay open"
        ),
    )


class GPUSpec(CRDModel):
    """The accelerator each pod gets."""

    __rules__ = (
        Rule(
            cel="has(self.type) || has(self.memoryGiB)",
            message="gpu needs a type preset (h100-80gb, a100-40gb, ...) or memoryGiB",
            check=lambda g: g.type is not None or g.memory_gib is not None,
        ),
        Rule(
            cel="!has(self.tensorParallel) || self.countPerPod % self.tensorParallel == 0",
            message=(
                "gpu.tensorParallel must divide gpu.countPerPod (the remaining factor becomes "
                "pipeline parallelism)"
            ),
            check=lambda g: g.tensor_parallel is None or g.count_per_pod % g.tensor_parallel == 0,
            field_path=".tensorParallel",
        ),
        # A core resource (cpu, memory, ...) here would replace the engine's own request and
        # limit for it: `memory` gave the pod 1 byte.
        Rule(
            cel=(
                f"self.resourceName.matches('{_EXTENDED_RESOURCE}') && "
                f"!self.resourceName.matches('^[^/]{{{_MAX_RESOURCE_DOMAIN + 1}}}') && "
                "!self.resourceName.contains('kubernetes.io/') && "
                "!self.resourceName.startsWith('requests.')"
            ),
            message=(
                "gpu.resourceName must be an extended resource, domain/name such as "
                "nvidia.com/gpu or amd.com/gpu: core resources (cpu, memory, ephemeral-storage, "
                "hugepages-*, names under kubernetes.io) are not GPUs, a name may not start "
                "with requests. (quota's prefix), and its domain is at most 244 characters"
            ),
            check=lambda g: (
                re.fullmatch(_EXTENDED_RESOURCE, g.resource_name) is not None
                and len(g.resource_name.split("/")[0]) <= _MAX_RESOURCE_DOMAIN
                and "kubernetes.io/" not in g.resource_name
                and not g.resource_name.startswith("requests.")
            ),
            field_path=".resourceName",
        ),
    )

    type: str | None = Field(
        default=None,
        description=(
            "a GPU headroom knows the memory of. It sizes the KV pool only and does not steer "
            "scheduling: set gpu.nodeSelector to the label your nodes carry for this GPU (GPU "
            "Feature Discovery's nvidia.com/gpu.product, e.g. NVIDIA-H100-80GB-HBM3, or your "
            "cloud's, e.g. cloud.google.com/gke-accelerator: nvidia-h100-80gb), or a pod sized "
            "for one GPU may land on a smaller one"
        ),
        json_schema_extra={"enum": list(GPU_TYPE_NAMES)},
    )
    # At least 1 GiB: the sizing counts whole bytes, and 1e-10 GiB was a GPU of none.
    memory_gib: float | None = Field(
        default=None,
        ge=1,
        le=4096,
        alias="memoryGiB",
        description="memory per GPU in GiB; overrides the type's",
    )
    count_per_pod: int = Field(default=1, ge=1, le=64, description="GPUs each pod requests")
    tensor_parallel: int | None = Field(
        default=None, ge=1, le=64, description="tensor-parallel ranks; defaults to countPerPod"
    )
    resource_name: str = Field(
        default="nvidia.com/gpu",
        min_length=1,
        max_length=253,
        description="the extended resource the device plugin advertises (nvidia.com/gpu, ...)",
    )
    node_selector: dict[str, Annotated[str, Field(max_length=63, pattern=LABEL_VALUE_PATTERN)]] = (
        Field(
            default_factory=dict,
            max_length=MAX_NODE_SELECTOR,
            description=(
                "node labels the pods require; the way to put them on nodes with gpu.type (which "
                "itself does not steer scheduling)"
            ),
            json_schema_extra={"x-kubernetes-validations": [NODE_SELECTOR_KEY_RULE]},
        )
    )

    @field_validator("node_selector")
    @classmethod
    def _label_keys(cls, v: dict[str, str]) -> dict[str, str]:
        # NODE_SELECTOR_KEY_RULE's twin, whose message names the key.
        for key in v:
            if not _label_key(key):
                raise ValueError(
                    f"gpu.nodeSelector key {key!r} is not a label key ([prefix/]name, the name "
                    "at most 63 letters, digits, '-', '_' or '.')"
                )
        return v

    @field_validator("type")
    @classmethod
    def _known_gpu(cls, v: str | None) -> str | None:
        if v is not None and v not in GPU_TYPE_NAMES:
            raise ValueError(f"unknown GPU {v!r}; known GPUs: {', '.join(GPU_TYPE_NAMES)}")
        return v


class TrafficSpec(CRDModel):
    """The peak the deployment is sized for."""

    peak_concurrency: int = Field(ge=1, le=10_000_000, description="concurrent sequences at peak")
    context_tokens: int = Field(
        ge=1, le=10_000_000, description="tokens per sequence, prompt + output, p95"
    )
    prefix_hit_ratio: float = Field(
        default=0.0,
        ge=0.0,
        lt=1.0,
        description=(
            "share of each sequence's tokens that the sequences in flight hold together (a "
            "shared prefix), stored once per pod; a prefix cache's hit ratio is an upper bound"
        ),
    )


class ScalingSpec(CRDModel):
    """When and how far to scale; see decide.py for the rules."""

    __rules__ = (
        Rule(
            cel="self.minReplicas <= self.maxReplicas",
            message="scaling.minReplicas must not exceed scaling.maxReplicas",
            check=lambda s: s.min_replicas <= s.max_replicas,
            field_path=".minReplicas",
        ),
        Rule(
            cel="self.targetOccupancy < self.scaleOutOccupancy",
            message=(
                "scaling.targetOccupancy must be below scaling.scaleOutOccupancy: a scale-out "
                "sizes the deployment back down to targetOccupancy"
            ),
            check=lambda s: s.target_occupancy < s.scale_out_occupancy,
            field_path=".targetOccupancy",
        ),
        Rule(
            cel="self.scaleInHysteresis < self.targetOccupancy",
            message="scaling.scaleInHysteresis must be smaller than scaling.targetOccupancy",
            check=lambda s: s.scale_in_hysteresis < s.target_occupancy,
            field_path=".scaleInHysteresis",
        ),
        # A rule, not `minimum: 0.5`: the API server checks an integer against an integer
        # minimum, int64(0.5) = 0, so `forecastQuantile: 0` passed the schema.
        Rule(
            cel="self.forecastQuantile >= 0.5",
            message=(
                "scaling.forecastQuantile must be at least 0.5 (0.5 sizes for the forecast "
                "itself, with no band above it)"
            ),
            check=lambda s: s.forecast_quantile >= 0.5,
            field_path=".forecastQuantile",
        ),
    )

    mode: ScalingMode = Field(
        default="auto",
        description="auto sets the Deployment's replicas; advisory only publishes the decision",
    )
    min_replicas: int = Field(default=1, ge=1, le=10_000)
    max_replicas: int = Field(default=10, ge=1, le=10_000)
    target_occupancy: float = Field(
        default=0.85,
        gt=0.0,
        lt=1.0,
        description=(
            "the share of each pod's KV pool the forecast demand may fill on average; its upper "
            "band (forecastQuantile) must also fit the pools, less room for one long request"
        ),
    )
    scale_out_occupancy: float = Field(
        default=0.95,
        gt=0.0,
        le=1.0,
        description=(
            "present occupancy above which the KV in use alone is enough to scale out (the "
            "forecast covers the rest: below this line, KV about to leave buys no pods)"
        ),
    )
    # 0.10, not 0.15: at the default forecastQuantile the band already holds the demand's
    # noise, and on the autoscaling bench's 20 seeds the wider margin bought up to 5 % more
    # GPU-hours (azure; diurnal 3 %, spike 0.5 %) for a worst seed at most 3 s better
    # (bench/autoscale_sim.py, issue 20).
    scale_in_hysteresis: float = Field(
        default=0.10,
        ge=0.0,
        lt=1.0,
        description=(
            "scale in only if the forecast on fewer pods stays below targetOccupancy minus "
            "this (and its band within the usable pools minus this): the margin that keeps a "
            "deployment from releasing a pod on a dip it will need back"
        ),
    )
    saturation_lookahead_seconds: int = Field(
        default=180,
        ge=1,
        le=86400,
        description=(
            "the HeadroomKVSaturationSoon alert fires with this many seconds left before a "
            "pod's KV cache fills (its forecast under this plus 2 minutes, for 2 minutes): a "
            "pod's start time, so a scale-out can still help"
        ),
    )
    pod_start_seconds: int = Field(
        default=180,
        ge=0,
        le=7200,
        description=(
            "a new pod's start time (scheduling, image pull, weight load, warm-up) until the "
            "operator has measured this deployment's own pods (status.podStartSeconds); the "
            "forecast looks this far ahead, plus intervalSeconds"
        ),
    )
    forecast_quantile: float = Field(
        default=0.95,
        lt=1.0,
        description=(
            "the demand forecast's band: its prediction interval at this quantile (at least 0.5), "
            "from the scatter of the deployment's own demand and KV in use (never below the "
            "Poisson noise of the requests in flight), is added before sizing"
        ),
    )
    scale_up_stabilization_seconds: int = Field(default=0, ge=0, le=3600)
    scale_down_stabilization_seconds: int | None = Field(
        default=None,
        ge=0,
        le=86400,
        description=(
            "scale in only after fewer pods have been enough for this long; unset: the "
            "forecast's horizon (status.podStartSeconds plus intervalSeconds plus half the "
            "demand rates' window), the time it takes to get a released pod back"
        ),
    )
    max_scale_up_pods: int = Field(default=8, ge=1, le=10_000, description="pods added per step")
    max_scale_down_pods: int = Field(
        default=2, ge=1, le=10_000, description="pods removed per step"
    )
    interval_seconds: int = Field(default=15, ge=1, le=3600, description="decision period")
    metrics_source: MetricsSource = "sidecar"
    prometheus_url: str | None = Field(
        default=None,
        max_length=1024,
        # A base URL only: no user, query or fragment to bend the query path with.
        pattern=r"^https?://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]+)(:[0-9]{1,5})?(/[A-Za-z0-9._~%/-]*)?$",
        alias="prometheusURL",
        description=(
            "Prometheus base URL (http(s)://host[:port][/path]); defaults to the operator's "
            "--prometheus-url, and any other must match one of its --allow-prometheus-url"
        ),
    )
    metrics_max_age_seconds: int = Field(
        default=60, ge=1, le=3600, description="older samples count as missing"
    )
    startup_grace_seconds: int = Field(
        default=900,
        ge=0,
        le=86400,
        description="a pod not ready after this long is reported as stuck",
    )
    warmup_seconds: int = Field(
        default=90,
        ge=0,
        le=3600,
        description=(
            "scale-in steps are at least this far apart, so the load of the removed pods "
            "settles on the others before the next step is measured"
        ),
    )
    growth_window_seconds: int = Field(
        default=180,
        ge=0,
        le=3600,
        description=(
            "the demand trend is one least-squares line over this window of decisions (a slope "
            "within two standard errors of zero is not projected, nor any before half the "
            "window is measured); 0 fits none and projects no trend"
        ),
    )


# The tensor-parallel size a spec asks for (gpu.tensorParallel, else gpu.countPerPod), in CEL.
_CEL_TP = (
    "(has(self.gpu.tensorParallel) ? self.gpu.tensorParallel : "
    "has(self.gpu.countPerPod) ? self.gpu.countPerPod : 1)"
)


# The weights the headroom engine loads: it refuses a quantized checkpoint.
HEADROOM_ENGINE_WEIGHT_DTYPES = ("fp32", "bf16", "fp16")


def headroom_engine_refusal(s: InferenceDeploymentSpec) -> tuple[str, str] | None:
    """The field, and why, the headroom engine cannot load this spec's model (None when it can
    or another runtime runs it): an MLA model, a preset of an architecture it does not
    implement, or quantized weights. 'tiny' it always loads: the preset then only sizes."""
    m = s.model
    if s.engine.runtime != "headroom" or m.path == "tiny":
        return None
    if m.kv_lora_rank is not None:
        return "model.kvLoraRank", "model.kvLoraRank makes it an MLA model"
    if m.preset in NOT_HEADROOM_ENGINE_PRESETS:
        return "model.preset", f"model.preset {m.preset} is a {PRESET_ARCHITECTURES[m.preset]}"
    if m.weight_dtype is not None and m.weight_dtype not in HEADROOM_ENGINE_WEIGHT_DTYPES:
        return "model.weightDtype", f"model.weightDtype {m.weight_dtype} is a quantized checkpoint"
    return None


def _cel_list(items: tuple[str, ...]) -> str:
    return "[" + ", ".join(f"'{i}'" for i in items) + "]"


_HEADROOM_ENGINE_LOADS = (
    "the headroom engine loads "
    + ", ".join(HEADROOM_ENGINE_ARCHITECTURES)
    + f" checkpoints in {', '.join(HEADROOM_ENGINE_WEIGHT_DTYPES)}"
)


def _tp_splits_heads(s: InferenceDeploymentSpec) -> bool:
    """The architecture fields' heads shard gpu's tensor-parallel size ways (the budget's
    tp_split_error, which sizing applies to presets too)."""
    m = s.model
    if m.num_attention_heads is None or m.num_kv_heads is None:
        return True
    tp = s.gpu.tensor_parallel or s.gpu.count_per_pod
    kv = m.num_kv_heads
    return m.num_attention_heads % tp == 0 and (
        m.kv_lora_rank is not None or kv % tp == 0 or tp % kv == 0
    )


class InferenceDeploymentSpec(CRDModel):
    """What the user asks for. The operator never writes it."""

    __rules__ = (
        Rule(
            cel=(
                "!has(self.engine) || !has(self.engine.maxModelLen) || "
                "self.engine.maxModelLen >= self.traffic.contextTokens"
            ),
            message="engine.maxModelLen must be at least traffic.contextTokens",
            check=lambda s: (
                s.engine.max_model_len is None or s.engine.max_model_len >= s.traffic.context_tokens
            ),
            field_path=".engine.maxModelLen",
        ),
        Rule(
            cel=(
                "(has(self.engine) && has(self.engine.runtime) && "
                "self.engine.runtime != 'headroom') || "
                "!has(self.gpu.countPerPod) || self.gpu.countPerPod == 1"
            ),
            message=(
                "the headroom engine runs on one GPU: gpu.countPerPod above 1 needs "
                "engine.runtime vllm or sglang"
            ),
            check=lambda s: s.engine.runtime != "headroom" or s.gpu.count_per_pod == 1,
            field_path=".gpu.countPerPod",
        ),
        # What the engines can run: the operator's twins of these are in sizing.size, a
        # SpecError that names the runtime or the head counts (and checks presets' heads too).
        Rule(
            cel=(
                "!has(self.engine) || self.engine.runtime == 'headroom' || "
                "self.model.path != 'tiny'"
            ),
            message=(
                "engine.runtime vllm or sglang needs model.path: a weights directory inside the "
                "pod or a Hugging Face id ('tiny', the default, is the headroom engine's "
                "built-in test model)"
            ),
            check=lambda s: s.engine.runtime == "headroom" or s.model.path != "tiny",
            field_path=".model.path",
            in_model=False,
        ),
        Rule(
            cel=(
                "(has(self.engine) && has(self.engine.runtime) && "
                "self.engine.runtime != 'headroom') || self.model.path == 'tiny' || "
                "(!has(self.model.kvLoraRank) && (!has(self.model.preset) || "
                f"!(self.model.preset in {_cel_list(NOT_HEADROOM_ENGINE_PRESETS)})) && "
                "(!has(self.model.weightDtype) || "
                f"self.model.weightDtype in {_cel_list(HEADROOM_ENGINE_WEIGHT_DTYPES)}))"
            ),
            message=(
                f"{_HEADROOM_ENGINE_LOADS}: an MLA model (model.kvLoraRank), the presets "
                f"{', '.join(NOT_HEADROOM_ENGINE_PRESETS)} and quantized weights "
                "(model.weightDtype fp8, int8, int4) need engine.runtime vllm or sglang, or "
                "model.path tiny (its built-in test model, whatever the preset)"
            ),
            check=lambda s: headroom_engine_refusal(s) is None,
            field_path=".engine.runtime",
            in_model=False,
        ),
        Rule(
            cel=(
                "!has(self.model.numAttentionHeads) || !has(self.model.numKVHeads) || "
                f"(self.model.numAttentionHeads % {_CEL_TP} == 0 && "
                f"(has(self.model.kvLoraRank) || self.model.numKVHeads % {_CEL_TP} == 0 || "
                f"{_CEL_TP} % self.model.numKVHeads == 0))"
            ),
            message=(
                "gpu.tensorParallel (default gpu.countPerPod) must divide model.numAttentionHeads "
                "and divide or be a multiple of model.numKVHeads (vLLM and SGLang refuse to "
                "start)"
            ),
            check=_tp_splits_heads,
            field_path=".gpu.tensorParallel",
            in_model=False,
        ),
    )

    model: ModelSpec
    gpu: GPUSpec
    traffic: TrafficSpec
    engine: EngineSpec = Field(default_factory=EngineSpec)
    scaling: ScalingSpec = Field(default_factory=ScalingSpec)
    replicas: int | None = Field(
        default=None,
        ge=0,
        le=10_000,
        description=(
            "the /scale channel of an external autoscaler (HPA, KEDA) in advisory mode: when set "
            "the operator follows it (within min/max); unset, it leaves the Deployment's replicas "
            "to whoever scales the Deployment. Set it once before pointing an HPA at this "
            "resource: /scale answers an error while it is unset. Ignored in auto mode"
        ),
    )


# ---------------------------------------------------------------------------- status


class Budget(CRDModel):
    """The sizing arithmetic (`headroom plan` for the same inputs)."""

    feasible: bool
    binding: str = Field(max_length=32)
    reason: str | None = Field(default=None, max_length=4096)
    kv_cache_dtype: str = Field(max_length=16)
    block_size: int
    tensor_parallel: int
    pipeline_parallel: int
    gpus_per_pod: int
    weights_bytes_per_gpu: int
    kv_bytes_per_token: int = Field(description="whole model, one token")
    kv_bytes_per_token_per_gpu: int
    kv_bytes_per_gpu: int
    kv_blocks_per_pod: int
    kv_tokens_per_pod: int
    sequences_per_pod: int
    sized_replicas: int | None = Field(default=None, description="pods the peak needs")


class KVStatus(CRDModel):
    """Live KV-cache figures across ready pods."""

    occupancy: float | None = Field(default=None, description="mean used/capacity, 0-1")
    occupancy_percent: int | None = None
    max_occupancy: float | None = None
    hit_ratio: float | None = Field(default=None, description="mean prefix-cache hit ratio")
    hit_percent: int | None = None
    eta_seconds: int | None = Field(default=None, description="soonest pod saturation forecast")
    eta: str | None = Field(default=None, max_length=32, description="eta for people")
    waiting: int | None = None
    preemption_rate_per_second: float | None = None
    pods_reporting: int | None = None
    demand_blocks: float | None = Field(
        default=None,
        description="KV the arriving traffic holds at steady state (arrival rate x block-seconds "
        "per request, Little's law); the KV in use when the pods report no demand counters, "
        "the last measured value, held while a pod that has just started has none yet",
    )
    arrival_rate_per_second: float | None = Field(default=None, description="requests/s")
    forecast_blocks: float | None = Field(
        default=None, description="the demand forecast at the horizon (pod start + period)"
    )
    forecast_band_blocks: float | None = Field(
        default=None, description="how far above the forecast the deployment is sized"
    )
    horizon_seconds: float | None = Field(default=None, description="how far the forecast looks")
    observed_at: str | None = Field(default=None, json_schema_extra={"format": "date-time"})


class Condition(CRDModel):
    """metav1.Condition."""

    type: str = Field(max_length=316, pattern=r"^[A-Z][A-Za-z0-9]*$")
    status: ConditionStatus
    observed_generation: int | None = Field(default=None, ge=0)
    last_transition_time: str = Field(json_schema_extra={"format": "date-time"})
    reason: str = Field(min_length=1, max_length=1024, pattern=r"^[A-Za-z]([A-Za-z0-9_,:]*)?$")
    message: str = Field(max_length=32768)


class DecisionInputs(CRDModel):
    """The numbers a scaling decision was made from."""

    ready_replicas: int
    starting_replicas: int
    pods_reporting: int
    mean_occupancy: float | None = None
    max_occupancy: float | None = None
    min_eta_seconds: float | None = None
    waiting: int | None = None
    preemption_rate_per_second: float | None = None
    demand_blocks: float | None = None
    projected_occupancy: float | None = None
    present_blocks: float | None = None
    forecast_blocks: float | None = None
    forecast_band_blocks: float | None = None
    horizon_seconds: float | None = None
    needed_replicas: int | None = None


class DecisionRecord(CRDModel):
    """One scaling decision that changed (or would have changed, in advisory mode) replicas."""

    time: str = Field(json_schema_extra={"format": "date-time"})
    from_: int = Field(alias="from")
    to: int
    reason: str = Field(max_length=64)
    message: str = Field(default="", max_length=4096)
    applied: bool = Field(description="false in advisory mode")
    inputs: DecisionInputs


# status.lastDecisions keeps the newest this many (the scaling loop trims to it).
MAX_DECISIONS = 10


class InferenceDeploymentStatus(CRDModel):
    """What the operator observed and decided."""

    observed_generation: int | None = None
    replicas: int | None = Field(default=None, description="replicas set on the Deployment")
    ready_replicas: int | None = None
    desired_replicas: int | None = Field(default=None, description="the operator's decision")
    selector: str | None = Field(default=None, max_length=1024, description="for /scale")
    budget: Budget | None = None
    kv: KVStatus | None = None
    pod_start_seconds: float | None = Field(
        default=None,
        description="this deployment's pod start time (creation to ready, 90th percentile of the "
        "pods the operator saw start): the forecast's horizon",
    )
    pod_starts_observed: int | None = Field(default=None, description="pod starts it is from")
    conditions: list[Condition] = Field(default_factory=list, max_length=16)
    last_decisions: list[DecisionRecord] = Field(default_factory=list, max_length=MAX_DECISIONS)


CONDITION_TYPES = ("Ready", "Feasible", "KVSaturated", "ScalingLimited", "PoolMatchesPlan")
