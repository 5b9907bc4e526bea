"""identity: decode's registration carries digests of its prompt tokens and its weights' identity,
computed from what vLLM's scheduler and config hold; prefill's match exactly when both legs ran the
same tokens (sliding windows included: prefill's prompt is one token shorter) and the same weights."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from kvferry.connector.actions import Reject, SendFailure, StartWrite  # noqa: E402
from kvferry.connector.config import KvferryConfig  # noqa: E402
from kvferry.connector.identity import model_digest, tokens_digest  # noqa: E402
from kvferry.connector.protocol import ProducerCore  # noqa: E402
from kvferry.connector.scheduler import KvferryScheduler  # noqa: E402
from kvferry.connector.wire import Registration  # noqa: E402
from kvferry.connector.worker import model_identity  # noqa: E402
from kvferry.contracts.params import ConsumerParams, ProducerParams  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402

DECODE = ConsumerParams("abc", 0, "prefill-0", "127.0.0.1", 5600, 1, 30.0).kv_transfer_params()
PREFILL = ProducerParams("abc", 0, "decode-0", 30.0).kv_transfer_params()
BLOCKS = SimpleNamespace(get_block_ids=lambda: ([4, 5, 6, 7, 8, 9, 10],))
CFG = KvferryConfig.from_extra({"backends": ["UCX"]})


def request(params, prompt, status=RequestStatus.WAITING):
    ids = list(prompt)
    return SimpleNamespace(
        request_id="cmpl-abc",
        kv_transfer_params=copy.deepcopy(params),
        prompt_token_ids=ids,
        _all_token_ids=list(ids),
        num_prompt_tokens=len(ids),
        num_computed_tokens=0,
        max_tokens=16,
        status=status,
        get_skip_reading_prefix_cache=lambda: False,
    )


def prefill_leg(prompt, windows):
    s = KvferryScheduler(CFG, is_producer=True, windows=windows)
    r = request(PREFILL, prompt)
    s.on_new_request(r)
    r.status = RequestStatus.FINISHED_LENGTH_CAPPED
    s.request_finished(r, ([1, 2, 3, 4, 5, 6, 7],))
    (f,) = s.build_connector_meta(None).finished
    return f


def decode_leg(prompt, windows):
    s = KvferryScheduler(CFG, is_producer=False, windows=windows)
    r = request(DECODE, prompt)
    count, _ = s.get_num_new_matched_tokens(r, 0)
    s.update_state_after_alloc(r, BLOCKS, count)
    (e,) = s.build_connector_meta(None).expects
    return e


def registration(e):
    digest = tokens_digest(e.token_ids, e.num_tokens)
    return Registration(
        "abc", 0, "decode-0", 0, 1, "h", 1, "i", e.num_tokens, [[4]], "", "", 0.0, 0, digest, ""
    )


PROMPT = list(range(500, 600))


@pytest.mark.parametrize("windows", [(0,), (64,)], ids=["full-attention", "sliding-window"])
def test_the_same_prompt_on_both_legs_is_written_and_another_is_refused(windows):
    f = prefill_leg(PROMPT, windows)
    assert f.num_tokens == len(f.token_ids) == 100 - (1 if any(windows) else 0)
    for consumer_prompt, want in [(PROMPT, StartWrite), ([*PROMPT[:50], 7, *PROMPT[51:]], SendFailure)]:
        e = decode_leg(consumer_prompt, windows)
        assert e.num_tokens == f.num_tokens and e.token_ids == consumer_prompt[: e.num_tokens]
        p = ProducerCore(total_heads=4, rank=0, tp_size=1)
        p.prefill_finished(("abc", 0), [[1]], f.num_tokens, "decode-0", 0.0, tuple(f.token_ids))
        out = p.registration(registration(e), now=0.1)
        assert want in [type(a) for a in out], out
        if want is SendFailure:  # e.g. a chat template or tokenizer on one role only
            assert [a.reason for a in out if isinstance(a, Reject | SendFailure)] == ["token_mismatch"] * 2


def config(**model):
    fields = {"model": "/models/m", "revision": None, "tokenizer": "/models/m", "dtype": "torch.bfloat16"}
    return SimpleNamespace(model_config=SimpleNamespace(**{**fields, **model}))


def test_the_model_identity_covers_weights_and_tokenizer_and_nothing_else():
    base = model_digest(model_identity(config()))
    assert model_digest(model_identity(config(max_model_len=4096, seed=3))) == base  # not identity
    changes = [{"tokenizer": "/models/other"}, {"revision": "abc"}, {"quantization": "fp8"}]
    changes += [{"dtype": "torch.float16"}, {"hf_overrides": {"rope_scaling": {"factor": 2}}}]
    for change in changes:
        assert model_digest(model_identity(config(**change))) != base, change

    def override(cfg):  # a callable override is identified by its name, not its address
        return cfg

    assert model_digest(model_identity(config(hf_overrides=override))) == model_digest(
        model_identity(config(hf_overrides=override))
    )
