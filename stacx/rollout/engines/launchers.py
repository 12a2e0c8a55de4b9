"""The servers a run starts for its built-in engine kinds: `stacx serve` as a child process ('cpu')
and SGLang servers as Ray actors on the cluster's GPUs ('sglang').

Every launcher has one shape (what `register_engine(launcher=...)` takes):

    servers = launcher(ServerLaunch(hf_checkpoint=..., seed=..., api_key=...))   # returns once started
    urls = servers.wait_until_ready()     # every server's URL; on failure nothing is left running
    servers.stop()                        # best effort, idempotent

Servers that can be restarted also have `restart(index) -> url`: stop server `index` (dead or hung) and
start it again on the same URL (the run's engine pool does, stacx.rollout.engine_health); the 'cpu'
kind's (a new `stacx serve` child) and the 'sglang' kind's (a new actor on the same node and port) have it.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Optional, Protocol, Sequence

from stacx.rollout.engines.processes import LocalServerGroup, ReadyLineWatch, stop_process
from stacx.rollout.engines.sglang import SglangServerSpec, launch_sglang_servers_on_ray, sglang_lora_args

SERVER_START_TIMEOUT_S = 180.0
SGLANG_PORT = 30000
"""Port of the SGLang server a run launches on its GPU node."""


@dataclass(frozen=True, kw_only=True)
class ServerLaunch:
    """What a launcher needs to start a run's rollout servers."""

    hf_checkpoint: str
    """The Hugging Face folder the servers load (the policy's starting weights)."""
    seed: int = 0
    """The run's rollout seed (a server that samples with a global generator seeds it)."""
    api_key: Optional[str] = field(default=None, repr=False)
    """The fresh shared secret the servers must require (None when the kind does not own one)."""
    return_routed_experts: bool = False
    """The run replays routes (--use-routing-replay): servers that need a switch for it get it
    (SGLang's --enable-return-routed-experts; `stacx serve` always can)."""
    num_servers: int = 1
    """Servers to start (--rollout-num-engines); the requests are spread over them."""
    lora_flags: tuple[str, ...] = ()
    """The run's --lora-* flags (as `stacx serve` takes them) when it pushes LoRA adapters only (--lora-sync
    adapters); the 'vllm' and 'sglang' launchers turn them into their servers' LoRA flags."""
    engine_python: Optional[str] = None
    """The python of the engine's own environment, for kinds whose server runs outside Stacx's (vLLM:
    --vllm-python)."""
    weight_transfer: Optional[str] = None
    """How the weights reach the servers, for kinds that offer a choice (vLLM: --vllm-weight-transfer; its
    'nccl' and 'gloo' start the server's own weight-transfer engine)."""


class LaunchedServers(Protocol):
    """Servers a launcher started."""

    def wait_until_ready(self) -> tuple[str, ...]:
        """Every server's URL once it serves; raises (after stopping them) when they fail to start."""

    def stop(self) -> None:
        """Stop every server (best effort; a second call does nothing)."""


class CpuServerProcess:
    """`stacx serve --hf-checkpoint PATH --port 0` as a child process; `url` once it is ready."""

    def __init__(self, hf_checkpoint: str, *, seed: int = 0, host: str = "127.0.0.1", num_threads: int = 1,
                 timeout_s: float = SERVER_START_TIMEOUT_S, api_key: Optional[str] = None, wait: bool = True,
                 port: int = 0, extra_args: tuple[str, ...] = ()):
        """api_key: the secret the server requires on mutating endpoints, handed over in its
        environment (STACX_API_KEY), never on its command line where other users could read it.
        wait=False returns once the process is started; `wait_until_ready()` then gives `url`
        (a run starts its server this way while its role workers start). port: 0 picks a free one; a
        restarted server takes its predecessor's."""
        env = dict(os.environ, OMP_NUM_THREADS=str(num_threads), PYTHONUNBUFFERED="1")
        env.pop("STACX_API_KEY", None)
        if api_key:
            env["STACX_API_KEY"] = api_key
        command = [sys.executable, "-m", "stacx", "serve", "--hf-checkpoint", hf_checkpoint, "--port", str(port),
                   "--host", host, "--seed", str(seed), "--parent-pid", str(os.getpid()), *extra_args]
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


