"""The endpoint's sleep between rounds follows what is pending (connector/pacing.py)."""

from __future__ import annotations

from dataclasses import replace

from kvferry.connector.config import KvferryConfig
from kvferry.connector.pacing import Load, next_wait

CFG = KvferryConfig.from_extra({"poll_min_s": 0.0002, "poll_max_s": 0.01, "idle_tick_s": 1.0})
IDLE = Load(active=False, writing=False, receiving=False, pending=False, connecting=False)


def test_nothing_pending_sleeps_the_idle_tick():
    assert next_wait(CFG, IDLE, 0.01) == 1.0


def test_activity_or_a_write_in_flight_polls_at_full_rate():
    assert next_wait(CFG, replace(IDLE, active=True), 1.0) == 0.0002
    assert next_wait(CFG, replace(IDLE, writing=True, pending=True), 0.01) == 0.0002


def test_receives_back_off_to_8x_the_minimum_other_pending_work_to_the_maximum():
    waits, interval = [], 0.0002
    for _ in range(8):
        interval = next_wait(CFG, replace(IDLE, receiving=True, pending=True), interval)
        waits.append(interval)
    assert waits[0] == 0.0004 and waits[-1] == 0.0016
    assert next_wait(CFG, replace(IDLE, pending=True), 0.008) == 0.01


def test_a_connecting_peer_is_polled_even_with_nothing_pending():
    assert next_wait(CFG, replace(IDLE, connecting=True), 1.0) == 0.01


def test_a_consumer_driven_by_engine_steps_polls_on_its_own_only_as_a_backstop():
    driven = replace(IDLE, receiving=True, pending=True, driven=True)
    assert next_wait(CFG, driven, 0.0002) == 0.01
    assert next_wait(CFG, replace(driven, active=True), 0.0002) == 0.01  # the next step takes the news
    assert next_wait(CFG, replace(driven, connecting=True, active=True), 1.0) == 0.0002  # a peer wires up
    assert next_wait(CFG, replace(driven, writing=True), 0.01) == 0.0002
