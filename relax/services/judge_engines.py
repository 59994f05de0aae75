"""The reward role's generative judge (``genrm``): its model, its engines, its API and its record.

:func:`open_judge` builds what ``cfg.genrm`` asks for (docs/genrm.md):

* ``genrm.urls``: judge servers the run does not own, behind the router (routed around, never replaced);
* ``genrm.engines=N``: ``N`` judge engine processes (native or SGLang, ``genrm.engine``) started by the
  launchers the rollout's engines use, with their token, and supervised by their pool: a dead one is
  replaced; ``genrm.api_port`` serves the elastic REST API over them, so the pool grows and shrinks
  while the run trains;
* ``genrm.engines=0``: one native engine inside the reward role's process. In the colocated topology
  that is the rollout's process: the judge's weights sit beside the policy's, in a model of their own,
  and the two take turns on the same CPUs or GPU.

Lineage: the judge is named by its weights' content hash and its template's hash
(:func:`judge_identity`), checked against the run's record (relax.services.judge_record) before
any engine starts, and put on every reward commit.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
from typing import Any

import torch

from relax.config import ModelConfig, RelaxConfig
from relax.rollout.engine_pool import EnginePool, LocalEngines
from relax.rollout.genrm import GenRMJudge, JudgeSpec
from relax.rollout.remote_engines import RemoteEngines
from relax.rollout.verdicts import TEMPLATES, template_hash
from relax.services.api.server import RolloutAPIServer
from relax.services.judge_record import check_judge_record
from relax.services.launchers.factory import engine_launcher, first_engines
from relax.services.launchers.lifetime import owned_temp_dir
from relax.services.run_context import RunContext
from relax.transfer.weight_delta import content_hash


def judge_model_config(cfg: RelaxConfig) -> ModelConfig:
    g = cfg.genrm
    return dataclasses.replace(cfg.model, name_or_path=g.name_or_path, family=g.family,
                               tokenizer=g.tokenizer or cfg.model.tokenizer, hidden_size=g.hidden_size,
                               num_layers=g.num_layers, num_heads=g.num_heads, init_checkpoint="", value_head=False,
                               max_seq_len=judge_context(cfg),  # a built-in judge reads template + prompt + response
                               dtype="float32", lora=dataclasses.replace(cfg.model.lora, rank=0))


def judge_context(cfg: RelaxConfig) -> int:
    """The context a built-in judge is built with and its in-process engine serves: room for the template
    around the policy's whole prompt and response."""
    return 2 * cfg.model.max_seq_len + 256


def judge_tokenizer(ctx: RunContext) -> Any:
    from relax.models import build_tokenizer

    spec = ctx.cfg.genrm.tokenizer
    return ctx.tokenizer if not spec or spec == ctx.cfg.model.tokenizer else build_tokenizer(spec)


def judge_template(cfg: RelaxConfig) -> str:
    if not cfg.genrm.template:
        return TEMPLATES[cfg.genrm.verdict]
    with open(cfg.genrm.template, encoding="utf-8") as f:
        return f.read()


def judge_spec(cfg: RelaxConfig) -> JudgeSpec:
    g = cfg.genrm
    return JudgeSpec(judge_template(cfg), g.verdict, g.reference, g.top_logprobs, g.max_new_tokens, g.invalid)


def context_of(model: torch.nn.Module) -> int:
    """Tokens the judge's engines take, prompt and verdict together (its config's positions)."""
    return int(model.config.get_text_config().max_position_embeddings)


def weights_id(model: torch.nn.Module) -> str:
    """The judge's content (the WeightStore's hash over names, dtypes, shapes, bytes), 16 hex digits: not its path."""
    return content_hash(model.state_dict())[:16]


def judge_identity(cfg: RelaxConfig, model_id: str) -> dict[str, Any]:
    """What names the judge in reward commits, checkpoints' lineage and ``relax lineage``."""
    g = cfg.genrm
    where = {"urls": list(g.urls)} if g.urls else {"name_or_path": g.name_or_path, "checkpoint": g.checkpoint}
    return {"model_id": model_id, "template_hash": template_hash(judge_template(cfg)), "verdict": g.verdict,
            **where}


