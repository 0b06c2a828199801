"""Multi-turn conversations against a server's streaming /v1/completions, TTFT per turn.

Each conversation starts from a system text shared by all of them and a first user message;
each later turn's prompt is the previous prompt + the answer it got + a new user message, so
a server that keeps the conversation's K/V prefills only the new part, while the context it
would otherwise recompute grows every turn. The conversations run at once, each one turn
after another; every answer is exactly --output-len tokens (greedy, ignore_eos), so both
servers do the same work. Words are drawn from a small fixed list with a seeded generator.
Bounded: conversations x turns requests, each with a timeout.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass

import aiohttp
import numpy as np

WORDS = ("time person year way day thing man world life hand part child eye woman place work "
         "week case point number group problem fact river stone light garden music letter "
         "window morning market story paper answer city table road voice island bridge").split()
REQUEST_TIMEOUT_S = 600


@dataclass(frozen=True)
class Workload:
    conversations: int = 4  # run side by side, one request each at a time
    turns: int = 6  # requests per conversation, each prompt the last one's + answer + message
    system_words: int = 256  # the conversation's opening prompt
    message_words: int = 40  # each turn's new user message
    output_len: int = 32  # tokens generated per turn (ignore_eos)
    seed: int = 0  # the words drawn

    def __post_init__(self):
        for name in ("conversations", "turns", "system_words", "message_words", "output_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: expected >= 1, got {getattr(self, name)}")


def _text(rng: np.random.Generator, words: int) -> str:
    return " ".join(rng.choice(WORDS, words))


async def _complete(session, url: str, model: str, prompt: str, output_len: int) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0,
            "stream": True, "ignore_eos": True}
    start = time.perf_counter()
    stamps, text = [], []
    async with session.post(url + "/v1/completions", json=body) as response:
        if response.status != 200:
            raise RuntimeError(f"{url}: HTTP {response.status}: {await response.text()}")
        async for raw in response.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choices = json.loads(line[len("data: "):]).get("choices")
            if choices and choices[0].get("text") is not None:
                stamps.append(time.perf_counter())
                text.append(choices[0]["text"])
    if not stamps:
        raise RuntimeError(f"{url}: no token streamed back")
    # ignore_eos: exactly output_len tokens, however many chunks a server packs them into
    return {"ttft_s": stamps[0] - start, "text": "".join(text),
            "tpot_s": (stamps[-1] - stamps[0]) / max(1, output_len - 1)}


async def _conversation(session, url, model, workload: Workload, system: str,
                        rng: np.random.Generator) -> list[dict]:
    prompt, turns = f"System: {system}", []
    for _ in range(workload.turns):
        prompt += f"\nUser: {_text(rng, workload.message_words)}\nAssistant:"
        turn = await _complete(session, url, model, prompt, workload.output_len)
        turns.append(turn)
        prompt += turn["text"]
    return turns


async def _run(url: str, model: str, workload: Workload) -> list[list[dict]]:
    rng = np.random.default_rng(workload.seed)
    system = _text(rng, workload.system_words)
    rngs = [np.random.default_rng([workload.seed, c]) for c in range(workload.conversations)]
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S * workload.turns)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        return await asyncio.gather(*(_conversation(session, url, model, workload, system, r)
                                      for r in rngs))


def run(url: str, model: str, workload: Workload) -> dict:
    """TTFT per turn (median of the conversations) and over all requests, TPOT, throughput."""
    start = time.perf_counter()
    conversations = asyncio.run(_run(url, model, workload))
    duration = time.perf_counter() - start
    ttft = [[r["ttft_s"] for r in turn] for turn in zip(*conversations)]  # ttft[turn][conv]
    every = [t for turn in ttft for t in turn]
    tpots = [r["tpot_s"] for c in conversations for r in c]
    tokens = workload.conversations * workload.turns * workload.output_len
    return {"ttft_p50_ms": 1000 * float(np.median(every)),
            "ttft_p90_ms": 1000 * float(np.percentile(every, 90)),
            "tpot_p50_ms": 1000 * float(np.median(tpots)),
            "output_throughput": tokens / duration, "duration_s": duration,
            "ttft_p50_ms_per_turn": [1000 * float(np.median(t)) for t in ttft],
            "ttft_s_per_turn": ttft, "texts": [[r["text"] for r in c] for c in conversations]}
