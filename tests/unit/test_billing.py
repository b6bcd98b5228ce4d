"""bill_request against bills computed by hand: each prompt once, cached tokens the fewest any
of a prompt's choices found, undelivered = computed - delivered, cost from busy seconds and
revenue from list prices."""

from __future__ import annotations

import pytest

from engine.meter.billing import Bill, ChoiceReading, Prices, bill_request
from scheduler.request import RequestCost

PRICES = Prices(input_per_million=0.5, output_per_million=2.0)
PRICE_PER_SECOND = 0.001


def _reading(
    prompt_index: int = 0,
    *,
    cached: int = 0,
    computed: int = 0,
    delivered: int = 0,
    cost: RequestCost | None = None,
) -> ChoiceReading:
    return ChoiceReading(
        prompt_index=prompt_index,
        num_cached_tokens=cached,
        num_computed_tokens=computed,
        num_delivered_tokens=delivered,
        cost=cost if cost is not None else RequestCost(),
    )


def test_a_prompt_shared_by_two_choices_is_counted_once():
    choices = [
        _reading(0, cached=3, computed=3, delivered=3),
        _reading(0, cached=3, computed=4, delivered=4),
    ]
    bill = bill_request([7], choices, PRICES, PRICE_PER_SECOND)
    assert bill.prompt_tokens == 7  # not 14
    assert bill.cached_tokens == 3  # not 6
    assert bill.completion_tokens == 7  # both choices' deliveries


def test_several_prompts_each_count_once_with_their_own_cached_tokens():
    choices = [
        _reading(0, cached=3, computed=2, delivered=2),
        _reading(0, cached=3, computed=2, delivered=2),
        _reading(1, cached=2, computed=5, delivered=5),
        _reading(1, cached=2, computed=1, delivered=1),
    ]
    bill = bill_request([7, 5], choices, PRICES, PRICE_PER_SECOND)
    assert bill.prompt_tokens == 12
    assert bill.cached_tokens == 3 + 2
    assert bill.completion_tokens == 10


@pytest.mark.parametrize("order", [(4, 1, 3), (1, 4, 3), (4, 3, 1)])
def test_cached_tokens_are_the_fewest_any_choice_of_the_prompt_found(order):
    # The first choice seen is not special: the minimum wins wherever it comes.
    choices = [_reading(0, cached=cached) for cached in order]
    choices.append(_reading(1, cached=2))
    bill = bill_request([8, 6], choices, PRICES, PRICE_PER_SECOND)
    assert bill.cached_tokens == 1 + 2


def test_undelivered_is_computed_minus_delivered_and_never_negative():
    choices = [
        _reading(0, computed=5, delivered=3),  # a stop string matched 2 tokens early: 2
        _reading(0, computed=4, delivered=4),  # all delivered: 0
        _reading(0, computed=2, delivered=4),  # more delivered than computed: 0, not -2
        _reading(0, computed=3, delivered=0),  # the client left before any: 3
    ]
    bill = bill_request([7], choices, PRICES, PRICE_PER_SECOND)
    assert bill.undelivered_tokens == 2 + 0 + 0 + 3
    assert bill.completion_tokens == 3 + 4 + 4 + 0


def test_cost_is_busy_seconds_times_the_hardware_price():
    choices = [
        _reading(0, cost=RequestCost(prefill_seconds=0.25, decode_seconds=0.5,
                                     prefill_flops=2e9, decode_flops=1e9)),
        _reading(0, cost=RequestCost(prefill_seconds=0.125, decode_seconds=0.125,
                                     prefill_flops=5e8, decode_flops=5e8)),
    ]  # fmt: skip
    bill = bill_request([7], choices, PRICES, 0.002)
    assert bill.prefill_seconds == 0.375
    assert bill.decode_seconds == 0.625
    assert bill.busy_seconds == 1.0
    assert bill.cost_usd == pytest.approx(0.002)
    assert bill.flops == 4e9


def test_revenue_is_prompt_and_completion_tokens_at_list_prices_per_million():
    choices = [_reading(0, delivered=6), _reading(1, delivered=4)]
    bill = bill_request([7, 5], choices, Prices(1.0, 4.0), PRICE_PER_SECOND)
    # 12 prompt tokens at 1 $/M and 10 completion tokens at 4 $/M.
    assert bill.revenue_usd == pytest.approx((12 * 1.0 + 10 * 4.0) / 1e6)
    assert bill_request([7, 5], choices, PRICES, 1.0).revenue_usd == pytest.approx(
        (12 * 0.5 + 10 * 2.0) / 1e6
    )


def test_a_choice_without_cost_contributes_no_seconds_but_its_tokens_count():
    reported = RequestCost(prefill_seconds=0.5, decode_seconds=0.25, prefill_flops=3e9)
    choices = [
        _reading(0, cached=2, computed=3, delivered=3, cost=reported),
        ChoiceReading(0, num_cached_tokens=2, num_computed_tokens=0, num_delivered_tokens=2,
                      cost=None),  # the engine never reported back
    ]  # fmt: skip
    bill = bill_request([7], choices, PRICES, PRICE_PER_SECOND)
    assert bill.prefill_seconds == 0.5
    assert bill.decode_seconds == 0.25
    assert bill.flops == 3e9
    assert bill.cost_usd == pytest.approx(0.75 * PRICE_PER_SECOND)
    assert bill.completion_tokens == 5  # what the client got is billed all the same
    assert bill.prompt_tokens == 7


def test_a_bill_with_nothing_in_it_is_all_zeros():
    assert bill_request([], [], PRICES, PRICE_PER_SECOND) == Bill(
        prompt_tokens=0,
        cached_tokens=0,
        completion_tokens=0,
        undelivered_tokens=0,
        prefill_seconds=0.0,
        decode_seconds=0.0,
        flops=0.0,
        cost_usd=0.0,
        revenue_usd=0.0,
    )
