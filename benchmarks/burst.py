"""A burst of simultaneous streaming clients against one attention client: every one answered.

What a report found before the fix: 400 simultaneous connections to ``eaas serve`` left 32 waiting
past a 60-second timeout (the listen backlog was the standard library's 5: resets and one-second
SYN retransmits before the server could answer), 1,000 left 329. Here, for each burst size, that
many client threads (on loopback, each its own connection) are released at once by a barrier and
each sends one streaming completion (3 prompt tokens, 4 output tokens, greedy) to an attention
client process (``eaas attention-client``, as a pod runs it, its default queue of 64 waiting
sequences) in front of two expert-server processes (tcp).

Counted per burst: answered 200 (the stream read to ``[DONE]``); refused 429 (and of those, with a
``Retry-After`` header); anything else: a connection error, a timeout (60 s, as in the issue), an
other status. Timed: when each client had its response headers, and when its answer was complete
(p50, p99, max, from the barrier).

Targets: 0 connection errors and 0 timeouts at 400 and at 1,000 clients, and every refusal a 429
with ``Retry-After``. No baseline runs in the same run: the old listen backlog is gone, and the
targets are counts, not ratios.

Usage: python benchmarks/burst.py [--quick] [--sizes N,M] [--json-out PATH]  (--quick: 100 and 300 clients)
"""

from __future__ import annotations

import json
import tempfile
import threading
import time
from http.client import HTTPConnection
from pathlib import Path
from typing import Any

from _common import emit, parser, target
from _load import percentile, serving_config, start_client

from eaas.runtime.local.cluster import LocalCluster
from eaas.runtime.model import write_random_checkpoint
from eaas.runtime.placement import round_robin

TIMEOUT_S = 60.0
MODEL = "burst"


def one_client(port: int, barrier: threading.Barrier, origin: list[float]) -> dict[str, Any]:
    body = json.dumps(
        {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 4, "temperature": 0, "stream": True}
    ).encode()
    barrier.wait()
    started = time.monotonic()
    if not origin:
        origin.append(started)
    connection = HTTPConnection("127.0.0.1", port, timeout=TIMEOUT_S)
    try:
        connection.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        response = connection.getresponse()
        headers_at = time.monotonic()
        text = response.read().decode(errors="replace")
        done_at = time.monotonic()
    except TimeoutError:
        return {"outcome": "timeout", "started": started}
    except OSError as exc:
        return {"outcome": f"{type(exc).__name__}", "detail": str(exc), "started": started}
    finally:
        connection.close()
    if response.status == 200:
        outcome = "200" if "data: [DONE]" in text else "200 without [DONE]"
    elif response.status == 429:
        outcome = "429" if response.getheader("Retry-After") else "429 without Retry-After"
    else:
        outcome = f"HTTP {response.status}"
    return {"outcome": outcome, "started": started, "headers": headers_at, "done": done_at}


def burst(port: int, clients: int) -> dict[str, Any]:
    barrier = threading.Barrier(clients)
    origin: list[float] = []
    results: list[dict[str, Any]] = [{} for _ in range(clients)]

    def run(index: int) -> None:
        try:
            results[index] = one_client(port, barrier, origin)
        except Exception as exc:  # counted, never lost
            results[index] = {"outcome": f"client error {type(exc).__name__}: {exc}"}

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(TIMEOUT_S + 30)
    counts: dict[str, int] = {}
    for result in results:
        outcome = result.get("outcome", "not finished")
        counts[outcome] = counts.get(outcome, 0) + 1
    start = origin[0] if origin else 0.0
    headers = [r["headers"] - start for r in results if "headers" in r]
    done = [r["done"] - start for r in results if "done" in r and r["outcome"] == "200"]
    errors = sum(n for outcome, n in counts.items() if outcome not in ("200", "429"))
    return {
        "clients": clients,
        "counts": counts,
        "answered_200": counts.get("200", 0),
        "refused_429": counts.get("429", 0),
        "errors": errors,
        "headers_p50_s": round(percentile(headers, 0.5), 3),
        "headers_max_s": round(max(headers, default=float("nan")), 3),
        "done_p50_s": round(percentile(done, 0.5), 3),
        "done_p99_s": round(percentile(done, 0.99), 3),
        "done_max_s": round(max(done, default=float("nan")), 3),
    }


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--sizes", help="burst sizes, comma-separated (default 400,1000; --quick 100,300)")
    args = p.parse_args()
    sizes = (
        tuple(int(n) for n in args.sizes.split(","))
        if args.sizes
        else (100, 300)
        if args.quick
        else (400, 1000)
    )
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        config = serving_config()
        checkpoint = write_random_checkpoint(config, workdir / "ckpt", seed=1)
        placement = round_robin(config.moe_layers, config.num_experts, 2, replication=1)
        with LocalCluster(checkpoint, placement, workdir / "cluster", transports=("tcp",)) as cluster:
            process, url = start_client(
                "continuous", checkpoint, cluster, workdir, ("--max-queue", "64", "--model-name", MODEL)
            )
            try:
                port = int(url.rsplit(":", 1)[1])
                for clients in sizes:
                    row = burst(port, clients)
                    rows.append(row)
                    print(row, flush=True)
                    time.sleep(2)  # the next burst starts on an idle client
            finally:
                process.terminate()
                process.wait(timeout=30)
    print(f"{'clients':>7} {'200':>5} {'429':>5} {'errors':>6} {'headers p50':>11} {'headers max':>11} "
          f"{'done p50':>8} {'done p99':>8} {'done max':>8}  (s from the release)")  # fmt: skip
    for row in rows:
        print(
            f"{row['clients']:>7} {row['answered_200']:>5} {row['refused_429']:>5} {row['errors']:>6} "
            f"{row['headers_p50_s']:>11} {row['headers_max_s']:>11} {row['done_p50_s']:>8} "
            f"{row['done_p99_s']:>8} {row['done_max_s']:>8}"
        )
    largest = rows[-1]
    emit(
        "burst",
        rows,
        {
            "errors_at_largest": target(largest["errors"], 0, higher_is_better=False),
            "errors_in_every_burst": target(sum(row["errors"] for row in rows), 0, higher_is_better=False),
        },
        args.json_out,
    )


if __name__ == "__main__":
    main()
