"""The run-config sections the rollout reads: `rollout:` (engine, data, sampling, rewards,
evaluation) and `teacher:` (teacher server, distillation, DAgger roll-ins).

They are sections of the run config (`stacx.trainer.config.run.RunConfig.rollout` and `.teacher`,
one flag per field, e.g. `--rollout-engine`), defined here so that the rollout receives the
sections it reads and never imports the trainer for them.
"""

from __future__ import annotations

from dataclasses import dataclass

from stacx.ranges import require_in_range


@dataclass(frozen=True, kw_only=True)
class RolloutSection:
    rollout_engine: str = "auto"
    """Engine kind: 'cpu' (`stacx serve` started on loopback), 'http' (attach to rollout_urls), 'sglang' (SGLang
    servers on the Ray cluster's GPUs), 'vllm' (vLLM's server from its own environment, docs/vllm.md), 'auto'
    (sglang on GPU, else cpu), or a kind registered with
    @register_engine (docs/adding-an-engine.md)."""
    rollout_urls: tuple[str, ...] = ()
    """URLs of running inference servers to attach to (with 'http', and with 'vllm' instead of launching one)."""
    rollout_num_engines: int = 1
    """Servers the run starts for an engine kind it launches ('cpu': that many `stacx serve` processes;
    'sglang' starts one); requests are spread over them, each takes every weight update."""
    min_live_engines: int = 1
    """With several engines, the run goes on while at least this many are live (a dead or hung one is
    restarted, or set aside until its health check passes, docs/fault_tolerance.md); below it, it stops
    naming each engine out and why."""
    engine_deadline_s: float = 3600.0
    """Seconds one generation call on an engine may run before the engine counts as hung."""
    engine_health_interval_s: float = 10.0
    """Seconds between health checks of an engine while a generation runs on it (it counts as dead after
    stacx.rollout.engine_health.HEALTH_MISSES missed in a row), and of a set-aside engine."""
    attached_engine_wait_s: float = 600.0
    """Seconds an attached engine (--rollout-urls: the run cannot restart it) that failed is waited for when too
    few engines are live (--min-live-engines): its health is checked every --engine-health-interval-s, and when it
    answers it gets the current weights and the run goes on; after this long the run stops naming it. 0: stop at
    once."""
    episode_retries: int = 2
    """Times an episode that failed for an infrastructure reason (sandbox server gone, tool transport error,
    agent program crash it reported as such, reward call error; never a bad action or a timeout the policy
    caused) is played again before it is dropped and its group replaced by a fresh prompt."""
    max_dropped_fraction: float = 0.25
    """A step whose dropped episodes exceed this fraction of its episodes stops the run, naming the cause."""
    vllm_python: str | None = None
    """--rollout-engine vllm: the python of the vLLM environment the run starts its server with (default:
    $STACX_VLLM_PYTHON; `scripts/setup_vllm_venv.sh` makes one; docs/vllm.md)."""
    vllm_weight_transfer: str = "auto"
    """--rollout-engine vllm: how the trainer's weights reach the server. 'auto' (Stacx's buckets through its
    worker extension: same-host shared memory for a loopback server, else in the request), 'shm', 'http', or
    vLLM's own weight-transfer API: 'nccl' (GPU; the sending trainer rank broadcasts to the server's workers) or
    'gloo' (the same API on CPU). A server the run launches is started for it; an attached one must be started
    with vLLM's --weight-transfer-config (docs/vllm.md)."""
    weight_check_every: int = 1
    """After every Nth weight push, compare a digest of every tensor the engine holds with the trainer's; a
    mismatch stops the run naming the tensor (0: never; docs/vllm.md, 'Post-sync check')."""
    agent: str | None = None
    """Bring your own scaffold: 'path/to/file.py:function' or 'module:function', called once per episode as
    function(base_url, task) -> reward (or None: --reward-fn scores the last turn). It talks to the
    run's engine through the OpenAI-compatible base URL it is given; its turns are trained on
    (docs/openai-endpoint.md). `task` is the prompt row: prompt, label and metadata."""
    agent_command: str | None = None
    """Bring your own scaffold as a program: a command line run once per episode ('{base_url}' and
    '{task_json}' are replaced, shell-quoted inside a `sh -c` script) with a scrubbed environment
    (PATH, HOME, locale, OPENAI_BASE_URL, OPENAI_API_KEY, STACX_TASK, STACX_REWARD_FILE, the --agent-env
    names); the reward it writes to the file STACX_REWARD_FILE names is the episode's, else --reward-fn
    scores the last turn (stdout is never read as a reward). Its agent's commands run where the program
    runs them: a scaffold's own local environment runs the policy's commands on this host as this user,
    so run them in a sandbox (stacx.sandbox.agent_environment; docs/agents.md)."""
    agent_env: tuple[str, ...] = ()
    """Names of this process's environment variables an --agent-command program also gets (e.g. HF_HOME);
    every other variable (tokens, keys) is withheld from it."""
    agent_timeout: float = 3600.0
    """Seconds one --agent-command episode may run; then the program and every process of its group are
    killed and the episode fails (reward 0, its turns kept)."""
    agent_max_parallel_episodes: int = 8
    """Agent episodes run at once (--agent / --agent-command)."""
    prompt_data: str | None = None
    """JSONL or Parquet file of prompts, or 'builtin:<task>' for a built-in task."""
    input_key: str = "prompt"
    """Dataset key of the prompt (text or chat messages)."""
    label_key: str = "label"
    """Dataset key of the reference answer passed to the reward function."""
    metadata_key: str = "metadata"
    """Dataset key of per-sample metadata passed to the reward function."""
    apply_chat_template: bool = False
    """Format prompts with the checkpoint tokenizer's chat template."""
    rollout_batch_size: int = 8
    """Prompts per rollout step (rollout_batch_size x n_samples_per_prompt samples, trained on in
    num_steps_per_rollout optimizer steps of global_batch_size samples)."""
    n_samples_per_prompt: int = 4
    """Responses sampled per prompt (the group size of GRPO-style estimators)."""
    rollout_max_response_len: int = 64
    """Maximum response tokens per sample. Unless given, at most half the model's context (a tiny
    model with a 64-token context gets 32)."""
    rollout_temperature: float = 1.0
    """Sampling temperature; training log-probs use the same temperature."""
    rollout_top_p: float = 1.0
    """Nucleus sampling threshold."""
    rollout_top_k: int = -1
    """Top-k sampling (-1: off)."""
    rollout_seed: int = 0
    """Seed of the rollout sampler."""
    reward_fn: str = "exact_match"
    """Built-in reward name or 'module:function' import path."""
    reward_timeout_s: float | None = None
    """Seconds one reward call may take before the run stops naming it (unset: the function's @reward_timeout, else 120)."""
    dynamic_sampling: bool = False
    """Drop groups whose rewards are all equal and over-sample to refill the batch (DAPO)."""
    over_sampling_factor: float = 1.5
    """How many prompts dynamic sampling draws per needed prompt."""
    rollout_mode: str = "sync"
    """'sync': each step trains on a rollout of the weights it trains (generation and training take
    turns); 'async': a driver thread keeps the engine generating while the trainer trains, each
    sample at most --max-staleness policy versions behind the step that trains it."""
    max_staleness: int = 1
    """Async mode: samples generated by policy version v are trained at versions up to v + K
    (admission control: nothing is discarded; 0 reproduces the synchronous run)."""
    use_routing_replay: bool = False
    """Mixture-of-experts models: the engine returns the experts it routed each token to, and the
    policy's training forwards (loss and pi_old) route the same way instead of routing again (R3;
    docs/models.md, "Routing replay"). The reference routes itself."""
    partial_rollout: bool = False
    """Async mode: at a weight update, in-flight generations are interrupted, kept and continued
    under the new weights (without it the update waits for them to finish)."""
    malformed_rows: str = "fail"
    """'fail' or 'skip' dataset rows that cannot be parsed (reported with file and line)."""
    eval_data: str | None = None
    """Held-out prompts evaluated every eval_interval steps."""
    eval_interval: int = 0
    """Steps between evaluations, the first of the starting model before step 1 (0: never)."""
    eval_n_samples: int = 1
    """Samples per eval prompt (pass@k uses them)."""
    eval_temperature: float = 0.0
    """Eval sampling temperature (0: greedy)."""
    save_rollouts_per_step: int = 4
    """Rollouts per step written to rollouts.jsonl for inspection."""

    def weight_transfer_for(self, engine_kind: str) -> str | None:
        """The weight transfer a push to an engine of `engine_kind` asks for (`EngineTarget.weight_transfer`):
        --vllm-weight-transfer for vLLM when set, else None (the kind's own)."""
        return self.vllm_weight_transfer if engine_kind == "vllm" and self.vllm_weight_transfer != "auto" else None

    def __post_init__(self):
        require_in_range("--min-live-engines", self.min_live_engines, at_least=1)
        require_in_range("--engine-deadline-s", self.engine_deadline_s, above=0)
        require_in_range("--engine-health-interval-s", self.engine_health_interval_s, above=0)
        require_in_range("--attached-engine-wait-s", self.attached_engine_wait_s, at_least=0)


