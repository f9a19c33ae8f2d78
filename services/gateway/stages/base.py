"""What every stage is: a class with ``admit`` and ``finish``, both no-ops unless a
stage overrides them. The pipeline runs ``finish`` only for the stages that override
it, and spawns nothing after a request none of whose admitted stages does."""

from __future__ import annotations

from llmesh.gateway.context import Context


class Stage:
    # True: ``finish`` also hears of the requests a front refused before any stage ran (a body
    # unreadable, over the limit or breaking the protocol's rules; ``Pipeline.refused``), with
    # nothing but the record's outcome and the request's id, operation and client id (the audit).
    front_refusals: bool = False

    async def admit(self, ctx: Context) -> None:
        """Refuse the request (raise a LlmeshError), rewrite it (``ctx.req = ...``),
        annotate the record or headers, add an output filter (``ctx.filters``) or wrap
        the upstream (``ctx.wrap``). Keep what ``finish`` needs in a ``Slot``."""

    async def finish(self, ctx: Context) -> None:
        """The outcome is in ``ctx.record``. Called in the background once the request
        is over, for every stage whose ``admit`` ran (also when it refused), last first."""

    async def drain(self) -> None:
        """Waits for work this stage started for requests that are over (the cache's
        stores); the pipeline's ``drain`` calls it."""


def finishes(stage: object) -> bool:
    """The stage has a ``finish`` of its own (one not inherited from ``Stage``)."""
    return getattr(type(stage), "finish", Stage.finish) is not Stage.finish