@dataclass(eq=False)
class LaunchedCpuServer(LocalServerGroup):
    """The 'cpu' kind's `stacx serve` children as `LaunchedServers` (restartable)."""

    process: CpuServerProcess
    """The first server (`processes[0]`)."""
    launch: Optional[ServerLaunch] = None
    """What started them (a restart starts the same server again)."""
    others: list = field(default_factory=list)
    """The second and further servers (--rollout-num-engines)."""

    @property
    def processes(self) -> list:
        return [self.process, *self.others]

    def restart(self, index: int) -> str:
        """Stop server `index` (killed if it does not stop: it may be hung) and start it again on its URL;
        returns the URL once it serves (the checkpoint's weights, version 0)."""
        old = self.processes[index]
        if old.url is None or self.launch is None:
            raise RuntimeError(f"rollout server {index} never became ready; it cannot be restarted")
        stop_process(old.process, timeout_s=5)
        port = int(old.url.rsplit(":", 1)[1])
        new = CpuServerProcess(self.launch.hf_checkpoint, seed=self.launch.seed + index, api_key=self.launch.api_key,
                               port=port, extra_args=self.launch.lora_flags)
        if index == 0:
            self.process = new
        else:
            self.others[index - 1] = new
        return new.url


def launch_cpu_server(launch: ServerLaunch) -> LaunchedCpuServer:
    """Start `launch.num_servers` `stacx serve` processes on loopback without waiting for them: they
    load their model while the run's role workers start."""
    started = [CpuServerProcess(launch.hf_checkpoint, seed=launch.seed + index, api_key=launch.api_key, wait=False,
                                extra_args=launch.lora_flags)
               for index in range(launch.num_servers)]
    return LaunchedCpuServer(started[0], launch, started[1:])


@dataclass(eq=False)
class LaunchedSglangServers:
    """The SGLang server actors of the 'sglang' kind as `LaunchedServers` (ready when launched; restartable)."""

    actors: Sequence[Any]
    urls: tuple[str, ...]
    specs: Sequence[SglangServerSpec] = ()
    """What started each server (a restart starts the same server again on its node and port); () when unknown."""
    launch_on_ray: Any = launch_sglang_servers_on_ray
    """(specs, pin_to_host=) -> (actors, urls): how a server is started again (tests give a fake)."""

    def wait_until_ready(self) -> tuple[str, ...]:
        return self.urls

    def restart(self, index: int) -> str:
        """Kill server `index`'s actor (it may be hung) and start the same server again, pinned to its node and
        bound to its address and port; returns its URL once it is healthy (the checkpoint's weights)."""
        if index >= len(self.specs):
            raise RuntimeError(f"SGLang server {index} was started without a spec; it cannot be restarted")
        url = self.urls[index]
        _kill_actor(self.actors[index])
        host = url.split("://", 1)[1].rsplit(":", 1)[0]
        spec = dataclasses.replace(self.specs[index], host=host, port=int(url.rsplit(":", 1)[1]))
        actors, urls = self.launch_on_ray([spec], pin_to_host=True)
        self.actors = [*self.actors[:index], actors[0], *self.actors[index + 1:]]
        if urls[0] != url:  # the run's clients and weight pushes know the old address
            raise RuntimeError(f"SGLang server {url} came back at {urls[0]}; the run's clients cannot follow it")
        return url

    def stop(self) -> None:
        """Kill every actor (best effort: a failure to kill one never keeps the others alive)."""
        # Imported here: Ray is slow to import (start-up time), and only this kind needs it.
        import ray

        actors, self.actors = list(self.actors), []
        for actor in actors:
            try:
                ray.kill(actor)
            except Exception:  # noqa: BLE001 - best-effort teardown
                pass


def _kill_actor(actor: Any) -> None:
    """Kill one server actor (best effort: it may be gone already)."""
    # Imported here: Ray is slow to import (start-up time), and only this kind needs it.
    import ray

    try:
        ray.kill(actor)
    except Exception:  # noqa: BLE001 - a dead actor is what a restart expects
        pass


def launch_sglang_servers(launch: ServerLaunch) -> LaunchedSglangServers:
    """One SGLang server on the Ray cluster's GPUs (blocks until it is healthy)."""
    if launch.num_servers != 1:
        raise ValueError(f"--rollout-num-engines {launch.num_servers}: the 'sglang' kind launches one server; start "
                         "more yourself and attach them with --rollout-engine http --rollout-urls")
    extra = ("--enable-return-routed-experts",) if launch.return_routed_experts else ()
    if launch.lora_flags:  # --lora-sync adapters: SGLang's LoRA API takes the pushes
        extra += tuple(sglang_lora_args(launch.lora_flags))
    specs = [SglangServerSpec(model_path=launch.hf_checkpoint, port=SGLANG_PORT, api_key=launch.api_key,
                              extra_args=extra)]
    actors, urls = launch_sglang_servers_on_ray(specs)
    return LaunchedSglangServers(actors, tuple(urls), specs)
