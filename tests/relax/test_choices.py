"""No silent choices (issue 44): every ``choices=`` value of the config tree either works or fails
before any work starts, with an error naming the field, the value and what to use instead.

The walk reads every ``(field, value)`` pair from the ``choices`` metadata of ``relax.config``'s
dataclasses, so a new choices field is walked without touching this file, and proves exactly one of:

* ``load``: ``load_config`` raises ``ConfigError`` naming the field and the value;
* ``preflight``: ``check_trainable(RunContext(cfg), None)`` raises it, before a run record exists;
* ``runs``: a one-step colocated run finishes, its ``run.json`` holds the value and, where a spy can
  tell cheaply, the value was in effect (the registered loss / estimator / correction was called, the
  model was built as that family, the trainer got that layout...);
* ``elsewhere``: a named existing test runs it (Ray, processes: too slow here); the pointer is
  checked to exist and to set the value, so it cannot rot.

Every pair must have an entry in ``EXPECTED``; a new value fails ``test_every_choice_is_accounted_for``
until its outcome is recorded there.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from relax.config import ConfigError, RelaxConfig, load_config
from relax.services.policy import build_model
from relax.services.run_context import RunContext
from relax.services.supervision import RunStopped
from relax.services.trainable import check_trainable
from tests.relax.services.runtime_helpers import tiny_config

REPO = Path(__file__).resolve().parents[2]


def choice_pairs(cls: type = RelaxConfig, prefix: str = "") -> list[tuple[str, Any]]:
    """Every (dotted field, accepted value) of the config tree, in declaration order."""
    hints = {f.name: f for f in dataclasses.fields(cls)}
    out: list[tuple[str, Any]] = []
    for name, f in hints.items():
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if dataclasses.is_dataclass(default):
            out += choice_pairs(type(default), f"{prefix}{name}.")
        for value in f.metadata.get("choices", ()):
            out.append((f"{prefix}{name}", value))
    return out


PAIRS = choice_pairs()
# one step on 2 prompts x 2 samples x 4 tokens; a crashing role stops the run at once instead of restarting
TINY = ["data.train_per_task=8", "data.eval_per_task=2", "rollout.prompts_per_step=2", "rollout.n_samples_per_prompt=2",
        "rollout.max_new_tokens=4", "trainer.total_steps=1", "trainer.checkpoint_every=1", "supervisor.max_restarts=0"]
GSM8K = "{gsm8k}"  # replaced by the module's small GSM8K file

# What a value needs beside it to mean anything (keyed by field: every value of it; by pair: that value).
COMPANIONS: dict[Any, list[str]] = {
    # the estimator is read only when there is a KL term (convention_checks refuses it otherwise)
    "algorithm.kl_estimator": ["algorithm.kl_coef=0.05"],
    # is_level is read only by the tis and icepop corrections
    "algorithm.is_level": ["algorithm.off_policy=tis"],
    # GAE needs the critic's value head (cross_checks refuses it otherwise)
    ("algorithm.advantage", "gae"): ["model.value_head=true"],
    # media families are other built-in models, and they read tasks with media
    ("model.family", "qwen2_5_vl"): ["model.name_or_path=tiny-qwen2-vl", "data.tasks=[shapes]"],
    ("model.family", "qwen2_audio"): ["model.name_or_path=tiny-qwen2-audio", "data.tasks=[tones]"],
    ("model.family", "qwen2_5_omni"): ["model.name_or_path=tiny-omni", "data.tasks=[shapes,tones]"],
    # distillation alone needs a teacher and the distill term's weight
    ("algorithm.mode", "distill"): ["teacher.name_or_path=tiny-qwen2", "algorithm.distill_coef=1"],
    # a row format is the format of a file: the built-in suite has none
    ("data.format", "gsm8k"): [f"data.train_url={GSM8K}", "data.eval_fraction=0.25"],
    # the judge's settings mean something only with a judge (the reward role's genrm)
    **{f: ["data.reward_role=true", "genrm.name_or_path=tiny-qwen2"]
       for f in ("genrm.family", "genrm.verdict", "genrm.invalid", "genrm.engine")},
    # parts are megatron's model-parallel ones (the torch backend refuses it)
    ("trainer.checkpoint_format", "sharded"): ["trainer.backend=megatron"],
}

# Values a walk here does not run: the test that does, as path::function (it must set field=value).
COVERED_ELSEWHERE = {
    ("topology", "async"): "tests/relax/services/topologies/test_topologies.py::test_async_topology_on_ray_serve",
    ("topology", "disaggregated"):
        "tests/relax/services/topologies/test_topologies.py::test_disaggregated_processes_share_only_s3",
    ("rollout.engine_launcher", "ray"):
        "tests/relax/services/launchers/test_ray_actors.py::test_a_rollout_owns_its_engines_as_ray_actors",
    ("rollout.weight_sync", "broadcast"): "tests/relax/services/test_sglang_rollout.py::"
                                          "test_weight_versions_broadcast_to_the_servers_are_the_ones_they_serve",
    # episodes need agent processes beside the run
    ("rollout.agents", "external"): "tests/relax/services/roles/test_external_agents.py::"
                                    "test_a_run_played_by_external_agents_trains_on_their_sessions_and_learns",
    # the format only the gateway's sessions read: the config picks the parser
    **{("rollout.tool_format", v): "tests/relax/rollout/test_tool_calls.py::"
                                   "test_each_configured_format_is_the_one_the_gateway_reads"
       for v in ("auto", "qwen", "llama3")},
}

MEGATRON = importlib.util.find_spec("megatron") is not None
RUNS, LOAD, PREFLIGHT, ELSEWHERE = "runs", "load", "preflight", "elsewhere"
EXPECTED: dict[tuple[str, Any], str] = {
    ("topology", "colocated"): RUNS, ("topology", "async"): ELSEWHERE, ("topology", "disaggregated"): ELSEWHERE,
    **{("model.family", v): RUNS
       for v in ("qwen2", "qwen3", "llama", "qwen2_moe", "qwen3_moe", "qwen2_5_vl", "qwen2_audio", "qwen2_5_omni")},
    **{("model.dtype", v): RUNS for v in ("float32", "bfloat16", "float16")},
    ("data.format", "relax"): RUNS, ("data.format", "gsm8k"): RUNS,
    ("rollout.engine", "native"): RUNS,
    ("rollout.engine", "sglang"): PREFLIGHT,  # without --engine-url the rollout starts no SGLang servers
    ("rollout.engine_launcher", "process"): RUNS, ("rollout.engine_launcher", "ray"): ELSEWHERE,
    ("rollout.weight_sync", "disk"): RUNS, ("rollout.weight_sync", "broadcast"): ELSEWHERE,
    ("rollout.partial_rollout", "wait"): RUNS,
    ("rollout.agents", "builtin"): RUNS, ("rollout.agents", "external"): ELSEWHERE,
    **{("rollout.tool_format", v): ELSEWHERE for v in ("auto", "qwen", "llama3")},
    # W&B's mode matters only with report.trackers=[wandb] (tests/relax/services/trackers): a run takes either
    ("report.wandb_mode", "offline"): RUNS, ("report.wandb_mode", "online"): RUNS,
    ("rollout.partial_rollout", "abort"): LOAD,  # colocated: no weights arrive mid-generation (see below)
    **{("algorithm.advantage", v): RUNS
       for v in ("grpo", "drgrpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "gae")},
    **{("algorithm.policy_loss", v): RUNS for v in ("ppo", "dual_clip", "gspo", "gspo_token", "cispo")},
    **{("algorithm.loss_agg", v): RUNS
       for v in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")},
    ("algorithm.std_estimator", "population"): RUNS, ("algorithm.std_estimator", "unbiased"): RUNS,
    **{("algorithm.kl_estimator", v): RUNS for v in ("k1", "k2", "k3", "abs")},
    **{("algorithm.off_policy", v): RUNS for v in ("none", "recompute", "decoupled", "tis", "icepop")},
    ("algorithm.is_level", "token"): RUNS, ("algorithm.is_level", "sequence"): RUNS,
    ("algorithm.mode", "rl"): RUNS, ("algorithm.mode", "distill"): RUNS,
    ("trainer.backend", "torch"): RUNS,
    ("trainer.backend", "megatron"): RUNS if MEGATRON else PREFLIGHT,  # megatron-core is an optional extra
    ("trainer.checkpoint_format", "gathered"): RUNS,
    ("trainer.checkpoint_format", "sharded"): RUNS if MEGATRON else PREFLIGHT,  # the Megatron actor's parts
    **{("trainer.micro_batch_layout", v): RUNS for v in ("pack", "bucket", "pad", "prefix")},
    ("trainer.lr_schedule", "constant"): RUNS, ("trainer.lr_schedule", "cosine"): RUNS,
    ("trainer.nan_policy", "skip"): RUNS, ("trainer.nan_policy", "fail"): RUNS,
    **{("genrm.family", v): RUNS for v in ("qwen2", "qwen3", "llama")},
    **{("genrm.verdict", v): RUNS for v in ("yes_no", "score", "boxed")},
    ("genrm.invalid", "skip"): RUNS, ("genrm.invalid", "zero"): RUNS,
    ("genrm.engine", "native"): RUNS,
    ("genrm.engine", "sglang"): LOAD,  # the judge runs inside the reward role unless genrm.engines >= 1
}
# Accepted values that crash mid-run today (after run.json): a strict xfail, so the fix turns it red.
# (model.dtype=bfloat16/float16 crashed the native engine's fused decode step until its rope tables
# were cast to the model's dtype.)
KNOWN_CRASHES: dict[tuple[str, Any], str] = {}


def _id(pair: tuple[str, Any]) -> str:
    return f"{pair[0]}={pair[1]}"


def _overrides(pair: tuple[str, Any], gsm8k: str) -> list[str]:
    field, value = pair
    extra = COMPANIONS.get(field, []) + COMPANIONS.get(pair, [])
    return [*TINY, *(o.replace(GSM8K, gsm8k) for o in extra), f"{field}={value}"]


def _run_id(pair: tuple[str, Any]) -> str:
    return f"{pair[0]}-{pair[1]}".replace("_", "-")


def _names(message: str, field: str, value: Any) -> bool:
    return field in message and str(value) in message


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> tuple[str, str]:
    """One root for every pair (the dataset snapshot is made once), and a small GSM8K file."""
    folder = tmp_path_factory.mktemp("choices")
    gsm8k = folder / "gsm8k.jsonl"
    gsm8k.write_text("".join(json.dumps({"question": f"What is {i} plus {i + 1}?",
                                         "answer": f"{i} + {i + 1} = {2 * i + 1}\n#### {2 * i + 1}"}) + "\n"
                             for i in range(8)))
    return f"file://{folder}/root", str(gsm8k)


def _config(root: tuple[str, str], pair: tuple[str, Any]):
    return tiny_config(root[0], _run_id(pair), *_overrides(pair, root[1]))


def _run_json(cfg) -> Path:
    return Path(RunContext(cfg).run_url.removeprefix("file://")) / "run.json"


# -- the account --------------------------------------------------------------------------------

def test_every_choice_is_accounted_for():
    walked = set(PAIRS)
    assert len(walked) == len(PAIRS) > 50  # the walk found the tree's choices
    missing = [_id(p) for p in PAIRS if p not in EXPECTED]
    assert not missing, f"record the outcome of {missing} in EXPECTED (runs, load, preflight or elsewhere)"
    for table in (EXPECTED, COVERED_ELSEWHERE, KNOWN_CRASHES):
        stale = [_id(p) for p in table if p not in walked]
        assert not stale, f"{stale} are no longer choices of relax.config: drop them"
    stale = [k for k in COMPANIONS if (k not in walked if isinstance(k, tuple) else k not in {f for f, _ in PAIRS})]
    assert not stale, f"COMPANIONS names {stale}, which the walk no longer has"
    elsewhere = {p for p, outcome in EXPECTED.items() if outcome == ELSEWHERE}
    assert elsewhere == set(COVERED_ELSEWHERE)
    assert all(EXPECTED[p] == RUNS for p in KNOWN_CRASHES)


@pytest.mark.parametrize("pair", sorted(COVERED_ELSEWHERE), ids=_id)
def test_covered_elsewhere_points_at_a_test_that_sets_the_value(pair):
    path, _, name = COVERED_ELSEWHERE[pair].partition("::")
    source = (REPO / path).read_text()
    [fn] = [n for n in ast.walk(ast.parse(source))
            if isinstance(n, ast.FunctionDef) and n.name == name and name.startswith("test_")]
    assert _id(pair) in ast.get_source_segment(source, fn), f"{path}::{name} does not set {_id(pair)}"


# -- refused before any work ------------------------------------------------------------------------

@pytest.mark.parametrize("pair", [p for p in PAIRS if EXPECTED.get(p) in (LOAD, PREFLIGHT)], ids=_id)
def test_refused_choice_fails_before_any_work_naming_field_and_value(pair, root):
    field, value = pair
    if EXPECTED[pair] == LOAD:
        with pytest.raises(ConfigError) as e:
            _config(root, pair)
        assert _names(str(e.value), field, value), str(e.value)
        assert "use " in str(e.value) or "set " in str(e.value), f"no way out in: {e.value}"
        return
    cfg = _config(root, pair)  # loads
    with pytest.raises(ConfigError) as e:
        check_trainable(RunContext(cfg), None)
    assert _names(str(e.value), field, value), str(e.value)
    assert not _run_json(cfg).exists()


# -- accepted: one step runs, with the value in effect ------------------------------------------------

class Calls:
    """Records the calls of the functions wrapped by :meth:`wrap`."""

    def __init__(self):
        self.seen: list[tuple[str, tuple, dict[str, Any], Any]] = []

    def wrap(self, tag: str, fn):
        def spied(*args, **kwargs):
            out = fn(*args, **kwargs)
            self.seen.append((tag, args, kwargs, out))
            return out
        return spied

    def tags(self) -> set[str]:
        return {tag for tag, *_ in self.seen}

    def args(self, tag: str, at: int) -> set[Any]:
        return {args[at] for t, args, _, _ in self.seen if t == tag}

    def kwargs(self, tag: str, key: str) -> set[Any]:
        return {kw[key] for t, _, kw, _ in self.seen if t == tag}

    def outs(self, tag: str) -> list[Any]:
        return [out for t, *_, out in self.seen if t == tag]


def _spy_registry(monkeypatch, registry: dict, calls: Calls) -> None:
    for name in list(registry):
        monkeypatch.setitem(registry, name, calls.wrap(name, registry[name]))


def _spy_effects(monkeypatch, cfg, pair) -> Calls:
    """Wrap what reads ``pair``'s field, so the run shows the value was in effect."""
    import relax.algorithms as alg
    import relax.algorithms.advantages as adv
    import relax.models
    import relax.services.driver as train_mod
    import relax.trainers.torch.actor as actor_mod
    import relax.trainers.torch.trainer as trainer_mod

    calls = Calls()
    field, value = pair
    if field == "algorithm.policy_loss":
        _spy_registry(monkeypatch, alg.POLICY_LOSSES, calls)
    elif field == "algorithm.loss_agg":  # the trainer weighs tokens by it (token_weights)
        monkeypatch.setattr(trainer_mod, "token_weights", calls.wrap("agg", trainer_mod.token_weights))
    elif field == "algorithm.kl_estimator":
        _spy_registry(monkeypatch, alg.KL_ESTIMATORS, calls)
    elif field in ("algorithm.off_policy", "algorithm.is_level"):
        monkeypatch.setattr(actor_mod, "off_policy_correction", calls.wrap("off", actor_mod.off_policy_correction))
    elif field in ("algorithm.advantage", "algorithm.std_estimator"):
        for name in alg.ADVANTAGES:
            monkeypatch.setattr(adv, f"{name}_advantages", calls.wrap(name, getattr(adv, f"{name}_advantages")))
    elif field in ("model.family", "model.dtype"):
        monkeypatch.setattr(relax.models, "build_policy", calls.wrap("model", relax.models.build_policy))
    elif field == "algorithm.mode":  # the advantage role adds the distill term
        import relax.services.roles.advantage as adv_role

        monkeypatch.setattr(adv_role, "distill_advantages", calls.wrap("distill", adv_role.distill_advantages))
    elif field.startswith("trainer."):
        trainer_cls = actor_mod.TorchTrainer

        def trainer(model, **kwargs):
            t = trainer_cls(model, **kwargs)
            calls.seen.append(("trainer", (model,), kwargs, t))
            return t
        monkeypatch.setattr(actor_mod, "TorchTrainer", trainer)
    elif field == "topology":
        monkeypatch.setattr(train_mod, f"run_{value}", calls.wrap(value, getattr(train_mod, f"run_{value}")))
    return calls


