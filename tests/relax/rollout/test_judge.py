"""Judge-model rewards (``data.judge_url``) against real HTTP servers.

* A grading server (FastAPI, OpenAI chat format) that gives <score>1</score> when the
  response contains the reference answer, answers without a score for "garble", and 500s
  for "crash": scores, errors and concurrency as the dispatcher records them.
* The native Relax engine's own chat route with a tiny random model: the request is accepted
  as sent, and its unscored answer becomes a recorded reward error, not a crash.
* A 2-step training run whose every reward came from the judge.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
from fastapi import Body, FastAPI

from relax.data.samples import Message, Sample
from relax.rollout.judge import JudgeError, JudgeReward, parse_score
from relax.rollout.rewards import RewardDispatcher
from relax.services.roles.media import sample_id_of
from tests.relax.engines.contract import InProcessServer, save_tiny_model


def grading_app() -> FastAPI:
    app = FastAPI()
    app.state.requests, app.state.inflight, app.state.peak = [], 0, 0
    lock = threading.Condition()

    @app.get("/health")
    def health() -> dict:
        return {}

    @app.post("/v1/chat/completions")
    def chat(body: dict = Body(...)) -> dict:
        with lock:
            app.state.requests.append(body)
            app.state.inflight += 1
            app.state.peak = max(app.state.peak, app.state.inflight)
            lock.notify_all()
            # the server's first request waits (up to 10 s) for a second one: a concurrent client
            # overlaps them at once, on any machine; one that sends a request at a time never does
            if len(app.state.requests) == 1:
                lock.wait_for(lambda: app.state.peak > 1, timeout=10)
        try:
            prompt = body["messages"][0]["content"]
            answer = prompt.split("Reference answer: ", 1)[1].split("\n", 1)[0]
            response = prompt.split("Response to grade:\n", 1)[1].split("\n\nDoes the response", 1)[0]
            if "crash" in response:
                raise RuntimeError("judge crashed")
            text = "no idea" if "garble" in response else f"<score>{int(answer in response)}</score>"
            return {"object": "chat.completion", "choices": [{"index": 0, "message": {"role": "assistant",
                                                                                      "content": text}}]}
        finally:
            with lock:
                app.state.inflight -= 1

    return app


def sample(answer: str = "7") -> Sample:
    return Sample(id="s1", task="largest", messages=(Message("user", "What is the largest of 3, 7 and 5?"),),
                  answer=answer)


@pytest.fixture(scope="module")
def judge_server():
    app = grading_app()
    with InProcessServer(app) as srv:
        yield srv.url, app


def test_the_judge_grades_and_failures_become_recorded_errors(judge_server):
    url, app = judge_server
    judge = JudgeReward(url, "grader", concurrency=8)
    dispatcher = RewardDispatcher(judge=judge)
    pairs = [("<answer>7</answer>", sample()), ("<answer>5</answer>", sample()), ("garble", sample()),
             ("crash", sample())] * 4
    before = len(app.state.requests)
    scored = dispatcher.score_many(pairs)
    assert [s.reward for s in scored[:4]] == [1.0, 0.0, 0.0, 0.0]
    assert scored[0].error == scored[1].error == ""
    assert "no <score>S</score>" in scored[2].error and "judge at" in scored[2].error
    assert "HTTP 500" in scored[3].error
    assert dispatcher.errors == 8  # garble and crash, four times each
    sent = app.state.requests[before:]
    assert len(sent) == 16 and all(b["model"] == "grader" and b["temperature"] == 0.0 for b in sent)
    assert app.state.peak > 1  # graded concurrently, not one after another


def test_scores_are_read_from_the_last_score_tag_and_checked():
    wrap = lambda text: {"choices": [{"message": {"content": text}}]}  # noqa: E731
    assert parse_score(wrap("first <score>0</score> then <score>0.5</score>")) == 0.5
    with pytest.raises(JudgeError, match="outside"):
        parse_score(wrap("<score>3</score>"))
    with pytest.raises(JudgeError, match="not a chat completion"):
        parse_score({"error": "x"})


def test_an_unreachable_judge_is_an_error_not_a_crash():
    judge = JudgeReward("http://127.0.0.1:9", timeout_s=2)
    scored = RewardDispatcher(judge=judge).score_many([("<answer>7</answer>", sample())])
    assert scored[0].reward == 0.0 and "no answer" in scored[0].error


def test_a_native_engine_serves_as_judge(tmp_path):
    from relax.engines.server import build_native_engine, create_app

    folder = save_tiny_model(Path(tmp_path) / "judge", max_positions=512)
    engine, _ = build_native_engine(str(folder), max_batch_size=4)
    engine.start()
    try:
        with InProcessServer(create_app(engine, str(folder))) as srv:
            judge = JudgeReward(srv.url + "/v1", max_tokens=4, api_key=os.environ["RELAX_ENGINE_TOKEN"])
            scored = RewardDispatcher(judge=judge).score_many([("<answer>7</answer>", sample())] * 2)
    finally:
        engine.stop()
    # the engine answered (a random tiny model writes no score): recorded as the judge's text
    assert all(s.reward == 0.0 and "has no <score>S</score>" in s.error for s in scored), scored


@pytest.mark.slow
def test_a_run_rewarded_by_the_judge(tmp_path, judge_server):
    from relax.services.driver import train
    from relax.services.run_context import RunContext
    from tests.relax.services.runtime_helpers import tiny_config

    url, app = judge_server
    before = len(app.state.requests)
    cfg = tiny_config(f"file://{tmp_path}", "judged", "data.tasks=[largest]", f"data.judge_url={url}",
                      "trainer.total_steps=2")
    assert train(cfg, progress=False).steps == 2
    queue = RunContext(cfg).queue()
    queue.refresh()
    ids = list(queue.state.samples)
    rows = queue.read(ids, ["reward", "response", "error"])
    assert len(app.state.requests) - before == len(ids)  # one judgement per sample
    answers = {s.id: s.answer for s in RunContext(cfg).split("train")}
    # the grading rule, applied to what was stored: the rewards are the judge's
    expected = [float(answers[sample_id_of(i)] in r) for i, r in zip(ids, rows["response"], strict=True)]
    assert rows["reward"] == pytest.approx(expected) and all(e == "" for e in rows["error"])
