"""An in-process inference engine on CPU, built from the same model definition as the trainer.

Two decoders, chosen by `decoding=`:

- "kv_cache" (default): the batch's prompts run once (left-padded), then each step is one
  forward of the newest token of every active row against a KV cache, on a `transformers`
  mirror of the megatron model (stacx.serving.kv_cache_decoding). Its fp32 log-probs match the
  trainer's packed forward to ~1e-6.
- "packed": no KV cache; each step runs one packed forward of the trainer's own model over
  every active sequence (prompt + tokens so far): O(steps) forwards of the whole rows, bit-for-bit
  the trainer's kernel. The reference the cached path is tested against.

Log-prob convention: see stacx.wire.types (log_softmax(logits / T) over the real vocab).

Abort: every request carries an `AbortFlag` (stacx.serving.aborts), polled between
decoding steps; an aborted row leaves the batch with what it generated (finish_reason "abort")
while the other rows go on. One call runs under one weight version (weight loads wait for the
call), and every token records it (`output_token_versions`).
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Iterable, Optional, Sequence

import torch
import torch.distributed as dist

from stacx.models.weight_loading import HfWeightReceiver
from stacx.parallel.groups import ProcessGroups, initialize_parallel_layout
from stacx.parallel.megatron_import import import_megatron_core
from stacx.parallel.node_interface import collectives_on_loopback
from stacx.serving.aborts import AbortBook, AbortFlag
from stacx.serving.batched_sampling import choose_tokens
from stacx.serving.cpu_threads import OpenMpBinding
from stacx.serving.kv_cache_decoding import KvCacheDecoder
from stacx.serving.request_batching import GenerateBatcher
from stacx.wire.engine import GenerationCancelled, InferenceEngine, WeightBucket
from stacx.wire.types import GenerateOutput, GenerateRequest, SamplingParams

DECODINGS = ("kv_cache", "packed")
"""`CpuEngine(decoding=...)` values: see the module docstring."""

WeightLoader = Callable[[torch.nn.Module, Sequence[tuple[str, torch.Tensor]]], None]

__all__ = ["CpuEngine", "DECODINGS", "ensure_single_process_layout"]


def sampling_log_probs(logits_V: torch.Tensor, temperature: float) -> torch.Tensor:
    """log_softmax(logits / T) [..., V]; T = 0 (greedy) reports T = 1 log-probs."""
    scale = temperature if temperature > 0 else 1.0
    return torch.log_softmax(logits_V.float() / scale, dim=-1)


def filter_top_k_top_p(log_probs_V: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Log-probs [V] with tokens outside top-k and outside the top-p nucleus set to -inf.

    The nucleus is the smallest prefix of tokens sorted by probability whose mass reaches top_p
    (the token that crosses the threshold is kept), as in SGLang and HF.
    """
    filtered = log_probs_V.clone()
    if top_k > 0 and top_k < filtered.numel():
        kth = torch.topk(filtered, top_k).values[-1]
        filtered[filtered < kth] = float("-inf")
    if top_p < 1.0:
        sorted_lp, order = torch.sort(filtered, descending=True)
        probs = sorted_lp.exp()
        mass_before = torch.cumsum(probs, 0) - probs
        drop = mass_before >= top_p
        filtered[order[drop]] = float("-inf")
    return filtered


def sample_token(log_probs_V: torch.Tensor, sampling: SamplingParams, generator: torch.Generator) -> int:
    """Greedy at T = 0, else a draw from the top-k/top-p filtered distribution after temperature."""
    if sampling.temperature == 0:
        return int(torch.argmax(log_probs_V))
    filters = (0 < sampling.top_k < log_probs_V.numel()) or sampling.top_p < 1.0
    filtered = filter_top_k_top_p(log_probs_V, sampling.top_k, sampling.top_p) if filters else log_probs_V
    return draw_index(torch.softmax(filtered.double(), dim=-1), generator)


