"""The rollout side of a run: the inference engine (started or attached), prompts, rewards, teacher.

    service = RolloutService.start(run_config, training_config)
    samples = service.generate(examples, step=3)      # responses + log-probs + rewards (+ teacher fields)
    service.begin_weight_update()                      # pause generation
    ... the policy's ranks stream buckets to service.url (RoleRuntime.push_weights_to_engine) ...
    service.finish_weight_update(version=4)            # flush, resume, confirm the engine serves 4
    service.close()

Engines (`rollout.rollout_engine`):
- 'cpu': `stacx serve` started as a child process on loopback (Stacx's CPU engine behind SGLang's
  HTTP API); the driver and the trainer's ranks talk to it over HTTP like to any server.
- 'http': attach to every URL of `rollout.rollout_urls` (running `stacx serve` or SGLang servers);
  with several, an `EnginePool` spreads requests (least-loaded) and every engine takes each
  weight update and confirms its version.
- 'sglang': launch SGLang servers on the Ray cluster's GPUs and attach to the first.
- 'auto': 'sglang' when CUDA is present, else 'cpu'.

Authentication: a server this run starts ('cpu', 'sglang') gets a fresh shared secret
(`secrets.token_urlsafe`, in the child's environment for `stacx serve`, SGLang's `--api-key`), and
every client of it (the driver's, the policy ranks' weight pushes) sends it. Attached servers
('http') use the `STACX_API_KEY` environment variable of the driver, if set.

Roll-in recipes also get a teacher engine (`teacher_engine()`): the teacher server at
`teacher_url` generates the teacher-executed turns through the same `/generate` API.

Sampling seeds: step s uses a RolloutManager seeded with (rollout_seed, s), so a resumed run draws
the same samples as an uninterrupted one.
"""

from __future__ import annotations

import logging
import os
import secrets
import subprocess
import sys
import time
from dataclasses import KW_ONLY, dataclass
from typing import Any, Optional, Sequence, TYPE_CHECKING

import torch

from stacx.rollout.engine_pool import EnginePool
from stacx.rollout.engines.base import InferenceEngine
from stacx.rollout.engines.http import HttpEngine
from stacx.rollout.engines.processes import ReadyLineWatch, stop_process
from stacx.rollout.engines.sglang import SglangEngine, SglangServerSpec, launch_sglang_servers_on_ray
from stacx.rollout.http_client import RetryPolicy
from stacx.rollout.manager import RolloutManager
from stacx.rollout.teacher import TeacherClient
from stacx.rollout.types import SamplingParams

if TYPE_CHECKING:  # annotations only: the rollout never imports the trainer at run time
    from stacx.trainer.config.recipe import TrainingConfig
    from stacx.trainer.config.run import RolloutSection, RunConfig, TeacherSection

logger = logging.getLogger(__name__)

ENGINE_KINDS = ("auto", "cpu", "http", "sglang")
SERVER_START_TIMEOUT_S = 180.0
SGLANG_PORT = 30000
"""Port of the SGLang server a run launches on its GPU node."""


def resolve_engine_kind(kind: str) -> str:
    """'auto' -> 'sglang' with CUDA, else 'cpu'; other names are checked."""
    if kind not in ENGINE_KINDS:
        raise ValueError(f"rollout_engine {kind!r} is not one of {ENGINE_KINDS}")
    if kind == "auto":
        return "sglang" if torch.cuda.is_available() else "cpu"
    return kind


def engine_client(kind: str, url: str, *, api_key: Optional[str] = None):
    """The InferenceEngine client for a server of `kind` at `url` (an SGLang server gets SGLang's
    weight-update endpoints; `stacx serve` gets the bucket endpoint); `api_key` is the server's secret."""
    if kind == "sglang":
        return SglangEngine(url, api_key=api_key)

    return HttpEngine(url, api_key=api_key)


class CpuServerProcess:
    """`stacx serve --hf-checkpoint PATH --port 0` as a child process; `url` once it is ready."""

    def __init__(self, hf_checkpoint: str, *, seed: int = 0, host: str = "127.0.0.1", num_threads: int = 1,
                 timeout_s: float = SERVER_START_TIMEOUT_S, api_key: Optional[str] = None, wait: bool = True):
        """api_key: the secret the server requires on mutating endpoints, handed over in its
        environment (STACX_API_KEY), never on its command line where other users could read it.
        wait=False returns once the process is started; `wait_until_ready()` then gives `url`
        (a run starts its server this way while its role workers start)."""
        env = dict(os.environ, OMP_NUM_THREADS=str(num_threads), PYTHONUNBUFFERED="1")
        env.pop("STACX_API_KEY", None)
        if api_key:
            env["STACX_API_KEY"] = api_key
        command = [sys.executable, "-m", "stacx", "serve", "--hf-checkpoint", hf_checkpoint, "--port", "0",
                   "--host", host, "--seed", str(seed), "--parent-pid", str(os.getpid())]
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        self.output = ReadyLineWatch(self.process, name="the CPU rollout server (stacx serve)")
        self.url: Optional[str] = None
        self._timeout_s = timeout_s
        self._started = time.monotonic()
        if wait:
            self.wait_until_ready()

    def wait_until_ready(self) -> str:
        """The server's URL once it reports ready (the start timeout counts from the launch); a
        server that exits first is reported at once with its own output."""
        if self.url is None:
            try:
                self.url = self.output.wait(max(0.0, self._timeout_s - (time.monotonic() - self._started)))
            except BaseException:
                self.stop()
                raise
        return self.url

    def stop(self) -> None:
        stop_process(self.process, timeout_s=10)


