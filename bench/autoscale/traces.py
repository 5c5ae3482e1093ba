"""The traces the autoscaling benchmark replays, each with the pod it runs on.

Fixed before any policy was run on them (issue 20), and printed with every table:
- spike, diurnal, flash-crowd: synthetic shapes (`headroom.operator.simulate.synthetic`),
  2 hours each, on Llama 3.1 8B, one H100 80GB per pod (27,955 KV blocks of 16 tokens), as in
  every earlier run of this benchmark.
- azure-conv: Azure's LLM inference trace 2023, conversation service (one hour, 19,366
  requests; Patel et al., ISCA 2024, CC-BY 4.0), at its recorded rate, on Llama 3.1 8B on one
  L4 24GB per pod (1,619 blocks = 25,904 tokens): its in-flight KV (p50 80k, p99 121k tokens)
  then spans 3-6 pods.
- mooncake: Mooncake's synthetic trace (1,022 s, 3,993 requests; Qin et al., FAST 2025,
  Apache-2.0) at twice its rate, on Llama 3.1 8B on one H100 80GB per pod with max model length
  131,072 (longer requests are refused at the door, as the engine refuses them): its in-flight
  KV (p50 0.95M, p99 2.2M tokens) spans 2-5 pods.
A real trace is one recording; each seed replays it with every request moved by up to +-5 s
(and, above rate 1, copied as many times as the rate says), so the 20 seeds are 20
realizations of the same traffic. The synthetic traces use the seed for the whole process.

Every pod serves 120 s after it is asked for; requests decode at 20 tokens/s and prefill at
10,000 tokens/s each.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from pathlib import Path

from headroom.operator.crd.models import InferenceDeploymentSpec
from headroom.operator.simulate.synthetic import SHAPES, synthetic
from headroom.operator.simulate.trace import Trace, read_trace, scaled

# Byte-for-byte copies of ../shared/traces, with their provenance and licences (README there).
TRACES_DIR = Path(__file__).resolve().parents[1] / "traces"
JITTER_SECONDS = 5.0
POD_START_SECONDS = 120


def spec(
    gpu: str, max_model_len: int, peak: int, context: int, lo: int = 1, hi: int = 16
) -> InferenceDeploymentSpec:
    """Llama 3.1 8B on one `gpu` per pod, scaling left at the CRD's defaults except the bounds
    and the pod start time (the simulator's)."""
    return InferenceDeploymentSpec.model_validate(
        {
            "model": {"preset": "llama-3.1-8b"},
            "gpu": {"type": gpu},
            "engine": {"maxModelLen": max_model_len},
            "traffic": {"peakConcurrency": peak, "contextTokens": context},
            "scaling": {
                "minReplicas": lo,
                "maxReplicas": hi,
                "podStartSeconds": POD_START_SECONDS,
            },
        }
    )


@dataclass(frozen=True)
class BenchTrace:
    """One trace of the benchmark: where its requests come from and what it runs on."""

    name: str
    spec: InferenceDeploymentSpec
    source: str  # a synthetic shape, or a file under TRACES_DIR (or any path)
    rate: float = 1.0  # copies of each request, for recorded traces
    describe: str = ""

    def requests(self, seed: int) -> Trace:
        """This seed's realization."""
        if self.source in SHAPES:
            return synthetic(self.source, seed)
        return scaled(_recorded(self.source), self.rate, seed, JITTER_SECONDS)


@cache
def _recorded(source: str) -> Trace:
    path = Path(source)
    return read_trace(path if path.is_absolute() else TRACES_DIR / path)


H100 = spec("h100-80gb", 8192, 256, 4096)
TRACES: tuple[BenchTrace, ...] = (
    BenchTrace("spike", H100, "spike", describe="launch: 4x over 6 min, held 20 min"),
    BenchTrace("diurnal", H100, "diurnal", describe="a day compressed 12x"),
    BenchTrace("flash-crowd", H100, "flash-crowd", describe="6x within a minute"),
    BenchTrace(
        "azure-conv",
        spec("l4-24gb", 8192, 128, 4136),
        "azure-llm-2023-conv.csv",
        rate=1.0,
        describe="Azure LLM trace 2023, conversation, recorded rate, 1 h",
    ),
    BenchTrace(
        "mooncake",
        spec("h100-80gb", 131072, 128, 48910),
        "mooncake-synthetic.jsonl",
        rate=2.0,
        describe="Mooncake synthetic trace at 2x its rate, 17 min",
    ),
)
# Graded on cost at the service level; flash-crowd only on its frontier (its 6x rise within a
# minute is faster than any pod can start: only a standing reserve meets 30 s there).
COST_GRADED = ("spike", "diurnal", "azure-conv", "mooncake")


def from_file(path: Path, rate: float, spec_: InferenceDeploymentSpec | None) -> BenchTrace:
    """A trace the benchmark has never seen, by naming its file (and optionally its spec)."""
    return BenchTrace(
        path.stem,
        spec_ or spec("h100-80gb", 131072, 128, 8192),
        str(path.resolve()),
        rate=rate,
        describe=f"{path.name} at {rate:g}x",
    )
