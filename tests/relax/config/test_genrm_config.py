"""The genrm section's config-time checks: each refusal names the field and the fix."""

from __future__ import annotations

import pytest

from relax.config import ConfigError, load_config

ON = ("data.reward_role=true", "genrm.name_or_path=tiny-qwen2")


def _load(*overrides: str):
    return load_config("tiny-cpu", ["data.tasks=[arithmetic]", *overrides])


def test_a_judge_loads_and_is_off_by_default():
    assert not _load().genrm.enabled
    cfg = _load(*ON)
    assert cfg.genrm.enabled and cfg.genrm.verdict == "yes_no" and cfg.genrm.invalid == "skip"


@pytest.mark.parametrize(("overrides", "named"), [
    (("genrm.name_or_path=tiny-qwen2",), "set data.reward_role=true"),
    ((*ON, "data.reward_fn=a.b:c"), "unset data.reward_fn"),
    ((*ON, "data.judge_url=http://127.0.0.1:1"), "unset data.judge_url"),
    (("data.reward_role=true", "genrm.urls=[http://127.0.0.1:1]", "genrm.engines=1"), "genrm.urls or the model"),
    (("data.reward_role=true", "genrm.urls=[ftp://judge]"), "must be an http:// or https://"),
    ((*ON, "genrm.engines=3", "genrm.max_engines=2"), "raise genrm.max_engines"),
    ((*ON, "genrm.api_port=8123"), "set genrm.engines >= 1 or genrm.api_port=0"),
    ((*ON, "genrm.template=/nonexistent/judge.txt"), "is not a file"),
    ((*ON, "genrm.verdict=maybe"), "genrm.verdict"),
    ((*ON, "genrm.top_logprobs=50"), "genrm.top_logprobs"),
])
def test_refusals_name_the_field_and_the_fix(overrides, named):
    with pytest.raises(ConfigError, match=named.replace("(", r"\(").replace(")", r"\)").replace("+", r"\+")):
        _load(*overrides)


def test_a_template_file_is_read_and_checked(tmp_path):
    good = tmp_path / "good.txt"
    good.write_text("Q: {question}\nA: {response}\nRef: {reference}\nCorrect? yes or no.")
    assert _load(*ON, f"genrm.template={good}").genrm.template == str(good)
    bad = tmp_path / "bad.txt"
    bad.write_text("Grade {answer}")
    with pytest.raises(ConfigError, match=r"genrm.template=.*unknown field\(s\) \['answer'\]"):
        _load(*ON, f"genrm.template={bad}")


def test_a_trained_judge_folder_is_read_the_way_it_answers(tmp_path):
    import json

    from relax.config import preflight

    folder = tmp_path / "judge"
    folder.mkdir()
    (folder / "relax_judge.json").write_text(json.dumps({"task": "largest", "verdict": "boxed", "max_new_tokens": 20}))
    on = ("data.reward_role=true", f"genrm.name_or_path={folder}", f"root=file://{tmp_path}/root")
    with pytest.raises(ConfigError, match="set genrm.verdict=boxed genrm.max_new_tokens=20"):
        preflight(_load(*on))  # the default yes_no would find no verdict in its answers
    preflight(_load(*on, "genrm.verdict=boxed", "genrm.max_new_tokens=20"))
    (folder / "relax_judge.json").write_text("{")
    with pytest.raises(ConfigError, match="is not a judge record"):
        preflight(_load(*on, "genrm.verdict=boxed"))
