"""Load bench statistics: seeded Poisson arrivals, percentiles, per-cell summaries and the table."""

from __future__ import annotations

import random

from kvferry.tools.loadbench import Result, arrivals, markdown, prompts, summarize


def test_arrivals_are_seeded_and_have_the_asked_mean_rate() -> None:
    a = arrivals(4.0, 2000, random.Random("s"))
    assert a == arrivals(4.0, 2000, random.Random("s"))
    assert a[0] == 0.0 and all(x < y for x, y in zip(a, a[1:], strict=False))
    assert abs((len(a) - 1) / a[-1] - 4.0) < 0.4


def test_prompts_have_exact_lengths_and_differ() -> None:
    batch = prompts(300, 3, 2000, random.Random(0))
    assert [len(p) for p in batch] == [300, 300, 300]
    assert batch[0][:16] != batch[1][:16], "no shared prefix between prompts"


def test_summary_counts_failures_and_reports_ms() -> None:
    results = [Result(True, ttft_s=0.010, tpot_s=0.002, e2e_s=0.1, tokens=32) for _ in range(9)]
    results.append(Result(False, error="HTTP 503"))
    cell = summarize(256, 2.0, results, wall_s=5.0)
    assert (cell.ok, cell.failed, cell.errors) == (9, 1, ["HTTP 503"])
    assert abs(cell.ttft_ms["p50"] - 10.0) < 1e-9 and abs(cell.tpot_ms["p99"] - 2.0) < 1e-9
    table = markdown([cell], "single")
    assert "| 256 | 2 | 9/1 | 10.0 / 10.0 | 2.00 / 2.00 | 100 | 1.80 |" in table


def test_the_api_key_goes_in_the_bearer_header_and_never_in_the_recorded_sweep() -> None:
    import asyncio
    import dataclasses

    import httpx
    from kvferry.tools.loadbench import Sweep

    seen: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.headers.get("authorization", ""))
        return httpx.Response(200)

    async def call(sweep: Sweep) -> None:
        async with sweep.client(transport=httpx.MockTransport(handler)) as client:
            await client.get("http://127.0.0.1:1/v1/models")

    asyncio.run(call(Sweep(url="u", api_key="s3cret")))
    asyncio.run(call(Sweep(url="u")))
    assert seen == ["Bearer s3cret", ""]
    assert "s3cret" not in repr(Sweep(url="u", api_key="s3cret"))
    assert [f.name for f in dataclasses.fields(Sweep) if not f.repr] == ["api_key"]


def test_a_missing_api_key_is_refused_naming_the_flag(capsys, monkeypatch) -> None:
    import pytest
    from kvferry.tools.loadbench import main

    monkeypatch.delenv("KVFERRY_TEST_NO_SUCH_KEY", raising=False)
    with pytest.raises(SystemExit) as exc:
        main(["--url", "http://127.0.0.1:1", "--api-key-env", "KVFERRY_TEST_NO_SUCH_KEY"])
    assert exc.value.code == 2
    assert "--api-key-env: environment variable KVFERRY_TEST_NO_SUCH_KEY is unset" in capsys.readouterr().err
