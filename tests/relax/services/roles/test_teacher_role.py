"""On-policy distillation in a run: the teacher role scores every sampled token, the advantage role
turns the scores into the negative reverse KL per token, lineage names the teacher, and a teacher
killed mid-run heals with every trained row scored exactly once."""

from __future__ import annotations

from contextlib import ExitStack, contextmanager

import numpy as np
import pytest
import torch

from relax.cli.train_cmd import run_status
from relax.config import ConfigError, load_config
from relax.engines.native.engine import NativeEngine
from relax.engines.server import create_app
from relax.models import build_tokenizer
from relax.services.driver import train
from relax.services.queue_contract import ACTOR_GROUP, ADVANTAGE_GROUP, TEACHER_GROUP
from relax.services.roles.teacher import build_teacher
from relax.services.run_context import RunContext
from relax.services.trainable import check_trainable
from relax.trainers.torch.batch import RolloutBatch
from relax.transfer.consumer import load_group_state
from relax.transfer.lineage import list_records
from tests.relax.engines.contract import InProcessServer
from tests.relax.services.manifest_checks import check_run
from tests.relax.services.runtime_helpers import tiny_config

TEACHER = ("teacher.name_or_path=tiny-qwen2", "teacher.hidden_size=96", "teacher.num_layers=3",
           "algorithm.distill_coef=2.0", "trainer.total_steps=2", "trainer.checkpoint_every=2")


def _rows(ctx: RunContext, fields: list[str]) -> tuple[list[str], dict]:
    queue = ctx.queue()
    queue.refresh()
    ids = sorted(sid for sid, m in queue.state.samples.items() if "advantages" in m.locs)
    return ids, queue.read(ids, fields)


TEACHER_KEY = "teacher-server-key"  # not the run's engine token: the teacher is a server of its own

@contextmanager
def served_teacher(cfg):
    """The teacher ``build_teacher`` makes for ``cfg``, behind a native engine server in this process."""
    teacher, _ = build_teacher(RunContext(cfg))
    engine = NativeEngine(teacher.model, build_tokenizer(cfg.model.tokenizer), max_batch_size=16,
                          max_seq_len=cfg.model.max_seq_len)
    try:  # a teacher server of its own, with its own key: the run reaches it with RELAX_TEACHER_API_KEY
        with InProcessServer(create_app(engine, "teacher", token=TEACHER_KEY)) as server:
            yield server.url
    finally:
        engine.stop()


