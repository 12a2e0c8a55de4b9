"""Rollout engine kinds by name: the one place that `--rollout-engine`, `stacx eval --engine-kind`,
the rollout service and the policy ranks' weight pushes ask.

    from stacx.rollout.engines.registry import register_engine

    @register_engine("my_engine", launcher=launch_my_servers)   # in a --custom-module file
    class MyEngineClient(InferenceEngine):
        def __init__(self, url: str, *, api_key: str | None = None): ...

A kind declares, where it is registered:
- its **client**: `client(url, *, api_key=None, retry=RetryPolicy())` -> `InferenceEngine`, the
  driver's generation client and the policy ranks' weight-push client for one server of the kind
  (`retry`: `stacx eval` passes a longer timeout; subclassing `HttpEngine` gives all of this);
- its **launcher** (optional): `launcher(ServerLaunch) -> LaunchedServers`
  (`stacx.rollout.engines.launchers`), the servers a run starts; a kind without one attaches to
  the running servers of `--rollout-urls`;
- **owns_secret**: a run that launches the servers gives them a fresh shared secret (and every
  client sends it); otherwise the clients send the driver's STACX_API_KEY, if set;
- **starts_beside_workers**: the launcher returns at once and the servers load while the role
  workers start (the CPU engine); False: they are launched after the workers hold their
  resources (SGLang's GPUs);
- **launches_on_ray**: the launcher places the servers on the Ray cluster (SGLang's), so a
  torchrun job cannot overlap it with training (`--rollout-mode async`);
- **records_sessions**: the servers record the turns of OpenAI-compatible sessions with their
  token ids and log-probs (`stacx serve`), so `--agent` / `--agent-command` runs may use the kind;
- **sessions_through_recorder**: the servers record no sessions, but the client generates from token
  ids with per-token log-probs, so an agent run puts `stacx serve`'s session recorder in front of it
  (in the driver: `stacx.trainer.session_recorder`) and may use the kind too (vLLM).
- **weight_transfers**: ways of sending weights the client offers beyond its default
  (`client(url, ..., weight_transport=NAME)`), which the sending rank's client is built with when a run asks
  for one (vLLM: `--vllm-weight-transfer`, e.g. its NCCL weight-transfer engine).

Built-ins: 'cpu' (`stacx serve` as a child of the driver; with --rollout-urls, those running `stacx serve`s
join the pool too: `attaches_beside_launched`), 'http' (attach to --rollout-urls),
'sglang' (SGLang servers on the Ray cluster's GPUs), 'vllm' (vLLM's server from its own environment,
or attached with --rollout-urls: `attaches_with_urls`). 'auto' is no kind: it resolves to 'sglang'
with CUDA, else 'cpu' (`resolve_engine_kind`). A user kind comes from a `--custom-module` file (or
`stacx/custom/`) like every plugin; the file is shipped to the role workers, where the weight push
looks the kind up again. Names are unique: registering one twice is refused.
`docs/adding-an-engine.md` walks through a new kind.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, TypeVar

import torch

from stacx.plugins.registry import Registry
from stacx.rollout.engines.http import IF_OFFERED, HttpEngine
from stacx.rollout.engines.launchers import LaunchedServers, ServerLaunch, launch_cpu_server, launch_sglang_servers
from stacx.rollout.engines.sglang import SglangEngine
from stacx.rollout.engines.vllm import VLLM_WEIGHT_TRANSFERS, VllmEngine, launch_vllm_servers
from stacx.wire.engine import InferenceEngine
from stacx.wire.http_client import RetryPolicy

AUTO = "auto"
"""Not a kind: 'sglang' when CUDA is present, else 'cpu'."""

EngineClient = Callable[..., InferenceEngine]
"""`client(url, *, api_key=None, retry=RetryPolicy())` -> the InferenceEngine for one server (usually
the client class)."""
Launcher = Callable[[ServerLaunch], LaunchedServers]
C = TypeVar("C", bound=EngineClient)


@dataclass(frozen=True, kw_only=True)
class EngineKind:
    """One registered engine kind (module doc)."""

    name: str
    client: EngineClient
    """`client(url, *, api_key=None, retry=RetryPolicy())`: the InferenceEngine talking to one server of this kind."""
    launcher: Optional[Launcher] = None
    """Starts the run's servers; None: the run attaches to `--rollout-urls`."""
    owns_secret: bool = True
    """The servers the run launches get a fresh shared secret (only meaningful with a launcher)."""
    starts_beside_workers: bool = False
    """The launcher returns at once, and the servers load while the role workers start."""
    launches_on_ray: bool = False
    """The launcher places the servers on the Ray cluster, which a torchrun job does not have (its
    asynchronous rollout needs an engine in its own process)."""
    records_sessions: bool = False
    """The servers record OpenAI-compatible sessions turn by turn, token ids and log-probs included (`stacx
    serve`), which an `--agent` / `--agent-command` run trains on."""
    attaches_with_urls: bool = False
    """Given --rollout-urls, the run attaches to those servers instead of launching its own (vLLM)."""
    attaches_beside_launched: bool = False
    """Given --rollout-urls, the run attaches to those running servers (of this kind) as well as launching its own
    (`stacx serve`: 'cpu'): one pool whose launched engines are restarted and attached ones set aside when they
    fail (docs/fault_tolerance.md)."""
    takes_lora_adapters: bool = False
    """The servers take adapter-only pushes (--lora-sync adapters): the launcher starts them for the run's --lora-*
    flags (`ServerLaunch.lora_flags`), and the client loads the pushed adapters."""
    sessions_through_recorder: bool = False
    """The servers record no sessions, but the client takes and returns token ids with per-token log-probs:
    an `--agent` / `--agent-command` run records the sessions with `stacx serve`'s recorder in front of the
    client (stacx.trainer.session_recorder)."""
    weight_transfers: tuple[str, ...] = ()
    """The ways of sending weights the client offers beyond its default, given as `client(url, ...,
    weight_transport=NAME)` (vLLM: --vllm-weight-transfer); empty: one way only."""

    @property
    def serves_agents(self) -> bool:
        """An `--agent` / `--agent-command` run may use this kind: its servers record the sessions, or a
        recorder in front of its client does."""
        return self.records_sessions or self.sessions_through_recorder

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name or self.name == AUTO:
            raise ValueError(f"engine kind name must be a non-empty string other than {AUTO!r}, got {self.name!r}")
        if not callable(self.client):
            raise ValueError(f"engine kind {self.name!r}: client {self.client!r} is not callable")
        if self.launcher is not None and not callable(self.launcher):
            raise ValueError(f"engine kind {self.name!r}: launcher {self.launcher!r} is not callable")

    @property
    def attaches(self) -> bool:
        """The run starts no server of this kind: it attaches to `--rollout-urls`."""
        return self.launcher is None

    def attaches_to(self, rollout_urls) -> bool:
        """Whether a run with these --rollout-urls attaches rather than launches."""
        return self.attaches or (self.attaches_with_urls and bool(rollout_urls))

    def attached_beside(self, rollout_urls) -> tuple[str, ...]:
        """The --rollout-urls a run that launches this kind's servers attaches as well (() unless
        `attaches_beside_launched`)."""
        return tuple(rollout_urls) if self.attaches_beside_launched and not self.attaches_to(rollout_urls) else ()

    def connect(self, url: str, *, api_key: Optional[str] = None, retry: Optional[RetryPolicy] = None,
                weight_transfer: Optional[str] = None) -> InferenceEngine:
        """The client for the server at `url`; `api_key` is the server's secret; `retry` replaces the
        client's default timeouts and attempts; `weight_transfer` one of `weight_transfers` (None: the default)."""
        options = {} if retry is None else {"retry": retry}
        if weight_transfer is not None:
            if weight_transfer not in self.weight_transfers:
                raise ValueError(f"engine kind {self.name!r} sends weights one way only; weight transfer "
                                 f"{weight_transfer!r} is not one of its {list(self.weight_transfers)}")
            options["weight_transport"] = weight_transfer
        return self.client(url, api_key=api_key, **options)


