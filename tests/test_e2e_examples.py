"""The examples as the e2e scenarios apply them: the files of examples/, with every URL on
loopback (an example's in-cluster Prometheus Service would be looked up off this machine)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from e2e import kube


def test_the_applied_examples_reach_loopback_only() -> None:
    out = kube.examples_dir()
    names = sorted(p.name for p in kube.EXAMPLES_SOURCE.glob("*.yaml"))
    assert sorted(p.name for p in out.glob("*.yaml")) == names
    rewritten = 0
    for name in names:
        src = (kube.EXAMPLES_SOURCE / name).read_text()
        got = (out / name).read_text()
        for d in yaml.safe_load_all(got):
            assert all(kube._loopback(u) for u in kube._urls(d)), name
        # Only the URL's line changes: the rest is the file as a user applies it.
        changed = [
            (a, b) for a, b in zip(src.splitlines(), got.splitlines(), strict=True) if a != b
        ]
        assert all("prometheusURL:" in a and kube.LOOPBACK_PROMETHEUS in b for a, b in changed)
        rewritten += len(changed)
        assert src.endswith("\n") == got.endswith("\n")
    assert rewritten >= 1  # the fp8kv example names prometheus-operated.monitoring


def test_an_example_naming_another_host_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "a.yaml").write_text(
        "kind: InferenceDeployment\nspec:\n  model:\n    path: https://models.example/x\n"
    )
    monkeypatch.setattr(kube, "EXAMPLES_SOURCE", tmp_path)
    kube.examples_dir.cache_clear()
    try:
        with pytest.raises(AssertionError, match="loopback only"):
            kube.examples_dir()
    finally:
        kube.examples_dir.cache_clear()
