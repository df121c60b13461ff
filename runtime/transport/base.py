"""What every transport provides: a server side that owns slots and a client side (``Channel``).

Server side (one per transport per expert server; used by the server loop thread, except
``attach``/``detach``/``slots`` which the control plane calls from its own thread):
``attach`` hands a client a slot and the handle it needs to reach it; ``poll`` returns requests
whose frames are complete; ``wait`` blocks until one may be (a server offering several
transports waits in one of them, which ``watch``es the others' ``wakeup_fd``); ``respond`` has
the loop write the response into the slot and publishes it, unless the slot changed hands since;
``reap`` releases slots of clients that disappeared (their slot goes ``OFFLINE``).

Client side: a ``Channel`` is one client's slot on one server. ``send`` writes a request,
``receive`` waits for its response. A transport whose server must know the client's memory
before it grants a slot (``nixl``: the client's NIXL agent and answer area) has the client make an
``Offer`` first; its ``body`` goes with the handshake and ``attach`` reads it. Connection-level
failures raise ``ChannelError``; an error status answered by the server raises ``RemoteError``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from eaas.runtime.protocol import PAYLOAD_OFFSET, SlotHeader, Status


class ChannelError(ConnectionError):
    """The server cannot be reached through this channel any more (the client fails over)."""


class ChannelClosed(ChannelError):
    """The server closed the connection or died."""


class ChannelTimeout(ChannelError):
    """No response before the deadline."""


class SlotsExhausted(RuntimeError):
    """Every slot of the server is attached (the control plane answers 503)."""


class OfferRefused(ValueError):
    """The client's offer in a handshake cannot be used (the control plane answers 400, naming the field)."""


class RemoteError(RuntimeError):
    """The server refused a request with an error status (a bug or a stale placement, not a fault)."""

    def __init__(self, status: int, message: str) -> None:
        name = Status(status).name if status in Status._value2member_map_ else str(status)
        super().__init__(f"expert server answered {name}: {message}")
        self.status = status
        self.message = message


@dataclass(frozen=True)
class TransportOptions:
    """Server-side settings shared by every transport."""

    max_clients: int  # slots
    capacity_bytes: int  # payload bytes per slot
    host: str = "127.0.0.1"  # tcp: address to listen on
    tcp_port: int = 0  # tcp: 0 = any free port
    tag: str = "server"  # shm: part of the segment name
    attach_grace_s: float = 5.0  # a slot attached but never claimed is released after this
    device: str = "cpu"  # where the server computes; the GPU transports put their slots there


@dataclass
class Request:
    """A complete request in a slot. ``header`` is raw (unvalidated); ``slot_buffer`` is the whole slot.

    ``payload`` is where the request's tensors are and the response's go: the slot's payload
    bytes by default, device memory (a uint8 tensor) for the GPU transports. Error messages
    always go to ``slot_buffer[PAYLOAD_OFFSET:]``.
    """

    transport: str
    slot: int
    generation: int  # the slot's attach count, so a response never lands in a re-used slot
    header: SlotHeader
    slot_buffer: memoryview
    payload: memoryview | torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.payload is None:
            self.payload = self.slot_buffer[PAYLOAD_OFFSET:]