ENGINE_KINDS: Registry[EngineKind] = Registry("engine kind", entries_are_callable=False)
"""Kind name -> its EngineKind (a `stacx.plugins.registry.Registry`: a name registered twice is refused)."""


def add_engine_kind(kind: EngineKind) -> EngineKind:
    """Register `kind`; a name registered before is refused with the registered names. A user kind's client
    module is shipped to the role workers, where the weight push looks the kind up again."""
    return ENGINE_KINDS.add(kind.name, kind, origin=kind.client)


def register_engine(name: str, *, launcher: Optional[Launcher] = None, owns_secret: bool = True,
                    starts_beside_workers: bool = False, launches_on_ray: bool = False,
                    records_sessions: bool = False, sessions_through_recorder: bool = False) -> Callable[[C], C]:
    """Class (or factory) decorator registering an engine kind whose client is the decorated object;
    the traits are those of `EngineKind`. Returns the client unchanged."""

    def decorator(client: C) -> C:
        add_engine_kind(EngineKind(name=name, client=client, launcher=launcher, owns_secret=owns_secret,
                                   starts_beside_workers=starts_beside_workers, launches_on_ray=launches_on_ray,
                                   records_sessions=records_sessions,
                                   sessions_through_recorder=sessions_through_recorder))
        return client

    return decorator