@dataclass(frozen=True, kw_only=True)
class TeacherSection:
    teacher_url: str | None = None
    """URL of the frozen teacher server (distillation recipes)."""
    teacher_engine: str = "http"
    """Engine kind of the --teacher-url server, as --rollout-engine names kinds: 'http' (a server that speaks
    `/generate`: `stacx serve` or SGLang), 'vllm' (vLLM's OpenAI server: prompt log-probs and top-k), or a
    registered kind whose client scores."""
    teacher_top_k: int = 8
    """Top-K of teacher log-probs requested for top-K reverse KL."""
    teacher_timeout_s: float = 60.0
    """Per-request timeout of teacher calls."""
    teacher_retries: int = 3
    """Retries with exponential backoff before a teacher call fails the run."""
    distill_kl_mode: str = "k3_sample"
    """'k3_sample' (single-sample K3 on the chosen token) or 'topk' (union of top-K supports)."""
    dagger_sampling_mode: str = "beta"
    """'beta' (per-turn beta-mixture DAgger) or 'kappa' (trajectory-level AggreVaTe)."""
    dagger_sft_mode: str = "live"
    """'live' rollouts or 'trajectory' replay of a saved teacher corpus."""
    trajectory_corpus: str | None = None
    """JSONL teacher corpus for trajectory replay."""
    dagger_beta_schedule: str = "linear"
    """'linear', 'cosine', 'exponential' or 'step' decay of beta."""
    dagger_beta_start: float = 1.0
    """Initial probability that the teacher acts in a turn."""
    dagger_beta_end: float = 0.0
    """Final beta."""
    dagger_beta_iters: int = 5
    """Iterations over which beta decays."""
    dagger_kappa_start: int = 0
    """T_max(0) of AggreVaTe roll-ins."""
    dagger_kappa_step: int = 20
    """Growth of T_max per iteration."""
    dagger_kappa_cap: int = 100
    """Upper bound of T_max."""
