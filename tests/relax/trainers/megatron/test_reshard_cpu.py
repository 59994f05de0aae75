"""A Megatron checkpoint saved at tensor parallel 2 resumes at another layout (tp=1, or the
PyTorch backend) and the next step equals the uninterrupted tp=2 run; data parallel 2 takes
the PyTorch backend's step.

Checkpoints hold the weights and the optimizer's moments in the Hugging Face layout, by name
(``relax.trainers.checkpoint.optim_state.optimizer_state``), so resharding is a conversion on load.
The resumed step is the second one: AdamW's moments from the first shape it, so a moment
loaded into the wrong place or shard would show. Each phase is a child process per rank (this
file as a script; megatron keeps process-wide state) writing what it measured to files.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.relax.trainers.megatron.child_ranks import run_ranks

pytest.importorskip(
    "megatron.core",
    reason="megatron-core does not import; pip install --no-deps megatron-core==0.16.1",
    exc_type=ImportError,
)

HERE = Path(__file__).resolve()

pytestmark = pytest.mark.slow


def _phase(mode: str, world: int, out: Path) -> None:
    run_ranks(HERE, world, mode, str(out), what=mode)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("mcore-reshard")
    _phase("tp2", 2, out)  # two steps at tp=2, checkpoint after the first
    _phase("tp1", 1, out)  # resume that checkpoint at tp=1, take the second step
    _phase("torch", 1, out)  # resume it on the PyTorch backend, take the second step
    _phase("dp2", 2, out)  # one step at data parallel 2 against the PyTorch backend's
    return out


def _result(out: Path, name: str) -> dict:
    return json.loads((out / f"{name}.json").read_text())


@pytest.mark.parametrize("resumed", ["tp1", "torch"])
def test_a_tp2_checkpoint_resumes_at_another_layout_and_takes_the_same_next_step(runs: Path, resumed: str) -> None:
    import torch

    ref, got = _result(runs, "tp2"), _result(runs, resumed)
    assert got["steps_done"] == 1  # the trainer state came back, not only the weights
    assert got["loss"] == pytest.approx(ref["loss"], abs=1e-5)
    assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5)
    assert ref["grad_norm"] > 0.05 and ref["moment_norm"] > 0  # a real step on real moments
    a, b = torch.load(runs / "tp2-after.pt"), torch.load(runs / f"{resumed}-after.pt")
    assert a.keys() == b.keys()
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-5
    # without the moments the second step differs: what the comparison above rules out
    assert ref["fresh_moment_diff"] > 1e-4


def test_data_parallel_2_takes_the_pytorch_backends_step(runs: Path) -> None:
    res = _result(runs, "dp2")
    assert res["dp"] == 2 and res["share_sizes"][0] > 0 and res["share_sizes"][1] > 0
    assert sum(res["share_sizes"]) == res["batch_size"]  # the ranks split the batch between them
    assert res["loss_megatron"] == pytest.approx(res["loss_torch"], abs=1e-5)
    assert res["grad_norm_megatron"] == pytest.approx(res["grad_norm_torch"], rel=1e-5)
    assert res["max_weight_diff"] < 1e-5 and res["max_weight_change"] > 1e-4


# ------------------------------------------------------------------ the ranks (child processes)


def _setup():
    from tiny import tiny_batch, tiny_qwen2

    from relax.config import load_config
    from relax.trainers.torch.actor import Actor

    cfg = load_config(None, ["trainer.warmup_steps=0", "trainer.lr=1e-3", "rollout.max_new_tokens=16",
                             "algorithm.off_policy=none", "trainer.micro_batch_layout=pack",
                             "trainer.micro_batch_tokens=40", "trainer.grad_clip=1.0"])
    hf, batch = tiny_qwen2(), tiny_batch()
    probe = Actor(hf, cfg)  # the behaviour logprobs of both steps, off the initial weights
    logprobs = probe.logprobs(batch)
    first, second = batch, tiny_batch()
    first.old_logprobs = [lp - 0.05 * m for lp, m in zip(logprobs, batch.loss_mask, strict=True)]
    second.old_logprobs = [lp + 0.03 * m for lp, m in zip(logprobs, batch.loss_mask, strict=True)]
    return cfg, tiny_qwen2(), first, second  # a fresh copy of the initial weights


def _megatron_actor(cfg, hf, rank: int, world: int, port: str, tp: int):
    from relax.trainers.megatron.cpu import init_cpu_distributed
    from relax.trainers.megatron.policy import megatron_policy
    from relax.trainers.torch.actor import Actor

    init_cpu_distributed(rank, world, int(port), tp=tp)
    return Actor(megatron_policy(hf), cfg)


def _finish(actor, result: dict, name: str, out: Path, rank: int) -> None:
    import torch

    after = actor.model.state_dict()  # collective: every rank gathers
    if rank == 0:
        torch.save(after, out / f"{name}-after.pt")
        (out / f"{name}.json").write_text(json.dumps(result))


def _main(mode: str, rank: int, world: int, port: str, out: Path) -> None:
    from relax.trainers.checkpoint.trainer_state import trainer_state, write_checkpoint

    cfg, hf, first, second = _setup()
    ckpt = str(out / "ckpt")
    if mode == "tp2":
        actor = _megatron_actor(cfg, hf, rank, world, port, tp=2)
        actor.train_step(first)
        state = trainer_state(actor.model, actor.trainer.optimizer, actor.trainer.scheduler)  # collective
        if rank == 0:
            write_checkpoint(ckpt, state, {"steps_done": actor.trainer.steps_done})
        moments = sum(float(s["exp_avg"].double().pow(2).sum()) for s in actor.trainer.optimizer.state.values())
        b = actor.train_step(second)
        # the same second step with the optimizer's moments cleared: how far a lost moment moves it
        fresh = _megatron_fresh_step(cfg, ckpt, second, actor)
        _finish(actor, {"loss": b.loss, "grad_norm": b.grad_norm, "moment_norm": moments,
                        "fresh_moment_diff": fresh}, "tp2", out, rank)
    elif mode in ("tp1", "torch"):
        from relax.trainers.torch.actor import Actor

        actor = _megatron_actor(cfg, hf, 0, 1, port, tp=1) if mode == "tp1" else Actor(hf, cfg)
        meta = actor.trainer.load(ckpt)
        b = actor.train_step(second)
        _finish(actor, {"loss": b.loss, "grad_norm": b.grad_norm, "steps_done": int(meta["steps_done"])},
                mode, out, rank)
    elif mode == "dp2":
        import copy

        from megatron.core import parallel_state

        from relax.trainers.torch.actor import Actor
        from relax.trainers.torch.batch import data_parallel_share

        torch_actor = Actor(copy.deepcopy(hf), cfg)
        a = torch_actor.train_step(first)
        actor = _megatron_actor(cfg, hf, rank, world, port, tp=1)
        b = actor.train_step(first)
        after_t = torch_actor.model.state_dict()
        after_m = actor.model.state_dict()
        _finish(actor, {"dp": parallel_state.get_data_parallel_world_size(), "batch_size": len(first),
                        "share_sizes": [len(data_parallel_share(first.lengths, r, 2)) for r in range(2)],
                        "loss_torch": a.loss, "loss_megatron": b.loss, "grad_norm_torch": a.grad_norm,
                        "grad_norm_megatron": b.grad_norm,
                        "max_weight_diff": max(float((after_t[k] - after_m[k]).abs().max()) for k in after_m),
                        "max_weight_change": max(float((after_t[k] - hf.state_dict()[k]).abs().max())
                                                 for k in after_m)}, "dp2", out, rank)


def _megatron_fresh_step(cfg, ckpt: str, second, trained) -> float:
    """Largest weight difference between the real second step and one from the checkpoint's
    weights with empty optimizer moments (this rank's process group, tp=2)."""
    from tiny import tiny_qwen2

    from relax.trainers.checkpoint.trainer_state import read_state
    from relax.trainers.megatron.policy import megatron_policy
    from relax.trainers.torch.actor import Actor

    fresh = Actor(megatron_policy(tiny_qwen2()), cfg)
    fresh.model.load_state_dict(read_state(ckpt)[1]["model"])
    fresh.train_step(second)
    a, b = trained.model.state_dict(), fresh.model.state_dict()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


if __name__ == "__main__":
    _main(sys.argv[4], int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], Path(sys.argv[5]))  # RANK WORLD PORT MODE OUT
    import torch.distributed as dist

    if dist.is_initialized():  # leave together: a rank exiting with gloo's threads alive aborts
        dist.barrier()
        from relax.trainers.megatron.cpu import shutdown_distributed

        shutdown_distributed()
