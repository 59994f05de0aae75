"""Images in the loop of a gateway session on a policy that takes them: a built-in image task (``shapes``)
played as a tool loop whose tool result is a picture. The image joins the policy's context as the built-in
agent loop adds one (placeholder tokens masked out of the loss), and travels with the sample's row."""

from __future__ import annotations

import base64
import threading

import torch

from relax.config import load_config
from relax.data.suite import shapes
from relax.engines.types import SamplingParams
from relax.models import build_policy, build_processor, build_tokenizer
from relax.rollout.engine_pool import LocalEngines
from relax.rollout.rewards import RewardDispatcher
from relax.rollout.sessions import SessionHub
from relax.services.api.gateway import openai_messages
from relax.services.roles.media import unpack_media
from relax.services.roles.rollout import trajectory_row


def test_an_image_in_a_tool_result_joins_the_context_and_the_samples_row():
    cfg = load_config("omni-cpu", [])
    tok = build_tokenizer(cfg.model.tokenizer)
    model, _ = build_policy(cfg.model, tok, seed=0)
    processor = build_processor(cfg.model, tok)
    pool = LocalEngines(model, tok, max_batch_size=4, max_seq_len=cfg.model.max_seq_len, seed=0)
    hub = SessionHub(pool, tok, processor, RewardDispatcher(), SamplingParams(max_new_tokens=8),
                     max_seq_len=cfg.model.max_seq_len)
    sample = shapes.generate(0, "train", 1, 1)[0]
    picture = sample.images[0].data  # the tool "zooms in": it returns the prompt's picture again
    seen: dict = {}

    def agent() -> None:
        while (claimed := hub.open_session()) is None:
            pass
        sid, opened = claimed
        messages = openai_messages(opened, lambda ref: ref.data)
        first = hub.chat(sid, {"messages": messages}).result(timeout=120)
        url = "data:image/png;base64," + base64.b64encode(picture).decode()
        messages += [{"role": "assistant", "content": first["text"]},
                     {"role": "tool", "content": [{"type": "text", "text": "zoomed:"},
                                                  {"type": "image_url", "image_url": {"url": url}}]}]
        seen["second"] = hub.chat(sid, {"messages": messages}).result(timeout=120)
        seen["state"] = hub.close(sid).result(timeout=120)

    thread = threading.Thread(target=agent, daemon=True)
    thread.start()
    (traj,) = hub.run_batch([(0, sample)], 1)
    thread.join(60)
    pool.close()
    assert traj.turns == 2 and seen["state"]["state"] == "closed"
    assert len(traj.images) == len(sample.images) + 1 and traj.images[-1] == picture
    grid = traj.mm_inputs["image_grid_thw"]
    assert grid.shape[0] == 2 and torch.equal(grid[0], grid[1])  # the same picture, encoded twice
    image_tokens = [i for i, t in enumerate(traj.tokens) if t == processor.image_token_id]
    second_image = image_tokens[len(image_tokens) // 2:]
    assert second_image and all(traj.mask[i] == 0 for i in second_image)  # context the agent added
    assert second_image[0] > traj.prompt_len and sum(traj.mask) > 0
    row = trajectory_row(traj, 1)
    assert unpack_media(row["turn_media"]) == ([picture], [])  # stored with the sample: the trainer rebuilds it
