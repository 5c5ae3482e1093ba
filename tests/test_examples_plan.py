"""Each example opens with the `headroom plan` command it was sized with: that command must
size what the operator sizes from the example's spec (the figures in status.budget)."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
import yaml

from headroom.contract.cli import main
from headroom.operator.crd.models import InferenceDeploymentSpec
from headroom.operator.reconcile.sizing import size

EXAMPLES = sorted((Path(__file__).resolve().parents[1] / "examples").glob("*.yaml"))


def plan_comment(text: str) -> list[str]:
    """The arguments of the `# headroom plan ...` comment, continuation lines joined."""
    lines = [line.removeprefix("#").strip() for line in text.splitlines() if line.startswith("#")]
    start = next(i for i, line in enumerate(lines) if line.startswith("headroom plan "))
    command = lines[start]
    for line in lines[start + 1 :]:
        if not command.endswith("\\"):
            break
        command = command.removesuffix("\\") + " " + line
    return shlex.split(re.sub(r"^headroom plan ", "", command))


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_the_comments_plan_sizes_what_the_operator_sizes(
    path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    text = path.read_text()
    assert main(["plan", *plan_comment(text), "--json"]) == 0
    planned = json.loads(capsys.readouterr().out)
    spec = InferenceDeploymentSpec.model_validate(
        next(d for d in yaml.safe_load_all(text) if d and d.get("kind") == "InferenceDeployment")[
            "spec"
        ]
    )
    sized = size(spec)
    assert (planned["kv_blocks_per_pod"], planned["sequences_per_pod"], planned["replicas"]) == (
        sized.plan.kv_blocks_per_pod,
        sized.plan.sequences_per_pod,
        sized.replicas,
    )