def draw_index(probs_V: torch.Tensor, generator: torch.Generator) -> int:
    """One index drawn with probability `probs_V` (non-negative, any positive total) by inverting
    the cumulative mass at a single uniform draw from `generator`.

    Exact like `torch.multinomial` (up to float64 rounding) and about 25x faster on CPU at a vocab of
    32k (0.05 ms against 1.3 ms per row): in sampled decoding the draw was a sixth of each step.
    A zero-probability index is never returned.
    """
    cumulative_V = torch.cumsum(probs_V, dim=0)
    target = torch.rand(1, generator=generator, dtype=cumulative_V.dtype) * cumulative_V[-1]
    index = int(torch.searchsorted(cumulative_V, target, right=True))  # first cumulative mass > target
    if index >= probs_V.numel():  # rounding put the target at the total: the last possible index
        index = int(torch.nonzero(probs_V)[-1])
    return index


def _top_pairs(log_probs_V: torch.Tensor, k: int) -> list[tuple[float, int]]:
    values, ids = torch.topk(log_probs_V, min(k, log_probs_V.numel()))
    return [(float(v), int(i)) for v, i in zip(values, ids)]


def _id_pairs(log_probs_V: torch.Tensor, token_ids: Sequence[int]) -> list[tuple[float, int]]:
    return [(float(log_probs_V[t]), int(t)) for t in token_ids]


def _first_prompt_logit(request: GenerateRequest) -> int:
    """The first prompt position whose next-token logits the request needs: the last one always
    (it predicts the first new token), and from logprob_start_len - 1 on when it asks for prompt
    log-probs."""
    last = len(request.input_ids) - 1
    if request.return_logprob and request.logprob_start_len >= 0:
        return min(max(request.logprob_start_len, 1) - 1, last)
    return last


def ensure_single_process_layout():
    """megatron-core builds its layers from its global groups, even for one process: create a
    world of one gloo rank (in-memory store) and the trivial tp = cp = dp = 1 layout. Each group's gloo
    device still listens on a socket: on loopback only (`collectives_on_loopback`), as no other host joins.

    Raises if this process already belongs to a larger torch.distributed world (a trainer rank):
    the CPU engine runs in the driver or in `stacx serve`, never inside a sharded worker.
    """
    if dist.is_initialized():
        if dist.get_world_size() != 1:
            raise RuntimeError(
                f"CpuEngine needs a single-process world, but torch.distributed has {dist.get_world_size()} ranks; "
                "run the engine in the driver or in `stacx serve`"
            )
    import_megatron_core()  # a server process imports megatron-core first here
    # Imported here: megatron-core is slow to import (start-up time).
    from megatron.core import parallel_state

    with collectives_on_loopback():
        if not dist.is_initialized():
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        if not parallel_state.model_parallel_is_initialized():
            initialize_parallel_layout(1, 1)
    return ProcessGroups.single_process()