@pytest.mark.slow
@pytest.mark.parametrize("where", ["local", "url"])
def test_distillation_alone_trains_on_the_teachers_scores_of_each_sampled_token(tmp_path, where, monkeypatch):
    # with distill_topk the teacher's top 4 at every trained position travel too, for the actor's exact KL;
    # "url": the same teacher behind an engine server, which scores the rows as SGLang's prompt log-probs
    cfg = tiny_config(f"file://{tmp_path}", "distill", *TEACHER, "algorithm.mode=distill", "algorithm.distill_topk=4")
    with ExitStack() as stack:
        if where == "url":
            monkeypatch.setenv("RELAX_TEACHER_API_KEY", TEACHER_KEY)  # role processes inherit it
            url = stack.enter_context(served_teacher(cfg))
            run_cfg = tiny_config(f"file://{tmp_path}", "distill", *TEACHER[3:], "algorithm.mode=distill",
                                  "algorithm.distill_topk=4", f"teacher.url={url}")
        result = train(run_cfg if where == "url" else cfg, progress=False)
    assert result.steps == 2 and [m["step"] for m in result.metrics("teacher")] == [0, 1]
    assert all(m["distill_topk_kl"] > 0 for m in result.metrics("actor"))
    ctx = RunContext(cfg)
    ids, rows = _rows(ctx, ["tokens", "loss_mask", "logprobs", "teacher_logprobs", "advantages",
                            "teacher_topk_ids", "teacher_topk_logprobs"])
    assert ids
    # the columns are the teacher's log-probability of each token and its top 4 from the first trained
    # token on (recomputed here from the same teacher)
    teacher, _ = build_teacher(ctx)
    batch = RolloutBatch(ids=ids, input_ids=[torch.tensor(t) for t in rows["tokens"]],
                         loss_mask=[torch.tensor(m, dtype=torch.float32) for m in rows["loss_mask"]])
    for lp, got in zip(teacher.logprobs(batch), rows["teacher_logprobs"], strict=True):
        np.testing.assert_allclose(got, lp.numpy(), atol=1e-5)
    top = teacher.topk(batch, 4)
    for mask, ids4, lps4, got_ids, got_lps in zip(rows["loss_mask"], top.ids, top.logprobs, rows["teacher_topk_ids"],
                                                  rows["teacher_topk_logprobs"], strict=True):
        start = int(np.flatnonzero(mask)[0])
        assert got_ids.shape == (len(mask) - start, 4)
        np.testing.assert_allclose(got_lps, lps4[start:].numpy(), atol=1e-5)
        assert np.array_equal(got_ids, ids4[start:].numpy())
    # mode=distill: the advantage is 2 * (teacher - behaviour) on the trained tokens, 0 elsewhere
    for mask, behav, tlp, adv in zip(rows["loss_mask"], rows["logprobs"], rows["teacher_logprobs"],
                                     rows["advantages"], strict=True):
        np.testing.assert_allclose(adv, 2.0 * (tlp - behav) * mask, atol=1e-6)
    assert all(np.any(a != 0) for a in rows["advantages"])
    assert "distill_reverse_kl" in result.metrics("advantage")[0]
    # the checkpoint's lineage names the teacher it was distilled from
    [record] = list_records(cfg.root, cfg.run_id)
    if where == "url":
        assert record.extra["teacher"]["url"] == url
    else:
        assert record.extra["teacher"]["name_or_path"] == "tiny-qwen2" and record.extra["teacher"]["hidden_size"] == 96


@pytest.mark.slow
def test_a_killed_teacher_heals_with_every_trained_row_scored_once(tmp_path, monkeypatch):
    cfg = tiny_config(f"file://{tmp_path}", "killed", *TEACHER, "topology=disaggregated", "supervisor.backoff_s=0.1")
    monkeypatch.setenv("RELAX_FAULT", "teacher:recorded:1:1")  # dies after recording step 1, before its column
    assert train(cfg, progress=False).steps == 2
    ctx = RunContext(cfg)
    check_run(ctx, 2)
    queue = ctx.queue()
    queue.refresh()
    trained = {sid for rec in load_group_state(queue, ACTOR_GROUP).steps.values() for sid in rec["ids"]}
    for group in (TEACHER_GROUP, ADVANTAGE_GROUP):
        taken = [sid for rec in load_group_state(queue, group).steps.values() for sid in rec["ids"]]
        assert len(taken) == len(set(taken)) and trained <= set(taken), group
    assert all("teacher_logprobs" in queue.state.samples[sid].locs for sid in trained)
    assert run_status(cfg.root, "killed")["restarts"] == {"teacher": 1}


@pytest.mark.parametrize("overrides, error", [
    (("algorithm.distill_coef=1",), "distils from a teacher: set teacher.name_or_path"),
    (("algorithm.distill_coef=1", "teacher.url=localhost:30000"), "must be an http:// or https://"),
    (("algorithm.distill_coef=1", "teacher.url=http://t:1", "teacher.name_or_path=tiny-qwen2"),
     "set one of them, not both"),
    (("algorithm.distill_coef=1", "teacher.url=http://t:1", "rollout.temperature=0.7"),
     "scores tokens at temperature 1 .* but rollout.temperature=0.7"),
    (("teacher.url=http://127.0.0.1:1",), "scores tokens nobody uses"),
    (("teacher.name_or_path=tiny-qwen2",), "scores tokens nobody uses"),
    (("algorithm.mode=distill",), "set algorithm.distill_coef > 0"),
    (("algorithm.mode=distill", "algorithm.distill_coef=1", "teacher.name_or_path=tiny-qwen2",
      "algorithm.advantage=gae", "model.value_head=true"), "a critic \\(advantage=gae\\) would train for nothing"),
])
def test_distillation_settings_that_would_be_ignored_are_refused(overrides, error):
    with pytest.raises(ConfigError, match=error):
        load_config("tiny-cpu", list(overrides))


