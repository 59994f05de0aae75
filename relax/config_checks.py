"""Strict checks of a config tree, shared by the loader and ``RelaxConfig.from_json``.

:func:`build` turns a (partial) mapping into the dataclass tree, naming the closest valid key
for a typo and the accepted type for a wrong value; :func:`validate` checks every field's
``choices`` and ``range`` (``relax.config.opt`` metadata) and the rules that span fields.
It knows the tree only through its dataclass fields, so it imports no Relax module but its sibling
config checks (``relax.config_mode_checks``) and ``relax.config_errors``.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
import typing
from collections.abc import Mapping
from typing import Any

from relax.config_errors import ConfigError
from relax.config_mode_checks import distill_checks, routing_replay_checks


def build(cls: type, data: Any, prefix: str) -> Any:
    where = prefix.rstrip(".") or "config"
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where} must be a mapping of fields, got {type(data).__name__}: {data!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    for key in data:
        if key not in fields:
            close = difflib.get_close_matches(str(key), list(fields), n=1, cutoff=0.5)
            hint = f"; did you mean {prefix}{close[0]}?" if close else ""
            raise ConfigError(f"unknown config key {prefix}{key}{hint} (valid in {where}: {', '.join(fields)})")
    kwargs = {}
    for name, value in data.items():
        tp = hints[name]
        if dataclasses.is_dataclass(tp):
            kwargs[name] = build(tp, value, prefix + name + ".")
        else:
            kwargs[name] = _coerce(value, tp, prefix + name)
    return cls(**kwargs)


def _coerce(value: Any, tp: Any, name: str) -> Any:
    """Accept what a YAML file or a command line would naturally give; reject the rest."""
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{name} must be true or false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigError(f"{name} must be an integer, got {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)  # YAML 1.1 reads "1e-3" as a string
            except ValueError:
                pass
        raise ConfigError(f"{name} must be a number, got {value!r}")
    if tp is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"{name} must be a string, got {value!r}")
    if typing.get_origin(tp) is list:
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{name} must be a list (e.g. {name}=[a,b]), got {value!r}")
        (item_tp,) = typing.get_args(tp)
        return [_coerce(v, item_tp, f"{name}[{i}]") for i, v in enumerate(value)]
    raise ConfigError(f"{name}: unsupported field type {tp}")  # a bug in relax.config, not user input


def validate(cfg: Any, prefix: str = "") -> None:
    """Check every field's choices and range, recursively, then cross-field rules."""
    for f in dataclasses.fields(cfg):
        name = prefix + f.name
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            validate(value, name + ".")
            continue
        choices = f.metadata.get("choices")
        if choices is not None and value not in choices:
            close = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"{name} = {value!r} is not accepted{hint}; choose one of {list(choices)}")
        if isinstance(value, float) and not math.isfinite(value):  # NaN passes every comparison below
            raise ConfigError(f"{name} = {value!r} is not a finite number; give a value in the field's range")
        bounds = f.metadata.get("range")
        if bounds is not None:
            lo, hi = bounds
            if (lo is not None and value < lo) or (hi is not None and value > hi):
                raise ConfigError(f"{name} = {value!r} is out of range; accepted: {lo} <= {name} <= {hi}")
    if not prefix:  # the whole tree: the rules that span fields
        cross_checks(cfg)


MEGATRON_FAMILIES = ("qwen2", "qwen3", "llama", "qwen2_moe", "qwen3_moe")
PARALLEL_FIELDS = ("tensor_parallel", "pipeline_parallel", "context_parallel", "expert_parallel")


