"""Repair of the failure-domain spread after a greedy assignment (shared by the builders)."""

from __future__ import annotations

import numpy as np

from eaas.runtime.placement.placement import PlacementError


def repair_spread(matrix: np.ndarray, share: np.ndarray, domain_ids: np.ndarray, needed: int) -> None:
    """Greedy packing can run out of servers in a fresh domain at its tail. For each (l, e) whose
    replicas cover fewer than ``needed`` domains, swap one of its replicas in a repeated domain with
    the most similar-weight expert ``f`` of a server in an uncovered domain (keeping ``f``'s own
    spread). Edits ``matrix [S, L, E]`` in place; share: float ``[L, E]`` tokens per replica."""
    num_servers, num_layers, num_experts = matrix.shape

    def covered(l: int, e: int) -> set[int]:
        return {int(domain_ids[s]) for s in np.flatnonzero(matrix[:, l, e])}

    for l in range(num_layers):
        for e in range(num_experts):
            while len(covered(l, e)) < needed:
                domains = covered(l, e)
                hosts = np.flatnonzero(matrix[:, l, e]).tolist()
                repeated = [a for a in hosts if sum(domain_ids[b] == domain_ids[a] for b in hosts) > 1]
                best: tuple[float, int, int, int] | None = None
                for a in repeated:
                    for b in range(num_servers):
                        if int(domain_ids[b]) in domains or matrix[b, l, e]:
                            continue
                        for f in np.flatnonzero(matrix[b, l] & ~matrix[a, l]).tolist():
                            f_hosts = [s for s in np.flatnonzero(matrix[:, l, f]).tolist() if s != b] + [a]
                            f_domains = len({int(domain_ids[s]) for s in f_hosts})
                            if f_domains < min(needed, len(covered(l, f))):
                                continue
                            score = abs(float(share[l, f] - share[l, e]))
                            if best is None or score < best[0]:
                                best = (score, a, b, f)
                if best is None:
                    raise PlacementError(
                        f"cannot spread the replicas of expert {e} (layer row {l}) over {needed} failure "
                        "domains; add servers in other domains or lower the replication"
                    )
                _, a, b, f = best
                matrix[a, l, e], matrix[b, l, e] = False, True
                matrix[b, l, f], matrix[a, l, f] = False, True
