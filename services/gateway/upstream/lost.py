"""An engine that went away under a request before its first token (its process killed or
crashed): the request may be what killed it (a poison pill), so it goes to no other engine
yet. It waits for that same endpoint to come back (``llmesh up`` or the kubelet restarts
it; the scheduler's table says so), at most ``hold_s`` and never past its deadline, and is
then tried there once more. An endpoint that is not back within the hold is presumed gone
for reasons of its own (its node lost): the request may then go to another engine, as an
ordinary retry.

"Back" means: in the scheduler's table and healthy in a new incarnation (it left the table,
or turned unhealthy, after the loss and returned: ``EndpointPicker.appeared``), kept by the
picker's always-on filters (serves the model, healthy, not refusing connections here),
let through by its breaker, and this gateway's channel to it connected again (a channel that
saw its engine die waits out a reconnect backoff: a call before that would fail unsent, and
the request would go elsewhere). Waiting polls that state every ``poll_s``: no lock or event
is shared with the feed, and the rare request that waits costs one check per poll."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from llmesh.gateway.upstream.picking import EndpointPicker, Endpoint, PickInput
from llmesh.gateway.upstream.resilience import Breakers


class LostEngineHold:
    def __init__(self, picker: EndpointPicker, breakers: Breakers | None, connected: Callable[[str], bool],
                 hold_s: float, clock: Callable[[], float],
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep, poll_s: float = 0.05):
        self._picker = picker
        self._breakers = breakers
        self._connected = connected
        self.hold_s = hold_s
        self._clock = clock
        self._sleep = sleep
        self._poll_s = poll_s

    def incarnation(self, endpoint_id: str) -> int | None:
        """The endpoint's incarnation now (see ``EndpointPicker.appeared``): take it when the
        loss is seen, and pass it to ``back``."""
        return self._picker.appeared(endpoint_id)

    def routable(self, endpoint_id: str, model: str, seen: int | None) -> Endpoint | None:
        """The endpoint, when it is back since incarnation ``seen`` and may take ``model``'s
        request now; else None."""
        appeared = self._picker.appeared(endpoint_id)
        if appeared is None or appeared == seen:
            return None
        now = self._clock()
        if self._breakers is not None and endpoint_id in self._breakers.refusing(now):
            return None
        endpoint = self._picker.routable(endpoint_id, PickInput(model=model, now=now))
        return endpoint if endpoint is not None and self._connected(endpoint.address) else None

    async def back(self, endpoint_id: str, model: str, seen: int | None, deadline: float) -> bool:
        """Waits until the endpoint is back (True), or the hold or ``deadline`` runs out (False)."""
        until = min(self._clock() + self.hold_s, deadline)
        while self.routable(endpoint_id, model, seen) is None:
            left = until - self._clock()
            if left <= 0:
                return False
            await self._sleep(min(self._poll_s, left))
        return True
