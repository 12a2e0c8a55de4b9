"""The rollout side of a run: the inference engine (started or attached), prompts, rewards, teacher.

    service = RolloutService.start(run_config.rollout, run_config.teacher, plan=plan, hf_checkpoint=...)
    samples = service.generate(examples, step=3)      # responses + log-probs + rewards (+ teacher fields)
    service.begin_weight_update()                      # pause generation
    ... the policy's ranks stream buckets to service.urls (RoleRuntime.push_weights_to_engine) ...
    service.finish_weight_update(version=4)            # flush, resume, confirm the engine serves 4
    service.close()

Engines (`rollout.rollout_engine`) are kinds of the engine registry (`stacx.rollout.engines.registry`):
a kind with a launcher has its servers started by the run ('cpu': `stacx serve` as a child process
on loopback; 'sglang': SGLang servers on the Ray cluster's GPUs), a kind without one attaches to
every URL of `rollout.rollout_urls` ('http': running `stacx serve` or SGLang servers). An `EnginePool`
(one engine or several) spreads requests (least-loaded), every engine takes each weight update and
confirms its version, and its supervisor restarts or sets aside a failed engine (engine_health). 'auto' is 'sglang' when CUDA is present, else 'cpu'.

Authentication: the servers a run starts of a kind that owns its secret ('cpu', 'sglang') get a
fresh shared secret (`secrets.token_urlsafe`, in the child's environment for `stacx serve`, SGLang's
`--api-key`), and every client of them (the driver's, the policy ranks' weight pushes) sends it.
Attached servers use the `STACX_API_KEY` environment variable of the driver, if set. A 'cpu' run given
`--rollout-urls` attaches those running `stacx serve`s beside the ones it launches (one pool: the launched
engines are restarted when they fail, the attached ones set aside until they answer again); its launched
servers then take the driver's `STACX_API_KEY` (a fresh secret when it is unset), the one key every client sends.

Roll-in recipes also get a teacher engine (`teacher_engine()`): the teacher server at
`teacher_url` generates the teacher-executed turns through its `--teacher-engine` kind's client.

Sampling seeds: step s uses a RolloutManager seeded with (rollout_seed, s), so a resumed run draws
the same samples as an uninterrupted one.
"""

from __future__ import annotations

import logging
import os
import secrets
import time
from dataclasses import KW_ONLY, dataclass, field
from typing import Any, Optional, Sequence

from stacx.rollout.engine_health import attach_supervisor, push_failure_action
from stacx.rollout.engine_pool import EnginePool
from stacx.rollout.episode_retry import retrying_reward
from stacx.rollout.engines.launchers import LaunchedServers, ServerLaunch
from stacx.rollout.engines.registry import ENGINE_KINDS, EngineKind, resolve_engine_kind
from stacx.rollout.manager import RolloutManager
from stacx.rollout.plan import RolloutPlan
from stacx.rollout.rewards import resolve_reward_fn
from stacx.rollout.sections import RolloutSection, TeacherSection
from stacx.rollout.teacher import TeacherClient
from stacx.wire.engine import InferenceEngine
from stacx.wire.http_client import RetryPolicy, api_key_from_env
from stacx.wire.types import SamplingParams

logger = logging.getLogger(__name__)


def load_tokenizer(path: str):
    """The tokenizer saved next to a Hugging Face checkpoint; a clear error when there is none.
    A path that is not a local checkpoint folder fails at once (never a Hub download attempt)."""
    # Imported here: megatron-core is slow to import (start-up time).
    from stacx.models.checkpoint import require_hf_checkpoint_folder
    from stacx.models.saved_tokenizer import load_saved_tokenizer

    require_hf_checkpoint_folder(path)
    try:
        return load_saved_tokenizer(path)
    except Exception as err:  # noqa: BLE001 - transformers raises several types for a missing tokenizer
        raise ValueError(f"--hf-checkpoint {path}: cannot load its tokenizer ({err})") from err


def build_teacher(teacher_section):
    """TeacherClient for `teacher.teacher_url` (None when unset): `/generate` requests for the default 'http'
    kind (`stacx serve`, SGLang), else scoring through the `--teacher-engine` kind's client (vLLM)."""
    if not teacher_section.teacher_url:
        return None
    retry = teacher_retry_policy(teacher_section)
    if teacher_section.teacher_engine == TeacherSection.teacher_engine:  # the default: a server speaking /generate
        return TeacherClient(teacher_section.teacher_url, retry=retry)
    return TeacherClient(engines=[teacher_engine_client(teacher_section)])