def _check_effect(pair, cfg, calls: Calls) -> None:
    field, value = pair
    if field in ("algorithm.policy_loss", "algorithm.kl_estimator"):
        assert calls.tags() == {value}, f"{field}={value}: called {calls.tags()}"
    elif field == "algorithm.loss_agg":
        assert calls.args("agg", 1) == {value}
    elif field == "algorithm.off_policy":  # none: the actor applies no correction at all
        assert calls.args("off", 0) == (set() if value == "none" else {value})
    elif field == "algorithm.is_level":
        assert calls.kwargs("off", "level") == {value}
    elif field == "algorithm.advantage":
        assert value in calls.tags(), f"{value}_advantages was not called: {calls.tags()}"
    elif field == "algorithm.mode":
        assert calls.tags() == ({"distill"} if value == "distill" else set()), calls.tags()
    elif field == "algorithm.std_estimator":
        assert calls.kwargs(cfg.algorithm.advantage, "unbiased") == {value == "unbiased"}
    elif field in ("model.family", "model.dtype"):
        models = [out[0] for out in calls.outs("model")]
        assert models
        for model in models:
            if field == "model.family":
                assert model.config.model_type in (value, f"{value}_thinker"), model.config.model_type
            else:
                assert next(model.parameters()).dtype == getattr(torch, value)
    elif field.startswith("trainer."):
        [(model, kwargs, trainer)] = [(args[0], kw, out) for tag, args, kw, out in calls.seen if tag == "trainer"]
        if field == "trainer.backend":  # the actor's model: megatron-core's layers or the HF model
            is_megatron = type(model).__module__.startswith("relax.trainers.megatron")
            assert is_megatron == (value == "megatron"), type(model)
        elif field == "trainer.micro_batch_layout":
            assert trainer.layout == value
        elif field == "trainer.lr_schedule":
            assert kwargs["schedule"] == value
        elif field == "trainer.nan_policy":
            assert trainer.nan_policy == value
        elif field == "trainer.checkpoint_format":  # the step's checkpoint: megatron's parts, or one file
            [ckpt] = (_run_json(cfg).parent / "checkpoints").iterdir()
            assert (ckpt / "shards").is_dir() == (value == "sharded") and (ckpt / "meta.json").is_file()
    elif field == "topology":
        assert calls.tags() == {value}
    elif field == "data.format" and value == "gsm8k":
        assert {s.task for s in RunContext(cfg).split("train")} == {"gsm8k"}


