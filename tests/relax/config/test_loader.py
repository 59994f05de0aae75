"""Loading a config: presets, YAML files, overrides, round trips and a run's saved config."""

from __future__ import annotations

import json

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


@pytest.mark.parametrize(
    "preset", ["tiny-cpu", "distill-cpu", "omni-video-cpu", "qwen2.5-0.5b", "qwen2.5-vl-3b", "qwen2.5-omni-3b"]
)
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


def test_dict_round_trip_is_identity():
    cfg = load_config("qwen2.5-omni-3b", ["seed=3"])
    assert config_from_dict(config_to_dict(cfg)) == cfg


def test_parse_override_values():
    assert parse_override("a.b=1") == ("a.b", 1)
    assert parse_override("a=") == ("a", "")
    assert parse_override("a=[x, y]") == ("a", ["x", "y"])
    assert parse_override("url=s3://b/k=v") == ("url", "s3://b/k=v")


def test_a_run_saved_with_a_removed_setting_off_resumes_and_one_that_used_it_is_refused():
    from relax.config import ConfigError, config_from_dict, config_to_dict, saved_config

    saved = config_to_dict(load_config("omni-cpu"))
    saved["rollout"]["explore_answers"], saved["data"]["task_repeats"] = 0, []  # as an earlier Relax wrote them
    assert config_from_dict(saved_config(saved)) == load_config("omni-cpu")
    assert "explore_answers" in saved["rollout"]  # the caller's record is left as it was
    saved["trainer"]["frozen_params"] = ["visual.patch_embed"]
    with pytest.raises(ConfigError, match=r"trainer.frozen_params=\['visual.patch_embed'\].*removed"):
        saved_config(saved)
