"""The operator's command line, conditions bookkeeping, RBAC rules and exported metrics."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
from prometheus_client import generate_latest

from headroom.operator import cli
from headroom.operator.rbac import cluster_role, cluster_role_rules
from headroom.operator.scaling.exporter import OperatorMetrics
from headroom.operator.status import get_condition, parse_time, rfc3339, set_condition


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="headroom")
    cli.add_parsers(p.add_subparsers(dest="command"))
    return p


def test_operator_flags() -> None:
    args = parser().parse_args(
        ["operator", "-n", "a", "-n", "team-*", "--metrics-port", "9100", "--kubeconfig", "kc",
         "--prometheus-url", "http://prom:9090"]
    )  # fmt: skip
    assert args.func is cli.run_operator
    assert args.namespaces == ["a", "team-*"] and args.metrics_port == 9100
    assert args.kubeconfig == "kc" and args.prometheus_url == "http://prom:9090"
    assert parser().parse_args(["operator", "-A"]).all_namespaces
    assert parser().parse_args(["crd"]).func is cli.run_crd


def test_metrics_and_liveness_bind_to_loopback_unless_told() -> None:
    args = parser().parse_args(["operator"])
    assert (args.metrics_host, args.liveness_host) == ("127.0.0.1", "127.0.0.1")
    args = parser().parse_args(
        ["operator", "--metrics-host", "0.0.0.0", "--liveness-host", "10.1.2.3"]
    )
    assert (args.metrics_host, args.liveness_host) == ("0.0.0.0", "10.1.2.3")


@pytest.mark.parametrize("flag", ["--metrics-host", "--liveness-host"])
def test_a_bind_address_that_is_no_address_is_a_clear_error(
    flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    args = parser().parse_args(["operator", flag, "lots"])
    assert cli.run_operator(args) == 2
    assert f"{flag}:" in capsys.readouterr().err


def test_namespace_and_all_namespaces_are_exclusive() -> None:
    with pytest.raises(SystemExit):
        parser().parse_args(["operator", "-n", "a", "--all-namespaces"])


def test_bad_option_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    args = parser().parse_args(["operator", "--metrics-port", "70000"])
    assert cli.run_operator(args) == 2
    assert "--metrics-port:" in capsys.readouterr().err


def test_a_kubeconfig_that_is_not_one_is_exit_2_before_anything_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    garbage = tmp_path / "kubeconfig"
    garbage.write_text("- just\n- a list\n")
    for path, says in ((tmp_path / "nowhere", "No configuration found"),
                       (tmp_path, "Is a directory"), (garbage, "")):  # fmt: skip
        args = parser().parse_args(["operator", "--kubeconfig", str(path), "--metrics-port", "0"])
        assert cli.run_operator(args) == 2, path
        err = capsys.readouterr().err
        assert f"--kubeconfig {path}:" in err and says in err and "Traceback" not in err, err


def test_a_kubeconfig_that_is_not_yaml_is_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    broken = tmp_path / "kubeconfig"
    broken.write_text("apiVersion: v1\nkind: Config\nclusters: [\n")
    args = parser().parse_args(["operator", "--kubeconfig", str(broken), "--metrics-port", "0"])
    assert cli.run_operator(args) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"headroom operator: --kubeconfig {broken}: ") and "Traceback" not in err
    assert err.count("\n") == 1, err


def test_peering_priority_and_rate_window_flags() -> None:
    args = parser().parse_args(["operator", "--peering", "p", "--priority", "5"])
    assert (args.peering, args.priority) == ("p", 5)
    args = parser().parse_args(["operator"])
    assert args.priority is None and args.prometheus_rate_window == "1m"
    args = parser().parse_args(["operator", "--prometheus-rate-window", "4m"])
    assert args.prometheus_rate_window == "4m"


def test_namespace_globs_negations_and_a_prometheus_url_are_taken() -> None:
    from headroom.operator.handlers import Options

    names = ["team-*", "!kube-*", "a", "!a-1", "[ab]x", "x?", "team-*,!team-x", "a, !b", "[!a]x"]
    o = Options(namespaces=names, prometheus_url="http://prom.mon:9090/x")
    assert o.namespaces == names


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--priority", "5"], "--priority: a peering priority needs --peering"),
        (["--peering", "p", "--priority", "-1"], "--priority:"),
        (["--prometheus-rate-window", "60"], "--prometheus-rate-window: '60' is not"),
        (["--prometheus-rate-window", "0s"], "--prometheus-rate-window: 0s is outside"),
        (["--prometheus-rate-window", "2h"], "--prometheus-rate-window:"),
        # Each would watch nothing, or fail every scaling tick, and say so only in its logs.
        (["--namespace", ""], "--namespace: '' is not a namespace name or glob"),
        (["--namespace", "Team-A"], "--namespace: 'Team-A' is not a namespace name"),
        # ... as would a plain name no namespace can have (the chart gives it a Role), an
        # unclosed '[' (a literal to fnmatch) and an empty part.
        (["--namespace=-a"], "--namespace: '-a' is not a namespace name or glob: a name is"),
        (["--namespace", "!team]"], "--namespace: '!team]' is not a namespace name or glob"),
        (["--namespace", "team-[ab"], "--namespace: 'team-[ab' is not a namespace name or glob"),
        (["--namespace", "a,"], "--namespace: 'a,' is not a namespace name or glob"),
        (["--prometheus-url", "prometheus:9090"], "--prometheus-url: must be an http://"),
        (["--prometheus-url", "http://p:99999"], "--prometheus-url: the port must be a number"),
        # The engine's image is derived as REPO-engine:TAG: a digest or no tag leaves none.
        (["--headroom-image", "reg.example.com/headroom@sha256:" + "a" * 64],
         "--headroom-image: 'reg.example.com/headroom@sha256:"),
        (["--headroom-image", "reg.example.com/headroom:1@sha256:" + "a" * 64],
         "set engine.image (and engine.sidecarImage) on each InferenceDeployment"),
        (["--headroom-image", "reg.example.com/headroom"], "--headroom-image: 'reg.example.com/"
         "headroom' has no tag"),
        (["--headroom-image", "localhost:5000/headroom"], "--headroom-image: 'localhost:5000/"
         "headroom' has no tag"),
    ],
)  # fmt: skip
def test_a_flag_that_cannot_work_is_exit_2(
    argv: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    args = parser().parse_args(["operator", *argv])
    assert cli.run_operator(args) == 2
    assert says in capsys.readouterr().err


def test_the_headroom_image_flag_reaches_the_operator(monkeypatch: pytest.MonkeyPatch) -> None:
    from headroom.operator import handlers
    from headroom.operator.crd.models import HEADROOM_ENGINE_IMAGE, HEADROOM_IMAGE
    from headroom.operator.kube import Kube

    seen: list[handlers.Options] = []

    async def operate(options: handlers.Options, **_: object) -> None:
        seen.append(options)

    monkeypatch.setattr(Kube, "connect", staticmethod(lambda kubeconfig=None: object()))
    monkeypatch.setattr(handlers, "operate", operate)
    monkeypatch.setattr(cli, "configure_logging", lambda **_: None)
    for argv, headroom, engine in (
        ([], HEADROOM_IMAGE, HEADROOM_ENGINE_IMAGE),
        (["--headroom-image", "registry.example.com:5000/ml/headroom:7.1"],
         "registry.example.com:5000/ml/headroom:7.1",
         "registry.example.com:5000/ml/headroom-engine:7.1"),
    ):  # fmt: skip
        args = parser().parse_args(["operator", "--metrics-port", "0", *argv])
        assert cli.run_operator(args) == 0
        images = seen.pop().images
        assert (images.headroom, images.engine) == (headroom, engine)


def test_conditions_keep_transition_time_until_status_flips() -> None:
    conds = set_condition(None, "Ready", "False", "ReplicasNotReady", "0/2", generation=1, now=100)
    conds = set_condition(conds, "Feasible", "True", "Sized", "ok", generation=1, now=100)
    assert [c["type"] for c in conds] == ["Ready", "Feasible"]
    again = set_condition(conds, "Ready", "False", "ReplicasNotReady", "1/2", generation=2, now=200)
    ready = get_condition(again, "Ready")
    assert ready is not None and ready["lastTransitionTime"] == rfc3339(100)
    assert ready["message"] == "1/2" and ready["observedGeneration"] == 2
    flipped = set_condition(
        again, "Ready", "True", "AllReplicasReady", "2/2", generation=2, now=300
    )
    ready = get_condition(flipped, "Ready")
    assert ready is not None and ready["lastTransitionTime"] == rfc3339(300)
    assert len(flipped) == 2
    with pytest.raises(ValueError, match="unknown condition"):
        set_condition(None, "Happy", "True", "Yes", "", generation=None, now=0)
    assert parse_time(rfc3339(1_700_000_000)) == 1_700_000_000
    assert parse_time("not a time") is None


def test_rbac_rules_are_least_privilege() -> None:
    rules = cluster_role_rules()
    verbs = {(g, r): set(rule["verbs"]) for rule in rules for g in rule["apiGroups"]
             for r in rule["resources"]}  # fmt: skip
    assert verbs[("apps", "deployments")] == {"get", "list", "watch", "create", "patch"}
    assert verbs[("apps", "deployments/scale")] == {"patch"}
    assert verbs[("", "pods")] == {"list"}
    assert verbs[("", "events")] == {"create"}
    assert "delete" not in set().union(*verbs.values())
    assert "update" not in verbs[("headroom.dev", "inferencedeployments")]
    assert len(cluster_role_rules(peering=True)) == len(rules) + 1
    assert cluster_role()["kind"] == "ClusterRole"


def test_desired_replicas_metric() -> None:
    m = OperatorMetrics()
    m.publish("ns", "chat", "advisory", desired=5, current=3)
    text = generate_latest(m.registry).decode()
    assert (
        'headroom_desired_replicas{inferencedeployment="chat",mode="advisory",namespace="ns"} 5.0'
        in text
    )
    m.publish("ns", "chat", "auto", desired=4, current=4)
    text = generate_latest(m.registry).decode()
    assert 'mode="advisory"' not in text and 'mode="auto"' in text
    m.decided("ns", "chat", "scale-out", "DemandForecast")
    m.decided("ns", "other", "scale-in", "LowDemand")
    assert (
        'headroom_scaling_decisions_total{action="scale-out"'
        in generate_latest(m.registry).decode()
    )
    m.forget("ns", "chat")
    text = generate_latest(m.registry).decode()
    assert 'inferencedeployment="chat"' not in text  # the decisions counter's series too
    assert 'inferencedeployment="other"' in text


@pytest.mark.parametrize(
    ("raised", "says"),
    [(OSError(98, "Address in use"), "headroom operator: [Errno 98] Address in use"),
     (TimeoutError(), None)],
)  # fmt: skip
def test_only_a_port_the_system_refuses_is_the_one_line_port_error(
    raised: OSError, says: str | None, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    # A TimeoutError out of kopf's shutdown is an OSError on Python 3.11: it printed as the
    # empty line "headroom operator: " with exit 1, read as a crash with no reason.
    from headroom.operator import handlers
    from headroom.operator.kube import Kube

    async def operate(*args: object, **kwargs: object) -> None:
        raise raised

    monkeypatch.setattr(handlers, "operate", operate)
    monkeypatch.setattr(cli, "configure_logging", lambda **kwargs: None)  # leave the root alone
    monkeypatch.setattr(Kube, "connect", classmethod(lambda cls, kubeconfig=None: object()))
    args = parser().parse_args(["operator", "--metrics-port", "0"])
    if says is None:
        with pytest.raises(type(raised)):
            cli.run_operator(args)
        assert capsys.readouterr().err == ""
    else:
        assert cli.run_operator(args) == 1
        assert capsys.readouterr().err == says + "\n"


def _run_captured(
    argv: list[str], monkeypatch: pytest.MonkeyPatch
) -> tuple[int, dict[str, object]]:
    """Run `headroom operator ARGV` with the API, kopf, logging and /metrics stubbed out; what
    each was handed comes back."""
    from headroom.operator import handlers
    from headroom.operator.kube import Kube
    from headroom.operator.scaling.exporter import OperatorMetrics

    seen: dict[str, object] = {}

    async def operate(options: handlers.Options, **_: object) -> None:
        seen["options"] = options

    def serve(self: OperatorMetrics, port: int, addr: str = "") -> None:
        seen["metrics"] = (port, addr)

    monkeypatch.setattr(Kube, "connect", staticmethod(lambda kubeconfig=None: object()))
    monkeypatch.setattr(handlers, "operate", operate)
    monkeypatch.setattr(OperatorMetrics, "serve", serve)
    monkeypatch.setattr(cli, "configure_logging", lambda **kw: seen.update(logging=kw))
    return cli.run_operator(parser().parse_args(["operator", *argv])), seen


def test_with_no_flags_the_operator_runs_on_the_documented_defaults(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The flags' defaults are Options' own (every namespace, /metrics on 127.0.0.1:8080, no
    /healthz, a resync every 300 s as the README says) and JSON logs, quiet."""
    from headroom.operator.handlers import Options

    rc, seen = _run_captured([], monkeypatch)
    assert rc == 0
    assert seen["options"] == Options()
    assert seen["metrics"] == (8080, "127.0.0.1")
    assert seen["logging"] == {"verbose": False, "json_format": True}