def teacher_engine_client(teacher_section) -> InferenceEngine:
    """The `--teacher-engine` kind's client for the `--teacher-url` server (scoring and roll-in turns)."""
    kind = resolve_engine_kind(teacher_section.teacher_engine, flag="--teacher-engine")
    return kind.connect(teacher_section.teacher_url, retry=teacher_retry_policy(teacher_section))


def teacher_retry_policy(teacher_section):
    """Per-request timeout and attempts (1 + teacher_retries) of every call to the teacher server."""
    return RetryPolicy(timeout_s=teacher_section.teacher_timeout_s, max_attempts=teacher_section.teacher_retries + 1)


@dataclass(frozen=True)
class LaunchedEngine:
    """The servers of a run's engine kind, started (and given their secret) before its `RolloutService`."""

    kind: str
    servers: LaunchedServers
    api_key: Optional[str] = field(default=None, repr=False)

    def stop(self) -> None:
        self.servers.stop()


def launch_engine(kind: EngineKind, rollout: RolloutSection, *, hf_checkpoint: str,
                  lora_flags: tuple[str, ...] = ()) -> LaunchedEngine:
    """Start the servers of `kind` (which has a launcher), with a fresh secret when the kind owns one; `lora_flags`:
    the run's --lora-* flags when it pushes LoRA adapters only (kinds with `takes_lora_adapters`)."""
    if lora_flags and not kind.takes_lora_adapters:
        takers = sorted(name for name, other in ENGINE_KINDS.items() if other.takes_lora_adapters and other.launcher)
        raise ValueError(f"--lora-sync adapters: the {kind.name!r} engine takes merged weights only; "
                         f"use --lora-sync merged, or --rollout-engine {' or '.join(takers)}")
    api_key = None
    if kind.owns_secret:  # servers attached beside them take the driver's STACX_API_KEY: the one key of the pool
        api_key = (api_key_from_env() if kind.attached_beside(rollout.rollout_urls) else None) or secrets.token_urlsafe(32)
    servers = kind.launcher(ServerLaunch(hf_checkpoint=hf_checkpoint, seed=rollout.rollout_seed, api_key=api_key,
                                         return_routed_experts=rollout.use_routing_replay,
                                         num_servers=rollout.rollout_num_engines, lora_flags=lora_flags,
                                         engine_python=rollout.vllm_python,
                                         weight_transfer=rollout.vllm_weight_transfer))
    return LaunchedEngine(kind=kind.name, servers=servers, api_key=api_key)