def _pool(ctx: RunContext, model: torch.nn.Module | None, slots: int) -> tuple[EnginePool, str | None]:
    """The judge's engine pool and the model copy its owned engines serve (removed on close)."""
    cfg, g, r = ctx.cfg, ctx.cfg.genrm, ctx.cfg.rollout
    faults = {"timeout_s": r.engine_timeout_s, "max_failures": r.engine_max_failures,
              "supervise_interval_s": r.supervise_interval_s}
    if g.urls:
        return RemoteEngines(list(g.urls), **faults), None
    assert model is not None
    if g.engines == 0:
        return LocalEngines(model, judge_tokenizer(ctx), max_batch_size=slots, max_seq_len=context_of(model),
                            seed=cfg.seed), None
    model_dir = owned_temp_dir("relax-judge-model-")  # swept by the next run if this process is killed
    try:
        model.save_pretrained(model_dir)
        judge_tokenizer(ctx).save_pretrained(model_dir)
        # the judge's model settings (context, dtype) and engine kind, the rollout's launcher and its token
        launch_cfg = dataclasses.replace(cfg, model=dataclasses.replace(judge_model_config(cfg),
                                                                          max_seq_len=context_of(model)),
                                         rollout=dataclasses.replace(r, engine=g.engine),
                                         algorithm=dataclasses.replace(cfg.algorithm, routing_replay=False))
        launcher = engine_launcher(launch_cfg, model_dir, g.max_engines, slots, ctx.run_url)
        started, killed = first_engines(launcher, g.engines)
    except BaseException:
        shutil.rmtree(model_dir, ignore_errors=True)
        raise
    pool = RemoteEngines([], owned=started, launcher=launcher, vocab_size=model.config.vocab_size,
                         local_weights=g.engine == "sglang", **faults)
    pool.supervisor.vacancies += killed  # its supervisor starts their replacements
    return pool, model_dir


class Judge(GenRMJudge):
    """The run's :class:`GenRMJudge` with what came with it: the model copy and the elastic API."""

    model_dir: str | None = None
    api: RolloutAPIServer | None = None

    def close(self) -> None:
        try:
            if self.api is not None:
                self.api.stop()
            super().close()
        finally:
            if self.model_dir is not None:
                shutil.rmtree(self.model_dir, ignore_errors=True)


def open_judge(ctx: RunContext) -> Judge:
    """The judge of ``ctx``'s config, its identity checked against the run's record, engines up."""
    from relax.models import build_policy
    from relax.trainers.checkpoint.trainer_state import load_checkpoint

    cfg, g = ctx.cfg, ctx.cfg.genrm
    model = None
    if g.urls:
        model_id = "urls:" + hashlib.sha256(json.dumps(sorted(g.urls)).encode()).hexdigest()[:16]
    else:
        model, _ = build_policy(judge_model_config(cfg), judge_tokenizer(ctx), seed=cfg.seed)
        if g.checkpoint:
            load_checkpoint(g.checkpoint, model, restore_rng=False)  # a shape mismatch names the tensor
        model.eval().requires_grad_(False)
        model_id = weights_id(model)
    identity = judge_identity(cfg, model_id)
    check_judge_record(ctx, identity)
    slots = max(8, cfg.rollout.n_samples_per_prompt * cfg.rollout.prompts_per_step)
    pool, model_dir = _pool(ctx, model, slots)
    judge = Judge(pool, judge_tokenizer(ctx), judge_spec(cfg), identity, context_of(model) if model else None)
    judge.model_dir = model_dir
    if g.api_port:
        assert isinstance(pool, RemoteEngines)  # relax.config.genrm.check_genrm: api_port needs servers
        judge.api = RolloutAPIServer(pool, None, cfg.rollout.api_host, g.api_port).start()
    return judge
