"""The rollout section of the config (``rollout``): engines, sampling, agents and the REST API.

Beside it, the checks that read only this section, and :func:`parse_resources`, the one reading of
``rollout.engine_resources`` (the Ray engine launcher places actors by it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from relax.config.fields import ConfigError, opt


@dataclass
class RolloutConfig:
    """Generation: engines and sampling."""

    engine: str = opt("native", "Inference engine: the native PyTorch engine or SGLang servers (GPU).",
                      choices=("native", "sglang"))
    num_engines: int = opt(1, "Engine replicas at start (the elastic API can change it).", range=(1, 4096))
    engine_processes: int = opt(
        0, "Native engine server processes the rollout starts and owns behind the router, each replaced with the "
        "current weights if it dies or turns unhealthy; 0 = one engine inside the rollout process. Ignored with "
        "--engine-url (those engines are routed around when they fail, never replaced).", range=(0, 4096))
    engine_launcher: str = opt(
        "process", "Where engine processes the rollout owns run: 'process' = children of the rollout process on its "
        "host; 'ray' = Ray actors holding engine_cpus and engine_gpus each, placed by the Ray cluster. 'ray' needs a "
        "running Ray cluster and the model folder at the same path on every node.", choices=("process", "ray"))
    engine_cpus: float = opt(1.0, "CPUs each Ray engine actor holds (engine_launcher=ray).", range=(0.0, 1024.0))
    engine_gpus: float = opt(0.0, "GPUs each Ray engine actor holds (engine_launcher=ray).", range=(0.0, 64.0))
    engine_resources: str = opt(
        "", "Custom Ray resources each engine actor holds (engine_launcher=ray) as name=amount pairs joined by "
        "commas, e.g. 'rollout_node=1': engines then run only on nodes started with those resources.")
    sglang_module: str = opt(
        "sglang.launch_server", "Python module the rollout runs as each SGLang server it owns (rollout.engine=sglang, "
        "python -m MODULE with SGLang's flags and the engine token); any other module must declare "
        "RELAX_SGLANG_STAND_IN = True at top level (tests name such a stand-in that serves the native engine).")
    weight_sync: str = opt(
        "disk", "How HTTP engines get each weight version: 'disk' = each reads its folder; 'broadcast' = the "
        "rollout reads it once and broadcasts it over one process group (SGLang's /update_weights_from_distributed), "
        "falling back to disk when that fails (docs/engines.md).", choices=("disk", "broadcast"))
    max_engine_processes: int = opt(
        0, "Most engine processes the rollout may own at once, replacements and REST API scale-outs included "
        "(a scale-out past it is refused as a whole); 0 = engine_processes.", range=(0, 4096))
    api_port: int = opt(
        0, "Serve the elastic rollout REST API (docs/rest_api.md) from the rollout process on this port; 0 = off. "
        "Needs HTTP engines (engine_processes > 0 or --engine-url) and the bearer token in the RELAX_API_TOKEN "
        "environment variable.", range=(0, 65535))
    api_host: str = opt("127.0.0.1", "Address the rollout REST API binds (0.0.0.0 to reach it from other hosts).")
    engine_timeout_s: float = opt(
        120.0, "A request to an HTTP engine that takes longer fails on that engine and is re-sent to another; "
        "also how long the rollout waits for a replacement engine while none serves.", range=(0.1, 86400.0))
    engine_max_failures: int = opt(
        3, "Consecutive faulty answers (malformed, timed out, HTTP 5xx) after which an HTTP engine is taken out "
        "of rotation; a good answer resets the count. An unreachable engine is taken out at once.",
        range=(1, 1000))
    supervise_interval_s: float = opt(
        5.0, "Seconds between engine supervision passes (HTTP engines): owned engines that died or are "
        "unhealthy are replaced; engines given by URL that answer /health again, with the current weights "
        "(loaded if needed), are routed to again. 0 disables supervision.", range=(0.0, 3600.0))
    n_samples_per_prompt: int = opt(8, "Responses per prompt (the GRPO group size).", range=(1, 1024))
    prompts_per_step: int = opt(16, "Prompts per training step; batch = prompts_per_step * n_samples_per_prompt.",
                                range=(1, 1_000_000))
    temperature: float = opt(1.0, "Sampling temperature.", range=(0.0, 10.0))
    top_p: float = opt(1.0, "Nucleus sampling mass.", range=(0.0, 1.0))
    top_k: int = opt(-1, "Top-k sampling; -1 disables.", range=(-1, 1_000_000))
    max_new_tokens: int = opt(16, "Longest response in tokens.", range=(1, 1_048_576))
    max_turns: int = opt(4, "Most assistant turns in a multi-turn (agent) episode.", range=(1, 1000))
    max_episode_tokens: int = opt(
        0, "Most policy tokens over all turns of one episode (built-in loop and gateway sessions); the turn that "
        "reaches it is cut there and the episode ends. 0 = no limit beyond max_turns * max_new_tokens.",
        range=(0, 1 << 30))
    env_fn: str = opt(
        "", "Dotted path 'package.module:function' of a custom env factory make_env(sample) -> Env "
        "(relax.data.suite.Env, docs/tasks.md) that runs every sample through the agent loop with a fresh env. "
        "Empty = each task's own env (tool_lookup); the other tasks are single-turn.")
    partial_rollout: str = opt(
        "wait", "On a weight update mid-generation: 'wait' for in-flight requests, or 'abort' and resume them "
        "with the new weights.", choices=("wait", "abort"))
    dynamic_sampling: bool = opt(False, "DAPO: drop prompt groups whose rewards are all equal, over-sample to refill.")
    stop: list[str] = opt(
        ["</answer>"], "Stop strings: a response ends right after the first one it generates, which stays in the "
        "response (docs/tasks.md). [] generates to end-of-turn or max_new_tokens.")
    session_done_fn: str = opt(
        "", "Dotted path 'package.module:function' of done(sample, response) -> bool, asked after each gateway "
        "session turn (agents=external) with the transcript so far; true ends the episode (docs/agents.md).")
    tool_format: str = opt(
        "auto", "How the policy writes tool calls, which the session gateway returns as tool calls: 'qwen' "
        "(<tool_call> JSON blocks), 'llama3' (a bare JSON call); 'auto' = by model.family (docs/agents.md).",
        choices=("auto", "qwen", "llama3"))
    agents: str = opt(
        "builtin", "Who runs the episodes: 'builtin' = the rollout's own loop (single-turn, or the task's env); "
        "'external' = outside programs through the session gateway (docs/agents.md).", choices=("builtin", "external"))
    gateway_host: str = opt("127.0.0.1", "Address the session gateway binds (agents=external); 0.0.0.0 to reach it "
                            "from other hosts.")
    gateway_port: int = opt(
        0, "Port of the session gateway (agents=external); 0 = a free port, bound again by a restarted rollout. "
        "Its URL is logged and written to <run>/gateway.json.", range=(0, 65535))
    session_timeout_s: float = opt(
        60.0, "Seconds an open gateway session may stay idle before it is dropped (no sample) and its episode "
        "offered to another agent.", range=(0.1, 86400.0))
    session_max_retries: int = opt(
        3, "Times one episode is offered again after its sessions were dropped before the batch fails with an "
        "error.", range=(0, 1000))
    agent_reward_min: float = opt(
        -1.0, "Smallest reward an external agent may post (agents=external); below it the post is a 400. The "
              "built-in tasks' verifiers score in [0, 1].", range=(-1e6, 1e6))
    agent_reward_max: float = opt(
        1.0, "Largest reward an external agent may post; above it the post is a 400 (a reward such as 1e39 "
             "would be inf in the float32 reward column and make every advantage of its batch NaN).",
        range=(-1e6, 1e6))


def check_agent_reward_range(cfg: Any) -> None:
    ro = cfg.rollout
    if ro.agents == "external" and ro.agent_reward_min >= ro.agent_reward_max:
        raise ConfigError(f"rollout.agent_reward_min={ro.agent_reward_min:g} must be below rollout.agent_reward_max="
                          f"{ro.agent_reward_max:g}: they bound the rewards agents may post")


def check_max_episode_tokens(cfg: Any) -> None:
    """A budget every episode stays under anyway is a setting that does nothing: say so."""
    r = cfg.rollout
    if r.max_episode_tokens and r.max_episode_tokens >= r.max_turns * r.max_new_tokens:
        raise ConfigError(f"rollout.max_episode_tokens={r.max_episode_tokens} is never reached: an episode has at "
                          f"most rollout.max_turns * rollout.max_new_tokens = {r.max_turns * r.max_new_tokens} "
                          f"policy tokens; set it below that, or 0 for no limit")


def check_session_done_fn(cfg: Any) -> None:
    ro = cfg.rollout
    if ro.session_done_fn and ro.agents != "external":
        raise ConfigError(f"rollout.session_done_fn={ro.session_done_fn!r} ends gateway sessions, and "
                          f"rollout.agents=builtin opens none (its episodes end by Env.step's done): set "
                          f"rollout.agents=external, or leave session_done_fn empty")


def check_gateway_port(cfg: Any) -> None:
    ro = cfg.rollout
    if ro.agents != "external" and ro.gateway_port:
        raise ConfigError(f"rollout.gateway_port={ro.gateway_port} serves external agents' sessions, and "
                          f"rollout.agents=builtin starts no gateway: set rollout.agents=external, or gateway_port=0")


def check_engine_kind_options(cfg: Any) -> None:
    """Settings of one engine kind are refused with the other, not ignored."""
    ro = cfg.rollout
    if ro.engine == "native" and ro.num_engines != 1:
        raise ConfigError(f"rollout.num_engines={ro.num_engines} sizes SGLang servers; native engines are "
                          f"rollout.engine_processes (0 = one inside the rollout): set that instead")
    if ro.engine == "sglang" and ro.engine_processes:
        raise ConfigError(f"rollout.engine_processes={ro.engine_processes} counts native engine processes; the SGLang "
                          f"servers the rollout launches are rollout.num_engines: set that, and engine_processes=0")
    # the judge's SGLang servers (genrm.engine=sglang) are launched as the rollout's would be
    if ro.engine == "native" and ro.sglang_module != "sglang.launch_server" and cfg.genrm.engine != "sglang":
        raise ConfigError(f"rollout.sglang_module={ro.sglang_module!r} is what runs as an SGLang server, and "
                          f"rollout.engine=native launches none: set rollout.engine=sglang (or genrm.engine=sglang), "
                          f"or drop sglang_module")


def check_engine_launcher(cfg: Any) -> None:
    """Placement settings the chosen engine launcher would not read are refused, not ignored."""
    ro = cfg.rollout
    if ro.engine_launcher == "ray" and ro.engine_processes == 0 and ro.engine != "sglang":
        raise ConfigError("rollout.engine_launcher=ray places engine processes, and rollout.engine_processes=0 runs "
                          "the engine inside the rollout: set engine_processes >= 1 or engine_launcher=process")
    parse_resources(ro.engine_resources)
    if ro.engine_resources and ro.engine_launcher != "ray":
        raise ConfigError("rollout.engine_resources are Ray resources each engine actor holds: they need "
                          "rollout.engine_launcher=ray")
    if ro.engine_launcher == "process" and (ro.engine_cpus != 1.0 or ro.engine_gpus != 0.0):
        raise ConfigError("rollout.engine_cpus and engine_gpus are what each Ray engine actor holds: they need "
                          "rollout.engine_launcher=ray (child processes take what the host has)")


def check_max_engine_processes(cfg: Any) -> None:
    ro = cfg.rollout
    if ro.max_engine_processes and ro.max_engine_processes < ro.engine_processes:
        raise ConfigError(f"rollout.max_engine_processes ({ro.max_engine_processes}) is below rollout.engine_processes "
                          f"({ro.engine_processes}); raise it, or 0 to cap at engine_processes")


# Ray's built-in resources: an actor asks for them through their own options (num_cpus, num_gpus,
# memory), and Ray refuses CPU and GPU inside ``resources=``; caught as the config loads, case-insensitively, so
# the error names the setting to use rather than surfacing from Ray at the first launch
_BUILTIN = {"cpu": "set it with rollout.engine_cpus", "gpu": "set it with rollout.engine_gpus",
            "memory": "Ray accounts memory itself", "object_store_memory": "Ray accounts memory itself"}


def parse_resources(text: str) -> dict[str, float]:
    """``'name=amount,...'`` (``rollout.engine_resources``) as ``{name: amount}``; ``''`` is ``{}``.

    Raises ConfigError naming the bad pair and the expected form: a pair not ``name=amount``, a
    name given twice or naming a built-in resource (CPU, GPU, memory have their own settings), or
    an amount that is not a positive number (at least 0.0001, the finest unit Ray counts).
    """
    form = "expected name=amount pairs joined by commas, e.g. 'rollout_node=1', each amount a positive number"
    out: dict[str, float] = {}
    if not text.strip():
        return out
    for pair in text.split(","):
        name, eq, amount = (part.strip() for part in pair.partition("="))
        bad = f"bad resource {pair.strip()!r} in rollout.engine_resources={text!r}"
        if not eq or not name or any(c.isspace() for c in name) or "=" in amount:
            raise ConfigError(f"{bad}: {form}")
        if name.lower() in _BUILTIN:
            raise ConfigError(f"{bad}: {name} is a built-in Ray resource, not a custom one "
                             f"({_BUILTIN[name.lower()]}); {form}")
        if name in out:
            raise ConfigError(f"{bad}: {name} is given twice; {form}")
        try:
            value = float(amount)
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and value >= 1e-4):
            raise ConfigError(f"{bad}: the amount must be a number >= 0.0001; {form}")
        out[name] = value
    return out
