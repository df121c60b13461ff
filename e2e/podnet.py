"""Pod networking for the process runner (:mod:`e2e.podrunner`): one bridge, one network namespace
per pod, and nothing that leads out of the machine.

The bridge lives in the host's namespace with the subnet's first address (the *gateway*); the control
plane, kube-proxy and CoreDNS listen there, so pods reach them as they would reach a node. Each pod
gets a namespace with ``lo`` and an ``eth0`` (one end of a veth pair whose other end is a port of the
bridge) holding the pod IP, and a default route via the gateway. ``ip netns exec`` gives a pod's
processes that namespace and the ``resolv.conf``/``hosts`` of ``/etc/netns/<ns>/``.

Containment (the workplace's network rules): the subnet is private and exists only on the bridge
and in these namespaces; forwarding is switched on for the bridge alone (a pod reaching a ClusterIP
is routed bridge → bridge after kube-proxy's DNAT), and an nftables table of ours drops anything that
would be forwarded off the bridge, leave by another interface to or from the pod subnet, or reach
the service range without kube-proxy's DNAT. No route, NAT or masquerade leads out.
"""

from __future__ import annotations

import ipaddress
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

NETNS_DIR = Path("/etc/netns")  # `ip netns exec` bind-mounts these files over /etc in the namespace
SUBNET_BASE = ipaddress.ip_network("10.245.0.0/16")  # one /24 of it per cluster, first free one


def run_ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and result.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {result.stderr.strip() or result.returncode}")
    return result


def nft(script: str) -> None:
    result = subprocess.run(["nft", "-f", "-"], input=script, capture_output=True, text=True, timeout=30)
    if result.returncode != 0:
        raise RuntimeError(f"nft: {result.stderr.strip()}\n{script}")


def missing_tools() -> list[str]:
    """Host tools pod networking needs (``make host-tools`` installs them)."""
    return [tool for tool in ("ip", "nft") if shutil.which(tool) is None]


def _used_subnets() -> set[ipaddress.IPv4Network | ipaddress.IPv6Network]:
    out = run_ip("-4", "-o", "addr", "show").stdout
    used: set[ipaddress.IPv4Network | ipaddress.IPv6Network] = set()
    for line in out.splitlines():
        fields = line.split()
        if "inet" in fields:
            used.add(ipaddress.ip_interface(fields[fields.index("inet") + 1]).network)
    return used


@dataclass(frozen=True)
class PodAddress:
    namespace: str  # the network namespace (``ip netns exec <namespace> ...``)
    ip: str
    host_veth: str


class PodNetwork:
    """``up()`` makes the bridge (and guard rules), ``attach``/``detach`` a pod, ``down()`` all of it.

    `name` must be short (it prefixes interface names, 15 characters at most) and unique per run.
    """

    def __init__(self, name: str, service_cidr: str) -> None:
        if len(name) > 8 or not name.isalnum():
            raise ValueError(f"pod network name must be 1-8 alphanumerics, got {name!r}")
        self.name = name
        self.bridge = f"{name}br"
        self.service_cidr = service_cidr
        self.subnet: ipaddress.IPv4Network | ipaddress.IPv6Network = ipaddress.ip_network("0.0.0.0/32")
        self.gateway = ""
        self._next = 2
        self._in_use: set[str] = set()

    @property
    def prefix_length(self) -> int:
        return self.subnet.prefixlen

    def up(self) -> None:
        used = _used_subnets()
        self.subnet = next(
            s for s in SUBNET_BASE.subnets(new_prefix=24) if not any(s.overlaps(u) for u in used)
        )
        self.gateway = str(self.subnet.network_address + 1)
        self.down()  # a crashed run of the same name
        run_ip("link", "add", self.bridge, "type", "bridge")
        run_ip("addr", "add", f"{self.gateway}/{self.prefix_length}", "dev", self.bridge)
        run_ip("link", "set", self.bridge, "up")
        Path(f"/proc/sys/net/ipv4/conf/{self.bridge}/forwarding").write_text("1")
        nft(self._guard_rules())

    def _guard_rules(self) -> str:
        table = f"eaas_{self.name}"
        return f"""
table inet {table} {{
  chain forward {{
    type filter hook forward priority filter; policy accept;
    iifname "{self.bridge}" oifname != "{self.bridge}" drop
    oifname "{self.bridge}" iifname != "{self.bridge}" drop
  }}
  chain postrouting {{
    # After DNAT and re-routing: the device a packet really leaves by.
    type filter hook postrouting priority srcnat + 10; policy accept;
    ip daddr {self.subnet} oifname != "{self.bridge}" oifname != "lo" drop
    ip saddr {self.subnet} oifname != "{self.bridge}" oifname != "lo" drop
    ip daddr {self.service_cidr} drop
  }}
}}
"""

    def down(self) -> None:
        """Remove every namespace, the bridge and the rules of this name (idempotent)."""
        for namespace in run_ip("netns", "list", check=False).stdout.split("\n"):
            ns = namespace.split(" ")[0]
            if ns.startswith(f"{self.name}-"):
                run_ip("netns", "del", ns, check=False)
                shutil.rmtree(NETNS_DIR / ns, ignore_errors=True)
        run_ip("link", "del", self.bridge, check=False)
        subprocess.run(
            ["nft", "delete", "table", "inet", f"eaas_{self.name}"], capture_output=True, timeout=30
        )

    def _allocate(self) -> str:
        hosts = self.subnet.num_addresses - 2
        for _ in range(hosts):
            # Round robin over the subnet: an address is not reused right after its pod went away.
            offset = self._next
            self._next = 2 + (self._next - 1) % (hosts - 1)
            ip = str(self.subnet.network_address + offset)
            if ip not in self._in_use:
                self._in_use.add(ip)
                return ip
        raise RuntimeError(f"pod network {self.subnet}: no free address")

    def attach(self, key: str, hostname: str, fqdn: str, dns_search: list[str]) -> PodAddress:
        """A namespace ``<name>-<key>`` with an address on the bridge, resolv.conf and hosts."""
        ns = f"{self.name}-{key}"
        veth = f"{self.name}{key}"[:15]
        ip = self._allocate()
        try:
            run_ip("netns", "add", ns)
            run_ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
            run_ip("link", "set", veth, "master", self.bridge, "up")
            run_ip("-n", ns, "addr", "add", f"{ip}/{self.prefix_length}", "dev", "eth0")
            run_ip("-n", ns, "link", "set", "lo", "up")
            run_ip("-n", ns, "link", "set", "eth0", "up")
            run_ip("-n", ns, "route", "add", "default", "via", self.gateway)
            etc = NETNS_DIR / ns
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "resolv.conf").write_text(
                f"nameserver {self.gateway}\nsearch {' '.join(dns_search)}\noptions ndots:5\n"
            )
            names = f"{fqdn} {hostname}" if fqdn != hostname else hostname
            (etc / "hosts").write_text(f"127.0.0.1\tlocalhost\n::1\tlocalhost\n{ip}\t{names}\n")
        except Exception:
            self.detach(PodAddress(ns, ip, veth))
            raise
        return PodAddress(ns, ip, veth)

    def detach(self, address: PodAddress) -> None:
        run_ip("netns", "del", address.namespace, check=False)  # takes the veth pair with it
        run_ip("link", "del", address.host_veth, check=False)
        shutil.rmtree(NETNS_DIR / address.namespace, ignore_errors=True)
        self._in_use.discard(address.ip)