@dataclass(eq=False)
class RolloutService:
    """Generation, rewards and teacher scoring for the driver, plus the weight-update handshake."""

    engine: InferenceEngine
    """The engine client (an `EnginePool` over several servers)."""
    _: KW_ONLY
    engine_kind: str
    """The registered kind ('cpu', 'http', 'sglang', or a user's; 'auto' already resolved)."""
    url: str
    """The first engine's URL."""
    tokenizer: Any
    rollout_section: Optional[RolloutSection]
    """The run's rollout settings (sampling, rewards, seeds)."""
    teacher: Optional[TeacherClient] = None
    num_teacher_top_log_probs: int = 0
    """How many of the teacher's top log-probs to fetch per token: teacher.teacher_top_k in topk
    distillation, else 0 (only the sampled token's)."""
    servers: Optional[LaunchedServers] = None
    """The servers this run started (`stacx serve`, SGLang actors, ...), stopped by `close`."""
    urls: Sequence[str] = ()
    """Every engine URL (default: `url`); weight updates go to each."""
    teacher_section: Optional[TeacherSection] = None
    api_key: Optional[str] = None
    """The rollout servers' shared secret (None: they take none); weight pushes send it."""

    def __post_init__(self) -> None:
        self.urls = tuple(self.urls) or (self.url,)
        self._teacher_engine = None
        self._closers: list = []

    def close_first(self, stop) -> None:
        """Call `stop()` when the service closes, before its clients shut down (a session recorder in front of
        the engine: stacx.trainer.session_recorder); the last one added is stopped first."""
        self._closers.append(stop)

    @staticmethod
    def launch_beside_workers(rollout: RolloutSection, *, hf_checkpoint: Optional[str],
                              lora_flags: tuple[str, ...] = ()) -> Optional[LaunchedEngine]:
        """Start the servers of an engine kind that loads beside the role workers (the CPU engine's
        `stacx serve`) without waiting for them; None for other kinds. A run launches them first,
        starts its role workers, then hands them to `start`, which waits for them."""
        kind = resolve_engine_kind(rollout.rollout_engine)
        if kind.attaches_to(rollout.rollout_urls) or not kind.starts_beside_workers or hf_checkpoint is None:
            return None
        return launch_engine(kind, rollout, hf_checkpoint=hf_checkpoint, lora_flags=lora_flags)

    @classmethod
    def start(cls, rollout: RolloutSection, teacher_section: TeacherSection, *, plan: RolloutPlan,
              hf_checkpoint: Optional[str], tokenizer=None,
              launched: Optional[LaunchedEngine] = None, lora_flags: tuple[str, ...] = ()) -> "RolloutService":
        """Start or attach the engine named by `rollout.rollout_engine` for a run of `plan`, serving
        `hf_checkpoint`; `launched`: the servers `launch_beside_workers` already started for this run
        (stopped here if anything fails)."""
        try:
            kind = resolve_engine_kind(rollout.rollout_engine)
            if hf_checkpoint is None:
                raise ValueError("the rollout engine serves --hf-checkpoint, which is not set")
            tokenizer = tokenizer if tokenizer is not None else load_tokenizer(hf_checkpoint)
        except BaseException:
            if launched is not None:
                launched.stop()
            raise
        if kind.attaches_to(rollout.rollout_urls):
            if not rollout.rollout_urls:
                raise ValueError(f"rollout_engine {kind.name!r} attaches to running servers; give them with "
                                 "--rollout-urls")
            if len(set(rollout.rollout_urls)) != len(rollout.rollout_urls):
                raise ValueError(f"--rollout-urls lists a server twice: {list(rollout.rollout_urls)}")
            urls, api_key = tuple(rollout.rollout_urls), os.environ.get("STACX_API_KEY") or None
        else:
            launched = launched if launched is not None else launch_engine(kind, rollout, hf_checkpoint=hf_checkpoint,
                                                                           lora_flags=lora_flags)
            try:
                urls = tuple(launched.servers.wait_until_ready())
                beside = kind.attached_beside(rollout.rollout_urls)  # running servers that join the launched ones
                if len(set(urls + beside)) != len(urls) + len(beside):
                    raise ValueError(f"--rollout-urls lists a server twice, or one the run launched: {list(beside)}")
            except BaseException:
                launched.stop()
                raise
            urls, api_key = urls + beside, launched.api_key
        servers = launched.servers if launched is not None else None
        attached = range(len(urls) - len(kind.attached_beside(rollout.rollout_urls)), len(urls))
        try:
            teacher = build_teacher(teacher_section) if plan.uses_teacher else None
            if plan.uses_teacher and teacher is None:
                raise ValueError(f"recipe {plan.recipe!r} scores rollouts with a teacher; set --teacher-url")
        except BaseException:
            if servers is not None:
                servers.stop()  # a server this call started must not outlive the error
            raise
        num_top = teacher_section.teacher_top_k if teacher_section.distill_kl_mode == "topk" else 0
        # one engine or several: a supervised pool (a failed engine is restarted or set aside, engine_health)
        engine = EnginePool([kind.connect(u, api_key=api_key) for u in urls], names=urls)
        try:
            attach_supervisor(engine, rollout, servers=servers, connect=lambda u: kind.connect(u, api_key=api_key),
                              attached=attached)
        except BaseException:
            engine.shutdown()
            if servers is not None:
                servers.stop()
            raise
        service = cls(engine, engine_kind=kind.name, url=urls[0], tokenizer=tokenizer,
                      rollout_section=rollout, teacher=teacher, num_teacher_top_log_probs=num_top, servers=servers,
                      urls=urls, teacher_section=teacher_section, api_key=api_key)
        try:
            service.wait_until_healthy()
        except BaseException:
            service.close()
            raise
        return service

    def wait_until_healthy(self, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.engine.health():
            if time.monotonic() > deadline:
                raise RuntimeError(f"rollout engine at {self.url} is not healthy after {timeout_s:.0f}s")
            time.sleep(0.5)

    def sampling_params(self):
        r = self.rollout_section
        eos = getattr(self.tokenizer, "eos_token_id", None)
        return SamplingParams(max_new_tokens=r.rollout_max_response_len, temperature=r.rollout_temperature,
                              top_p=r.rollout_top_p, top_k=r.rollout_top_k,
                              stop_token_ids=(eos,) if eos is not None else ())

    def manager(self, step: int, *, seed_offset: int = 0, with_teacher: bool = True):
        """A RolloutManager on the rollout engine(s), its sampling seeds fixed by (rollout_seed, step, offset)."""
        return RolloutManager(
            self.engine, tokenizer=self.tokenizer,
            # a reward call that fails for an infrastructure reason is retried (stacx.rollout.episode_retry)
            reward_fn=retrying_reward(_resolved(self.rollout_section.reward_fn),
                                      self.rollout_section.episode_retries),
            reward_timeout_s=self.rollout_section.reward_timeout_s,
            teacher=self.teacher if with_teacher else None, num_teacher_top_log_probs=self.num_teacher_top_log_probs,
            seed=self.rollout_section.rollout_seed * 100_003 + step + seed_offset,
            return_routed_experts=self.rollout_section.use_routing_replay,
        )

    def teacher_engine(self):
        """The teacher server as an InferenceEngine (it executes the teacher's turns of roll-ins)."""
        if self._teacher_engine is None:
            section = self.teacher_section
            if section is None or not section.teacher_url:
                raise ValueError("DAgger roll-ins let the teacher act; set --teacher-url (a `stacx serve` or SGLang teacher)")

            self._teacher_engine = teacher_engine_client(section)
        return self._teacher_engine

    def generate(self, examples: Sequence[Any], *, step: int) -> list:
        """`n_samples_per_prompt` samples per example, with rewards and teacher fields as configured."""
        manager = self.manager(step)
        return manager.generate([e.prompt_ids for e in examples], self.sampling_params(),
                                n_samples_per_prompt=self.rollout_section.n_samples_per_prompt,
                                labels=[e.label for e in examples], metadatas=[e.metadata for e in examples])

    def weight_version(self) -> int:
        return self.engine.weight_version()

    def begin_weight_update(self) -> None:
        self.engine.pause()

    @property
    def supervisor(self):
        """The engine pool's `EngineSupervisor` (stacx.rollout.engine_health), or None."""
        return getattr(self.engine, "supervisor", None)

    def weight_push_urls(self) -> tuple[str, ...]:
        """The URLs a weight push goes to: every engine, or with a supervisor the live ones and those
        behind (restarted or recovered); set-aside engines get the weights when they rejoin."""
        if self.supervisor is None:
            return tuple(self.urls)
        return tuple(self.urls[index] for index in self.supervisor.push_targets())

    def recover_engine(self, url: str, error: BaseException) -> str:
        """After a weight push to `url` failed: 'retry' (the engine answers again, or was restarted),
        'skip' (set aside; it takes the weights when it rejoins) or 'raise' (not an engine failure)."""
        if self.supervisor is None:
            return "raise"
        return push_failure_action(self.supervisor, self.urls.index(url), error)

    def fault_metrics(self) -> dict[str, float]:
        """rollout/engine_restarts, rollout/requests_reissued, rollout/live_engines, rollout/health_check_s
        ({} without a supervisor)."""
        return self.supervisor.metrics() if self.supervisor is not None else {}

    def finish_weight_update(self, version: int) -> None:
        """Flush, resume, and confirm every engine now serves `version`."""
        try:
            self.engine.flush_cache()
        finally:
            self.engine.resume()
        versions = self.engine.weight_versions() if hasattr(self.engine, "weight_versions") \
            else {self.url: self.engine.weight_version()}
        stale = {url: served for url, served in versions.items() if served != version}
        if stale:
            raise RuntimeError(f"rollout engine(s) serve weight version(s) {stale} after pushing {version}")
        if self.supervisor is not None:
            self.supervisor.confirm_version(version, {self.urls.index(url): served for url, served in versions.items()})

    def abort_weight_update(self) -> None:
        """Resume generation after a failed push; a failure to resume is logged, not raised, so the
        push's own error is the one reported."""
        try:
            self.engine.resume()
        except Exception:  # noqa: BLE001 - the push's error is already propagating
            logger.exception("resuming the rollout engine after a failed weight push failed")

    def close(self) -> None:
        """Stop what sits in front of the engine (`close_first`), close the clients, then stop the servers this
        run started, even when a client's close fails."""
        try:
            while self._closers:
                try:
                    self._closers.pop()()
                except Exception:  # noqa: BLE001 - the engine and servers below must still close
                    logger.exception("stopping what sits in front of the rollout engine failed")
            shutdown = getattr(self.engine, "shutdown", None)
            if shutdown is not None:
                shutdown()
            if self.teacher is not None:
                self.teacher.close()
            if self._teacher_engine is not None:
                self._teacher_engine.shutdown()
        finally:
            if self.servers is not None:
                self.servers.stop()


def _resolved(reward_fn):
    """A reward name resolved to its function (None and callables as they are)."""
    return resolve_reward_fn(reward_fn) if isinstance(reward_fn, str) else reward_fn
