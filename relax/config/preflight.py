"""``preflight(cfg)``: every check of a config against the environment, before anything is written.

The loader's checks read the config alone; these read what is around it: model folders and their
``config.json``, checkpoints, installed packages (by ``importlib.util.find_spec``, never by
importing them), visible GPUs, environment secrets, and the servers the config names. Nothing
here writes, builds a model or makes the dataset snapshot; what needs those (a vocabulary, the
model's Megatron layout, the dataset's rows) is ``relax.config.fit``'s. The small pieces of the
engines and launchers that these checks need (the token variables, whether a module may run as an
SGLang server, the visible GPUs, the served vocabulary) live here and those layers import them.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import urllib.request
from pathlib import Path
from typing import Any

from relax import objstore
from relax.config.cross import sglang_tp_size
from relax.config.fields import ConfigError

TOKEN_ENV = "RELAX_ENGINE_TOKEN"  # the engines' bearer token (relax.engines.guards)
# the session gateway's, for external agents: an agent's token must not let it swap the engines' weights,
# and the engines' must not open sessions
AGENT_TOKEN_ENV = "RELAX_AGENT_TOKEN"
API_TOKEN_ENV = "RELAX_API_TOKEN"  # the rollout REST API's bearer token (relax.services.api.elastic)
TEACHER_KEY_ENV = "RELAX_TEACHER_API_KEY"  # the teacher server's bearer token, if it wants one
SGLANG_MODULE = "sglang.launch_server"
STAND_IN_MARK = "RELAX_SGLANG_STAND_IN"  # a stand-in module declares ``RELAX_SGLANG_STAND_IN = True`` at top level


def preflight(cfg: Any, engine_urls: list[str] | None = None, *, teacher: bool = True) -> None:
    """Raise ConfigError, naming the setting and the fix, on the first thing around ``cfg`` that would stop
    its run. ``engine_urls``: engine servers the user started (``--engine-url``); ``teacher``: also check
    the distillation teacher (False for work that never scores with it: the format warm-start, evaluation).
    A served teacher (teacher.url) is asked by :func:`check_served_teacher` once the training rows are known
    (``relax.services.trainable``): rows with media refuse it whether or not it answers."""
    check_root_writable(cfg.root)
    check_model_folder(cfg)
    if teacher and cfg.teacher.name_or_path:
        check_teacher_folder(cfg)
    check_judge_folder(cfg)
    check_megatron_installed(cfg)
    check_http_engine_options(cfg, engine_urls)
    check_agent_token(cfg)
    check_sglang_launchable(cfg, engine_urls)


ROOT_FIX = "pick a root you can write (root=PATH; --root PATH for relax data snapshot) or change its permissions"


def check_root_writable(root: str) -> None:
    """A local root can be made and written to, judged from its nearest existing folder without
    writing anything (an object store answers for itself at the first write)."""
    path = objstore.local_path(root)
    if path is None:
        return
    folder = path
    while not os.path.exists(folder):
        folder = os.path.dirname(folder)
    if not os.path.isdir(folder):
        raise ConfigError(f"root {root} cannot be made: {folder} is a file, not a folder; {ROOT_FIX}")
    if not os.access(folder, os.W_OK | os.X_OK):
        inside = "" if folder == path else f" (nor its nearest existing folder {folder})"
        raise ConfigError(f"root {root} is not writable{inside}: permission denied or a read-only file system; "
                          f"{ROOT_FIX}")


def _model_type(folder: str) -> str | None:
    """The ``model_type`` of a local model folder's ``config.json``; None when it has none (a built-in)."""
    config = Path(folder).expanduser() / "config.json"
    if not config.is_file():
        return None
    return json.loads(config.read_text()).get("model_type", "")


def check_model_folder(cfg: Any) -> None:
    """A local model folder's ``config.json`` decides its classes: ``model.family`` must name them
    (a family the folder is not would otherwise be ignored)."""
    m = cfg.model
    model_type = _model_type(m.name_or_path)  # None: a built-in, or a name the model builder refuses itself
    if model_type is not None and model_type not in (m.family, f"{m.family}_thinker"):
        raise ConfigError(f"model.family={m.family!r}, but {m.name_or_path} holds a {model_type!r} model "
                          f"(its config.json), which decides the classes: set model.family="
                          f"{model_type.removesuffix('_thinker')}")


