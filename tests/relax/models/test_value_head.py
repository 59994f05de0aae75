"""ValueHeadModel: zero-initialised values, per-token output, exact HF-format round trip."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from relax.config import ModelConfig  # noqa: E402
from relax.data.suite import generate_suite  # noqa: E402
from relax.models.builders import build_policy  # noqa: E402
from relax.models.processors import prepare_inputs  # noqa: E402
from relax.models.tokenizers import build_tokenizer  # noqa: E402
from relax.models.value_head import VALUE_HEAD_FILE, ValueHeadModel  # noqa: E402


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer("bpe-tiny")


def test_zero_init_and_shapes(tok) -> None:
    backbone, _ = build_policy(ModelConfig(), tok, seed=0)
    critic = ValueHeadModel(backbone)
    ids = torch.tensor([tok("What is 1 + 5?")["input_ids"]] * 2)
    with torch.no_grad():
        values = critic(input_ids=ids)
        logits, values2 = critic(input_ids=ids, return_logits=True)
    assert values.shape == ids.shape and torch.count_nonzero(values) == 0
    assert torch.equal(values, values2) and logits.shape == (*ids.shape, len(tok))


def test_head_trains(tok) -> None:
    critic = ValueHeadModel(build_policy(ModelConfig(), tok, seed=0)[0])
    ids = torch.tensor([tok("What is 1 + 5?")["input_ids"]])
    opt = torch.optim.SGD(critic.parameters(), lr=0.5)
    for _ in range(3):
        loss = (critic(input_ids=ids) - 1.0).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert critic(input_ids=ids).abs().mean() > 0.1


@pytest.mark.parametrize(("name", "family"), [("tiny-qwen2", "qwen2"), ("tiny-qwen2-vl", "qwen2_5_vl")])
def test_round_trip_exact(tok, tmp_path, name: str, family: str) -> None:
    backbone, proc = build_policy(ModelConfig(name_or_path=name, family=family), tok, seed=2)
    critic = ValueHeadModel(backbone)
    with torch.no_grad():
        critic.value_head.weight.normal_()  # non-zero so the round trip is meaningful
        critic.value_head.bias.fill_(0.25)
    critic.save_pretrained(tmp_path)
    assert (tmp_path / VALUE_HEAD_FILE).is_file() and (tmp_path / "config.json").is_file()
    loaded = ValueHeadModel.from_pretrained(tmp_path)
    sample = generate_suite(["shapes"], seed=0, train_per_task=1, eval_per_task=0)["train"][0]
    images = [r.data for r in sample.images] if proc is not None else []
    prompt = sample if proc is not None else "What is 1 + 5?"
    kw = prepare_inputs(prompt, images, [], tok, proc)
    with torch.no_grad():
        la, va = critic(**kw, return_logits=True)
        lb, vb = loaded(**kw, return_logits=True)
    assert torch.equal(va, vb) and torch.equal(la, lb)
    sa, sb = critic.state_dict(), loaded.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_missing_head_file_is_clear(tok, tmp_path) -> None:
    build_policy(ModelConfig(), tok, seed=0)[0].save_pretrained(tmp_path)
    with pytest.raises(FileNotFoundError, match=VALUE_HEAD_FILE):
        ValueHeadModel.from_pretrained(tmp_path)