def load_tokenizer(path: str):
    """The tokenizer saved next to a Hugging Face checkpoint; a clear error when there is none.
    A path that is not a local checkpoint folder fails at once (never a Hub download attempt)."""
    # Imported here: transformers is slow to import (start-up time).
    from transformers import AutoTokenizer

    # Imported here: megatron-core is slow to import (start-up time).
    from stacx.models.checkpoint import require_hf_checkpoint_folder

    require_hf_checkpoint_folder(path)
    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as err:  # noqa: BLE001 - transformers raises several types for a missing tokenizer
        raise ValueError(f"--hf-checkpoint {path}: cannot load its tokenizer ({err})") from err


def build_teacher(teacher_section):
    """TeacherClient for `teacher.teacher_url` (None when unset)."""
    if not teacher_section.teacher_url:
        return None

    return TeacherClient(teacher_section.teacher_url, retry=teacher_retry_policy(teacher_section))


def teacher_retry_policy(teacher_section):
    """Per-request timeout and attempts (1 + teacher_retries) of every call to the teacher server."""
    return RetryPolicy(timeout_s=teacher_section.teacher_timeout_s, max_attempts=teacher_section.teacher_retries + 1)


@dataclass(frozen=True)
class LaunchedCpuServer:
    """A CPU engine server started ahead of its run's `RolloutService` (`launch_cpu_server`)."""

    process: CpuServerProcess
    api_key: str


