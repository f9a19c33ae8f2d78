import asyncio

import pytest

from llmesh.errors import Unavailable
from llmesh.streams import coalesce
from llmesh.types import Delta, Finish, FinishReason, Usage


async def source(items, gate: asyncio.Event | None = None, fail: Exception | None = None):
    for item in items:
        yield item
    if gate is not None:
        await gate.wait()
    if fail is not None:
        raise fail


async def test_items_pass_one_by_one_when_the_consumer_keeps_up():
    async def slow():
        for i in range(3):
            yield Delta(f"t{i}", 1)
            await asyncio.sleep(0.01)
        yield Finish(FinishReason.STOP, Usage(1, 3))

    out = [item async for item in coalesce(slow())]
    assert [i.text for i in out[:-1]] == ["t0", "t1", "t2"]
    assert isinstance(out[-1], Finish)


async def test_a_lagging_consumer_gets_merged_deltas_with_summed_tokens():
    items = [Delta("a", 1), Delta("b", 1), Delta("c", 2), Finish(FinishReason.LENGTH, Usage(2, 4))]
    stream = coalesce(source(items))
    first = await anext(stream)
    await asyncio.sleep(0.01)  # let the rest pile up
    rest = [i async for i in stream]
    merged = [first, *rest]
    assert "".join(i.text for i in merged if isinstance(i, Delta)) == "abc"
    assert sum(i.tokens for i in merged if isinstance(i, Delta)) == 4
    assert len(merged) < len(items)
    assert merged[-1] == items[-1]


async def test_source_errors_reach_the_consumer_after_earlier_items():
    stream = coalesce(source([Delta("a", 1)], fail=Unavailable("gone")))
    assert (await anext(stream)).text == "a"
    with pytest.raises(Unavailable):
        await anext(stream)


async def test_closing_early_closes_the_source():
    closed = asyncio.Event()

    async def endless():
        try:
            while True:
                yield Delta("x", 1)
                await asyncio.sleep(0)
        finally:
            closed.set()

    stream = coalesce(endless())
    await anext(stream)
    await stream.aclose()
    assert closed.is_set()
