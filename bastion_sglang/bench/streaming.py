"""One batch of requests streamed from an Engine, and the decode timing of each request's chunks.

Streaming (SGLang 0.5.23): for a list of input ids, the Engine yields the chunks of all the batch's requests
interleaved, each tagged with `index` (the request's position in the list). Every chunk's meta_info carries
`completion_tokens`, the request's tokens so far (cumulative); a request's last chunk has a non-null
`finish_reason` and, under speculation, `spec_verify_ct`. SGLang streams every scheduler step (stream
interval 1): the first chunk holds the prefill's token, each later one the tokens of one decode step (several
per verify pass). A chunk's arrival time is `time.perf_counter()` when the Engine's generator hands it over.

How the chunk arrivals become decode tokens, decode seconds and per-token latencies: `bench.report`.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class ChunkArrival:
    """One streamed chunk of a request: when the client got it and the request's tokens by then."""

    seconds: float  # time.perf_counter() at arrival, seconds
    completion_tokens: int  # meta_info completion_tokens: cumulative


@dataclass(frozen=True)
class StreamedRequest:
    """Every chunk of one request, in arrival order, and its final spec_verify_ct (None: not speculative)."""

    arrivals: tuple[ChunkArrival, ...]
    verify_passes: int | None

    @property
    def completion_tokens(self) -> int:
        return self.arrivals[-1].completion_tokens


@dataclass(frozen=True)
class DecodeTiming:
    """The decode phase of one request (or of several, summed): what arrived after the first chunk."""

    decode_tokens: int
    decode_seconds: float
    token_latencies: tuple[float, ...]  # seconds per token, one sample per decode token


def decode_timing(arrivals: Sequence[ChunkArrival]) -> DecodeTiming:
    """Decode tokens, seconds and per-token latencies of one request's chunks (defined in `bench.report`).

    Chunks that bring no new token are skipped; the first token-carrying chunk (the prefill's) starts the
    clock; each later one with k new tokens, g seconds after the previous token-carrying chunk, gives k
    latency samples of g / k. The last token-carrying chunk is left out when at least two came after the
    first: under SGLang's overlap scheduler a step's tokens leave after the next step has run, so the first
    chunk arrives one decode step late while the last arrives right behind its predecessor (no further step
    runs for a request that ends by length); from the first chunk to the last, an overlapped Engine would be
    timed over one decode step fewer than the tokens counted, one without overlap over as many. Up to the
    last but one, both are timed over as many steps as they emit tokens in.
    """
    carrying: list[ChunkArrival] = []
    for chunk in arrivals:
        if chunk.completion_tokens > (carrying[-1].completion_tokens if carrying else 0):
            carrying.append(chunk)
    if not carrying:
        return DecodeTiming(0, 0.0, ())
    if len(carrying) > 2:
        carrying.pop()
    latencies: list[float] = []
    for previous, chunk in itertools.pairwise(carrying):
        tokens = chunk.completion_tokens - previous.completion_tokens
        latencies += [(chunk.seconds - previous.seconds) / tokens] * tokens
    first, last = carrying[0], carrying[-1]
    return DecodeTiming(
        last.completion_tokens - first.completion_tokens, last.seconds - first.seconds, tuple(latencies)
    )


def pooled_timing(timings: Sequence[DecodeTiming]) -> DecodeTiming:
    """Several requests' decode timings summed: Σ tokens, Σ seconds, every latency sample."""
    return DecodeTiming(
        sum(t.decode_tokens for t in timings),
        sum(t.decode_seconds for t in timings),
        tuple(itertools.chain.from_iterable(t.token_latencies for t in timings)),
    )


def latency_percentiles_ms(latencies: Sequence[float]) -> tuple[float, float]:
    """(p50, p90) in ms of per-token latencies in seconds, interpolating linearly between samples."""
    p50, p90 = np.percentile(np.asarray(latencies, dtype=np.float64), [50.0, 90.0])
    return 1e3 * float(p50), 1e3 * float(p90)


def _check_finish(reason: Any, index: int) -> None:
    """RuntimeError when a request's finish_reason says the Engine aborted it."""
    if isinstance(reason, dict) and reason.get("type") == "abort":
        raise RuntimeError(f"the Engine aborted request {index} of a batch: {reason.get('message')}")


def stream_batch(
    engine: Any, prompt_ids: Sequence[list[int]], params: Sequence[dict[str, Any]]
) -> list[StreamedRequest]:
    """Send one batch with `stream=True`; every request's chunk arrivals and final spec_verify_ct.

    Chunks of the batch's requests arrive interleaved, each naming its request by `index`; RuntimeError if a
    request is aborted or its stream ends without a finished chunk.
    """
    arrivals: list[list[ChunkArrival]] = [[] for _ in prompt_ids]
    verify_passes: list[int | None] = [None] * len(prompt_ids)
    finished = [False] * len(prompt_ids)
    for chunk in engine.generate(input_ids=list(prompt_ids), sampling_params=list(params), stream=True):
        now = time.perf_counter()
        index = chunk["index"]
        meta = chunk["meta_info"]
        arrivals[index].append(ChunkArrival(now, int(meta["completion_tokens"])))
        if meta.get("finish_reason") is not None:
            _check_finish(meta["finish_reason"], index)
            finished[index] = True
            passes = meta.get("spec_verify_ct")
            verify_passes[index] = None if passes is None else int(passes)
    if not all(finished):
        raise RuntimeError(
            f"requests {[i for i, done in enumerate(finished) if not done]}: stream ended early"
        )
    return [StreamedRequest(tuple(a), v) for a, v in zip(arrivals, verify_passes, strict=True)]