class CpuEngine(InferenceEngine):
    """Generation with per-token log-probs from a single-process megatron GPTModel.

    model: built by `stacx.models.build_model(..., ProcessGroups.single_process())`.
    weight_loader: copies (hf_name, tensor) pairs into the model (default: stacx.models).
    eos_token_id: generation stops after it unless a request sets ignore_eos.
    decoding: "kv_cache" (default; a cached decoder that mirrors the model's weights) or
        "packed" (no cache, the trainer's packed forward at every step).
    bind_cores: core ids to pin the engine's torch threads to, one thread per core, bound by each thread
        that calls `generate` before its first call (stacx.serving.cpu_threads); None (default) leaves
        the threads to the scheduler, which is right when other engines or a trainer share the cores.
    """

    def __init__(self, model, *, eos_token_id: Optional[int] = None, weight_loader: Optional[WeightLoader] = None,
                 seed: int = 0, model_path: str = "", decoding: str = "kv_cache",
                 bind_cores: Optional[Sequence[int]] = None):
        # Imported here: megatron-core is slow to import (start-up time).
        from stacx.models import hf_config_of


        if decoding not in DECODINGS:
            raise ValueError(f"CpuEngine decoding={decoding!r} is not one of {DECODINGS}")
        self.model = model.eval()
        self.groups = ProcessGroups.single_process()
        self.vocab_size = int(hf_config_of(model).vocab_size)
        self.context_length = int(getattr(hf_config_of(model), "max_position_embeddings", 0) or 0) or None
        """Most tokens one sequence may hold (prompt + max_new_tokens); None when the config has none."""
        self.eos_token_id = eos_token_id
        self.model_path = model_path
        self._weight_loader = weight_loader
        self._receiver = HfWeightReceiver(model, self.groups)
        self._generator = torch.Generator().manual_seed(seed)
        self._lock = threading.Lock()  # one model call at a time; updates never interleave a batch
        self._resumed = threading.Event()
        self._resumed.set()
        self._version = 0
        self._progress_at: Optional[float] = None  # monotonic time of the last step while a call runs
        self.aborts = AbortBook()
        """The requests in flight, by rid, for `abort` (registered where they enter the engine)."""
        self._batcher = GenerateBatcher(self)  # `submit`: concurrent submissions decode as one batch
        self.decoding = decoding
        self._binding = OpenMpBinding(bind_cores) if bind_cores is not None else None
        self._cached_decoder = None
        if decoding == "kv_cache":
            self._cached_decoder = KvCacheDecoder(self.model, self.groups)

    adapters = None
    """`stacx.models.lora.MergedAdapters` when the engine takes adapter-only syncs (`from_hf_checkpoint(lora=...)`)."""

    @classmethod
    def from_hf_checkpoint(cls, path: str, *, params_dtype: torch.dtype = torch.float32, seed: int = 0,
                           decoding: str = "kv_cache", lora=None,
                           bind_cores: Optional[Sequence[int]] = None) -> "CpuEngine":
        """Build the model from `path`'s config.json, load its weights, read eos from its config. `lora`
        (LoraSettings): the engine takes the policy's adapters only and merges them (`MergedAdapters`).
        `bind_cores`: as in `CpuEngine`."""
        # Imported here: megatron-core is slow to import (start-up time).
        from stacx.models import build_model, load_hf_checkpoint
        from stacx.models.architectures import load_hf_config

        config = load_hf_config(path)
        groups = ensure_single_process_layout()
        model = build_model(config, groups, params_dtype=params_dtype)
        load_hf_checkpoint(model, path, groups)
        adapters = None
        if lora is not None:
            # Imported here, like stacx.models above: megatron-core is slow to import (start-up time).
            from stacx.models.lora import MergedAdapters

            adapters = MergedAdapters(model, lora, groups)
        eos = getattr(config, "eos_token_id", None)
        if isinstance(eos, (list, tuple)):
            eos = eos[0] if eos else None
        engine = cls(model, eos_token_id=eos, seed=seed, model_path=str(path), decoding=decoding,
                     bind_cores=bind_cores)
        engine.adapters = adapters
        return engine

    # ---- forward ---------------------------------------------------------------------------

    @torch.no_grad()
    def _logits(self, sequences: Sequence[Sequence[int]], record_routes: bool = False):
        """Per sequence, fp32 logits [len, V] over the real vocab from one packed forward, and with
        `record_routes` each sequence's routed experts [len, MoE layers, top_k] (else None)."""
        # Imported here: megatron-core is slow to import (start-up time).
        from stacx.models import forward_packed
        from stacx.models.routing_replay import RoutesRecorder

        lengths = [len(s) for s in sequences]
        tokens = torch.tensor([t for s in sequences for t in s], dtype=torch.long)
        if not record_routes:
            logits = forward_packed(self.model, tokens, lengths, self.groups)[:, : self.vocab_size]
            return list(torch.split(logits, lengths)), None
        with RoutesRecorder(self.model) as recorder:
            logits = forward_packed(self.model, tokens, lengths, self.groups)[:, : self.vocab_size]
        return list(torch.split(logits, lengths)), list(torch.split(recorder.routes(), lengths))

    def _model_call(self, forward: Callable, *args):
        """Every model forward of both decoders goes through here (one per generated token, the
        prefill included); tests slow or stall it to exercise cancellation and /health."""
        return forward(*args)

    # ---- InferenceEngine -------------------------------------------------------------------

    def check_requests(self, requests: Sequence[GenerateRequest]) -> None:
        """Raise ValueError naming the field when a request cannot be served by this model: token ids
        outside the vocabulary, or prompt + max_new_tokens beyond the model's context length."""
        for index, request in enumerate(requests):
            for field, ids in (("input_ids", request.input_ids), ("token_ids_logprob", request.token_ids_logprob)):
                bad = [t for t in ids if not 0 <= t < self.vocab_size]
                if bad:
                    raise ValueError(f"request {index}: {field} hold token ids {bad[:5]} outside the vocabulary "
                                     f"[0, {self.vocab_size})")
            total = len(request.input_ids) + request.sampling.max_new_tokens
            if self.context_length is not None and total > self.context_length:
                raise ValueError(
                    f"request {index}: input_ids ({len(request.input_ids)} tokens) + sampling_params.max_new_tokens "
                    f"({request.sampling.max_new_tokens}) = {total} exceeds the model's context length "
                    f"{self.context_length}; lower max_new_tokens")

    def generate(self, requests: Sequence[GenerateRequest], *, should_stop: Optional[Callable[[], bool]] = None,
                 abort_flags: Optional[Sequence[AbortFlag]] = None) -> list[GenerateOutput]:
        """Generate for every request. `should_stop` (e.g. "the client disconnected") is polled while
        waiting for the engine and before every decoding step; when it returns True the call raises
        GenerationCancelled and the engine moves on to the next call.

        abort_flags: one per request, from `self.aborts.register` where the requests entered (the
        server, `submit`); None registers them here. A request whose flag is set (`abort`) stops
        before its next decoding step and returns what it has, finish_reason "abort"; one aborted
        before it started returns no tokens, at once (a paused engine does not hold it).
        """
        self.check_requests(requests)
        if abort_flags is None:
            flags = self.aborts.register([r.rid for r in requests])
            try:
                return self._generate_flagged(requests, should_stop, flags)
            finally:
                self.aborts.release(flags)
        if len(abort_flags) != len(requests):
            raise ValueError(f"generate: {len(abort_flags)} abort_flags for {len(requests)} requests")
        return self._generate_flagged(requests, should_stop, abort_flags)

    def _generate_flagged(self, requests: Sequence[GenerateRequest], should_stop: Optional[Callable[[], bool]],
                          abort_flags: Sequence[AbortFlag]) -> list[GenerateOutput]:
        """`generate` once every request has its abort flag."""
        if not self._acquire_unpaused(should_stop, abort_flags):
            return [self._aborted_before_start() for _ in requests]
        try:
            if self._binding is not None:
                self._binding.ensure_bound()  # once per calling thread (its OpenMP team)
            self._progress_at = time.monotonic()
            outputs: list[Optional[GenerateOutput]] = [None] * len(requests)
            live = []
            for i, flag in enumerate(abort_flags):
                if flag.is_set():
                    outputs[i] = self._aborted_before_start()
                else:
                    live.append(i)
            decode = self._generate_cached if self._cached_decoder is not None else self._generate_packed
            for i, output in zip(live, decode([requests[i] for i in live], should_stop,
                                              [abort_flags[i] for i in live])):
                outputs[i] = output
            return outputs
        finally:
            self._progress_at = None
            self._lock.release()

    def _acquire_unpaused(self, should_stop: Optional[Callable[[], bool]], abort_flags: Sequence[AbortFlag]) -> bool:
        """Take the model lock while the engine is not paused (checked again under the lock, so no
        call starts between a pause and the weight update after it). False, without the lock, when
        every request was aborted meanwhile."""
        while True:
            if all(flag.is_set() for flag in abort_flags):
                return False
            if should_stop is not None and should_stop():
                raise GenerationCancelled("the caller stopped waiting for the engine")
            if not self._resumed.wait(timeout=0.1) or not self._lock.acquire(timeout=0.1):
                continue
            if self._resumed.is_set():
                return True
            self._lock.release()

    def _aborted_before_start(self) -> GenerateOutput:
        return GenerateOutput(output_ids=[], finish_reason="abort", weight_version=self._version)

    def submit(self, request: GenerateRequest):
        """Start one request (registered for `abort` at once); concurrent submissions that wait
        for the engine decode together as one batch (stacx.serving.request_batching)."""
        self.check_requests([request])
        (flag,) = self.aborts.register([request.rid])

        def run() -> GenerateOutput:
            try:
                return self._batcher.generate([request], abort_flags=[flag])[0]
            finally:
                self.aborts.release([flag])

        try:
            return self._submissions().submit(run)
        except BaseException:
            self.aborts.release([flag])
            raise

    def abort(self, rids: Optional[Sequence[str]] = None) -> None:
        self.aborts.abort(rids)

    def stalled_for_s(self) -> float:
        """Seconds since the running call last made progress (0 when idle); `/health` reads it."""
        progress_at = self._progress_at
        return 0.0 if progress_at is None else time.monotonic() - progress_at

    def _generate_packed(self, requests: Sequence[GenerateRequest], should_stop: Optional[Callable[[], bool]],
                         abort_flags: Sequence[AbortFlag]) -> list[GenerateOutput]:
        """The "packed" decoder: every step, one packed forward of all active (prompt + tokens) rows."""
        outputs, generators = self._start_outputs(requests, abort_flags)
        sequences = [list(r.input_ids) for r in requests]
        active = list(range(len(requests)))
        first_step = True
        record_routes = self._check_routes_asked(requests)
        while active:
            if should_stop is not None and should_stop():
                raise GenerationCancelled(f"stopped after {len(outputs[active[0]].output_ids)} generated tokens")
            logits, routes = self._model_call(self._logits, [sequences[i] for i in active], record_routes)
            self._progress_at = time.monotonic()
            still_active = []
            for row, (i, logits_LV) in enumerate(zip(active, logits)):
                request, out = requests[i], outputs[i]
                if request.return_routed_experts:  # this forward ran every token of the sequence so far
                    out.routed_experts = routes[row]
                    abort_flags[i].routes = (routes[row],)
                log_probs_LV = sampling_log_probs(logits_LV, request.sampling.temperature)
                if first_step and request.return_logprob and request.logprob_start_len >= 0:
                    self._fill_prompt_fields(out, request, log_probs_LV)
                if len(out.output_ids) >= request.sampling.max_new_tokens:
                    out.finish_reason = "length"
                    continue
                if abort_flags[i].is_set():  # checked after the forward, as the cached decoder does
                    out.finish_reason = "abort"
                    continue
                last = log_probs_LV[-1]
                token = sample_token(last, request.sampling, generators[i])
                sequences[i].append(token)
                if self._record_token(out, request, token, float(last[token]), last):
                    still_active.append(i)
            active = still_active
            first_step = False
        for request, out in zip(requests, outputs):
            if request.return_routed_experts:  # the last sampled token was never run through the model
                out.routed_experts = out.routed_experts[: len(request.input_ids) + len(out.output_ids) - 1]
        return outputs

    def _start_outputs(self, requests: Sequence[GenerateRequest],
                       abort_flags: Sequence[AbortFlag]) -> tuple[list[GenerateOutput], list[torch.Generator]]:
        """Both decoders' start: an empty output per request at the served version, each exposed on its abort flag
        (its tokens so far, for a streamed /generate: stacx.serving.generate_stream), and the generator each
        request samples from (its own seed's, else the engine's)."""
        outputs = [GenerateOutput(output_ids=[], weight_version=self._version) for _ in requests]
        for flag, output in zip(abort_flags, outputs):
            flag.output = output
        generators = [
            torch.Generator().manual_seed(r.sampling.seed) if r.sampling.seed is not None else self._generator
            for r in requests
        ]
        return outputs, generators

    def _check_routes_asked(self, requests: Sequence[GenerateRequest]) -> bool:
        """Whether any request asks for routed experts; raises naming the field for a dense model."""
        # Imported here: megatron-core is slow to import (start-up time).
        from stacx.models.moe import is_mixture_of_experts

        asked = any(r.return_routed_experts for r in requests)
        if asked and not is_mixture_of_experts(self.model):
            raise ValueError("return_routed_experts: this engine serves a dense model, which routes nothing; "
                             "ask for routed experts only from a mixture-of-experts model")
        return asked

    def _generate_cached(self, requests: Sequence[GenerateRequest], should_stop: Optional[Callable[[], bool]],
                         abort_flags: Sequence[AbortFlag]) -> list[GenerateOutput]:
        """The "kv_cache" decoder: one prefill of the whole batch, then one cached forward per step.

        Same choices as `_generate_packed` (same sampling helpers, same generator draws in request
        order), so a seed reproduces a sample and greedy decoding picks the same tokens.
        """
        if not requests:
            return []
        outputs, generators = self._start_outputs(requests, abort_flags)
        prompt_starts = [_first_prompt_logit(r) for r in requests]
        num_prompt_logits = max(len(r.input_ids) - start for r, start in zip(requests, prompt_starts))
        self._cached_decoder.record_routes = self._check_routes_asked(requests)
        try:
            return self._decode_cached(requests, should_stop, abort_flags, outputs, generators, prompt_starts,
                                       num_prompt_logits)
        finally:
            self._cached_decoder.record_routes = False

    def _decode_cached(self, requests, should_stop, abort_flags, outputs, generators, prompt_starts,
                       num_prompt_logits) -> list[GenerateOutput]:
        """`_generate_cached` after its set-up: the prefill and the decoding steps."""
        batch = self._model_call(self._cached_decoder.prefill, [r.input_ids for r in requests], num_prompt_logits,
                                 max(r.sampling.max_new_tokens for r in requests))
        self._progress_at = time.monotonic()
        routes = [[] for _ in requests]  # per request, [S, MoE layers, top_k] pieces
        for flag, pieces in zip(abort_flags, routes):  # a streamed /generate reads them as they come
            flag.routes = pieces
        if batch.last_routes_BSLK is not None:
            for i, request in enumerate(requests):  # prompts are left-padded
                routes[i].append(batch.last_routes_BSLK[i, batch.last_routes_BSLK.shape[1] - len(request.input_ids):])
        for i, (request, start) in enumerate(zip(requests, prompt_starts)):
            if request.return_logprob and request.logprob_start_len >= 0:
                first_index = num_prompt_logits - len(request.input_ids) + start
                log_probs_LV = sampling_log_probs(batch.prompt_logits_BKV[i, first_index:],
                                                  request.sampling.temperature)
                self._fill_prompt_fields(outputs[i], request, log_probs_LV, first_position=start)
        active = [i for i, r in enumerate(requests) if r.sampling.max_new_tokens > 0]
        logits_BV = batch.prompt_logits_BKV[:, -1]
        if len(active) < len(requests):  # max_new_tokens = 0: prompt fields only
            for i in set(range(len(requests))) - set(active):
                outputs[i].finish_reason = "length"
            batch.keep_rows(active)
            logits_BV = logits_BV[active]
        while active:
            if should_stop is not None and should_stop():
                raise GenerationCancelled(f"stopped after {len(outputs[active[0]].output_ids)} generated tokens")
            still = self._drop_aborted(active, outputs, abort_flags)
            if len(still) < len(active):
                if not still:
                    break
                kept = set(still)
                kept_rows = [row for row, i in enumerate(active) if i in kept]
                batch.keep_rows(kept_rows)
                logits_BV = logits_BV[kept_rows]
                active = still
            temperatures = [requests[i].sampling.temperature or 1.0 for i in active]
            if any(temperature != 1.0 for temperature in temperatures):
                logits_BV = logits_BV / torch.tensor(temperatures).unsqueeze(1)
            log_probs_BV = torch.log_softmax(logits_BV, dim=-1)  # (x / 1.0 is x: greedy and T = 1 skip the division)
            tokens = choose_tokens(log_probs_BV, [requests[i].sampling for i in active], [generators[i] for i in active],
                                   filter_top_k_top_p)
            chosen_B = log_probs_BV.gather(1, torch.tensor(tokens).unsqueeze(1)).squeeze(1).tolist()
            kept_rows = []
            for row, i in enumerate(active):
                if self._record_token(outputs[i], requests[i], tokens[row], chosen_B[row], log_probs_BV[row]):
                    kept_rows.append(row)
            if not kept_rows:
                break
            batch.keep_rows(kept_rows)
            active = [active[row] for row in kept_rows]
            logits_BV = self._model_call(batch.step, [tokens[row] for row in kept_rows])
            self._progress_at = time.monotonic()
            if batch.last_routes_BSLK is not None:
                for row, i in enumerate(active):
                    routes[i].append(batch.last_routes_BSLK[row])
        for request, out, pieces in zip(requests, outputs, routes):
            if request.return_routed_experts:  # the last sampled token was never run through the model
                out.routed_experts = torch.cat(pieces)[: len(request.input_ids) + len(out.output_ids) - 1]
        return outputs

    @staticmethod
    def _drop_aborted(active: list[int], outputs: list[GenerateOutput], abort_flags: Sequence[AbortFlag]) -> list[int]:
        """The active requests whose abort flag is not set; the others finish with "abort"."""
        still = []
        for i in active:
            if abort_flags[i].is_set():
                outputs[i].finish_reason = "abort"
            else:
                still.append(i)
        return still

    def _record_token(self, out: GenerateOutput, request: GenerateRequest, token: int, log_prob: float,
                      log_probs_V: torch.Tensor) -> bool:
        """Append a generated token (its log-prob fields, the version producing it); return whether
        the request goes on."""
        out.output_ids.append(token)
        out.output_token_versions.append(out.weight_version)
        if request.return_logprob:
            out.output_log_probs.append(log_prob)
            if request.top_logprobs_num:
                out.output_top_log_probs.append(_top_pairs(log_probs_V, request.top_logprobs_num))
            if request.token_ids_logprob:
                out.output_token_ids_log_probs.append(_id_pairs(log_probs_V, request.token_ids_logprob))
        stop_ids = set(request.sampling.stop_token_ids)
        if not request.sampling.ignore_eos and self.eos_token_id is not None:
            stop_ids.add(self.eos_token_id)
        if token in stop_ids:
            out.finish_reason = "stop"
        elif len(out.output_ids) >= request.sampling.max_new_tokens:
            out.finish_reason = "length"
        else:
            return True
        return False

    @staticmethod
    def _fill_prompt_fields(out: GenerateOutput, request: GenerateRequest, log_probs_LV: torch.Tensor,
                            first_position: int = 0) -> None:
        """Prompt position p >= logprob_start_len: log p(prompt[p] | prompt[:p]); None at p = 0.

        log_probs_LV[k] holds the log-probs after prompt position first_position + k.
        """
        prompt = request.input_ids
        for p in range(request.logprob_start_len, len(prompt)):
            if p == 0:
                out.input_log_probs.append(None)
                out.input_top_log_probs.append(None)
                out.input_token_ids_log_probs.append(None)
                continue
            row = log_probs_LV[p - 1 - first_position]
            out.input_log_probs.append(float(row[prompt[p]]))
            out.input_top_log_probs.append(_top_pairs(row, request.top_logprobs_num) if request.top_logprobs_num else None)
            out.input_token_ids_log_probs.append(
                _id_pairs(row, request.token_ids_logprob) if request.token_ids_logprob else None
            )

    def load_weights(self, named_tensors: Sequence[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face-named tensors into the model (no version change)."""
        with self._lock:
            if self._cached_decoder is not None:
                self._cached_decoder.mark_stale()
            if self._weight_loader is not None:
                self._weight_loader(self.model, named_tensors)
            else:
                self._receiver.receive(named_tensors)

    def weight_update_size(self) -> tuple[int, int]:
        """(tensor bytes, tensors) of the largest weight update this model takes (`HfWeightReceiver.update_size`)."""
        return self._receiver.update_size()

    def set_weight_version(self, version: int) -> None:
        """Mark the update finished; raises if a parameter received only part of its tensors."""
        with self._lock:
            self._receiver.check_complete()
            if self.adapters is not None:  # an adapter-only sync: the weights become W0 + s B A
                self.adapters.apply()
                if self._cached_decoder is not None:
                    self._cached_decoder.mark_stale()
            self._version = int(version)

    def update_weights(self, buckets: Iterable[WeightBucket], *, version: int) -> None:
        for bucket in buckets:
            self.load_weights(bucket)
        self.set_weight_version(version)

    def weight_version(self) -> int:
        return self._version

    def weight_digests(self, names: Sequence[str]) -> dict:
        """{"digests": {name: digest or None}, "dtype"} of the weights served now (stacx.rollout.weight_check)."""
        # Imported here: megatron-core is slow to import (start-up time).
        from stacx.models.weight_digests import hf_weight_digests, model_dtype

        with self._lock:
            dtype = model_dtype(self.model)
            return {"digests": hf_weight_digests(self.model, self.groups, names, dtype=dtype),
                    "dtype": str(dtype).removeprefix("torch.")}

    def pause(self) -> None:
        """New calls wait (and a call waiting for the running one does not start) until `resume`."""
        self._resumed.clear()

    def resume(self) -> None:
        self._resumed.set()

    def flush_cache(self) -> None:
        """Nothing to drop: this engine keeps no prefix cache."""

    def health(self) -> bool:
        return True