def test_the_flags_reach_the_operator(monkeypatch: pytest.MonkeyPatch) -> None:
    """Repeated --namespace and --allow-prometheus-url, the resync period, the ports and the log
    format arrive as given: a flag dropped on the way would watch or serve the wrong thing."""
    rc, seen = _run_captured(
        ["-n", "a", "-n", "team-*", "--allow-prometheus-url", "http://*.mon.svc:9090",
         "--allow-prometheus-url", "http://p:9090", "--resync-seconds", "60",
         "--metrics-port", "0", "--liveness-port", "8081", "--log-format", "text", "-v"],
        monkeypatch,
    )  # fmt: skip
    assert rc == 0 and "metrics" not in seen  # port 0: no /metrics
    options = seen["options"]
    assert options.namespaces == ["a", "team-*"]  # type: ignore[attr-defined]
    assert options.allowed_prometheus_urls == ["http://*.mon.svc:9090", "http://p:9090"]  # type: ignore[attr-defined]
    assert (options.resync_seconds, options.liveness_port) == (60.0, 8081)  # type: ignore[attr-defined]
    assert seen["logging"] == {"verbose": True, "json_format": False}


def test_crd_prints_the_crd_yaml_and_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    """`headroom crd > crds/inferencedeployment.yaml` in a script: the YAML on stdout, exit 0."""
    import yaml

    assert cli.run_crd(parser().parse_args(["crd"])) == 0
    doc = yaml.safe_load(capsys.readouterr().out)
    assert doc["kind"] == "CustomResourceDefinition"
    assert doc["metadata"]["name"] == "inferencedeployments.headroom.dev"
