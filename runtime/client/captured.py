"""``CapturedExperts``: the ``MoEExecutor`` of decode steps captured in CUDA graphs (``cuda_ipc``).

Inside a capture nothing may wait for the host, so a layer's exchange is pure stream work
(``CudaIpcChannel.send_async``/``wait_async``): routing runs on the GPU (``RoutingTable.assign``
with ``check=False``), and every live server that hosts experts of the layer gets all T tokens,
with expert id -1 where another server computes the entry (rows with nothing to do cost the
server no compute, only the copy). Shapes, addresses and header values are fixed at capture; the
data (x, ids, weights) is read from the same buffers at every replay.

The live set is fixed at capture. After each replay the caller calls ``finish``: it waits for
the step with a deadline while watching the servers; a server that died (or stopped answering
before the deadline) has its pending waits released (``abandon_wait``), is marked failed in the
``RemoteExperts`` (so its share goes to replicas from then on) and ``CapturedStepFailed`` tells
the caller to redo the step eagerly and capture again (a decode step rewrites the same KV
positions, so redoing it gives the same answer). Servers that refused a request raise
``RemoteError`` with the server's message.
Legend: T = tokens, K = top-k, H = hidden.
"""

from __future__ import annotations

import time

import torch

from eaas.runtime.client.errors import ExpertUnavailable
from eaas.runtime.client.remote_experts import RemoteExperts
from eaas.runtime.transport import RemoteError
from eaas.runtime.transport.cuda_ipc_client import CudaIpcChannel
from eaas.runtime.transport.segment_channel import LIVENESS_CHECK_S


class CapturedStepFailed(RuntimeError):
    """A server failed during a replayed step: its results are garbage; redo the step eagerly."""

    def __init__(self, servers: list[int]) -> None:
        super().__init__(f"expert server(s) {servers} failed during a captured step; redo it eagerly")
        self.servers = servers


class CapturedExperts:
    def __init__(self, experts: RemoteExperts, device: torch.device | str = "cuda") -> None:
        if experts.options.transport != "cuda_ipc":
            raise ValueError(f"captured steps need transport cuda_ipc, got {experts.options.transport!r}")
        self.experts = experts
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.live = experts.live.clone()  # [S] bool, fixed at capture
        # A replayed step cannot raise for an expert no live server hosts (it would add nothing for
        # it, silently): such a step is not captured, and the caller steps eagerly, which waits for
        # a rejoin or raises ExpertUnavailable.
        if unserved := experts.table.unserved(self.live):
            layer, expert = unserved[0]
            raise ExpertUnavailable(layer, expert, experts.table.replicas(layer, expert))
        self.live_device = self.live.to(self.device)
        experts.table.prepare(self.device)
        self.channels: dict[int, CudaIpcChannel] = {}
        for index in self.live.nonzero().squeeze(1).tolist():
            channel = experts.connections[index].channel
            if not isinstance(channel, CudaIpcChannel):
                raise ValueError(f"server {experts.table.ordinals[index]}: not a cuda_ipc channel")
            self.channels[index] = channel
        self.refusals = {index: channel.refusals() for index, channel in self.channels.items()}

    def is_current(self) -> bool:
        """False once the live servers changed (a failure or a rejoin): capture again."""
        return bool(torch.equal(self.live, self.experts.live)) and all(
            self.experts.connections[i].channel is c for i, c in self.channels.items()
        )

    def __call__(
        self, layer: int, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """Routed-expert output [T, H] for x [T, H], expert ids [T, K], router weights [T, K]."""
        table = self.experts.table
        ids = expert_ids.to(torch.int64)
        assignment = table.assign(layer, ids, self.live_device, check=False)  # [T, K]
        weights = weights.to(torch.float32)
        sent = []
        for index in table.servers_of_layer(layer):
            channel = self.channels.get(index)
            if channel is None:
                continue
            mine = torch.where(assignment == index, ids, -1)  # [T, K]
            channel.send_async(layer, x, mine, weights)
            sent.append(channel)
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for channel in sent:
            out += channel.wait_async().to(torch.float32)
        return out.to(x.dtype)

    def finish(self, done: torch.cuda.Event, timeout_s: float | None = None) -> None:
        """Waits until ``done`` (recorded after a replay) while watching the servers; see the module doc."""
        timeout_s = self.experts.options.request_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        failed: dict[int, str] = {}
        next_check = 0.0
        while not done.query():
            now = time.monotonic()
            if now >= next_check:
                next_check = now + LIVENESS_CHECK_S
                for index, channel in self.channels.items():
                    if index not in failed and not channel.server_alive():
                        failed[index] = "the server process is gone"
                if now >= deadline:
                    for index in self.channels:
                        failed.setdefault(index, f"no answer within {timeout_s:.1f} s")
            for index in failed:
                self.channels[index].abandon_wait()
            time.sleep(0)
        for index, reason in failed.items():
            self.experts._mark_dead(index, f"captured step: {reason}")
        if failed:
            raise CapturedStepFailed([self.experts.table.ordinals[i] for i in sorted(failed)])
        for index, channel in self.channels.items():
            count = channel.refusals()
            if count != self.refusals[index]:
                self.refusals[index] = count
                error = channel.last_refusal()
                ordinal = self.experts.table.ordinals[index]
                raise RemoteError(
                    error.status, f"server {ordinal} refused a captured request: {error.message}"
                )
