"""``relax export``: a LoRA checkpoint as a PEFT adapter folder PEFT loads, and merged into its base."""

from __future__ import annotations

import copy
import json

import torch

from relax.cli.main import main
from relax.config import load_config
from relax.models import build_policy, build_tokenizer
from relax.models.lora import adapter_info, apply_lora
from relax.trainers.checkpoint.trainer_state import save_checkpoint


def test_a_lora_checkpoint_exports_as_a_peft_folder_and_merged(tmp_path, capsys):
    import peft
    from transformers import AutoModelForCausalLM

    cfg = load_config(None, ["model.lora.rank=4", "model.lora.alpha=8", "model.lora.target_modules=[q_proj,v_proj]"])
    tok = build_tokenizer(cfg.model.tokenizer)
    base, _ = build_policy(cfg.model, tok, seed=cfg.seed)
    ours = apply_lora(copy.deepcopy(base), cfg.model)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in ours.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    url = save_checkpoint(str(tmp_path / "ckpt"), ours, meta={"lora": adapter_info(cfg.model)})
    ids = torch.tensor([tok("3+4=7 and 12+9=21")["input_ids"]])
    with torch.no_grad():
        want = ours.eval()(input_ids=ids).logits

    # the config gives family and tokenizer only: rank and modules come from the checkpoint's record
    assert main(["export", "--checkpoint", url, "--out", str(tmp_path / "adapter")]) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["kind"] == "PEFT adapter"
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 4 and sorted(config["target_modules"]) == ["q_proj", "v_proj"]
    loaded = peft.PeftModel.from_pretrained(copy.deepcopy(base), str(tmp_path / "adapter")).eval()
    with torch.no_grad():
        got = loaded(input_ids=ids).logits
    assert torch.allclose(got, want, atol=1e-5), float((got - want).abs().max())
    assert not torch.allclose(base.eval()(input_ids=ids).logits, want, atol=1e-3)  # the adapter matters

    assert main(["export", "--checkpoint", url, "--out", str(tmp_path / "merged"), "--merge"]) == 0
    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged")).eval()
    with torch.no_grad():
        got = merged(input_ids=ids).logits
    assert torch.allclose(got, want, atol=1e-5), float((got - want).abs().max())