def _run_params():
    for p in PAIRS:
        if EXPECTED.get(p) != RUNS:
            continue
        marks = (
            [pytest.mark.xfail(raises=RunStopped, strict=True, reason=KNOWN_CRASHES[p])] if p in KNOWN_CRASHES else []
        )
        yield pytest.param(p, id=_id(p), marks=marks)


@pytest.mark.slow
@pytest.mark.parametrize("pair", list(_run_params()))
def test_accepted_choice_runs_one_step_and_takes_effect(pair, root, monkeypatch):
    from relax.services.driver import train

    field, value = pair
    cfg = _config(root, pair)
    calls = _spy_effects(monkeypatch, cfg, pair)
    try:
        result = train(cfg, progress=False, max_steps=1)
    finally:
        if cfg.trainer.backend == "megatron" and MEGATRON:  # its process group would outlive the test
            from relax.trainers.megatron.cpu import shutdown_distributed

            shutdown_distributed()
    assert result.steps == 1
    saved = json.loads(_run_json(cfg).read_text())["config"]
    section, _, name = field.rpartition(".")
    assert (saved[section] if section else saved)[name] == value
    _check_effect(pair, cfg, calls)


# -- the refusals the walk found missing (relax.config.tree.CHECKS) ---------------------------------------

@pytest.mark.parametrize("family, builtin", [("qwen2_5_vl", "tiny-qwen2-vl"), ("qwen2_audio", "tiny-qwen2-audio"),
                                             ("qwen2_5_omni", "tiny-omni")])
