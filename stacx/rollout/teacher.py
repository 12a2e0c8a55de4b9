"""Teacher scoring: a frozen teacher server's log-probs of given trajectories (prefill only).

For each trajectory `tokens = prompt + response` the teacher returns, aligned with the R
response tokens (position j is response token j, conditioned on everything before it):

    log_probs        [R]      log p_T(response[j] | tokens[:P+j])
    top_log_probs    [R, K]   its K most likely tokens' log-probs, with top_ids [R, K]
    id_log_probs     [R, M]   log-probs of M caller-chosen ids per position (student top-K RKL)

One `/generate` request per trajectory with max_new_tokens=0, logprob_start_len=P, so only
the response positions come back. SGLang's `token_ids_logprob` is one id list for every
position of a request, so per-position ids are sent as their union and picked per position.
Log-probs are at temperature 1 (the teacher's own distribution).

A teacher that does not speak `/generate` is scored through its engine client instead
(`TeacherClient(engines=[VllmEngine(url)])`, what `--teacher-engine vllm` builds): the same requests, through `InferenceEngine.generate`;
vLLM's answers carry the prompt's log-probs and top-k (caller-chosen ids per position are SGLang's and
`stacx serve`'s only).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from stacx.wire.engine import InferenceEngine
from stacx.wire.http_client import HttpTransport, RetryPolicy, ServerUnavailableError
from stacx.wire.sglang_protocol import build_generate_payload, parse_generate_response
from stacx.wire.types import GenerateRequest, SamplingParams



class TeacherUnavailableError(RuntimeError):
    """The teacher server stayed down for the whole retry budget."""


@dataclass
class TeacherScores:
    """One trajectory's teacher fields, aligned with its response tokens (see module doc)."""

    log_probs: torch.Tensor
    top_log_probs: Optional[torch.Tensor] = None
    top_ids: Optional[torch.Tensor] = None
    id_log_probs: Optional[torch.Tensor] = None


_SCORING = SamplingParams(max_new_tokens=0, temperature=1.0)


class TeacherClient:
    """Scores trajectories on one or more teacher servers (requests spread round-robin)."""

    def __init__(self, urls: str | Sequence[str] = (), *, retry: RetryPolicy = RetryPolicy(), max_concurrency: int = 8,
                 sequences_per_request: int = 8, engines: Sequence[InferenceEngine] = ()):
        """urls: teacher servers that speak `/generate` (`stacx serve`, SGLang); engines: engine clients that
        score instead (a `VllmEngine`: its prompt log-probs, top-k included), used when given."""
        urls = [urls] if isinstance(urls, str) else list(urls)
        if not urls and not engines:
            raise ValueError("TeacherClient: no teacher URL given (teacher.urls)")
        self.engines = list(engines)
        self.transports = [] if self.engines else [HttpTransport(u, retry) for u in urls]
        self.max_concurrency = max_concurrency
        self.sequences_per_request = sequences_per_request

    def score(
        self,
        tokens: Sequence[Sequence[int]],
        response_lengths: Sequence[int],
        *,
        top_k: int = 0,
        ids_per_position: Optional[Sequence[torch.Tensor]] = None,
    ) -> list[TeacherScores]:
        """Teacher fields per trajectory. ids_per_position[i]: int [R_i, M] ids to score per position."""
        if self.engines and ids_per_position is not None:
            raise ValueError("a teacher scored through engine clients (vLLM) returns its top-k, not the log-probs of "
                             "caller-chosen ids per position: use --distill-kl-mode topk, or a `stacx serve` or "
                             "SGLang teacher (--teacher-url)")
        if len(tokens) != len(response_lengths):
            raise ValueError(f"score: {len(tokens)} trajectories but {len(response_lengths)} response_lengths")
        requests = []
        for i, (seq, r_len) in enumerate(zip(tokens, response_lengths)):
            if not 0 < r_len < len(seq):
                raise ValueError(f"trajectory {i}: response_length {r_len} must be in [1, {len(seq) - 1}] (length {len(seq)})")
            union = ()
            if ids_per_position is not None:
                ids = ids_per_position[i]
                if ids.shape[0] != r_len:
                    raise ValueError(f"trajectory {i}: ids_per_position has {ids.shape[0]} rows for {r_len} response tokens")
                union = tuple(sorted(set(ids.flatten().tolist())))
            requests.append(GenerateRequest(
                input_ids=tuple(seq), sampling=_SCORING, return_logprob=True,
                logprob_start_len=len(seq) - r_len, top_logprobs_num=top_k, token_ids_logprob=union,
            ))
        chunks = [list(range(s, min(s + self.sequences_per_request, len(requests))))
                  for s in range(0, len(requests), self.sequences_per_request)]
        with ThreadPoolExecutor(max_workers=max(1, min(self.max_concurrency, len(chunks)))) as pool:
            answers = list(pool.map(lambda c: self._send(c[0], [requests[j] for j in c[1]]), enumerate(chunks)))
        outputs = [o for answer in answers for o in answer]
        return [self._to_scores(o, ids_per_position[i] if ids_per_position is not None else None)
                for i, o in enumerate(outputs)]

    def _send(self, chunk_index: int, requests: list[GenerateRequest]):
        if self.engines:
            engine = self.engines[chunk_index % len(self.engines)]
            try:
                return engine.generate(requests)
            except ServerUnavailableError as err:
                raise TeacherUnavailableError(f"teacher {err}") from err
        transport = self.transports[chunk_index % len(self.transports)]
        summary = f"teacher scoring of {len(requests)} trajectories, lengths {[len(r.input_ids) for r in requests][:8]}"
        try:
            body = transport.post_json("/generate", build_generate_payload(requests), summary=summary)
        except ServerUnavailableError as err:
            raise TeacherUnavailableError(f"teacher {err}") from err
        return parse_generate_response(body, requests)

    @staticmethod
    def _to_scores(output, ids: Optional[torch.Tensor]) -> TeacherScores:
        scores = TeacherScores(log_probs=torch.tensor(output.input_log_probs, dtype=torch.float32))
        if output.input_top_log_probs:
            scores.top_log_probs = torch.tensor([[lp for lp, _ in row] for row in output.input_top_log_probs])
            scores.top_ids = torch.tensor([[t for _, t in row] for row in output.input_top_log_probs], dtype=torch.long)
        if ids is not None:
            per_position = [dict((t, lp) for lp, t in row) for row in output.input_token_ids_log_probs]
            scores.id_log_probs = torch.tensor(
                [[row[int(t)] for t in ids_row] for row, ids_row in zip(per_position, ids)], dtype=torch.float32
            )
        return scores

    def close(self) -> None:
        for t in self.transports:
            t.close()
        for engine in self.engines:
            engine.shutdown()