def check_teacher_folder(cfg: Any) -> None:
    """The teacher is built as the student's family, and its checkpoint must be one."""
    t, m = cfg.teacher, cfg.model
    model_type = _model_type(t.name_or_path)
    if model_type is not None and model_type not in (m.family, f"{m.family}_thinker"):
        raise ConfigError(f"teacher.name_or_path={t.name_or_path} holds a {model_type!r} model and the "
                          f"student is model.family={m.family!r}: the teacher is built as the student's "
                          f"family; use a teacher of that family")
    if t.checkpoint and not objstore.exists(objstore.join(t.checkpoint, "meta.json")):
        raise ConfigError(f"teacher.checkpoint={t.checkpoint!r} is not a Relax checkpoint (no meta.json there); "
                          f"point it at <root>/runs/<run>/checkpoints/step-NNNNNN of a finished run")


JUDGE_RECORD = "relax_judge.json"  # what `relax genrm train-judge` leaves beside its judge's weights


def check_judge_folder(cfg: Any) -> None:
    """A judge folder that says how it answers (relax.trainers.torch.judge_sft) is read that way, or refused."""
    g = cfg.genrm
    path = os.path.join(g.name_or_path, JUDGE_RECORD) if g.name_or_path else ""
    if not path or not os.path.isfile(path):
        return
    try:
        with open(path) as f:
            record = json.load(f)
        verdict, tokens = str(record["verdict"]), int(record["max_new_tokens"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"{path} is not a judge record ({e}); remove it, or train the judge again") from None
    if g.verdict != verdict or g.max_new_tokens < tokens:
        raise ConfigError(f"genrm.name_or_path={g.name_or_path} was trained to answer {verdict!r} verdicts in up to "
                          f"{tokens} tokens ({JUDGE_RECORD}), and the config reads genrm.verdict={g.verdict!r} with "
                          f"genrm.max_new_tokens={g.max_new_tokens}: set genrm.verdict={verdict} "
                          f"genrm.max_new_tokens={tokens}")


def served_vocab_size(url: str, timeout_s: float = 30.0) -> int | None:
    """The vocabulary of the model an engine server at ``url`` serves (``/get_model_info``), or None when the
    server does not say; raises OSError or ValueError when it does not answer as an engine. The bearer token
    is the teacher's own (RELAX_TEACHER_API_KEY), never the run's engine token."""
    key = os.environ.get(TEACHER_KEY_ENV) or ""
    request = urllib.request.Request(url.rstrip("/") + "/get_model_info",
                                     headers={"Authorization": f"Bearer {key}"} if key else {})
    with urllib.request.urlopen(request, timeout=timeout_s) as answer:
        info = json.loads(answer.read() or b"null")
    size = info.get("vocab_size") if isinstance(info, dict) else None
    return int(size) if isinstance(size, int) else None


def check_served_teacher(cfg: Any) -> int | None:
    """teacher.url answers as an engine server; returns its vocabulary size, which relax.config.fit compares
    with the student's (one request for both)."""
    url = cfg.teacher.url
    try:
        return served_vocab_size(url)
    except Exception as e:  # unreachable, refused, not an engine
        raise ConfigError(f"teacher.url={url} does not answer /get_model_info ({type(e).__name__}: {e}); "
                          f"start the teacher's engine server first") from None


def check_megatron_installed(cfg: Any) -> None:
    # find_spec, not import: megatron.core takes seconds to import and the actor imports it anyway
    if cfg.trainer.backend == "megatron" and importlib.util.find_spec("megatron") is None:
        raise ConfigError("trainer.backend=megatron needs megatron-core: pip install --no-deps "
                          "megatron-core==0.16.1, or use trainer.backend=torch")


def http_engines(cfg: Any, engine_urls: list[str] | None) -> bool:
    """Whether the rollout talks to its engines over HTTP (engine processes, SGLang, or servers by URL)."""
    r = cfg.rollout
    return bool(engine_urls or r.engine_processes > 0 or r.engine == "sglang")


def check_http_engine_options(cfg: Any, engine_urls: list[str] | None) -> None:
    """Settings that only in-process, or only HTTP, engines honour."""
    r = cfg.rollout
    if engine_urls and r.partial_rollout == "abort":  # only the in-process engine aborts
        raise ConfigError("rollout.partial_rollout=abort would change nothing with --engine-url (engines over "
                          "HTTP finish what they started): use rollout.partial_rollout=wait")
    if r.weight_sync == "broadcast" and not http_engines(cfg, engine_urls):
        raise ConfigError("rollout.weight_sync=broadcast sends weights to engine servers, and this rollout runs its "
                          "engine in-process: set rollout.engine_processes >= 1 (or rollout.engine=sglang, or "
                          "--engine-url), or rollout.weight_sync=disk")


def check_api_engines(cfg: Any, engine_urls: list[str] | None) -> None:
    """The elastic REST API scales HTTP engines (the rollout checks it before its producer starts)."""
    r = cfg.rollout
    if r.api_port and not (engine_urls or r.engine_processes > 0):
        raise ConfigError(f"rollout.api_port={r.api_port} scales HTTP engines, but this rollout runs its "
                          f"engine in-process; set rollout.engine_processes=N (or pass --engine-url), or "
                          f"rollout.api_port=0")


def check_api_token(cfg: Any) -> str:
    """The REST API's scale routes need a bearer token (RELAX_API_TOKEN); returns it."""
    token = os.environ.get(API_TOKEN_ENV)
    if cfg.rollout.api_port and not token:
        raise ConfigError(f"rollout.api_port={cfg.rollout.api_port} serves the elastic REST API, whose scale "
                          f"routes need a bearer token: set {API_TOKEN_ENV} for relax train")
    return token or ""


def check_agent_token(cfg: Any) -> None:
    """The gateway's token is the agents': the engines' would let them swap weights."""
    if cfg.rollout.agents != "external":
        return
    agent, engine = os.environ.get(AGENT_TOKEN_ENV), os.environ.get(TOKEN_ENV)
    if not agent or agent == engine:
        raise ConfigError(f"rollout.agents=external: set {AGENT_TOKEN_ENV} to a secret your agents send to the "
                          f"session gateway (its own: not {TOKEN_ENV}, which controls the run's engines)")


def check_sglang_launchable(cfg: Any, engine_urls: list[str] | None) -> None:
    if cfg.rollout.engine == "sglang" and not engine_urls:
        why = sglang_missing(cfg)
        if why:
            raise ConfigError(f"rollout.engine=sglang: {why}; or start SGLang servers yourself and pass their "
                              f"URLs with --engine-url, or use rollout.engine=native")


def sglang_missing(cfg: Any) -> str | None:
    """What stops the rollout from launching its SGLang servers here, if anything."""
    r = cfg.rollout
    if objstore.local_path(cfg.root) is None:
        return (f"SGLang loads each weight version from a local folder and root={cfg.root!r} is not one: "
                f"use a local or shared-filesystem root")
    if r.sglang_module != SGLANG_MODULE:  # a stand-in (tests), which must declare itself
        return server_module_problem(r.sglang_module)
    if importlib.util.find_spec("sglang") is None:
        return "the sglang package is not installed (pip install sglang on a GPU machine)"
    if r.engine_launcher == "ray":  # the cluster's GPUs, not this host's: the launch checks Ray's free ones
        return None
    need, have = r.num_engines * sglang_tp_size(cfg), len(visible_gpus())
    if have < need:
        return (f"rollout.num_engines={r.num_engines} server(s) of {sglang_tp_size(cfg)} GPU(s) each need {need} "
                f"GPUs and {have} are visible")
    return None


def visible_gpus() -> list[str]:
    """The GPU ids this process may hand out: ``CUDA_VISIBLE_DEVICES``, else every device torch sees."""
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return [g.strip() for g in listed.split(",") if g.strip()]
    import torch

    return [str(i) for i in range(torch.cuda.device_count())]


def server_module_problem(module: str) -> str | None:
    """Why ``module`` may not run as the rollout's SGLang server (``python -m MODULE`` with the engine
    token in its arguments), or None: it is SGLang's entry point, or a stand-in that declares itself
    with ``RELAX_SGLANG_STAND_IN = True``, read from its source without running it. ``os`` or
    ``http.server`` would otherwise start with the token on their command line."""
    if module == SGLANG_MODULE:
        return None
    try:
        spec = importlib.util.find_spec(module)
    except (ModuleNotFoundError, ValueError):
        spec = None
    if spec is None:
        return f"rollout.sglang_module={module!r} is not an importable module"
    refused = (f"rollout.sglang_module={module!r} is neither {SGLANG_MODULE} nor a stand-in that declares "
               f"{STAND_IN_MARK} = True; only those run as the rollout's SGLang servers (with the engine token)")
    if not spec.origin or not spec.origin.endswith(".py"):  # built in, frozen (os), compiled: no declaration
        return refused
    try:
        with open(spec.origin, encoding="utf-8") as f:
            tree = ast.parse(f.read(), spec.origin)
    except (OSError, SyntaxError, ValueError) as e:
        return f"rollout.sglang_module={module!r}: its source {spec.origin} cannot be read ({e})"
    declared = any(isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == STAND_IN_MARK
                                                        for t in node.targets)
                   and isinstance(node.value, ast.Constant) and node.value.value is True for node in tree.body)
    return None if declared else refused