def backend_checks(t: Any, family: str) -> None:
    """Refuse a trainer layout the chosen backend would not honour, before any work starts."""
    bigger = {name: getattr(t, name) for name in PARALLEL_FIELDS if getattr(t, name) > 1}
    if t.backend == "torch" and bigger:
        raise ConfigError(f"trainer.{next(iter(bigger))}={next(iter(bigger.values()))} is a Megatron layout; the "
                          f"torch backend would ignore it: set trainer.backend=megatron or remove it")
    if t.backend == "torch" and t.distributed_optimizer:
        raise ConfigError("trainer.distributed_optimizer=true is megatron-core's optimizer; the torch backend would "
                          "ignore it: set trainer.backend=megatron or remove it")
    if t.backend == "torch" and t.checkpoint_format == "sharded":
        raise ConfigError("trainer.checkpoint_format=sharded writes megatron's model-parallel parts; the torch "
                          "backend's ranks hold whole replicas: set trainer.checkpoint_format=gathered or "
                          "trainer.backend=megatron")
    if t.backend != "megatron":
        return
    if family not in MEGATRON_FAMILIES:
        raise ConfigError(f"trainer.backend=megatron builds {list(MEGATRON_FAMILIES)} text models, not "
                          f"model.family={family!r}: use trainer.backend=torch")
    if t.context_parallel > 1 and t.expert_parallel > 1:
        raise ConfigError(f"trainer.context_parallel={t.context_parallel} with expert_parallel={t.expert_parallel}: "
                          f"the Megatron actor splits sequences at expert_parallel=1 only (docs/megatron.md); set "
                          f"one of them to 1")
    if t.expert_parallel > 1 and t.data_parallel % t.expert_parallel:
        raise ConfigError(f"trainer.expert_parallel={t.expert_parallel} splits the experts over data-parallel ranks "
                          f"and must divide trainer.data_parallel={t.data_parallel}: raise data_parallel to a "
                          f"multiple of it")
    if t.expert_parallel > 1 and t.pipeline_parallel > 1:
        raise ConfigError(f"trainer.expert_parallel={t.expert_parallel} with pipeline_parallel="
                          f"{t.pipeline_parallel}: expert-parallel ranks run their micro-batches in lockstep, "
                          f"which megatron's pipeline schedule does not do here; use pipeline_parallel=1")
    if t.micro_batch_layout == "prefix":
        raise ConfigError("trainer.micro_batch_layout=prefix shares a prompt's positions between responses, which "
                          "megatron's GPTModel cannot take: use pack, bucket or pad with trainer.backend=megatron")


SAFE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")  # what becomes a path segment (as lineage names)


def convention_checks(a: Any) -> None:
    """An algorithm option that the chosen estimator or loss would not read is refused, not ignored."""
    unused = [
        (a.is_level != "token", "is_level", a.is_level, "off_policy tis or icepop", a.off_policy in ("tis", "icepop")),
        (a.std_estimator != "population", "std_estimator", a.std_estimator,
         "advantage grpo, reinforce_pp, reinforce_pp_baseline or gae",
         a.advantage in ("grpo", "reinforce_pp", "reinforce_pp_baseline", "gae")),
        (a.gspo_clamp > 0, "gspo_clamp", a.gspo_clamp, "policy_loss gspo or gspo_token",
         a.policy_loss in ("gspo", "gspo_token")),
        (a.loss_agg_norm > 0, "loss_agg_norm", a.loss_agg_norm, "loss_agg seq-mean-token-sum-norm",
         a.loss_agg == "seq-mean-token-sum-norm"),
        (a.overlong_penalty != 1.0, "overlong_penalty", a.overlong_penalty, "overlong_buffer > 0",
         a.overlong_buffer > 0),
        (a.kl_estimator != "k3", "kl_estimator", a.kl_estimator, "kl_coef > 0", a.kl_coef > 0),
        (a.kl_clamp > 0, "kl_clamp", a.kl_clamp, "kl_coef > 0", a.kl_coef > 0),
        (a.kl_in_reward, "kl_in_reward", a.kl_in_reward, "kl_coef > 0", a.kl_coef > 0),
        (a.dual_clip_c != 3.0, "dual_clip_c", a.dual_clip_c, "policy_loss dual_clip", a.policy_loss == "dual_clip"),
        (a.is_cap != 2.0, "is_cap", a.is_cap, "off_policy decoupled, tis or icepop",
         a.off_policy in ("decoupled", "tis", "icepop")),
        # verl's reinforce_plus_plus_baseline spreads r - mean over the tokens undiscounted: refused there
        (a.gamma != 1.0, "gamma", a.gamma, "advantage gae or reinforce_pp", a.advantage in ("gae", "reinforce_pp")),
        (a.lam != 0.95, "lam", a.lam, "advantage gae", a.advantage == "gae"),
        (a.value_clip != 0.2, "value_clip", a.value_clip, "advantage gae (the critic)", a.advantage == "gae"),
    ]
    for set_, name, value, needs, used in unused:
        if set_ and not used:
            raise ConfigError(f"algorithm.{name}={value} is read only with {needs}: it would change nothing here; "
                              f"remove it or choose one of those")


