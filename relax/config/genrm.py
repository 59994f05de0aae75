"""The generative reward model section (``genrm``): a judge model the run serves, scales and records.

With ``genrm.name_or_path`` (or ``genrm.urls``) set, the reward role (``data.reward_role=true``)
grades every response with the judge instead of the task verifiers (relax.services.roles.reward,
docs/genrm.md). Beside the section, the checks that read it.
"""

from __future__ import annotations

import os
import string
from dataclasses import dataclass
from typing import Any

from relax.config.fields import ConfigError, opt
from relax.config.model import TEXT_FAMILIES

FIELDS = ("question", "response", "reference")  # what a judge template may ask for (relax.rollout.verdicts)


@dataclass
class GenRMConfig:
    """A generative reward model: a frozen text model that reads prompt, response and reference and writes a
    verdict, on engines the reward role owns (or a pool of URLs)."""

    name_or_path: str = opt("", "The judge: a local Hugging Face folder (e.g. a tiny judge fine-tuned to grade a "
                            "task, docs/genrm.md) or a built-in tiny name; empty = no generative reward model.")
    family: str = opt("qwen2", "The judge's architecture family (a text model).", choices=TEXT_FAMILIES)
    hidden_size: int = opt(64, "Hidden width of a built-in tiny judge.", range=(8, 16384))
    num_layers: int = opt(2, "Decoder layers of a built-in tiny judge.", range=(1, 256))
    num_heads: int = opt(4, "Attention heads of a built-in tiny judge.", range=(1, 256))
    checkpoint: str = opt("", "A Relax checkpoint folder (any fsspec URL) whose weights the judge loads; empty = "
                          "the model's own weights.")
    tokenizer: str = opt("", "The judge's tokenizer (as model.tokenizer); empty = model.tokenizer.")
    template: str = opt("", "A local text file holding the judge prompt, with {question}, {response} and "
                        "{reference} fields (docs/genrm.md); empty = the built-in template of genrm.verdict.")
    reference: bool = opt(True, "Show the judge the sample's reference answer; false = it reads '(none)'.")
    verdict: str = opt("yes_no", "How the judge's answer becomes a reward in [0, 1]: p(yes) / (p(yes) + p(no)) of "
                       "its first token, <score>S</score>, or \\boxed{S}.", choices=("yes_no", "score", "boxed"))
    top_logprobs: int = opt(20, "With verdict=yes_no: how many likeliest first tokens are searched for yes and no.",
                            range=(2, 20))
    max_new_tokens: int = opt(32, "Longest verdict with verdict=score or boxed (yes_no reads one token).",
                              range=(1, 4096))
    invalid: str = opt("skip", "An unparsable or out-of-range verdict: 'skip' = reward 0 with zero loss weight and "
                       "the reason as the row's error; 'zero' = reward 0, trained. Counted either way.",
                       choices=("skip", "zero"))
    engines: int = opt(0, "Judge engine processes the reward role owns and supervises; 0 = one engine inside the "
                       "reward role (in the colocated topology: the rollout's process, time-shared).",
                       range=(0, 1024))
    engine: str = opt("native", "The owned judge engines' kind.", choices=("native", "sglang"))
    max_engines: int = opt(8, "Most judge engines alive at once, scale-outs through genrm.api_port included.",
                           range=(1, 1024))
    urls: list[str] = opt([], "Judge engine servers the run does not own (Relax's or SGLang's /generate, the "
                          "judge's tokenizer), used instead of name_or_path.")
    api_port: int = opt(0, "Serve the judge pool's elastic REST API (docs/rest_api.md routes) on this port from "
                        "the reward role; bearer token from RELAX_API_TOKEN. 0 = off.", range=(0, 65535))
    allow_change: bool = opt(False, "Let a resumed run grade with a judge whose weights or template differ from "
                             "the one it started with (recorded in lineage); false refuses.")

    @property
    def enabled(self) -> bool:
        return bool(self.name_or_path or self.urls)


def check_genrm(cfg: Any) -> None:
    """A judge grades in the reward role, alone, from one source, with a template it can fill."""
    g = cfg.genrm
    if not g.enabled:
        return
    if not cfg.data.reward_role:
        raise ConfigError("genrm grades responses in the reward role: set data.reward_role=true (or unset "
                          "genrm.name_or_path / genrm.urls)")
    other = [k for k, v in (("data.reward_fn", cfg.data.reward_fn), ("data.judge_url", cfg.data.judge_url)) if v]
    if other:
        raise ConfigError(f"genrm and {other[0]} both replace the task verifiers; unset {other[0]}")
    if g.urls and (g.name_or_path or g.checkpoint or g.engines):
        raise ConfigError("genrm.urls serve the judge, and genrm.name_or_path/checkpoint/engines would build "
                          "another one here: set genrm.urls or the model, not both")
    bad = [u for u in g.urls if not u.startswith(("http://", "https://"))]
    if bad:
        raise ConfigError(f"genrm.urls: {bad[0]!r} must be an http:// or https:// engine server URL")
    if g.engines > g.max_engines:
        raise ConfigError(f"genrm.engines={g.engines} is more than genrm.max_engines={g.max_engines}; raise "
                          f"genrm.max_engines")
    if g.engine == "sglang" and not g.engines:
        raise ConfigError("genrm.engine=sglang picks the kind of the judge engines the reward role starts, and "
                          "genrm.engines=0 starts none (the judge runs inside the role): set genrm.engines >= 1, "
                          "or genrm.engine=native")
    if g.api_port and not (g.engines or g.urls):
        raise ConfigError("genrm.api_port scales a pool of judge engine servers, and genrm.engines=0 runs the judge "
                          "inside the reward role: set genrm.engines >= 1 or genrm.api_port=0")
    if g.template:
        check_template_file(g.template)


def check_template(template: str, where: str) -> None:
    """A template must show ``{response}`` and use no field but :data:`FIELDS`; ValueError names ``where``."""
    try:
        names = {name for _, name, _, _ in string.Formatter().parse(template) if name is not None}
    except ValueError as e:  # an unmatched brace
        raise ValueError(f"{where}: not a format template ({e}); write literal braces as {{{{ and }}}}") from None
    unknown = names - set(FIELDS)
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {sorted(unknown)}; a judge template may use {list(FIELDS)}")
    if "response" not in names:
        raise ValueError(f"{where}: the template never shows the judge the {{response}} it grades")


def check_template_file(path: str) -> None:
    if not os.path.isfile(path):
        raise ConfigError(f"genrm.template={path!r} is not a file; give a local text file with the judge prompt, "
                          f"or leave genrm.template empty for the built-in one")
    with open(path, encoding="utf-8") as f:
        text = f.read()
    try:
        check_template(text, f"genrm.template={path!r}")
    except ValueError as e:
        raise ConfigError(str(e)) from None
