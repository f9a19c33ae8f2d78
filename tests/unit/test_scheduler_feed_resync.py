"""A restarted scheduler knows no engine until each reports again: for RESYNC_S after the
gateway's stream to it is back, engines the last table had and the new one lacks stay in
the gateway's table, so a scheduler restart under load never answers 503 (chaos suite:
19 of 781 requests did before). After the window, the scheduler's table is the truth."""

from __future__ import annotations

from llmesh.gateway.upstream.feed import SchedulerFeed
from llmesh.gateway.upstream.picking import Endpoint, EndpointPicker


def ep(eid: str, healthy: bool = True) -> Endpoint:
    return Endpoint(endpoint_id=eid, address=f"127.0.0.1:{1000 + len(eid)}", models=frozenset({"m"}),
                    healthy=healthy)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def feed_with(picker: EndpointPicker, clock: Clock) -> SchedulerFeed:
    async def resolve() -> str:
        return "unused:1"
    return SchedulerFeed(resolve, picker, clock=clock, resync_s=10.0)


def ids(picker: EndpointPicker) -> set[str]:
    return {e.endpoint_id for e in picker.all()}


def test_engines_missing_from_a_restarted_schedulers_table_stay_until_the_window_ends():
    picker, clock = EndpointPicker(), Clock()
    feed = feed_with(picker, clock)
    feed.apply([ep("a"), ep("b"), ep("c")], keep_until=0.0)  # the first stream: as it says
    keep_until = clock.now + 10.0  # the stream came back
    feed.apply([], keep_until)  # the restarted scheduler has heard from no engine yet
    assert ids(picker) == {"a", "b", "c"}
    feed.apply([ep("a", healthy=False)], keep_until)  # what it reports wins for the engines it names
    assert ids(picker) == {"a", "b", "c"} and not next(e for e in picker.all() if e.endpoint_id == "a").healthy
    clock.now += 10.5
    feed.apply([ep("a"), ep("b")], keep_until)  # after the window, the table is the scheduler's
    assert ids(picker) == {"a", "b"}


def test_the_first_stream_keeps_nothing():
    picker, clock = EndpointPicker(), Clock()
    feed = feed_with(picker, clock)
    feed.apply([ep("a"), ep("b")], keep_until=0.0)
    feed.apply([ep("a")], keep_until=0.0)
    assert ids(picker) == {"a"}
