"""The test cluster's pod network (e2e/cluster/podnet.py): a loopback /16 per cluster, picked
from the name, never one another cluster on this machine claims. No cluster needed."""

from __future__ import annotations

import ipaddress
import subprocess
import sys
from pathlib import Path

import pytest

from e2e.cluster import podnet

LOOPBACK = ipaddress.IPv4Network("127.0.0.0/8")
SCRIPT = Path(podnet.__file__)


def test_a_name_always_gets_the_same_loopback_slash_16() -> None:
    net = podnet.pick("alice", [])
    assert net == podnet.pick("alice", [])
    assert net.subnet_of(LOOPBACK) and net.prefixlen == 16
    assert podnet.FIRST_OCTET <= podnet.octet_of(net) <= podnet.LAST_OCTET


def test_a_claimed_network_is_skipped() -> None:
    first = podnet.pick("alice", [])
    second = podnet.pick("alice", [podnet.octet_of(first)])
    assert second != first and second.subnet_of(LOOPBACK)


def test_clusters_of_different_names_never_share_a_network_when_they_claim_theirs() -> None:
    claimed: list[int] = []
    for name in [f"c{i}" for i in range(50)]:
        net = podnet.pick(name, claimed)
        assert podnet.octet_of(net) not in claimed
        claimed.append(podnet.octet_of(net))


def test_no_network_left_is_an_error() -> None:
    every = range(podnet.FIRST_OCTET, podnet.LAST_OCTET + 1)
    with pytest.raises(podnet.PodNetError, match="claimed"):
        podnet.pick("x", every)


def test_node_cidrs_and_the_node_ip_are_inside_the_cluster_network() -> None:
    net = ipaddress.IPv4Network("127.77.0.0/16")
    cidrs = [ipaddress.IPv4Network(podnet.node_cidr(net, i)) for i in range(3)]
    assert [str(c) for c in cidrs] == ["127.77.1.0/24", "127.77.2.0/24", "127.77.3.0/24"]
    assert ipaddress.IPv4Address(podnet.node_ip(net)) in net
    assert not any(ipaddress.IPv4Address(podnet.node_ip(net)) in c for c in cidrs)
    with pytest.raises(podnet.PodNetError, match="at most 254 nodes"):
        podnet.node_cidr(net, 254)


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("10.244.0.0/16", "outside 127.0.0.0/8"),
        ("127.77.0.0/24", "must be a /16"),
        ("127.0.0.0/16", "127.0.x.x and 127.1.x.x"),
        ("not-a-cidr", "not an IPv4 CIDR"),
    ],
)
def test_an_unusable_network_is_refused_with_the_reason(text: str, reason: str) -> None:
    with pytest.raises(podnet.PodNetError, match=reason):
        podnet.parse_net(text)


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, check=False
    )


def test_the_script_skips_networks_other_state_directories_claim(tmp_path: Path) -> None:
    own = tmp_path / "mine"
    free = _run("mine", str(tmp_path), str(own))
    assert free.returncode == 0, free.stderr
    other = tmp_path / "other"
    other.mkdir()
    (other / podnet.CLAIM_FILE).write_text(free.stdout)
    again = _run("mine", str(tmp_path), str(own))
    assert again.returncode == 0, again.stderr
    assert again.stdout != free.stdout
    # Its own claim (a restart of the same cluster) does not count against it.
    own.mkdir()
    (own / podnet.CLAIM_FILE).write_text(again.stdout)
    assert _run("mine", str(tmp_path), str(own)).stdout == again.stdout


def test_the_script_exits_2_on_a_network_off_loopback_or_claimed(tmp_path: Path) -> None:
    bad = _run("mine", str(tmp_path), str(tmp_path / "mine"), "10.244.0.1/16")
    assert bad.returncode == 2 and "outside 127.0.0.0/8" in bad.stderr
    other = tmp_path / "other"
    other.mkdir()
    (other / podnet.CLAIM_FILE).write_text("127.77.0.0/16\n")
    taken = _run("mine", str(tmp_path), str(tmp_path / "mine"), "127.77.0.0/16")
    assert taken.returncode == 2 and "claimed by" in taken.stderr
