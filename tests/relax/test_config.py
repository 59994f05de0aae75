"""Config tree: presets, overrides, round trips and every kind of bad input."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest
import yaml

from relax.config import (
    ConfigError,
    RelaxConfig,
    config_from_dict,
    config_hash,
    config_to_dict,
    config_to_yaml,
    list_presets,
    load_config,
    parse_override,
)


def test_default_preset_is_the_dataclass_defaults():
    assert load_config() == RelaxConfig()
    assert load_config("tiny-cpu") == RelaxConfig()
    assert RelaxConfig().root == "file://./.relax"


@pytest.mark.parametrize("preset", ["tiny-cpu", "distill-cpu", "omni-video-cpu", "qwen2.5-0.5b", "qwen2.5-vl-3b", "qwen2.5-omni-3b"])
def test_every_preset_loads_and_round_trips(preset, tmp_path):
    cfg = load_config(preset)
    path = tmp_path / "cfg.yaml"
    path.write_text(config_to_yaml(cfg))
    assert load_config(str(path)) == cfg
    assert RelaxConfig.from_json(json.dumps(config_to_dict(cfg))) == cfg
    assert preset in list_presets()


def test_gpu_presets_use_their_model_family():
    assert load_config("qwen2.5-vl-3b").model.family == "qwen2_5_vl"
    assert load_config("qwen2.5-omni-3b").model.family == "qwen2_5_omni"
    assert load_config("qwen2.5-0.5b").rollout.engine == "sglang"


def test_overrides_parse_types():
    cfg = load_config(None, ["trainer.lr=3e-4", "rollout.temperature=0.7", "data.tasks=[arithmetic,shapes]",
                             "model.value_head=true", "run_id=exp1", "queue.max_staleness=0"])
    assert cfg.trainer.lr == pytest.approx(3e-4)
    assert cfg.rollout.temperature == pytest.approx(0.7)
    assert cfg.data.tasks == ["arithmetic", "shapes"]
    assert cfg.model.value_head is True
    assert cfg.run_id == "exp1"
    assert cfg.queue.max_staleness == 0


def test_comma_list_override_and_numeric_string():
    cfg = load_config(None, ["data.tasks=shapes,tones", "run_id=123"])
    assert cfg.data.tasks == ["shapes", "tones"]
    assert cfg.run_id == "123"  # a name that looks like a number stays a string


def test_partial_yaml_file_keeps_other_defaults(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text(yaml.safe_dump({"seed": 7, "rollout": {"n_samples_per_prompt": 4}}))
    cfg = load_config(str(path), ["seed=9"])
    assert cfg.seed == 9  # overrides win over the file
    assert cfg.rollout.n_samples_per_prompt == 4
    assert cfg.rollout.temperature == RelaxConfig().rollout.temperature


def test_a_file_value_of_the_wrong_type_names_the_field(tmp_path):
    # what `pyflyte run ... --cfg` shows before any task runs (tests/workflows/test_omni_rl.py runs the typo case)
    path = tmp_path / "bad-type.yaml"
    path.write_text(yaml.safe_dump({"trainer": {"total_steps": "many"}}))
    with pytest.raises(ConfigError, match=r"trainer\.total_steps.*integer"):
        load_config(str(path))


def test_config_hash_changes_with_any_field():
    base = config_hash(RelaxConfig())
    assert config_hash(load_config()) == base
    assert config_hash(load_config(None, ["rollout.top_p=0.9"])) != base


@pytest.mark.parametrize(
    "override, fragments",
    [
        ("trainer.lrr=1", ["unknown config key trainer.lrr", "did you mean trainer.lr"]),
        ("rolout.temperature=1", ["unknown config key rolout", "did you mean rollout"]),
        ("trainer.lr=fast", ["trainer.lr must be a number", "'fast'"]),
        ("rollout.top_p=1.5", ["rollout.top_p = 1.5 is out of range", "0.0 <= rollout.top_p <= 1.0"]),
        ("queue.max_staleness=-1", ["queue.max_staleness = -1 is out of range"]),
        ("rollout.n_samples_per_prompt=2.5", ["rollout.n_samples_per_prompt must be an integer"]),
        ("topology=asynk", ["topology = 'asynk' is not accepted", "did you mean 'async'", "disaggregated"]),
        ("model.value_head=yes please", ["model.value_head must be true or false"]),
        ("data.tasks=5", ["data.tasks must be a list"]),
        ("trainer=1", ["trainer must be a mapping"]),
        ("novalue", ["not of the form key=value"]),
        ("run_id=a/b", ["run_id", "without '/'"]),
    ],
)
def test_bad_values_name_the_field_and_the_fix(override, fragments):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    for fragment in fragments:
        assert fragment in str(err.value)


def test_cross_field_checks():
    with pytest.raises(ConfigError, match="exceed resources.num_gpus"):
        load_config(None, ["resources.rollout_gpus=1"])
    with pytest.raises(ConfigError, match="model.value_head=true"):
        load_config(None, ["algorithm.advantage=gae"])
    assert load_config(None, ["algorithm.advantage=gae", "model.value_head=true"]).algorithm.advantage == "gae"


def test_thawing_needs_one_rank():
    with pytest.raises(ConfigError, match="data_parallel=1"):
        load_config("omni-cpu", ["trainer.thaw_encoders_at=10", "trainer.data_parallel=2"])
    assert load_config("omni-cpu", ["trainer.thaw_encoders_at=10"]).trainer.thaw_encoders_at == 10


@pytest.mark.parametrize("clash", ["algorithm.kl_coef=0", "algorithm.kl_in_reward=true"])
def test_topk_kl_needs_a_kl_loss_term(clash):
    with pytest.raises(ConfigError, match="algorithm.kl_topk is the actor's KL loss term"):
        load_config(None, ["algorithm.kl_coef=0.1", "algorithm.kl_topk=8", clash])
    assert load_config(None, ["algorithm.kl_coef=0.1", "algorithm.kl_topk=8"]).algorithm.kl_topk == 8


def test_topk_weight_needs_the_top_k_term():
    with pytest.raises(ConfigError, match="kl_topk_weight splits the KL"):
        load_config(None, ["algorithm.kl_coef=0.1", "algorithm.kl_topk_weight=0.5"])
    with pytest.raises(ConfigError, match="kl_topk_weight=0 puts no weight"):
        load_config(None, ["algorithm.kl_coef=0.1", "algorithm.kl_topk=8", "algorithm.kl_topk_weight=0"])
    assert load_config(None, ["algorithm.kl_coef=0.1", "algorithm.kl_topk=8",
                              "algorithm.kl_topk_weight=0.25"]).algorithm.kl_topk_weight == 0.25


def test_backend_layouts_are_honoured_or_refused():
    # a parallel layout the chosen backend would ignore is an error naming the field, not a quiet no-op
    with pytest.raises(ConfigError, match="trainer.tensor_parallel=2 is a Megatron layout"):
        load_config(None, ["trainer.tensor_parallel=2"])
    assert load_config(None, ["trainer.backend=megatron", "trainer.context_parallel=2"]).trainer.context_parallel == 2
    assert load_config(None, ["trainer.backend=megatron", "trainer.context_parallel=2",
                              "trainer.pipeline_parallel=2"]).trainer.pipeline_parallel == 2
    with pytest.raises(ConfigError, match="trainer.context_parallel=2 with expert_parallel=2: .* set one of them to 1"):
        load_config(None, ["trainer.backend=megatron", "trainer.context_parallel=2", "trainer.expert_parallel=2",
                           "trainer.data_parallel=2"])
    with pytest.raises(ConfigError, match="trainer.context_parallel=2 is a Megatron layout"):
        load_config(None, ["trainer.context_parallel=2"])
    # expert parallel splits the experts over data-parallel ranks: it must divide them, and runs at pp = 1
    with pytest.raises(ConfigError, match="expert_parallel=2 splits the experts .* must divide trainer.data_parallel=1"):
        load_config(None, ["trainer.backend=megatron", "trainer.expert_parallel=2"])
    with pytest.raises(ConfigError, match="expert_parallel=2 with pipeline_parallel=2: .* use pipeline_parallel=1"):
        load_config(None, ["trainer.backend=megatron", "trainer.expert_parallel=2", "trainer.data_parallel=2",
                           "trainer.pipeline_parallel=2"])
    with pytest.raises(ConfigError, match="trainer.expert_parallel=2 is a Megatron layout"):
        load_config(None, ["trainer.expert_parallel=2", "trainer.data_parallel=2"])
    # megatron's DistributedOptimizer is the Megatron backend's; the torch backend would step plain AdamW
    with pytest.raises(ConfigError, match="trainer.distributed_optimizer=true is megatron-core's optimizer; the torch "
                                          "backend would ignore it: set trainer.backend=megatron"):
        load_config(None, ["trainer.distributed_optimizer=true", "trainer.data_parallel=2"])
    assert load_config(None, ["trainer.backend=megatron", "trainer.distributed_optimizer=true"]).trainer.distributed_optimizer
    # sharded checkpoints are megatron's model-parallel parts; the torch backend's ranks hold whole replicas
    with pytest.raises(ConfigError, match="trainer.checkpoint_format=sharded writes megatron's model-parallel parts; "
                                          "the torch backend.* set trainer.checkpoint_format=gathered"):
        load_config(None, ["trainer.checkpoint_format=sharded"])
    assert load_config(None, ["trainer.backend=megatron", "trainer.checkpoint_format=sharded"]).trainer.checkpoint_format
    ep = load_config(None, ["trainer.backend=megatron", "trainer.expert_parallel=2", "trainer.data_parallel=4"])
    assert (ep.trainer.expert_parallel, ep.trainer.data_parallel) == (2, 4)
    # data and tensor parallel ranks are the actor's processes (relax.services.roles.actor_ranks)
    cfg = load_config(None, ["trainer.backend=megatron", "trainer.tensor_parallel=2", "trainer.data_parallel=2"])
    assert (cfg.trainer.tensor_parallel, cfg.trainer.data_parallel) == (2, 2)
    assert load_config(None, ["trainer.data_parallel=2"]).trainer.data_parallel == 2
    with pytest.raises(ConfigError, match="a 2-rank actor .* colocated topology would share its process group"):
        load_config(None, ["trainer.data_parallel=2", "algorithm.advantage=gae", "model.value_head=true"])
    with pytest.raises(ConfigError, match="a 2-rank actor .* colocated topology would share its process group"):
        load_config(None, ["trainer.backend=megatron", "trainer.context_parallel=2", "algorithm.advantage=gae",
                           "model.value_head=true"])  # context ranks are processes too
    with pytest.raises(ConfigError, match="trainer.data_parallel=8 ranks but each optimizer step trains 4 samples"):
        load_config(None, ["trainer.data_parallel=8", "rollout.prompts_per_step=2", "rollout.n_samples_per_prompt=4",
                           "trainer.mini_batches=2"])
    with pytest.raises(ConfigError, match="micro_batch_layout=prefix"):
        load_config(None, ["trainer.backend=megatron", "trainer.micro_batch_layout=prefix"])
    with pytest.raises(ConfigError, match="not model.family='qwen2_audio'"):
        load_config(None, ["trainer.backend=megatron", "model.family=qwen2_audio"])
    assert load_config(None, ["trainer.backend=megatron"]).trainer.backend == "megatron"


def test_overlong_buffer_fits_inside_the_length_limit():
    with pytest.raises(ConfigError, match=r"overlong_buffer \(32\) exceeds rollout.max_new_tokens \(16\)"):
        load_config(None, ["rollout.max_new_tokens=16", "algorithm.overlong_buffer=32"])
    assert load_config(None, ["rollout.max_new_tokens=16", "algorithm.overlong_buffer=4"]).algorithm.overlong_buffer == 4


def test_near_miss_credit_refuses_a_custom_reward_and_stays_below_one():
    with pytest.raises(ConfigError, match="near_miss_credit shapes the built-in task verifiers"):
        load_config(None, ["algorithm.near_miss_credit=0.5", "data.reward_fn=tests.some:reward"])
    with pytest.raises(ConfigError, match="near_miss_credit"):
        load_config(None, ["algorithm.near_miss_credit=1.0"])  # a near miss worth a hit is no shaping
    assert load_config(None, ["algorithm.near_miss_credit=0.5"]).algorithm.near_miss_credit == 0.5


def test_exact_staleness_refuses_switching_versions_mid_generation():
    with pytest.raises(ConfigError, match="partial_rollout=wait or exact_staleness=false"):
        load_config(None, ["queue.exact_staleness=true", "rollout.partial_rollout=abort"])
    assert load_config(None, ["queue.exact_staleness=true"]).queue.exact_staleness


def test_unknown_preset_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="did you mean preset 'tiny-cpu'"):
        load_config("tiny-cpo")
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(str(tmp_path / "nope.yaml"))
    bad = tmp_path / "bad.yaml"
    bad.write_text("seed: [1,\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(str(bad))
    listy = tmp_path / "list.yaml"
    listy.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="must hold a mapping"):
        load_config(str(listy))


def test_from_json_is_strict():
    # pyflyte passes --cfg files through RelaxConfig.from_json: a typo must not be dropped silently.
    with pytest.raises(ConfigError, match="did you mean data.train_url"):
        RelaxConfig.from_json(json.dumps({"data": {"train_urll": "x.jsonl"}}))


def test_every_field_is_documented():
    def walk(obj, prefix=""):
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            assert f.metadata.get("help"), f"{prefix}{f.name} has no help text"
            if dataclasses.is_dataclass(value):
                walk(value, prefix + f.name + ".")

    walk(RelaxConfig())


# a sentence ends at . ! or ? followed by a space and a capital, a digit or an opening quote/bracket
# ("0 = off.", "'ray' needs ..."); the dots of e.g. / i.e. / etc. / vs. end nothing
SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z0-9'\"`(\[])")
ABBREVIATIONS = re.compile(r"\b(?:e\.g|i\.e|etc|vs|cf)\.", re.IGNORECASE)


def sentences(text: str) -> list[str]:
    text = ABBREVIATIONS.sub(lambda m: m.group(0).replace(".", ""), text.strip())
    return [s for s in SENTENCE_END.split(text) if s.strip()]


def test_sentences_counts_sentences_not_abbreviations():
    assert len(sentences("One (e.g. [a:2]). Two, i.e. more. 0 = off.")) == 3
    assert len(sentences("A 0.5 share; [] = none. 'ray' needs it.")) == 2


def test_help_texts_are_at_most_two_sentences_and_300_characters():
    def walk(obj, prefix=""):
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            if dataclasses.is_dataclass(value):
                walk(value, prefix + f.name + ".")
                continue
            text = f.metadata["help"]
            assert len(text) <= 300, f"{prefix}{f.name}: help is {len(text)} characters (at most 300)"
            assert len(sentences(text)) <= 2, f"{prefix}{f.name}: help has {len(sentences(text))} sentences (at most 2)"

    walk(RelaxConfig())


def test_dict_round_trip_is_identity():
    cfg = load_config("qwen2.5-omni-3b", ["seed=3"])
    assert config_from_dict(config_to_dict(cfg)) == cfg


def test_parse_override_values():
    assert parse_override("a.b=1") == ("a.b", 1)
    assert parse_override("a=") == ("a", "")
    assert parse_override("a=[x, y]") == ("a", ["x", "y"])
    assert parse_override("url=s3://b/k=v") == ("url", "s3://b/k=v")


def test_stuck_group_push_needs_a_group_estimator():
    with pytest.raises(ConfigError, match="stuck_group_push adds to a group estimator"):
        load_config(None, ["algorithm.stuck_group_push=0.2", "algorithm.advantage=reinforce_pp"])
    assert load_config(None, ["algorithm.stuck_group_push=0.2", "algorithm.advantage=rloo"]).algorithm.stuck_group_push == 0.2


def test_a_run_saved_with_a_removed_setting_off_resumes_and_one_that_used_it_is_refused():
    from relax.config import ConfigError, config_from_dict, config_to_dict, saved_config

    saved = config_to_dict(load_config("omni-cpu"))
    saved["rollout"]["explore_answers"], saved["data"]["task_repeats"] = 0, []  # as an earlier Relax wrote them
    assert config_from_dict(saved_config(saved)) == load_config("omni-cpu")
    assert "explore_answers" in saved["rollout"]  # the caller's record is left as it was
    saved["trainer"]["frozen_params"] = ["visual.patch_embed"]
    with pytest.raises(ConfigError, match=r"trainer.frozen_params=\['visual.patch_embed'\].*removed"):
        saved_config(saved)


@pytest.mark.parametrize("override", ["trainer.lr=nan", "algorithm.clip_high=.inf", "trainer.grad_clip=NaN"])
def test_non_finite_floats_are_refused(override):
    # NaN compares false with both ends of a range, so it used to pass every range check
    with pytest.raises(ConfigError, match=r"is not a finite number"):
        load_config(None, [override])


@pytest.mark.parametrize("run_id", ["..", "../other", "a/b", ".hidden", ""])
def test_run_id_is_a_safe_folder_name(run_id):
    with pytest.raises(ConfigError, match="becomes a folder under <root>/runs/"):
        load_config(None, [f"run_id={run_id}"])


@pytest.mark.parametrize(("overrides", "name"), [
    (["algorithm.is_level=sequence"], "is_level"),  # default off_policy decoupled has no level
    (["algorithm.std_estimator=unbiased", "algorithm.advantage=rloo"], "std_estimator"),
    (["algorithm.gspo_clamp=10"], "gspo_clamp"),
    (["algorithm.loss_agg_norm=8"], "loss_agg_norm"),
    (["algorithm.overlong_penalty=0.5"], "overlong_penalty"),
    (["algorithm.kl_estimator=k1"], "kl_estimator"),  # kl_coef is 0 by default: no KL is computed
    (["algorithm.kl_clamp=10"], "kl_clamp"),
    (["algorithm.kl_in_reward=true"], "kl_in_reward"),
    (["algorithm.dual_clip_c=5"], "dual_clip_c"),
    (["algorithm.off_policy=none", "algorithm.is_cap=5"], "is_cap"),
    (["algorithm.gamma=0.9"], "gamma"),
    (["algorithm.lam=1.0"], "lam"),
    (["algorithm.value_clip=0.5"], "value_clip"),
])
def test_an_option_the_algorithm_would_not_read_is_refused(overrides, name):
    with pytest.raises(ConfigError, match=rf"algorithm\.{name}=\S+ is read only with"):
        load_config(None, overrides)


@pytest.mark.parametrize(("overrides", "words"), [
    (["rollout.num_engines=2"], "rollout.num_engines=2 sizes SGLang servers"),
    (["rollout.engine_launcher=ray"], "engine_launcher=ray places engine processes"),
    (["rollout.engine_gpus=1"], "need rollout.engine_launcher=ray"),
])
def test_engine_settings_the_layout_would_ignore_are_refused(overrides, words):
    with pytest.raises(ConfigError, match=re.escape(words)):
        load_config(None, overrides)
    ok = load_config(None, ["rollout.engine_processes=1", "rollout.engine_launcher=ray", "rollout.engine_gpus=1"])
    assert ok.rollout.engine_gpus == 1.0


def test_engine_resources_are_checked_as_the_config_loads():
    # a custom Ray resource only means something to Ray engine actors; a malformed one fails here, not at launch
    with pytest.raises(ConfigError, match="engine_resources are Ray resources .* need rollout.engine_launcher=ray"):
        load_config("tiny-cpu", ["rollout.engine_resources=rollout_node=1"])
    ray = ["rollout.engine_launcher=ray", "rollout.engine_processes=1"]
    with pytest.raises(ConfigError, match=r"bad resource 'GPU=1' .*set it with rollout.engine_gpus"):
        load_config("tiny-cpu", [*ray, "rollout.engine_resources=GPU=1"])
    assert load_config("tiny-cpu", [*ray, "rollout.engine_resources=rollout_node=1"]).rollout.engine_resources
