"""Reading kube-proxy's nftables rules (:func:`e2e.controlplane.service_chain_endpoints`): every
form kube-proxy 1.37 writes a Service's endpoints in, from listings of a drills run. No cluster."""

from __future__ import annotations

from e2e.controlplane import service_chain_endpoints

TABLE = """table ip kube-proxy {
\tcomment "rules for kube-proxy"
\tchain masquerading {
\t\tmeta mark & 0x00004000 != 0x00000000 meta mark set meta mark ^ 0x00004000 masquerade fully-random
\t}

\tchain service-2QRHZV4L-default/kubernetes/tcp/https {
\t}

\tchain service-RRXMZSAB-drills-d2aa30/tiny/tcp/http {
\t\tmeta l4proto tcp dnat ip to numgen random mod 2 map { 0 : 10.245.0.4 . 8000, 1 : 10.245.0.6 . 8000 }
\t}

\tchain service-QNKOTMIO-drills-d2aa30/tiny-attention/tcp/http {
\t\tmeta l4proto tcp dnat to 10.245.0.4:8000
\t}

\tchain service-ABCDEFGH-drills-d2aa30/sticky/tcp/http {
\t\tip saddr @affinity-ENDPOINT goto endpoint-ENDPOINT
\t\tnumgen random mod 1 vmap { 0 : goto endpoint-ENDPOINT }
\t}
}
""".replace("ENDPOINT", "AAAAAAAA-drills-d2aa30/sticky/tcp/http__10.245.0.7/8000")


def test_several_endpoints_are_read_from_the_numgen_map() -> None:
    assert service_chain_endpoints(TABLE, "drills-d2aa30/tiny/tcp/http") == {
        "10.245.0.4:8000",
        "10.245.0.6:8000",
    }


def test_a_single_endpoint_is_read_from_its_dnat() -> None:
    assert service_chain_endpoints(TABLE, "drills-d2aa30/tiny-attention/tcp/http") == {"10.245.0.4:8000"}


def test_endpoint_chains_of_session_affinity_are_read() -> None:
    assert service_chain_endpoints(TABLE, "drills-d2aa30/sticky/tcp/http") == {"10.245.0.7:8000"}


def test_an_empty_or_missing_chain_has_no_endpoints() -> None:
    assert service_chain_endpoints(TABLE, "default/kubernetes/tcp/https") == frozenset()
    assert service_chain_endpoints(TABLE, "drills-d2aa30/gone/tcp/http") == frozenset()
    assert service_chain_endpoints("", "drills-d2aa30/tiny/tcp/http") == frozenset()
