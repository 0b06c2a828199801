"""bench/ttft_breakdown.py on a step log written the way the runner writes it."""

import pytest

from bench import ttft_breakdown


def _log(steps) -> str:
    lines = ["INFO 12-02 04:00:00 [api_server.py:1] warm-up done"]
    for start, forward_ms, sample_ms, end, tokens, ones in steps:
        lines.append(f"(EngineCore pid=1) DEBUG 12-02 04:00:01 [vllm_runner.py:239] step: 3 "
                     f"sequences ({ones} of one token), {tokens} tokens after 96 already in the "
                     f"cache, sdpa attention (sequences: 2 read in place); forward {forward_ms} ms"
                     f" (1.5 ms of it building the graph) from t={start} s, 2.0 ms after the "
                     f"last step")
        lines.append(f"(EngineCore pid=1) DEBUG 12-02 04:00:01 [vllm_runner.py:220] step: "
                     f"sampled 3 rows in {sample_ms} ms, ending at t={end} s")
    return "\n".join(lines)


def test_the_parts_add_up_to_each_requests_ttft():
    steps = [(9.0, 50.0, 1.0, 9.06, 300, 0),  # warm-up, before any request
             (10.010, 40.0, 2.0, 10.055, 256, 0), (10.060, 30.0, 2.0, 10.095, 129, 1)]
    detail = {"start_times": [10.000, 10.002], "ttfts": [0.060, 0.100]}
    b = ttft_breakdown.breakdown(_log(steps), detail)
    first = ttft_breakdown.request_parts(10.000, 0.060, ttft_breakdown.steps_of(_log(steps)))
    assert first["steps"] == 1 and first["prefill_tokens"] == 256
    assert first["before"] == pytest.approx(10.0) and first["forward"] == 40.0
    assert first["sampling"] == 2.0 and first["between"] == pytest.approx(3.0)
    assert first["after"] == pytest.approx(5.0)
    assert sum(b["mean_ms"].values()) == pytest.approx(b["ttft_mean_ms"])
    assert b["run_steps"] == 2 and b["run_prefill_tokens"] == 256 + 128


def test_a_log_without_timed_steps_says_what_to_do():
    with pytest.raises(ValueError, match="VLLM_LOGGING_LEVEL=DEBUG"):
        ttft_breakdown.breakdown("INFO nothing here", {"start_times": [1.0], "ttfts": [0.1]})

