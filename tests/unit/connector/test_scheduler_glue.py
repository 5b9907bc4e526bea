"""scheduler glue: bad params fail one request (never raise), producers hold blocks only while pushing,
and a one-step prefill leg is handed over right after its forward pass (early hand-off)."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm", reason="the scheduler glue runs inside vLLM")  # the connector extra has vLLM

from kvferry.connector.config import KvferryConfig  # noqa: E402
from kvferry.connector.scheduler import KvferryScheduler  # noqa: E402
from kvferry.contracts.params import ConsumerParams, ProducerParams  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402

# Without deadline_s, as a client may send them: the connector's configured deadline applies.
DECODE = ConsumerParams("abc", 0, "prefill-0", "127.0.0.1", 5600, 1, 30.0).kv_transfer_params()
PREFILL = ProducerParams("abc", 0, "decode-0", 30.0).kv_transfer_params()
del DECODE["kvferry"]["deadline_s"], PREFILL["kvferry"]["deadline_s"]


def request(params, status=RequestStatus.WAITING, n=300):
    return SimpleNamespace(
        request_id="cmpl-abc-0-1234",
        kv_transfer_params=copy.deepcopy(params),
        prompt_token_ids=list(range(n)),
        num_computed_tokens=0,
        status=status,
    )


BLOCKS = SimpleNamespace(get_block_ids=lambda: ([4, 5, 6],))


def test_consumer_registers_once_and_recomputes_after():
    s = KvferryScheduler(KvferryConfig.from_extra({"backends": ["UCX"]}), is_producer=False)
    req = request(DECODE)
    assert s.get_num_new_matched_tokens(req, 0) == (300, True)
    s.update_state_after_alloc(req, BLOCKS, 300)
    s.update_state_after_alloc(req, BLOCKS, 300)  # vLLM may call twice
    meta = s.build_connector_meta(None)
    assert [(e.req_id, e.block_ids, e.num_tokens) for e in meta.expects] == [
        (req.request_id, [[4, 5, 6]], 300)
    ]
    assert s.get_num_new_matched_tokens(req, 0) == (0, False)  # after a failure: local recompute
    assert s.build_connector_meta(None).expects == []


def test_malformed_consumer_params_fail_that_request_without_raising():
    s = KvferryScheduler(KvferryConfig.from_extra({"backends": ["UCX"]}), is_producer=False)
    bad = copy.deepcopy(DECODE)
    del bad["kvferry"]["producer"]["host"]
    req = request(bad)
    assert s.get_num_new_matched_tokens(req, 0) == (300, True)
    s.update_state_after_alloc(req, BLOCKS, 300)
    meta = s.build_connector_meta(None)
    assert meta.expects == [] and meta.invalid == [(req.request_id, meta.invalid[0][1])]
    assert "kvferry.producer.host is missing" in meta.invalid[0][1]


def test_consumer_abort_while_waiting_cancels():
    s = KvferryScheduler(KvferryConfig.from_extra({"backends": ["UCX"]}), is_producer=False)
    req = request(DECODE)
    s.get_num_new_matched_tokens(req, 0)
    s.update_state_after_alloc(req, BLOCKS, 300)
    s.build_connector_meta(None)
    req.status = RequestStatus.FINISHED_ABORTED
    assert s.request_finished(req, ([4, 5, 6],)) == (False, None)
    assert s.build_connector_meta(None).aborted == [("abc", 0)]


def test_producer_holds_blocks_only_for_pushed_finishes():
    s = KvferryScheduler(KvferryConfig.from_extra({"backends": ["UCX"], "lease_s": 30}), is_producer=True)
    done = request(PREFILL, RequestStatus.FINISHED_LENGTH_CAPPED)
    hold, params = s.request_finished(done, ([1, 2, 3],))
    assert hold and params["kvferry"]["request_id"] == "abc"
    assert s.has_pending_push_work()
    meta = s.build_connector_meta(None)
    assert [(f.req_id, f.block_ids, f.num_tokens) for f in meta.finished] == [
        (done.request_id, [[1, 2, 3]], 300)
    ]
    s.update_connector_output(SimpleNamespace(finished_sending={done.request_id}))
    assert not s.has_pending_push_work()
    aborted = request(PREFILL, RequestStatus.FINISHED_ABORTED)
    assert s.request_finished(aborted, ([1],)) == (False, None)
    assert s.build_connector_meta(None).aborted == [("abc", 0)]
    bad = request({"do_remote_decode": True}, RequestStatus.FINISHED_LENGTH_CAPPED)
    hold, params = s.request_finished(bad, ([1],))
    assert not hold and "kvferry is missing" in params["kvferry_error"]


def early_scheduler(enabled: bool = True) -> KvferryScheduler:
    cfg = KvferryConfig.from_extra({"backends": ["UCX"], "lease_s": 30})
    return KvferryScheduler(cfg, is_producer=True, early_handoff=enabled)


def prefill_leg(max_tokens: int = 1) -> SimpleNamespace:
    req = request(PREFILL)
    req.sampling_params = SimpleNamespace(max_tokens=max_tokens)
    return req


def step(req_id: str, tokens: int) -> SimpleNamespace:
    return SimpleNamespace(num_scheduled_tokens={req_id: tokens})


def test_a_one_step_prefill_leg_is_handed_over_in_its_own_step_and_only_once():
    s = early_scheduler()
    req = prefill_leg()
    s.update_state_after_alloc(req, BLOCKS, 0)
    meta = s.build_connector_meta(step(req.request_id, 300))
    assert [(f.req_id, f.block_ids, f.num_tokens, f.params.request_id) for f in meta.early] == [
        (req.request_id, [[4, 5, 6]], 300, "abc")
    ]
    assert meta.finished == []
    req.status = RequestStatus.FINISHED_LENGTH_CAPPED
    hold, params = s.request_finished(req, ([4, 5, 6],))
    assert hold and params["kvferry"]["pushing"] and s.has_pending_push_work()
    later = s.build_connector_meta(step("other", 1))
    assert later.finished == [] and later.early == [] and later.aborted == []
    s.update_connector_output(SimpleNamespace(finished_sending={req.request_id}))
    assert not s.has_pending_push_work() and s.pending()["early"] == 0


def test_an_early_prefill_aborted_afterwards_still_holds_its_blocks_until_sent():
    s = early_scheduler()
    req = prefill_leg()
    s.update_state_after_alloc(req, BLOCKS, 0)
    s.build_connector_meta(step(req.request_id, 300))
    req.status = RequestStatus.FINISHED_ABORTED  # the push may be in flight: blocks must stay
    assert s.request_finished(req, ([4, 5, 6],))[0] is True
    assert s.build_connector_meta(step("other", 1)).aborted == []


@pytest.mark.parametrize(
    ("enabled", "max_tokens", "scheduled"),
    [(False, 1, 300), (True, 2, 300), (True, 1, 200)],
    ids=["disabled", "not-a-prefill-leg", "chunked-prefill"],
)
def test_other_prefills_are_handed_over_when_they_finish(enabled, max_tokens, scheduled):
    s = early_scheduler(enabled)
    req = prefill_leg(max_tokens)
    s.update_state_after_alloc(req, BLOCKS, 0)
    assert s.build_connector_meta(step(req.request_id, scheduled)).early == []
    req.status = RequestStatus.FINISHED_LENGTH_CAPPED
    assert s.request_finished(req, ([4, 5, 6],))[0] is True
    assert [f.req_id for f in s.build_connector_meta(step("other", 1)).finished] == [req.request_id]


def test_a_second_decode_request_with_a_live_key_is_refused_and_the_first_is_kept():
    s = KvferryScheduler(KvferryConfig.from_extra({"backends": ["UCX"]}), is_producer=False)
    first, second = request(DECODE), request(DECODE)
    second.request_id = "cmpl-replayed"
    for req in (first, second):
        s.get_num_new_matched_tokens(req, 0)
        s.update_state_after_alloc(req, BLOCKS, 300)
    meta = s.build_connector_meta(None)
    assert [e.req_id for e in meta.expects] == [first.request_id]
    assert meta.invalid == [("cmpl-replayed", "duplicate kvferry key")]
    first.status = RequestStatus.FINISHED_STOPPED
    s.request_finished(first, ([4, 5, 6],))
    s.request_finished(second, ([4, 5, 6],))
    third = request(DECODE)  # once the first ended, the key may be used again (the worker guards quarantine)
    third.request_id = "cmpl-third"
    s.update_state_after_alloc(third, BLOCKS, 300)
    assert [e.req_id for e in s.build_connector_meta(None).expects] == ["cmpl-third"]


def test_a_second_prefill_with_a_live_key_frees_its_blocks_without_a_push():
    s = KvferryScheduler(KvferryConfig.from_extra({"backends": ["UCX"]}), is_producer=True)
    first = request(PREFILL, RequestStatus.FINISHED_LENGTH_CAPPED)
    second = request(PREFILL, RequestStatus.FINISHED_LENGTH_CAPPED)
    second.request_id = "cmpl-replayed"
    assert s.request_finished(first, ([1, 2, 3],))[0] is True
    hold, params = s.request_finished(second, ([7, 8],))
    assert not hold and params == {"kvferry_error": "duplicate kvferry key"}
    assert [f.req_id for f in s.build_connector_meta(None).finished] == [first.request_id]
    s.update_connector_output(SimpleNamespace(finished_sending={first.request_id}))
    assert s.pending()["keys"] == 0


def test_a_duplicate_early_prefill_is_not_handed_over():
    s = early_scheduler()
    first, second = prefill_leg(), prefill_leg()
    second.request_id = "cmpl-replayed"
    s.update_state_after_alloc(first, BLOCKS, 0)
    s.update_state_after_alloc(second, BLOCKS, 0)
    meta = s.build_connector_meta(
        SimpleNamespace(num_scheduled_tokens={first.request_id: 300, "cmpl-replayed": 300})
    )
    assert [f.req_id for f in meta.early] == [first.request_id]
    second.status = RequestStatus.FINISHED_LENGTH_CAPPED
    assert s.request_finished(second, ([4, 5, 6],))[0] is False


def test_a_decode_prefix_hit_registers_only_the_tokens_after_it():
    """vLLM asks with D's own (block-aligned) hit and sets num_computed_tokens only after the alloc
    call: the expectation must start at the hit and end at the prompt's end, not at hit + 0."""
    s = KvferryScheduler(KvferryConfig.from_extra({"backends": ["UCX"]}), is_producer=False)
    req = request(DECODE)
    assert s.get_num_new_matched_tokens(req, 128) == (172, True)
    all_blocks = SimpleNamespace(get_block_ids=lambda: ([1, 2, 3, 4, 5, 6, 7, 8, 9, 10],))
    s.update_state_after_alloc(req, all_blocks, 172)
    (e,) = s.build_connector_meta(None).expects
    assert (e.first_token, e.num_tokens, e.block_ids) == (128, 300, [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10]])
    assert s._hits == {}


def test_a_prefill_prefix_hit_is_still_handed_over_early_with_the_whole_prompt():
    """P computes only the tokens after its own hit in this step; its blocks hold the whole prompt."""
    s = early_scheduler()
    req = prefill_leg()
    s.update_state_after_alloc(req, BLOCKS, 0)
    req.num_computed_tokens = 128  # vLLM sets it after the alloc call, before building the metadata
    (f,) = s.build_connector_meta(step(req.request_id, 172)).early
    assert (f.req_id, f.num_tokens, f.block_ids) == (req.request_id, 300, [[4, 5, 6]])