def unregister_engine(name: str) -> None:
    """Remove a user kind (tests and interactive sessions that redefine one)."""
    ENGINE_KINDS.unregister(name)


def engine_kind_names(*, discover: bool = True) -> list[str]:
    """The registered kinds, sorted: with `discover`, user kinds of `stacx/custom/` included
    (importing that folder first); `--custom-module` kinds once their files are loaded."""
    return ENGINE_KINDS.all_names() if discover else ENGINE_KINDS.names()


def resolve_engine_kind(name: str, *, flag: str = "--rollout-engine") -> EngineKind:
    """The kind `name` selects ('auto': 'sglang' with CUDA, else 'cpu'); an unknown name raises
    ValueError naming `flag`, the close matches and the registered kinds."""
    if name == AUTO:
        name = "sglang" if torch.cuda.is_available() else "cpu"
    known = engine_kind_names()
    if name not in ENGINE_KINDS:
        raise ValueError(f"{flag} {name!r} is not a registered engine kind; {ENGINE_KINDS.close_match_hint(name)}known: "
                         f"{[AUTO, *known]}. Register a new kind with @register_engine in a --custom-module file "
                         "(docs/adding-an-engine.md)")
    return ENGINE_KINDS[name]


def engine_client(kind: str, url: str, *, api_key: Optional[str] = None,
                  weight_transfer: Optional[str] = None) -> InferenceEngine:
    """The InferenceEngine client for a server of `kind` at `url` (an SGLang server gets SGLang's
    weight-update endpoints; `stacx serve` gets the bucket endpoint); `api_key` is the server's secret;
    `weight_transfer` one of the kind's `weight_transfers`."""
    return resolve_engine_kind(kind).connect(url, api_key=api_key, weight_transfer=weight_transfer)


def launched_stacx_serve_client(url: str, *, api_key: Optional[str] = None,
                                retry: RetryPolicy = RetryPolicy()) -> HttpEngine:
    """The client of a `stacx serve` the run launched: its `/generate` answers are streamed, so the tokens of a
    server that is killed mid-call are kept and continued on a live one (stacx.rollout.engines.streamed_generate).
    An attached server ('http', `attached_server_client`) is asked whether it streams."""
    return HttpEngine(url, retry, api_key=api_key, stream_progress=True)


def attached_server_client(url: str, *, api_key: Optional[str] = None,
                           retry: RetryPolicy = RetryPolicy()) -> HttpEngine:
    """The client of an attached server (`--rollout-urls`): `stacx serve` offers a streamed `/generate` (its
    `/get_model_info` says so), so a killed server's tokens are kept as with a launched one; another server
    (SGLang, which streams another format) is asked unstreamed."""
    return HttpEngine(url, retry, api_key=api_key, stream_progress=IF_OFFERED)


def sglang_client(url: str, *, api_key: Optional[str] = None, **options) -> SglangEngine:
    """A run's client of an SGLang server: its `/generate` answers are streamed (SGLang's event format), so the
    tokens of a server killed mid-call are kept and continued on a live one (stacx.wire.sglang_stream)."""
    return SglangEngine(url, api_key=api_key, stream_progress=True, **options)


add_engine_kind(EngineKind(name="cpu", client=launched_stacx_serve_client, launcher=launch_cpu_server, starts_beside_workers=True,
                           records_sessions=True, takes_lora_adapters=True, attaches_beside_launched=True))
add_engine_kind(EngineKind(name="http", client=attached_server_client, records_sessions=True, takes_lora_adapters=True))  # attaches to `stacx serve`
add_engine_kind(EngineKind(name="sglang", client=sglang_client, launcher=launch_sglang_servers, launches_on_ray=True,
                           takes_lora_adapters=True))
add_engine_kind(EngineKind(name="vllm", client=VllmEngine, launcher=launch_vllm_servers, starts_beside_workers=True,
                           attaches_with_urls=True, takes_lora_adapters=True, sessions_through_recorder=True,
                           weight_transfers=VLLM_WEIGHT_TRANSFERS))