def engine_checks(cfg: Any) -> None:
    """Engine settings that the chosen engine layout would not read are refused, not ignored."""
    ro = cfg.rollout
    if ro.engine == "native" and ro.num_engines != 1:
        raise ConfigError(f"rollout.num_engines={ro.num_engines} sizes SGLang servers; native engines are "
                          f"rollout.engine_processes (0 = one inside the rollout): set that instead")
    if ro.engine == "sglang" and ro.engine_processes:
        raise ConfigError(f"rollout.engine_processes={ro.engine_processes} counts native engine processes; the SGLang "
                          f"servers the rollout launches are rollout.num_engines: set that, and engine_processes=0")
    if ro.engine == "native" and ro.sglang_module != "sglang.launch_server":
        raise ConfigError(f"rollout.sglang_module={ro.sglang_module!r} is what runs as an SGLang server, and "
                          f"rollout.engine=native launches none: set rollout.engine=sglang, or drop sglang_module")
    # an SGLang server runs on the GPUs its Ray actor holds: as many as its tensor-parallel size (the rollout's
    # GPUs split over its servers, relax.engines.sglang.launch.tp_size); stand-ins on CPU hold none
    per_server = max(1, cfg.resources.rollout_gpus // max(1, ro.num_engines))
    if (ro.engine == "sglang" and ro.engine_launcher == "ray" and ro.sglang_module == "sglang.launch_server"
            and ro.engine_gpus != per_server):
        raise ConfigError(f"rollout.engine_gpus={ro.engine_gpus:g} per Ray engine actor, but each SGLang server "
                          f"runs tensor parallel {per_server} (resources.rollout_gpus / rollout.num_engines): set "
                          f"rollout.engine_gpus={per_server}")
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


# the families each built-in tiny model (relax.models.builders) can be built as
BUILTIN_FAMILIES = {"tiny-qwen2": ("qwen2", "qwen3", "llama", "qwen2_moe", "qwen3_moe"), "tiny-qwen2-vl": ("qwen2_5_vl",),
                    "tiny-qwen2-audio": ("qwen2_audio",), "tiny-omni": ("qwen2_5_omni",)}
TEXT_FAMILIES = ("qwen2", "qwen3", "llama")  # what a media built-in's own text decoder stands for


def choice_checks(cfg: Any) -> None:
    """A ``choices`` value that the rest of the config would ignore, or that would fail mid-run,
    is refused here, naming the field, the value and what to use instead."""
    m = cfg.model
    allowed = BUILTIN_FAMILIES.get(m.name_or_path)
    # a text family on a media built-in still loads (the built-in decides the classes there)
    if allowed and m.family not in allowed and m.family not in TEXT_FAMILIES:
        builtin = next(name for name, fams in BUILTIN_FAMILIES.items() if m.family in fams)
        raise ConfigError(f"model.family={m.family!r} cannot be built from model.name_or_path={m.name_or_path!r} "
                          f"(families {list(allowed)}): use model.name_or_path={builtin} for {m.family}, or "
                          f"model.family in {list(allowed)}")
    d = cfg.data
    if d.format != "relax" and not d.train_url:
        raise ConfigError(f"data.format={d.format!r} is the row format of data.train_url/eval_url, and data.train_url "
                          f"is empty (the built-in task suite, which ignores it): set data.train_url to your "
                          f"{d.format} file, or data.format=relax")
    ro = cfg.rollout
    if ro.partial_rollout == "abort":
        why = next((reason for applies, reason in (
            (cfg.topology == "colocated", "topology=colocated generates and trains in turn"),
            (cfg.queue.max_staleness == 0, "queue.max_staleness=0 makes each batch wait for its own weights"),
            (ro.engine != "native" or ro.engine_processes > 0,
             f"rollout.engine={ro.engine} with engine_processes={ro.engine_processes} serves over HTTP, and only "
             f"the in-process native engine aborts")) if applies), "")
        if why:
            raise ConfigError(f"rollout.partial_rollout=abort would change nothing here ({why}, so no generation is "
                              f"cut by new weights): use rollout.partial_rollout=wait, or abort with topology async "
                              f"or disaggregated, queue.max_staleness >= 1 and rollout.engine_processes=0")


def cross_checks(cfg: Any) -> None:
    if not SAFE_NAME.fullmatch(cfg.run_id):
        raise ConfigError(f"run_id = {cfg.run_id!r} becomes a folder under <root>/runs/: use a name without '/' of "
                          f"letters, digits, '.', '_' or '-', starting with a letter or digit")
    r = cfg.resources
    if r.rollout_gpus + r.actor_gpus > r.num_gpus:
        raise ConfigError(
            f"resources.rollout_gpus ({r.rollout_gpus}) + resources.actor_gpus ({r.actor_gpus}) exceed "
            f"resources.num_gpus ({r.num_gpus}); raise num_gpus or lower the role GPUs"
        )
    if cfg.algorithm.advantage == "gae" and not cfg.model.value_head:
        raise ConfigError("algorithm.advantage = 'gae' needs a critic: set model.value_head=true")
    unknown = sorted(set(cfg.trainer.freeze_encoders) - {"vision", "audio"})
    if unknown:
        raise ConfigError(f"trainer.freeze_encoders: unknown encoder(s) {unknown}; use 'vision' and/or 'audio'")
    backend_checks(cfg.trainer, cfg.model.family)
    if cfg.trainer.freeze_encoders and cfg.trainer.backend != "torch":
        raise ConfigError("trainer.freeze_encoders is supported by the torch backend only; "
                          "set trainer.backend=torch or remove it")
    t = cfg.trainer
    if t.thaw_encoders_at and t.freeze_encoders and t.data_parallel > 1:
        raise ConfigError("trainer.thaw_encoders_at needs trainer.data_parallel=1: DDP fixes the parameters it "
                          "synchronises when it wraps the model, so a thawed encoder would drift apart per rank")
    ranks = t.actor_processes
    if ranks > 1 and cfg.topology == "colocated" and cfg.algorithm.advantage == "gae":
        raise ConfigError(f"a {ranks}-rank actor (trainer.data/tensor/pipeline/context_parallel) in the colocated "
                          f"topology would share its process group with the critic, which trains in the same "
                          f"process: use topology=disaggregated (each role its own process) or a one-rank actor")
    per_update = cfg.rollout.prompts_per_step * cfg.rollout.n_samples_per_prompt // max(1, t.mini_batches)
    if per_update < t.data_parallel:
        raise ConfigError(f"trainer.data_parallel={t.data_parallel} ranks but each optimizer step trains "
                          f"{per_update} samples (rollout.prompts_per_step x n_samples_per_prompt / "
                          f"trainer.mini_batches): every rank needs one; raise the batch or lower data_parallel")
    if cfg.data.judge_url and cfg.data.reward_fn:
        raise ConfigError("data.judge_url and data.reward_fn both replace the task verifiers; set one of them")
    if cfg.algorithm.near_miss_credit and (cfg.data.reward_fn or cfg.data.judge_url):
        raise ConfigError("algorithm.near_miss_credit shapes the built-in task verifiers, which data.reward_fn and "
                          "data.judge_url replace: give partial credit inside your own reward, or set it to 0")
    if cfg.data.judge_url and not cfg.data.judge_url.startswith(("http://", "https://")):
        raise ConfigError(f"data.judge_url {cfg.data.judge_url!r} must be an http(s) URL of an OpenAI-compatible "
                          f"server (e.g. http://judge-host:30000)")
    if cfg.algorithm.reference_role and cfg.algorithm.kl_coef == 0:
        raise ConfigError("algorithm.reference_role=true scores a reference nobody uses: set algorithm.kl_coef > 0 "
                          "or reference_role=false")
    if cfg.queue.exact_staleness and cfg.rollout.partial_rollout == "abort":
        raise ConfigError("queue.exact_staleness pins each batch to one policy version, and rollout.partial_rollout="
                          "abort switches versions mid-generation: set partial_rollout=wait or exact_staleness=false")
    a = cfg.algorithm
    convention_checks(a)
    routing_replay_checks(cfg)
    distill_checks(cfg)
    if a.overlong_buffer > cfg.rollout.max_new_tokens:
        raise ConfigError(f"algorithm.overlong_buffer ({a.overlong_buffer}) exceeds rollout.max_new_tokens "
                          f"({cfg.rollout.max_new_tokens}): the penalty ramps inside the length limit; lower it")
    if a.stuck_group_push and a.advantage not in ("grpo", "drgrpo", "rloo"):
        raise ConfigError(f"algorithm.stuck_group_push adds to a group estimator's advantage (grpo, drgrpo, rloo), "
                          f"not {a.advantage!r}: set it to 0 or change algorithm.advantage")
    if a.kl_topk and (a.kl_coef == 0 or a.kl_in_reward):
        raise ConfigError("algorithm.kl_topk is the actor's KL loss term: it needs algorithm.kl_coef > 0 and "
                          "kl_in_reward=false (a reward penalty sees only the sampled tokens); set kl_topk=0 or "
                          "change those")
    if a.kl_topk_weight != 1.0 and not a.kl_topk:
        raise ConfigError("algorithm.kl_topk_weight splits the KL between the top-k term and kl_estimator: it needs "
                          "algorithm.kl_topk > 0; set kl_topk or leave kl_topk_weight at 1")
    if a.kl_topk and a.kl_topk_weight == 0:
        raise ConfigError("algorithm.kl_topk_weight=0 puts no weight on the top-k KL the reference would still "
                          "score: set algorithm.kl_topk=0 for kl_estimator alone")
    if cfg.data.reward_role:
        clash = [name for name, on in (("rollout.dynamic_sampling", cfg.rollout.dynamic_sampling),
                                       ("rollout.env_fn", bool(cfg.rollout.env_fn)),
                                       ("algorithm.advantage=gae", cfg.algorithm.advantage == "gae")) if on]
        if clash:
            raise ConfigError(f"data.reward_role=true cannot run with {', '.join(clash)}: the rollout needs rewards "
                              f"as it generates (to filter groups, from the env) or the critic's stage expects them; "
                              f"turn those off or set data.reward_role=false")
    ro = cfg.rollout
    if ro.agents == "external":
        clash = {"rollout.env_fn": "the agents are the environment", "data.reward_role=true": "a session is scored "
                 "when it closes (the agent's reward, else the verifier)", "rollout.partial_rollout=abort": "weights "
                 "change only between batches, never under an open session"}
        on = [k for k, v in (("rollout.env_fn", ro.env_fn), ("data.reward_role=true", cfg.data.reward_role),
                             ("rollout.partial_rollout=abort", ro.partial_rollout == "abort")) if v]
        if on:
            raise ConfigError(f"rollout.agents=external cannot run with {on[0]} ({clash[on[0]]}): unset it, or use "
                              f"rollout.agents=builtin")
        if ro.agent_reward_min >= ro.agent_reward_max:
            raise ConfigError(f"rollout.agent_reward_min={ro.agent_reward_min:g} must be below rollout.agent_reward_max="
                              f"{ro.agent_reward_max:g}: they bound the rewards agents may post")
    elif ro.gateway_port:
        raise ConfigError(f"rollout.gateway_port={ro.gateway_port} serves external agents' sessions, and "
                          f"rollout.agents=builtin starts no gateway: set rollout.agents=external, or gateway_port=0")
    engine_checks(cfg)
    if ro.max_engine_processes and ro.max_engine_processes < ro.engine_processes:
        raise ConfigError(f"rollout.max_engine_processes ({ro.max_engine_processes}) is below rollout.engine_processes "
                          f"({ro.engine_processes}); raise it, or 0 to cap at engine_processes")
    choice_checks(cfg)