@dataclass(eq=False)
class RolloutService:
    """Generation, rewards and teacher scoring for the driver, plus the weight-update handshake."""

    engine: InferenceEngine
    """The engine client (an `EnginePool` over several servers)."""
    _: KW_ONLY
    engine_kind: str
    """'cpu', 'http' or 'sglang' (`resolve_engine_kind`)."""
    url: str
    """The first engine's URL."""
    tokenizer: Any
    rollout_section: Optional[RolloutSection]
    """The run's rollout settings (sampling, rewards, seeds)."""
    teacher: Optional[TeacherClient] = None
    num_teacher_top_log_probs: int = 0
    """How many of the teacher's top log-probs to fetch per token: teacher.teacher_top_k in topk
    distillation, else 0 (only the sampled token's)."""
    server: Optional[CpuServerProcess] = None
    """The `stacx serve` child this run started, stopped by `close`."""
    sglang_actors: Sequence[Any] = ()
    """The SGLang server actors this run started, killed by `close`."""
    urls: Sequence[str] = ()
    """Every engine URL (default: `url`); weight updates go to each."""
    teacher_section: Optional[TeacherSection] = None
    api_key: Optional[str] = None
    """The rollout servers' shared secret (None: they take none); weight pushes send it."""

    def __post_init__(self) -> None:
        self.urls = tuple(self.urls) or (self.url,)
        self.sglang_actors = list(self.sglang_actors)
        self._teacher_engine = None

    @staticmethod
    def launch_cpu_server(run_config: RunConfig) -> Optional["LaunchedCpuServer"]:
        """Start the CPU engine's `stacx serve` process without waiting for it (None for other engines):
        a run launches it first, starts its role workers, then hands it to `start`, which waits for it."""
        if resolve_engine_kind(run_config.rollout.rollout_engine) != "cpu" or run_config.model.hf_checkpoint is None:
            return None
        api_key = secrets.token_urlsafe(32)
        process = CpuServerProcess(run_config.model.hf_checkpoint, seed=run_config.rollout.rollout_seed,
                                   api_key=api_key, wait=False)
        return LaunchedCpuServer(process=process, api_key=api_key)

    @classmethod
    def start(cls, run_config: RunConfig, training_config: TrainingConfig, tokenizer=None,
              launched: Optional["LaunchedCpuServer"] = None) -> "RolloutService":
        """Start or attach the engine named by `run_config.rollout.rollout_engine`; `launched`: the CPU
        server `launch_cpu_server` already started for this run (stopped here if anything fails)."""
        rollout = run_config.rollout
        kind = resolve_engine_kind(rollout.rollout_engine)
        hf_checkpoint = run_config.model.hf_checkpoint
        if hf_checkpoint is None:
            raise ValueError("the rollout engine serves --hf-checkpoint, which is not set")
        try:
            tokenizer = tokenizer if tokenizer is not None else load_tokenizer(hf_checkpoint)
        except BaseException:
            if launched is not None:
                launched.process.stop()
            raise
        server, actors = None, ()
        # a server this run starts gets a fresh secret; attached servers use the driver's STACX_API_KEY
        api_key = secrets.token_urlsafe(32) if kind in ("cpu", "sglang") else (os.environ.get("STACX_API_KEY") or None)
        if kind == "cpu":
            if launched is not None:
                server, api_key = launched.process, launched.api_key
            else:
                server = CpuServerProcess(hf_checkpoint, seed=rollout.rollout_seed, api_key=api_key, wait=False)
            url = server.wait_until_ready()
        elif kind == "http":
            if not rollout.rollout_urls:
                raise ValueError("rollout_engine 'http' needs --rollout-urls (the servers to attach to)")
            if len(set(rollout.rollout_urls)) != len(rollout.rollout_urls):
                raise ValueError(f"--rollout-urls lists a server twice: {list(rollout.rollout_urls)}")
            url = rollout.rollout_urls[0]
        else:  # sglang
            actors, urls = launch_sglang_servers_on_ray([SglangServerSpec(model_path=hf_checkpoint, port=SGLANG_PORT,
                                                                          api_key=api_key)])
            url = urls[0]
        try:
            teacher = build_teacher(run_config.teacher) if training_config.uses_teacher else None
            if training_config.uses_teacher and teacher is None:
                raise ValueError(f"recipe {training_config.name!r} scores rollouts with a teacher; set --teacher-url")
        except BaseException:
            _stop_started_servers(server, actors)  # a server this call started must not outlive the error
            raise
        num_top = run_config.teacher.teacher_top_k if run_config.teacher.distill_kl_mode == "topk" else 0
        urls = tuple(rollout.rollout_urls) if kind == "http" else (url,)
        if len(urls) > 1:
            engine = EnginePool([engine_client(kind, u, api_key=api_key) for u in urls], names=urls)
        else:
            engine = engine_client(kind, url, api_key=api_key)
        service = cls(engine, engine_kind=kind, url=url, tokenizer=tokenizer,
                      rollout_section=rollout, teacher=teacher, num_teacher_top_log_probs=num_top, server=server,
                      sglang_actors=actors, urls=urls, teacher_section=run_config.teacher, api_key=api_key)
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
            self.engine, tokenizer=self.tokenizer, reward_fn=self.rollout_section.reward_fn,
            reward_timeout_s=self.rollout_section.reward_timeout_s,
            teacher=self.teacher if with_teacher else None, num_teacher_top_log_probs=self.num_teacher_top_log_probs,
            seed=self.rollout_section.rollout_seed * 100_003 + step + seed_offset,
        )

    def teacher_engine(self):
        """The teacher server as an InferenceEngine (it executes the teacher's turns of roll-ins)."""
        if self._teacher_engine is None:
            section = self.teacher_section
            if section is None or not section.teacher_url:
                raise ValueError("DAgger roll-ins let the teacher act; set --teacher-url (a `stacx serve` or SGLang teacher)")

            self._teacher_engine = HttpEngine(section.teacher_url, teacher_retry_policy(section))
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

    def abort_weight_update(self) -> None:
        """Resume generation after a failed push; a failure to resume is logged, not raised, so the
        push's own error is the one reported."""
        try:
            self.engine.resume()
        except Exception:  # noqa: BLE001 - the push's error is already propagating
            logger.exception("resuming the rollout engine after a failed weight push failed")

    def close(self) -> None:
        """Close the clients, then stop the servers this run started, even when a client's close fails."""
        try:
            shutdown = getattr(self.engine, "shutdown", None)
            if shutdown is not None:
                shutdown()
            if self.teacher is not None:
                self.teacher.close()
            if self._teacher_engine is not None:
                self._teacher_engine.shutdown()
        finally:
            _stop_started_servers(self.server, self.sglang_actors)


def _stop_started_servers(server: Optional[CpuServerProcess], sglang_actors: Sequence[Any]) -> None:
    """Stop the `stacx serve` child and kill the SGLang server actors a run started (best effort:
    a failure to stop one never keeps the others alive)."""
    try:
        if server is not None:
            server.stop()
    finally:
        for actor in sglang_actors:
            try:
                import ray

                ray.kill(actor)
            except Exception:  # noqa: BLE001 - best-effort teardown
                pass