def test_a_family_the_builtin_model_cannot_be_is_refused_at_load(family, builtin):
    # it used to load, write run.json and fail in the first role that built the model
    with pytest.raises(ConfigError, match=rf"model.family='{family}'.*use model.name_or_path={builtin}"):
        load_config(None, [f"model.family={family}"])
    other = "qwen2_audio" if family != "qwen2_audio" else "qwen2_5_vl"  # another media family's built-in
    with pytest.raises(ConfigError, match=rf"model.family='{other}' cannot be built from .*{builtin}"):
        load_config(None, [f"model.name_or_path={builtin}", f"model.family={other}"])
    assert load_config(None, [f"model.name_or_path={builtin}", f"model.family={family}"]).model.family == family


def test_a_row_format_without_a_data_file_is_refused_at_load():
    # the built-in suite has no rows to read: gsm8k used to be accepted and ignored
    with pytest.raises(ConfigError, match="data.format='gsm8k'.*set data.train_url"):
        load_config(None, ["data.format=gsm8k"])
    assert load_config(None, ["data.format=gsm8k", "data.train_url=/data/gsm8k.jsonl"]).data.format == "gsm8k"


@pytest.mark.parametrize("overrides", [
    [],  # colocated: generation and training take turns, so no weights arrive mid-generation
    ["topology=disaggregated", "queue.max_staleness=0"],  # each batch waits for its own weights
    ["topology=async", "rollout.engine_processes=1"],  # HTTP engines finish their batch on their weights
    ["topology=async", "rollout.engine=sglang", "resources.num_gpus=1", "resources.rollout_gpus=1"],
], ids=["colocated", "staleness-0", "engine-processes", "sglang"])
def test_partial_rollout_abort_where_it_would_change_nothing_is_refused_at_load(overrides):
    with pytest.raises(ConfigError, match=r"rollout.partial_rollout=abort would change nothing.*partial_rollout=wait"):
        load_config(None, [*overrides, "rollout.partial_rollout=abort"])


