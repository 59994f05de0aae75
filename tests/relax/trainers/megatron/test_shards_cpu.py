"""Sharded checkpoints of the Megatron actor (``trainer.checkpoint_format=sharded``), on two gloo ranks:
at tensor parallel 2 (Qwen3), pipeline parallel 2 (Qwen2, tied embeddings) and data x expert parallel 2
(Qwen3-MoE, megatron's DistributedOptimizer), each part is written by the rank that holds it (a data-parallel
replica writes nothing); the parts consolidate into exactly the state the gathered format writes; resuming
at the same layout (each rank reads its own part) takes the uninterrupted run's next step bit for bit; and
the PyTorch backend in one process (tp = 1) resumes from the parts and takes the same next step.

The checkpoint-safety tests below run in this process on the files the ranks wrote: a corrupt, missing or
renamed part, or another model, is a CheckpointError naming the file or tensor, before anything is loaded.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.relax.trainers.megatron.child_ranks import run_ranks

pytest.importorskip(
    "megatron.core",
    reason="megatron-core does not import; pip install --no-deps megatron-core==0.16.1",
    exc_type=ImportError,
)

HERE = Path(__file__).resolve()
LAYOUTS = {"tp2": {"tp": 2}, "pp2": {"pp": 2}, "ep2": {"ep": 2}}
FAMILY = {"tp2": "qwen3", "pp2": "qwen2 tied", "ep2": "qwen3_moe"}

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    out = tmp_path_factory.mktemp("mcore-shards")
    run_ranks(HERE, 2, str(out), what="sharded checkpoints", timeout=400)
    return out, [json.loads((out / f"{r}.json").read_text()) for r in range(2)]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_each_rank_writes_its_own_part(ranks: tuple[Path, list[dict[str, Any]]], layout: str) -> None:
    out, res = ranks
    parts = sorted(p.name for p in (out / f"sharded-{layout}" / "shards").iterdir())
    assert parts == {"tp2": ["tp0-pp0-ep0.pt", "tp1-pp0-ep0.pt"], "pp2": ["tp0-pp0-ep0.pt", "tp0-pp1-ep0.pt"],
                     "ep2": ["tp0-pp0-ep0.pt", "tp0-pp0-ep1.pt"]}[layout]
    written = res[0][layout]["part_bytes"]  # one part per rank: no data-parallel replica here
    assert len(written) == 2
    # tp/pp: each part holds about half the weights and moments of the gathered file
    if layout != "ep2":
        assert all(0.3 < w / res[0][layout]["gathered_bytes"] < 0.7 for w in written)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_the_parts_consolidate_into_the_gathered_checkpoint(ranks: tuple[Path, list[dict[str, Any]]],
                                                             layout: str) -> None:
    res = ranks[1][0][layout]
    assert res["consolidated_names"] == res["gathered_names"]
    assert res["consolidated_max_diff"] == 0.0 and res["moments_compared"] > 0


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_resuming_the_parts_at_the_same_layout_is_bit_exact(ranks: tuple[Path, list[dict[str, Any]]],
                                                            layout: str) -> None:
    for res in (r[layout] for r in ranks[1]):
        assert res["read_own_part"]  # each rank read only its part
        assert res["resumed_loss"] == res["second_loss"] and res["resumed_grad_norm"] == res["second_grad_norm"]
        assert res["resumed_max_weight_diff"] == 0.0 and res["weight_change"] > 1e-5


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_the_pytorch_backend_resumes_the_parts_in_one_process(ranks: tuple[Path, list[dict[str, Any]]],
                                                              layout: str) -> None:
    res = ranks[1][0][layout]
    assert res["torch_loss"] == pytest.approx(res["second_loss"], abs=1e-5)
    assert res["torch_grad_norm"] == pytest.approx(res["second_grad_norm"], rel=1e-5)
    assert res["torch_max_weight_diff"] < 1e-5


def _copy(ranks: tuple[Path, list[dict[str, Any]]], tmp_path: Path) -> Path:
    dst = tmp_path / "ckpt"
    shutil.copytree(ranks[0] / "sharded-tp2", dst)
    return dst


def test_a_corrupt_or_missing_part_is_named_before_anything_loads(ranks, tmp_path: Path) -> None:
    from relax.trainers.checkpoint.files import CheckpointError
    from relax.trainers.checkpoint.trainer_state import read_state

    ckpt = _copy(ranks, tmp_path)
    part = ckpt / "shards" / "tp1-pp0-ep0.pt"
    blob = bytearray(part.read_bytes())
    blob[-100] ^= 1
    part.write_bytes(bytes(blob))
    with pytest.raises(CheckpointError, match="tp1-pp0-ep0.pt fails its sha256 check"):
        read_state(str(ckpt))
    part.unlink()
    with pytest.raises(CheckpointError, match="tp1-pp0-ep0.pt is missing"):
        read_state(str(ckpt))
    meta = json.loads((ckpt / "meta.json").read_text())
    meta["shards"] = meta["shards"][:1]
    (ckpt / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match=r"lacks parts \['shards/tp1-pp0-ep0.pt'\]"):
        read_state(str(ckpt))


def test_places_read_back_are_checked_not_trusted(ranks, tmp_path: Path) -> None:
    from relax.trainers.checkpoint.files import CheckpointError
    from relax.trainers.checkpoint.trainer_state import read_state

    ckpt = _copy(ranks, tmp_path)
    meta = json.loads((ckpt / "meta.json").read_text())
    good = json.dumps(meta)
    for bad, named in (("../../etc", "tp_rank='../../etc'"), (2, "tp_rank=2"), (True, "tp_rank=True")):
        meta = json.loads(good)
        meta["shards"][1]["place"]["tp_rank"] = bad  # a name never comes from storage: ranks are checked ints
        (ckpt / "meta.json").write_text(json.dumps(meta))
        with pytest.raises(CheckpointError, match=named.replace("[", r"\[")):
            read_state(str(ckpt))
    meta = json.loads(good)  # a part listed under another part's place
    meta["shards"][0]["place"], meta["shards"][1]["place"] = meta["shards"][1]["place"], meta["shards"][0]["place"]
    meta["shards"][0]["sha256"], meta["shards"][1]["sha256"] = meta["shards"][1]["sha256"], meta["shards"][0]["sha256"]
    (ckpt / "meta.json").write_text(json.dumps(meta))
    read_state(str(ckpt))  # the same two parts, listed in another order: fine


def test_another_model_is_refused_naming_the_tensor_and_both_shapes(ranks, tmp_path: Path) -> None:
    from relax.trainers.checkpoint.files import CheckpointError
    from relax.trainers.checkpoint.trainer_state import load_checkpoint
    from tests.relax.trainers.torch.tiny import tiny_qwen2

    model = tiny_qwen2()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointError, match="does not fit this model"):
        load_checkpoint(str(ranks[0] / "sharded-tp2"), model)
    assert all(v.equal(before[k]) for k, v in model.state_dict().items())  # nothing loaded


def _main(rank: int, port: str, out_dir: str) -> None:
    import copy

    import torch.distributed as dist
    from test_actor_distopt_cpu import _models
    from tiny import tiny_batch

    from relax.config import load_config
    from relax.trainers.checkpoint.files import read_meta, read_verified
    from relax.trainers.checkpoint.trainer_state import (
        read_state,
        save_sharded_checkpoint,
        trainer_state,
        write_checkpoint,
    )
    from relax.trainers.torch.actor import Actor

    def cfg(*extra: str):
        return load_config(None, ["trainer.warmup_steps=2", "trainer.lr=1e-3", "trainer.weight_decay=0.1",
                                  "rollout.max_new_tokens=16", "algorithm.off_policy=none", "trainer.grad_clip=0.005",
                                  "trainer.micro_batch_tokens=40", *extra])

    from megatron.core import parallel_state

    from relax.trainers.megatron.cpu import init_cpu_distributed, shutdown_distributed
    from relax.trainers.megatron.policy import megatron_policy

    models, out = _models(), Path(out_dir)
    result: dict[str, Any] = {}
    seconds = {}
    for layout, sizes in LAYOUTS.items():
        family = FAMILY[layout]
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        init_cpu_distributed(rank, 2, int(port), **sizes)
        batch = tiny_batch(n=8) if family != "qwen3_moe" else tiny_batch(n=8, lengths=(3, 9, 5, 7))

        def policy(family: str = family, layout: str = layout):
            return megatron_policy(copy.deepcopy(models[family]), distributed_optimizer=layout == "ep2")

        actor = Actor(policy(), cfg())
        actor.train_step(batch)
        t = actor.trainer
        gathered = trainer_state(t.model, t.optimizer, t.scheduler)
        url = str(out / f"sharded-{layout}")
        save_sharded_checkpoint(url, t.model, t.optimizer, t.scheduler, {"steps_done": 1})
        if rank == 0:
            write_checkpoint(str(out / f"gathered-{layout}"), gathered, {"steps_done": 1})
        dist.barrier()
        before = {k: v.clone() for k, v in actor.model.state_dict().items()}
        second = actor.train_step(batch)
        after = actor.model.state_dict()
        resumed = Actor(policy(), cfg())
        meta = read_meta(url)
        own = resumed.model.load_own_shard(url, meta, read_verified(url, "trainer.pt", meta["sha256"]), None)
        resumed.trainer.load(url)
        c = resumed.train_step(batch)
        result[layout] = {
            "read_own_part": own,
            "second_loss": second.loss,
            "second_grad_norm": second.grad_norm,
            "resumed_loss": c.loss,
            "resumed_grad_norm": c.grad_norm,
            "weight_change": max(float((after[k] - before[k]).abs().max()) for k in after),
            "resumed_max_weight_diff": max(
                float((after[k] - v).abs().max()) for k, v in resumed.model.state_dict().items()
            ),
        }
        seconds[layout] = (batch, after)
    shutdown_distributed()  # a gloo group left to the interpreter's exit can abort it
    if rank == 0:  # the PyTorch backend, one process: the consolidated parts, its own next step
        for layout, (batch, after) in seconds.items():
            gathered = read_state(str(out / f"gathered-{layout}"))[1]
            merged = read_state(str(out / f"sharded-{layout}"))[1]
            pairs = [(gathered["model"][k], merged["model"][k]) for k in gathered["model"]]
            pairs += [(g[m], merged["optimizer"]["state"][k][m]) for k, g in gathered["optimizer"]["state"].items()
                      for m in ("exp_avg", "exp_avg_sq") if m in g]
            actor = Actor(copy.deepcopy(models[FAMILY[layout]]), cfg())
            actor.trainer.load(str(out / f"sharded-{layout}"))
            d = actor.train_step(batch)
            result[layout].update({
                "part_bytes": [p["bytes"] for p in read_meta(str(out / f"sharded-{layout}"))["shards"]],
                "gathered_bytes": read_meta(str(out / f"gathered-{layout}"))["bytes"],
                "gathered_names": sorted(gathered["model"]), "consolidated_names": sorted(merged["model"]),
                "consolidated_max_diff": max(float((a - b).abs().max()) for a, b in pairs),
                "moments_compared": len(pairs) - len(gathered["model"]),
                "torch_loss": d.loss, "torch_grad_norm": d.grad_norm,
                "torch_max_weight_diff": max(float((after[k] - v).abs().max())
                                             for k, v in actor.model.state_dict().items())})
            assert merged["scheduler"] == gathered["scheduler"]
    (out / f"{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    _main(int(sys.argv[1]), sys.argv[3], sys.argv[4])