class ServerTransport(ABC):
    name: ClassVar[str]

    def __init__(self, options: TransportOptions) -> None:
        self.options = options

    @abstractmethod
    def attach(self, client_id: str, offer: dict[str, Any] | None = None) -> dict[str, Any]:
        """Allocates a slot to ``client_id``; returns its JSON handle (with ``transport`` and ``slot``).

        ``offer`` is the client's ``Offer.body`` (transports that need none ignore it); one that
        cannot be used raises ``OfferRefused`` and allocates nothing."""

    @abstractmethod
    def detach(self, slot: int) -> bool:
        """Releases ``slot`` (it goes ``OFFLINE``); False if it was not attached."""

    @abstractmethod
    def poll(self) -> list[Request]:
        """Complete requests not handed out yet; never blocks."""

    @abstractmethod
    def wait(self, timeout_s: float) -> None:
        """Blocks up to ``timeout_s``, or until a request may be ready (then ``poll``)."""

    def describe(self) -> dict[str, Any]:
        """What the server's ``/v1/info`` says of this transport under ``transports``, for a client
        preparing its ``Offer`` (none by default)."""
        return {}

    @property
    def wakeup_fd(self) -> int | None:
        """A descriptor that turns readable when a request may be ready, for another transport to
        watch while it waits (None: this transport cannot be watched)."""
        return None

    def watch(self, fd: int) -> bool:
        """Also return from ``wait`` when ``fd`` turns readable (and drain it); False if unsupported."""
        return False

    @abstractmethod
    def respond(self, request: Request, answer: Callable[[], SlotHeader]) -> None:
        """Publishes the answer to ``request`` if its client still holds the slot: ``answer()``
        writes the payload (into ``request.payload``; an error's message into ``slot_buffer``) and
        returns its header. It is called only then, with the slot held: a slot released while the
        loop computed (its client left, timed out, was reaped) may already be its next holder's,
        with that holder's request in it, which an answer for the one before must not overwrite."""

    @abstractmethod
    def reap(self) -> list[int]:
        """Releases slots whose client is gone; returns them."""

    @abstractmethod
    def slots(self) -> list[dict[str, Any]]:
        """Attached slots: ``slot``, ``client_id``, ``state`` name, ``requests``."""

    @abstractmethod
    def close(self) -> None: ...


class Offer(ABC):
    """What a client prepares before the handshake (its own registered memory, say) and describes
    to the server in ``body``; ``Channel.connect`` takes it over, or ``close`` frees it."""

    body: dict[str, Any]

    @abstractmethod
    def close(self) -> None: ...


class Channel(ABC):
    """One client's slot on one server."""

    name: ClassVar[str]
    capacity_bytes: int
    needs_offer: ClassVar[bool] = False  # True: call ``offer`` before the handshake

    @classmethod
    def offer(cls, capacity_bytes: int, server: dict[str, Any] | None = None) -> Offer:
        """The client's side prepared for a server whose slots hold ``capacity_bytes`` of payload;
        ``server`` is what its ``/v1/info`` says of this transport (``ServerTransport.describe``)."""
        raise NotImplementedError(f"transport {cls.name} makes no offer")

    @classmethod
    @abstractmethod
    def connect(
        cls, handle: dict[str, Any], host: str, timeout_s: float, offer: Offer | None = None
    ) -> Channel:
        """Opens the slot of ``handle`` (from the server's handshake) on the server at ``host``
        (with the ``offer`` made before the handshake, for transports that need one)."""

    @abstractmethod
    def send(self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> None:
        """Writes a request: x [T, H], ids [T, K] (-1 = not here), weights [T, K]. Raises ``ChannelError``."""

    def staging(
        self, num_tokens: int, hidden: int, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor | None:
        """Where the next request's x [T, H] may be built in place, or None (the default: build it
        anywhere, ``send`` copies or streams it from there).

        A transport that sends from memory of its own (``shm``'s slot, ``nixl``'s registered send
        area) returns a view of where x goes in it: a caller that gathers x straight into it
        (``torch.index_select(..., out=...)``) and passes that view to ``send`` saves a copy of x.
        The view is valid until the next ``send``; None when x of that size and device cannot go
        there."""
        return None

    @abstractmethod
    def receive(self, deadline: float) -> torch.Tensor:
        """Waits (until ``time.monotonic()`` reaches ``deadline``) for the response y [T, H].

        An answer that is already there is returned even when the deadline has passed. The tensor
        aliases the channel's buffer: use it before the next ``send``.
        """

    def answered(self) -> bool:
        """Never blocks: True when ``receive`` would return or fail at once (the answer, or a sign
        that the server is gone, is there). A client waiting on several servers calls it to take
        each answer as it comes. The default (True) makes such a client just call ``receive``."""
        return True

    def wakeup_fd(self) -> int | None:
        """A descriptor that turns readable when ``answered`` may have turned True (None: poll)."""
        return None

    def clear_wakeup(self) -> None:  # noqa: B027 - most channels have nothing to drain
        """Drains ``wakeup_fd`` after it turned readable (for descriptors that are only signals)."""

    def poll_interval_s(self) -> float:
        """For channels without ``wakeup_fd``: how long a waiter may sleep between ``answered`` calls."""
        return 0.0

    @abstractmethod
    def close(self) -> None: ...