def test_partial_rollout_abort_cuts_generation_and_resumes_under_new_weights(tmp_path):
    """Where abort is accepted (async or disaggregated, staleness >= 1, the in-process engine), the
    rollout's in-process engine aborts in-flight requests when new weights appear, reloads, and resumes."""
    from relax.engines.types import SamplingParams
    from relax.rollout.engine_pool import LocalEngines
    from relax.rollout.episodes import EpisodeRunner

    cfg = tiny_config(f"file://{tmp_path}", "abort", *TINY, "topology=disaggregated", "rollout.partial_rollout=abort")
    ctx = RunContext(cfg)
    model, _ = build_model(ctx)
    prompts = list(enumerate(ctx.split("train")[:2]))
    for mode in ("abort", "wait"):
        asked, reloads = [], []

        def new_weights(asked=asked) -> bool:  # a new version appears once, mid-generation
            asked.append(1)
            return len(asked) == 1

        def reload(reloads=reloads) -> bool:
            reloads.append(1)
            return True

        runner = EpisodeRunner(LocalEngines(model, ctx.tokenizer, max_batch_size=8, max_seq_len=256, seed=0),
                               ctx.tokenizer, None, None, SamplingParams(max_new_tokens=12, stop=[]),
                               partial_rollout=mode, new_weights=new_weights, reload=reload)
        trajs = runner.single_turn(prompts, 2)
        assert all(t.finish != "abort" for t in trajs)  # aborted requests resumed to their end
        if mode == "abort":
            assert runner.aborted > 0 and reloads == [1]
        else:
            assert runner.aborted == 0 and asked == [] and reloads == []
        runner.pool.close()
