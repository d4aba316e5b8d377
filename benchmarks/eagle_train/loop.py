"""Training the head: AdamW, warm-up then cosine decay over `steps` (the schedule is fixed
by the step count, so a run is reproducible; `deadline` only stops it early), the
training-time-test steps' losses weighted 0.8^j, bf16 autocast where the CPU has bf16
arithmetic. Progress is printed every `log_every` steps."""

from __future__ import annotations

import contextlib
import math
import random
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from benchmarks.eagle_train.dataset import IGNORE, Batch
from benchmarks.eagle_train.head_model import TrainableEagle3Head

STEP_WEIGHT = 0.8


@dataclass
class TrainSettings:
    steps: int
    lr: float
    ttt_steps: int
    bf16: bool
    seed: int
    log_every: int = 10
    warmup: int = 30


def cpu_has_bf16() -> bool:
    try:
        with open("/proc/cpuinfo") as info:
            flags = info.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def _autocast(bf16: bool):
    if bf16:
        return torch.autocast("cpu", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def _lr_scale(step: int, settings: TrainSettings, time_spent: float) -> float:
    """Warm-up, then cosine to a tenth over the steps or the time budget, whichever runs
    out first (`time_spent`: its fraction spent)."""
    if step < settings.warmup:
        return (step + 1) / settings.warmup
    progress = (step - settings.warmup) / max(1, settings.steps - settings.warmup)
    progress = min(1.0, max(progress, time_spent))
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))


def _losses(head, batch: Batch, ttt_steps: int, bf16: bool):
    """Per step (loss, correct, counted)."""
    out = []
    positions = torch.arange(batch.labels.shape[1])
    with _autocast(bf16):
        outputs = head(batch.token_ids, batch.states.float(), ttt_steps)
        for step, normed in enumerate(outputs):
            labels = batch.labels.masked_fill(positions < step, IGNORE)  # no chain before 0
            scored = labels != IGNORE
            logits = head.lm_head(normed[scored]).float()
            targets = labels[scored]
            # A batch with nothing to score at this step (short answers) adds no loss.
            loss = F.cross_entropy(logits, targets) if len(targets) else normed.sum() * 0
            correct = int((logits.argmax(-1) == targets).sum())
            out.append((loss, correct, len(targets)))
    return out


def train(
    head: TrainableEagle3Head,
    batches: list[Batch],
    settings: TrainSettings,
    deadline: float,
) -> int:
    """Steps run (fewer than `settings.steps` when the deadline came first); the
    schedule also decays with the time spent, so that a cut-short run ends on a low rate."""
    torch.manual_seed(settings.seed)
    rng = random.Random(settings.seed)
    params = [p for p in head.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=settings.lr, betas=(0.9, 0.95), weight_decay=0.0)
    order: list[int] = []
    started = time.monotonic()
    for step in range(settings.steps):
        if time.monotonic() > deadline:
            print(f"train: time budget reached after {step} steps", flush=True)
            return step
        if not order:
            order = list(range(len(batches)))
            rng.shuffle(order)
        batch = batches[order.pop()]
        for group in optimizer.param_groups:
            spent = (time.monotonic() - started) / max(1e-9, deadline - started)
            group["lr"] = settings.lr * _lr_scale(step, settings, spent)
        results = _losses(head, batch, settings.ttt_steps, settings.bf16)
        loss = sum(STEP_WEIGHT**j * r[0] for j, r in enumerate(results))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        loss = float(loss.detach())
        if step % settings.log_every == 0 or step + 1 == settings.steps:
            accuracy = " ".join(f"{r[1] / max(1, r[2]):.2f}" for r in results)
            lr = optimizer.param_groups[0]["lr"]
            print(
                f"train step {step + 1}/{settings.steps} {time.monotonic() - started:6.0f}s "
                f"loss {loss:.3f} acc/step {accuracy} lr {lr:.2e}",
                flush=True,
            )
    return settings.steps


@torch.no_grad()
def evaluate(head, batches: list[Batch], ttt_steps: int, bf16: bool) -> list[float]:
    """Top-1 accuracy of each step on `batches`, every draft before it taken as right."""
    correct = [0] * ttt_steps
    counted = [0] * ttt_steps
    for batch in batches:
        for step, (_, right, total) in enumerate(_losses(head, batch, ttt_steps, bf16)):
            correct[step] += right
            counted[step] += total
    return [c / max(1, n) for c, n in zip(correct, counted, strict=True)]


def expected_acceptance(accuracies: list[float], num_speculative_tokens: int) -> float:
    """Mean acceptance length (tokens a verifying step yields) if step j's accuracy holds
    for every later draft and each draft is right independently of the ones after it."""
    total, chain = 1.0, 1.0
    for k in range(num_speculative_tokens):
        chain *= accuracies[min(k, len(accuracies) - 1)]
        total += chain
    return total
