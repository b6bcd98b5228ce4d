"""RequestGroup: finish reasons as the client got them, completeness, the bill over its
engine requests (a shared prompt once), and next_event's timeout and failure paths."""

from __future__ import annotations

import asyncio

import pytest

from engine.meter.billing import Prices
from scheduler.output import TokenEvent
from scheduler.request import RequestCost, RequestTimes
from scheduler.sampling_params import SamplingParams
from server.engine_client.request_group import (
    CLIENT_LEFT,
    FAILED,
    TIMED_OUT,
    BillingAccount,
    EngineRequestSpec,
    RequestGroup,
)
from server.http.errors import OpenAIError

ACCOUNT = BillingAccount("acme", Prices(1.0, 4.0))


def _specs(prompt_lengths: list[int], n: int) -> list[EngineRequestSpec]:
    """n choices per prompt, in the server's order: choice i belongs to prompt i // n."""
    return [
        EngineRequestSpec(f"r{p}-{c}", list(range(length)), SamplingParams(), prompt_index=p)
        for p, length in enumerate(prompt_lengths)
        for c in range(n)
    ]


def _group(prompt_lengths: list[int], n: int = 1, deadline: float | None = None, **kwargs):
    return RequestGroup(_specs(prompt_lengths, n), deadline, ACCOUNT, **kwargs)


def _final(
    request_id: str, reason: str, *, cached: int, output: int, cost: RequestCost | None
) -> TokenEvent:
    return TokenEvent(
        request_id=request_id,
        new_token_ids=[],
        finish_reason=reason,
        num_cached_tokens=cached,
        num_output_tokens=output,
        times=RequestTimes(arrival=1.0, finished=2.0),
        cost=cost,
    )


def test_unfinished_choices_take_the_groups_end_reason():
    group = _group([4], n=3)
    group.finish_reasons[0] = "stop"
    group.finish_reasons[2] = "length"
    assert group.end_reason == CLIENT_LEFT
    assert group.client_finish_reasons() == ["stop", "abort", "length"]
    group.end_reason = TIMED_OUT
    assert group.client_finish_reasons() == ["stop", "timeout", "length"]
    group.end_reason = FAILED
    assert group.client_finish_reasons() == ["stop", "error", "length"]


def test_complete_once_every_engine_request_sent_its_final_event():
    group = _group([4], n=2)
    assert not group.complete
    group.final_events[1] = _final("r0-1", "stop", cached=0, output=1, cost=RequestCost())
    assert not group.complete
    group.final_events[0] = _final("r0-0", "abort", cached=0, output=0, cost=RequestCost())
    assert group.complete


def test_the_bill_counts_a_prompt_shared_by_n_choices_once():
    group = _group([7, 5], n=2)  # choices r0-0, r0-1 (prompt 0) and r1-0, r1-1 (prompt 1)
    costs = [RequestCost(prefill_seconds=0.25, decode_seconds=0.125, prefill_flops=1e9)] * 4
    for index, (cached, output) in enumerate([(3, 4), (4, 4), (0, 2), (1, 3)]):
        spec = group.specs[index]
        group.final_events[index] = _final(
            spec.request_id, "stop", cached=cached, output=output, cost=costs[index]
        )
    group.delivered[:] = [3, 4, 2, 1]
    bill = group.bill(hardware_price_per_second=0.002)
    assert bill.prompt_tokens == 7 + 5  # not 2 * (7 + 5)
    assert bill.cached_tokens == min(3, 4) + min(0, 1)
    assert bill.completion_tokens == 10
    assert bill.undelivered_tokens == 1 + 0 + 0 + 2
    assert bill.busy_seconds == 4 * 0.375
    assert bill.cost_usd == pytest.approx(1.5 * 0.002)
    assert bill.flops == 4e9
    assert bill.revenue_usd == pytest.approx((12 * 1.0 + 10 * 4.0) / 1e6)


def test_prompts_are_told_apart_by_prompt_index_not_by_their_tokens():
    # Two identical prompts are two prompts: each is billed.
    group = _group([6, 6], n=1)
    assert group.specs[0].prompt_token_ids == group.specs[1].prompt_token_ids
    assert group.bill(0.0).prompt_tokens == 12


def test_a_choice_without_a_final_event_bills_its_deliveries_and_no_seconds():
    group = _group([7], n=2)
    group.final_events[0] = _final(
        "r0-0", "stop", cached=3, output=2, cost=RequestCost(prefill_seconds=0.5)
    )
    group.delivered[:] = [2, 1]  # the second choice's engine never reported back
    bill = group.bill(hardware_price_per_second=1.0)
    assert bill.prompt_tokens == 7
    assert bill.cached_tokens == 0  # the fewest any choice found: none reported any
    assert bill.completion_tokens == 3
    assert bill.undelivered_tokens == 0
    assert bill.busy_seconds == 0.5
    assert bill.cost_usd == 0.5


def test_the_settlement_carries_tenant_bill_reasons_and_final_events():
    group = _group([7], n=2)
    final = _final("r0-0", "length", cached=0, output=2, cost=RequestCost())
    group.final_events[0] = final
    group.finish_reasons[0] = "length"
    group.delivered[0] = 2
    group.end_reason = TIMED_OUT
    settlement = group.settlement(hardware_price_per_second=0.001)
    assert settlement.tenant == "acme"
    assert settlement.bill == group.bill(0.001)
    assert settlement.finish_reasons == ["length", "timeout"]
    assert settlement.final_events == [final, None]
    assert settlement.final_events is not group.final_events  # a copy, not the live list


async def test_next_event_returns_events_in_order_and_counts_their_tokens():
    group = _group([3], n=2)
    first = TokenEvent("r0-1", new_token_ids=[5])
    second = TokenEvent("r0-0", new_token_ids=[6, 7])
    group.queue.put_nowait((1, first))
    group.queue.put_nowait((0, second))
    assert await group.next_event() == (1, first)
    assert await group.next_event() == (0, second)
    assert group.num_tokens_seen == 3
    assert group.end_reason == CLIENT_LEFT


async def test_without_a_deadline_next_event_waits_for_the_next_item():
    group = _group([3])
    event = TokenEvent("r0-0", new_token_ids=[1])
    asyncio.get_running_loop().call_later(0.01, group.queue.put_nowait, (0, event))
    assert await group.next_event() == (0, event)


async def test_next_event_past_the_deadline_raises_408_and_ends_the_group_as_timeout():
    timeouts: list[None] = []
    loop = asyncio.get_running_loop()
    group = _group([3], deadline=loop.time() + 0.01, on_timeout=lambda: timeouts.append(None))
    group.queue.put_nowait((0, TokenEvent("r0-0", new_token_ids=[1, 2])))
    await group.next_event()  # before the deadline
    with pytest.raises(OpenAIError) as caught:
        await group.next_event()
    assert caught.value.status == 408
    assert caught.value.code == "request_timeout"
    assert caught.value.type == "timeout_error"
    assert "(2 tokens had been generated)" in caught.value.message
    assert group.end_reason == TIMED_OUT
    assert group.client_finish_reasons() == ["timeout"]
    assert timeouts == [None]  # the rejection hook ran once


async def test_a_server_error_on_the_queue_ends_the_group_as_error_and_is_raised():
    group = _group([3], n=2)
    error = OpenAIError(503, "server is shutting down", code="server_shutdown")
    group.queue.put_nowait(error)
    with pytest.raises(OpenAIError) as caught:
        await group.next_event()
    assert caught.value is error
    assert group.end_reason == FAILED
    assert group.client_finish_reasons() == ["error", "error"]
