"""The P/D client's comparison (e2e tier and GPU check) accepts greedy outputs parting only at a numeric
tie of the reference."""

from __future__ import annotations

from kvferry.tools.pdclient import TIE_LOGPROB, compare_greedy, top2_gaps

WANT = {"a": {"token_ids": [1, 2, 3, 4], "text": "w"}}
GAPS = {"a": [0.5, TIE_LOGPROB / 4, 0.7, 0.1]}


def test_equal_outputs_pass() -> None:
    assert compare_greedy(WANT, {"a": dict(WANT["a"])}, GAPS) == ([], [])


def test_parting_at_a_tie_is_accepted_and_reported() -> None:
    mismatches, ties = compare_greedy(WANT, {"a": {"token_ids": [1, 9, 8, 7], "text": "g"}}, GAPS)
    assert mismatches == [] and len(ties) == 1 and "token 1" in ties[0]


def test_parting_where_the_reference_was_sure_is_a_mismatch() -> None:
    mismatches, ties = compare_greedy(WANT, {"a": {"token_ids": [9, 2, 3, 4], "text": "g"}}, GAPS)
    assert ties == [] and "token 0 is 9, reference 1" in mismatches[0]


def test_same_tokens_other_text_or_length_is_a_mismatch() -> None:
    assert compare_greedy(WANT, {"a": {"token_ids": [1, 2, 3, 4], "text": "x"}}, GAPS)[0]
    assert compare_greedy(WANT, {"a": {"token_ids": [1, 2, 3], "text": "w"}}, GAPS)[0]


def test_gaps_from_completion_and_chat_logprobs() -> None:
    completion = {"logprobs": {"top_logprobs": [{"x": -1.0, "y": -1.5}, {"z": -2.0}]}}
    assert top2_gaps(completion) == [0.5, float("inf")]
    chat = {"logprobs": {"content": [{"top_logprobs": [{"logprob": -3.0}, {"logprob": -2.0}]}]}}
    assert top2_gaps(chat) == [1.0]


def test_a_parting_at_a_tie_with_another_length_is_a_mismatch() -> None:
    mismatches, ties = compare_greedy(WANT, {"a": {"token_ids": [1, 9, 8], "text": "g"}}, GAPS)
    assert ties == [] and "3 tokens, reference 4" in mismatches[0]


def test_chat_without_logprobs_has_no_gaps() -> None:
    assert top2_gaps({"logprobs": None}) == [] and top2_gaps({}) == []
