"""The loopback network a test cluster's kwok nodes hand pod IPs from.

Every pod IP of a test cluster is a 127.0.0.0/8 address, so nothing that talks to a pod (the
operator polling ``http://<pod IP>:9090/saturation``) can send a packet off the machine.
Each cluster gets a /16 of its own, ``127.<octet>.0.0/16``: node *i* takes the /24
``127.<octet>.<i+1>.0/24`` as its ``spec.podCIDR`` (kwok allocates from the node's podCIDR)
and the node address is ``127.<octet>.0.1``. The octet comes from the cluster's name and skips
those other clusters on this machine claim, so two clusters never hand out the same pod IP
(a test that listens on a pod IP answers its own cluster's operator only).

``up.sh`` runs ``python3 podnet.py NAME CLUSTERS_ROOT [CIDR]``: it prints the /16, or exits 2
with the reason. Standard library only: up.sh runs it with the system python3.
"""

from __future__ import annotations

import hashlib
import ipaddress
import sys
from collections.abc import Iterable
from pathlib import Path

#: Octets a cluster may take: 127.0.x.x (127.0.0.1, where every test service listens) and
#: 127.1.x.x are left alone, and so is 127.255.x.x (its .255.255 is the broadcast address).
FIRST_OCTET, LAST_OCTET = 16, 254
#: A node's podCIDR is a /24 under the cluster's /16; .0.x holds the node address.
MAX_NODES = 254
#: The file in a cluster's state directory that records (claims) its /16.
CLAIM_FILE = "pod-net"
LOOPBACK = ipaddress.IPv4Network("127.0.0.0/8")


class PodNetError(ValueError):
    """A pod network that cannot be used (not loopback, wrong size, none left)."""


def octet_of(net: ipaddress.IPv4Network) -> int:
    """The second octet of a ``127.<octet>.0.0/16``."""
    return int(net.network_address.packed[1])


def parse_net(text: str) -> ipaddress.IPv4Network:
    """A /16 inside 127.0.0.0/8, e.g. ``127.77.0.0/16``; PodNetError says what is wrong."""
    try:
        net = ipaddress.IPv4Network(text.strip(), strict=False)
    except ValueError as exc:
        raise PodNetError(f"pod network {text!r} is not an IPv4 CIDR: {exc}") from None
    if not net.subnet_of(LOOPBACK):
        raise PodNetError(
            f"pod network {text!r} is outside 127.0.0.0/8: pod IPs must be loopback addresses "
            "so that nothing talking to a pod leaves the machine"
        )
    if net.prefixlen != 16:
        raise PodNetError(
            f"pod network {text!r} must be a /16 (one /24 per node), like 127.77.0.0/16"
        )
    if not FIRST_OCTET <= octet_of(net) <= LAST_OCTET:
        raise PodNetError(
            f"pod network {text!r}: use 127.{FIRST_OCTET}.0.0/16 to 127.{LAST_OCTET}.0.0/16 "
            "(127.0.x.x and 127.1.x.x are where the machine's own services listen)"
        )
    return net


def pick(name: str, claimed: Iterable[int]) -> ipaddress.IPv4Network:
    """The /16 for cluster ``name``: the octet its name hashes to, or the next one not claimed."""
    taken = set(claimed)
    span = LAST_OCTET - FIRST_OCTET + 1
    start = int.from_bytes(hashlib.sha256(name.encode()).digest()[:4], "big") % span
    for step in range(span):
        octet = FIRST_OCTET + (start + step) % span
        if octet not in taken:
            return ipaddress.IPv4Network(f"127.{octet}.0.0/16")
    raise PodNetError(f"all {span} loopback pod networks are claimed by other test clusters")


def node_cidr(net: ipaddress.IPv4Network, index: int) -> str:
    """Node ``index``'s podCIDR: the /24 ``127.<octet>.<index+1>.0/24``."""
    if not 0 <= index < MAX_NODES:
        raise PodNetError(f"node index {index} out of range: at most {MAX_NODES} nodes")
    return f"127.{octet_of(net)}.{index + 1}.0/24"


def node_ip(net: ipaddress.IPv4Network) -> str:
    """The address kwok gives the nodes (InternalIP, and the pods' hostIP)."""
    return f"127.{octet_of(net)}.0.1"


def claims(root: Path, own_dir: Path) -> dict[int, Path]:
    """Octet -> state directory of every other cluster under ``root`` that claims one."""
    out: dict[int, Path] = {}
    for f in sorted(root.glob(f"*/{CLAIM_FILE}")) if root.is_dir() else []:
        if f.parent.resolve() == own_dir.resolve():
            continue
        try:
            out[octet_of(parse_net(f.read_text()))] = f.parent
        except (OSError, PodNetError):
            continue  # unreadable or foreign: not a claim
    return out


def main(argv: list[str]) -> int:
    """``podnet.py NAME CLUSTERS_ROOT OWN_DIR [CIDR]``: print the cluster's /16; 2 on error."""
    if len(argv) not in (3, 4):
        print("usage: podnet.py NAME CLUSTERS_ROOT OWN_DIR [CIDR]", file=sys.stderr)
        return 2
    name, root, own = argv[0], Path(argv[1]), Path(argv[2])
    others = claims(root, own)
    try:
        if len(argv) == 4 and argv[3]:
            net = parse_net(argv[3])
            if octet_of(net) in others:
                raise PodNetError(f"pod network {net} is claimed by {others[octet_of(net)]}")
        else:
            net = pick(name, others)
    except PodNetError as exc:
        print(exc, file=sys.stderr)
        return 2
    print(net)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
