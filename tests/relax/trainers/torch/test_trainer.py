"""TorchTrainer: layouts agree, data parallel equals one process, checkpoints resume exactly."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tiny import tiny_batch, tiny_qwen2

from relax.trainers.checkpoint.trainer_state import export_hf, load_checkpoint, save_checkpoint
from relax.trainers.torch.trainer import TorchTrainer, combine_metrics, sft_loss, token_weights

WORKER = str(Path(__file__).with_name("ddp_worker.py"))


def grads_after_one_step(layout: str, budget: int) -> list[torch.Tensor]:
    model = tiny_qwen2().double()
    trainer = TorchTrainer(model, lr=0.0, micro_batch_tokens=budget, layout=layout)
    trainer.step(tiny_batch(), sft_loss)  # lr 0: the update leaves the weights and keeps .grad
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("layout,budget", [("pack", 24), ("bucket", 24), ("pad", 24), ("pack", 4096)])
def test_micro_batching_never_changes_the_gradient(layout, budget):
    reference = grads_after_one_step("pad", 10_000)  # everything in one padded micro-batch
    got = grads_after_one_step(layout, budget)
    assert max((a - b).abs().max().item() for a, b in zip(reference, got, strict=True)) < 1e-12  # float64


def test_token_weights_by_hand():
    masks = [torch.tensor([0.0, 1, 1]), torch.tensor([1.0, 1, 1, 1])]
    # token-mean: 2 + 4 = 6 masked tokens -> every masked token weighs 1/6
    sixth = 1 / 6
    assert [w.tolist() for w in token_weights(masks, "token-mean")] == [[0, sixth, sixth], [sixth] * 4]
    # seq-mean-token-mean: 2 sequences; 1/(2*2) for the first's 2 tokens, 1/(4*2) for the second's 4
    assert [w.tolist() for w in token_weights(masks, "seq-mean-token-mean")] == [[0, 0.25, 0.25], [0.125] * 4]
    # seq-mean-token-sum-norm with constant 8: 1/(8*2) for every masked token
    assert [w.tolist() for w in token_weights(masks, "seq-mean-token-sum-norm", norm=8)] == [[0, 1 / 16, 1 / 16],
                                                                                             [1 / 16] * 4]
    # seq-mean-token-sum (verl): no length divisor, 1/2 for every masked token of the 2 sequences
    assert [w.tolist() for w in token_weights(masks, "seq-mean-token-sum")] == [[0, 0.5, 0.5], [0.5] * 4]
    # an empty row counts in N in every seq-mean mode: 3 rows, so 1/(2*3) and 1/(4*3)
    empty = [*masks, torch.zeros(3)]
    assert [w.tolist() for w in token_weights(empty, "seq-mean-token-mean")] == [[0, 1 / 6, 1 / 6], [1 / 12] * 4,
                                                                                 [0, 0, 0]]
    with pytest.raises(ValueError, match="unknown loss aggregation"):
        token_weights(masks, "mean")


def run_two_ranks(tmp_path, *args: str) -> dict[str, torch.Tensor]:
    """ddp_worker.py on two gloo ranks; what rank 0 saved."""
    rendezvous, out = str(tmp_path / "rendezvous"), str(tmp_path / "ddp.pt")
    procs = [subprocess.Popen([sys.executable, WORKER, str(r), "2", rendezvous, out, *args],
                              stderr=subprocess.PIPE, text=True) for r in range(2)]
    try:
        errs = [p.communicate(timeout=150)[1] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], "\n".join(e[-3000:] for e in errs)
    return torch.load(out)


def verl_agg_loss(loss: torch.Tensor, mask: torch.Tensor, mode: str, rows: int, norm: float) -> torch.Tensor:
    """verl 0.9.1's ``agg_loss`` (trainer/ppo/core_algos.py) for one row, as its trainer calls it:
    ``global_batch_size`` = every row of the mini-batch, dp_size folded in by the caller."""
    row_sum = (loss * mask).sum()
    if mode == "seq-mean-token-mean":
        return row_sum / (mask.sum() + 1e-8) / rows
    return row_sum / rows / (norm if mode == "seq-mean-token-sum-norm" else 1.0)


@pytest.mark.slow
@pytest.mark.parametrize("agg", ["seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"])
def test_empty_rows_on_two_ranks_count_as_in_verl(tmp_path, agg):
    # 8 rows on 2 ranks, 4 each in 2+ micro-batches of <= 24 tokens; rows 2 and 5 empty. verl's trainer
    # divides by all 8 rows in every seq-mean mode; the reference is its formula on one process
    from ddp_worker import EMPTY_ROWS

    got = run_two_ranks(tmp_path, "1", agg, "empty")
    torch.set_default_dtype(torch.float64)
    try:
        model, batch = tiny_qwen2().double(), tiny_batch(n=8)
        total = 0.0
        for i, (ids, mask) in enumerate(zip(batch.input_ids, batch.loss_mask, strict=True)):
            mask = mask * 0 if i in EMPTY_ROWS else mask
            logits = model(ids[None]).logits[0]
            # token t's log-prob comes from position t - 1; position 0 scores nothing
            lp = torch.cat([torch.zeros(1), logits[:-1].log_softmax(-1).gather(-1, ids[1:, None])[:, 0]])
            total = total + verl_agg_loss(-lp, mask, agg, rows=8, norm=16.0)  # sft loss: -log p
        total.backward()
    finally:
        torch.set_default_dtype(torch.float32)
    # relative to the largest gradient: the packed forward's rotary tables are float32, so agreement is
    # ~1e-8, far inside the 25% a row count of 6 instead of 8 would make
    scale = max(p.grad.abs().max().item() for p in model.parameters())
    diff = max((got[n] - p.grad).abs().max().item() for n, p in model.named_parameters())
    assert diff < 1e-6 * scale, (diff, scale)


@pytest.mark.slow
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_two_gloo_processes_match_one_process(tmp_path, agg):
    ddp = run_two_ranks(tmp_path, "3", agg)
    torch.set_default_dtype(torch.float64)
    try:
        model = tiny_qwen2().double()
        trainer = TorchTrainer(model, lr=1e-2, micro_batch_tokens=24, aggregation=agg, agg_norm=16.0)
        for _ in range(3):
            trainer.step(tiny_batch(n=8), sft_loss)
    finally:
        torch.set_default_dtype(torch.float32)
    # float64 throughout: only summation order differs between 1 and 2 processes
    diff = max((ddp[k] - v).abs().max().item() for k, v in model.state_dict().items())
    assert diff < 1e-9, diff


def test_resume_from_checkpoint_is_bit_exact(tmp_path):
    batches = [tiny_batch(seed=s) for s in range(4)]
    straight = TorchTrainer(tiny_qwen2(), lr=1e-2, warmup_steps=2, total_steps=4, schedule="cosine")
    for b in batches:
        straight.step(b, sft_loss)
    first = TorchTrainer(tiny_qwen2(), lr=1e-2, warmup_steps=2, total_steps=4, schedule="cosine")
    for b in batches[:2]:
        first.step(b, sft_loss)
    first.save(str(tmp_path / "ckpt"), {"step": 2})
    resumed = TorchTrainer(tiny_qwen2(seed=99), lr=1e-2, warmup_steps=2, total_steps=4, schedule="cosine")
    assert resumed.load(str(tmp_path / "ckpt"))["step"] == 2
    for b in batches[2:]:
        resumed.step(b, sft_loss)
    for (name, a), b in zip(straight.model.state_dict().items(), resumed.model.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    assert resumed.scheduler.get_last_lr() == straight.scheduler.get_last_lr()


def test_checkpoint_of_another_shape_names_the_tensor(tmp_path):
    save_checkpoint(str(tmp_path / "small"), tiny_qwen2(hidden=32))
    with pytest.raises(ValueError, match=r"tensor 'model.embed_tokens.weight' has shape \(64, 32\) in the checkpoint "
                                         r"but \(64, 48\) in the model"):
        load_checkpoint(str(tmp_path / "small"), tiny_qwen2(hidden=48))
    with pytest.raises(FileNotFoundError, match="meta.json missing"):
        load_checkpoint(str(tmp_path / "nowhere"), tiny_qwen2())


def test_nan_loss_skips_the_step_and_names_samples(caplog):
    model = tiny_qwen2()
    before = [p.detach().clone() for p in model.parameters()]
    trainer = TorchTrainer(model, lr=1e-2)
    nan_loss = lambda mb, lps, ents, b: ([lp * float("nan") for lp in lps], {})  # noqa: E731
    result = trainer.step(tiny_batch(), nan_loss)
    assert result.skipped and "samples ['s0'" in caplog.text
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert not trainer.step(tiny_batch(), sft_loss).skipped  # training goes on
    fatal = TorchTrainer(tiny_qwen2(), lr=1e-2, nan_policy="fail")
    with pytest.raises(FloatingPointError, match="non-finite loss"):
        fatal.step(tiny_batch(), nan_loss)


def test_sft_learns_and_exports_to_hf(tmp_path):
    from transformers import Qwen2ForCausalLM

    trainer = TorchTrainer(tiny_qwen2(), lr=1e-2)
    losses = [trainer.step(tiny_batch(), sft_loss).loss for _ in range(30)]
    assert losses[-1] < 0.2 * losses[0]  # memorising 6 short demonstrations
    out = export_hf(trainer.model, str(tmp_path / "hf"))
    again = Qwen2ForCausalLM.from_pretrained(out).eval()
    ids = tiny_batch().input_ids[3][None]
    trainer.model.eval()
    assert torch.equal(again(ids).logits, trainer.model(ids).logits)


def test_bf16_autocast_step_keeps_fp32_master_weights():
    # CPU autocast runs the same code path a CUDA bf16 run takes; the weights stay float32
    model = tiny_qwen2()
    trainer = TorchTrainer(model, lr=1e-2, autocast="bfloat16")
    result = trainer.step(tiny_batch(), sft_loss)
    assert not result.skipped and result.grad_norm > 0
    assert all(p.dtype == torch.float32 for p in model.parameters())


@pytest.mark.gpu
def test_cuda_bf16_step():
    model = tiny_qwen2().cuda()
    trainer = TorchTrainer(model, lr=1e-2, autocast="bfloat16")
    batch = tiny_batch()
    batch.input_ids = [t.cuda() for t in batch.input_ids]
    batch.loss_mask = [m.cuda() for m in batch.loss_mask]
    assert not trainer.step(batch, sft_loss).skipped


def test_default_ddp_wrapper_is_refused(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rv", rank=0, world_size=1)
    try:
        with pytest.raises(ValueError, match="wrap_ddp"):
            TorchTrainer(torch.nn.parallel.DistributedDataParallel(tiny_qwen2()), lr=1e-2)
    finally:
        dist.destroy_process_group()


def test_step_metrics_are_means_but_maxima_stay_maxima():
    # three micro-batches: loss 1, 2, 6 -> mean 3; a key one part lacks counts 0 there: (0 + 3 + 0) / 3 = 1;
    # *_max keys keep the largest (a spike of 400 in one micro-batch is 400, not 400 / 3)
    parts = [{"loss": 1.0, "is_weight_max": 1.0}, {"loss": 2.0, "kl": 3.0, "is_weight_max": 400.0},
             {"loss": 6.0, "is_weight_max": 2.0}]
    assert combine_metrics(parts) == {"loss": 3.0, "kl": 1.0, "is_weight_max": 400.0}
    assert combine_metrics([]) == {}