def test_a_teacher_of_another_vocabulary_or_no_checkpoint_is_refused_before_the_run(tmp_path):
    other = tmp_path / "other-tok"
    tok = build_tokenizer("bpe-tiny")
    tok.add_tokens(["<extra-token>"])
    tok.save_pretrained(other)
    cfg = tiny_config(f"file://{tmp_path}", "vocab", *TEACHER, f"teacher.tokenizer={other}")
    with pytest.raises(ConfigError, match=r"teacher.tokenizer=.*\(513 tokens\) is not the student's "
                                          r"model.tokenizer='bpe-tiny' \(512 tokens\)"):
        check_trainable(RunContext(cfg))
    cfg = tiny_config(f"file://{tmp_path}", "ckpt", *TEACHER, f"teacher.checkpoint=file://{tmp_path}/nowhere")
    with pytest.raises(ConfigError, match="is not a Relax checkpoint"):
        check_trainable(RunContext(cfg))


def test_a_served_teacher_is_refused_before_the_run_on_media_rows_or_when_it_does_not_answer(tmp_path):
    served = ("algorithm.distill_coef=1", "teacher.url=http://127.0.0.1:9")  # port 9: nothing listens
    cfg = tiny_config(f"file://{tmp_path}", "media", *served, "data.tasks=[shapes]")
    with pytest.raises(ConfigError, match=r"scores token ids only, and training row .* \(shapes\) carries media"):
        check_trainable(RunContext(cfg))
    cfg = tiny_config(f"file://{tmp_path}", "down", *served)
    with pytest.raises(ConfigError, match=r"teacher.url=http://127.0.0.1:9 does not answer /get_model_info"):
        check_trainable(RunContext(cfg))


def test_a_remote_teacher_gets_its_own_key_never_the_engine_token(monkeypatch):
    # a capture server in place of the teacher records the Authorization header of each request
    import http.server
    import threading

    from relax.services.roles.teacher_remote import RemoteTeacher

    seen: list = []

    class Capture(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            seen.append(self.headers.get("Authorization"))
            body = b'{"vocab_size": 300}'
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Capture)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_port}"
    try:
        monkeypatch.setenv("RELAX_ENGINE_TOKEN", "the-runs-engine-token")
        monkeypatch.delenv("RELAX_TEACHER_API_KEY", raising=False)
        assert RemoteTeacher(url).vocab_size() == 300
        monkeypatch.setenv("RELAX_TEACHER_API_KEY", "the-teachers-key")
        assert RemoteTeacher(url).vocab_size() == 300
    finally:
        server.shutdown()
    assert seen == [None, "Bearer the-teachers-key"]


@pytest.mark.parametrize("url, refused", [("http://10.0.0.7:30000", True), ("http://teacher.internal", True),
                                          ("http://127.0.0.1:30000", False), ("http://localhost:1", False),
                                          ("http://[::1]:30000", False), ("https://teacher.example", False)])
def test_plain_http_to_another_machine_needs_an_opt_in(url, refused):
    base = ["algorithm.distill_coef=1", f"teacher.url={url}", "rollout.temperature=1.0"]
    if refused:
        with pytest.raises(ConfigError, match="is plain http to another machine.*teacher.allow_plain_http=true"):
            load_config("tiny-cpu", base)
        load_config("tiny-cpu", [*base, "teacher.allow_plain_http=true"])
    else:
        load_config("tiny-cpu", base)
