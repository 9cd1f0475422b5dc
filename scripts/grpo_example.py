"""GRPO on a verifiable arithmetic task with optax: pagejax rolls out, a JAX trainer learns, weights go back.

    python scripts/grpo_example.py --model=smollm2-135m --steps=10 --out=/tmp/grpo.jsonl

Each step: P problems "a+b=" (deterministic from --seed and the step, after a two-line few-shot prefix), a group of
--group samples per problem (`SamplingParams(n=...)`: the samples share the prompt's KV pages), a reward per sample
(1 for the right sum, plus 0.1 x the share of digits among the first characters, so a random policy already has a
signal), group-normalised advantages, --inner_steps optax updates of the clipped surrogate with a KL penalty
against the starting weights (inference/rl/grpo.py) on the importance ratio between the trainer's teacher-forced
logprobs (inference/rl/logprobs.py: log_probs) and the engine's, then `LLM.update_weights` with the new weights.
Both sides use logprobs_mode="processed" (the distribution sampled from, temperature included), so on the first
inner step the ratio is 1 up to float rounding (reported as ratio_max_dev). One JSON line per step: reward,
accuracy, KL, loss, wall seconds. A model without a tokenizer (the tiny test presets) reads and writes characters
as token ids (`CharCodec`).

LoRA-only training (`--lora_rank=R`, `--lora_alpha`): the base weights stay frozen and the trainer learns an
adapter's A/B on every projection (PEFT's init: A random, B zero, so step 0 starts at the base model). The engine is
built with `enable_lora=True` and the adapter is registered from a PEFT folder (`save_peft_adapter`); rollouts run
with its `lora_request`, the loss differentiates `log_probs(..., lora=A/B)` in the adapter only, and
`LLM.update_lora` writes the new A/B into the adapter's device slot (no recompile, no base-weight copy). The KL is
against the starting policy, the base model.

`--batch_invariant`: the engine runs `LLM(batch_invariant=True)`, so the trainer's `log_probs` is the engine's float
program row for row and the first inner step's ratio is exactly 1 (ratio_max_dev 0; docs/rl.md, "Numerically").
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import re
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from absl import app, flags  # noqa: E402

from inference import LoRARequest, SamplingParams  # noqa: E402
from inference.lora.peft import adapter_scaling, save_peft_adapter  # noqa: E402
from inference.rl.grpo import GRPOConfig, group_advantages, grpo_loss  # noqa: E402
from inference.rl.logprobs import log_probs, processed_tensors  # noqa: E402
from models.lora import init_adapter, target_shapes  # noqa: E402

FEW_SHOT = "3+4=7\n12+9=21\n"


@dataclasses.dataclass(frozen=True)
class Problem:
    prompt: str
    answer: int


def make_problems(count: int, seed: int) -> list[Problem]:
    """`count` problems a+b= with a, b in [0, 50), the same for the same seed on every machine."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        a, b = rng.randrange(50), rng.randrange(50)
        out.append(Problem(f"{FEW_SHOT}{a}+{b}=", a + b))
    return out


def reward(text: str, answer: int) -> float:
    """1 for the right number first (leading spaces allowed), plus 0.1 x the share of digits in the first 3 chars."""
    match = re.match(r"\s*(-?\d+)", text)
    correct = match is not None and int(match.group(1)) == answer
    head = text[:3]
    return float(correct) + 0.1 * (sum(c.isdigit() for c in head) / 3 if head else 0.0)


class CharCodec:
    """Characters as token ids for a model without a tokenizer (random tiny presets): id = code point mod vocab."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def encode(self, text: str) -> list[int]:
        return [ord(c) % self.vocab_size for c in text]

    def decode(self, ids) -> str:
        return "".join(chr(i) if 32 <= i < 127 or i == 10 else "?" for i in ids)


@dataclasses.dataclass
class Rollout:
    token_ids: np.ndarray  # i32[B, L] prompt + completion, right-padded; B = problems x group, problem-major
    prompt_lens: list[int]
    mask: np.ndarray  # bool[B, L]: completion tokens
    rollout_logp: np.ndarray  # f32[B, L]: the engine's logprob of each completion token
    rewards: np.ndarray  # f32[P, group]
    texts: list[str]


def rollout(llm, codec, problems: list[Problem], params: SamplingParams, pad_to: int,
            lora_request: LoRARequest | None = None) -> Rollout:
    prompts = [codec.encode(p.prompt) for p in problems]
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, lora_request=lora_request)
    rows, lens, logps, texts = [], [], [], []
    rewards = np.zeros((len(problems), params.n), np.float32)
    for i, (problem, prompt, out) in enumerate(zip(problems, prompts, outs)):
        if out.error is not None:
            raise ValueError(f"problem {i} was rejected: {out.error}")
        for j, c in enumerate(out.outputs):
            rows.append(prompt + list(c.token_ids))
            lens.append(len(prompt))
            logps.append([float(getattr(e[t], "logprob", e[t])) for e, t in zip(c.logprobs, c.token_ids)])
            text = codec.decode(c.token_ids)
            texts.append(text)
            rewards[i, j] = reward(text, problem.answer)
    width = max(pad_to, max(map(len, rows)))
    ids = np.zeros((len(rows), width), np.int32)
    mask = np.zeros((len(rows), width), bool)
    rollout_logp = np.zeros((len(rows), width), np.float32)
    for b, (row, n, lp) in enumerate(zip(rows, lens, logps)):
        ids[b, :len(row)] = row
        mask[b, n:len(row)] = True
        rollout_logp[b, n:len(row)] = lp
    return Rollout(ids, lens, mask, rollout_logp, rewards, texts)


@dataclasses.dataclass
class Policy:
    """What the trainer differentiates and how the engine receives it: every weight (`update_weights`), or a LoRA
    adapter's {projection: (a, b)} over frozen base weights (`update_lora`)."""

    trainable: Any
    frozen: Any = None  # the base weights under LoRA (an argument of the jitted steps, never a baked-in constant)
    lora_request: LoRARequest | None = None
    lora_scaling: float | None = None

    def log_probs(self, graphdef, trainable, frozen, ids, sampling) -> jax.Array:
        if self.lora_request is None:
            return log_probs((graphdef, trainable), ids, sampling=sampling)
        return log_probs((graphdef, frozen), ids, sampling=sampling, lora=trainable, lora_scaling=self.lora_scaling)

    def sync(self, llm, trainable) -> None:
        if self.lora_request is None:
            llm.update_weights(trainable)
        else:
            llm.update_lora(self.lora_request.lora_name, trainable)


def lora_policy(llm, rank: int, alpha: float, seed: int, name: str = "grpo") -> Policy:
    """A fresh PEFT-initialised adapter on every projection, registered with `llm` (built with enable_lora=True and
    max_lora_rank >= rank) from a PEFT folder; a second call with the same name resets that adapter."""
    lora = llm.engine_config.lora
    if not lora.enable_lora:
        raise ValueError("--lora_rank needs an LLM built with enable_lora=True")
    if not alpha > 0:
        raise ValueError(f"lora_alpha must be > 0 (the adapter's scaling is alpha / rank), got {alpha}")
    if not 1 <= rank <= lora.max_lora_rank:
        raise ValueError(f"lora_rank must be in [1, max_lora_rank={lora.max_lora_rank}], got {rank}")
    weights = init_adapter(target_shapes(llm.config), rank, jax.random.key(seed))
    with tempfile.TemporaryDirectory() as folder:  # read once at registration, then kept on the host
        request = LoRARequest(name, 1, save_peft_adapter(folder, weights, alpha=alpha))
        llm.add_lora(request)
    llm.update_lora(name, weights)  # an adapter of this name registered earlier starts over from `weights`
    return Policy(trainable=weights, frozen=llm.get_params(), lora_request=request,
                  lora_scaling=adapter_scaling(alpha, rank, use_rslora=False))


def compilations(llm, *jitted) -> int:
    """Compiled variants so far of the engine's steps, its LoRA slot write and the given jitted functions: the same
    number after every step once the first has run (no recompile across steps)."""
    count = sum(llm.runner.num_compilations().values()) + sum(f._cache_size() for f in jitted)
    return count + (llm.runner.lora.num_compilations() if llm.runner.lora is not None else 0)


def run(llm, *, steps: int, problems_per_step: int, group: int, max_tokens: int, inner_steps: int,
        learning_rate: float, temperature: float, seed: int, grpo: GRPOConfig = GRPOConfig(),
        lora_rank: int = 0, lora_alpha: float | None = None, log=None) -> list[dict]:
    """Run GRPO on `llm` for `steps` rollouts; returns one record per step (and calls `log(record)`). `lora_rank`
    > 0: LoRA-only training (alpha defaults to 2 x rank)."""
    codec = llm.tokenizer if llm.tokenizer is not None else CharCodec(llm.config.vocab_size)
    graphdef = llm.runner.graphdef
    if lora_rank:
        policy = lora_policy(llm, lora_rank, 2.0 * lora_rank if lora_alpha is None else lora_alpha, seed)
    else:
        policy = Policy(trainable=jax.tree.map(jnp.copy, llm.get_params()))  # the trainer's own copy
    params, frozen = policy.trainable, policy.frozen
    ref = jax.tree.map(jnp.copy, params)  # the starting policy (under LoRA: B = 0, the base model)
    optimizer = optax.adam(learning_rate)
    opt_state = optimizer.init(params)
    sample = SamplingParams(n=group, temperature=temperature, max_tokens=max_tokens, ignore_eos=True, logprobs=0,
                            logprobs_mode="processed")
    longest = max(len(codec.encode(p.prompt)) for p in make_problems(64, seed)) + max_tokens
    pad_to = -(-longest // 16) * 16  # one padded width for every step: the trainer's step compiles once

    lp_fn = jax.jit(lambda p, base, ids, sampling: policy.log_probs(graphdef, p, base, ids, sampling))

    @jax.jit  # nothing donated: after the sync the engine may run on the trainer's arrays
    def train_step(params, frozen, opt_state, ids, rollout_logp, ref_logp, adv, mask, sampling):
        def loss_fn(p):
            logp = policy.log_probs(graphdef, p, frozen, ids, sampling)
            return grpo_loss(logp, rollout_logp, ref_logp, adv, mask, grpo)
        (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, {**metrics, "loss": loss}

    records = []
    for step in range(steps):
        start = time.perf_counter()
        problems = make_problems(problems_per_step, seed * 100_003 + step)
        ro = rollout(llm, codec, problems, sample.replace(seed=seed * 100_003 + step), pad_to, policy.lora_request)
        rollout_s = time.perf_counter() - start
        sampling, _ = processed_tensors(sample, ro.token_ids, ro.prompt_lens)
        ref_logp = lp_fn(ref, frozen, ro.token_ids, sampling)
        adv = jnp.asarray(group_advantages(ro.rewards).reshape(-1))  # problem-major, like the rows
        first = None
        for _ in range(inner_steps):
            params, opt_state, metrics = train_step(params, frozen, opt_state, ro.token_ids, ro.rollout_logp,
                                                    ref_logp, adv, ro.mask, sampling)
            first = first or {k: float(v) for k, v in metrics.items()}
        jax.block_until_ready(params)
        sync_start = time.perf_counter()
        policy.sync(llm, params)
        sync_s = time.perf_counter() - sync_start
        record = dict(step=step, reward=float(ro.rewards.mean()), accuracy=float((ro.rewards >= 1).mean()),
                      kl=first["kl"], loss=first["loss"], ratio_max_dev=first["ratio_max_dev"],
                      clipped=first["clipped"], completion_tokens=int(ro.mask.sum()), rollout_s=rollout_s,
                      sync_s=sync_s, step_s=time.perf_counter() - start,
                      compilations=compilations(llm, lp_fn, train_step), sample=ro.texts[0])
        records.append(record)
        if log is not None:
            log(record)
    return records


def full_sync_seconds(llm, repeats: int = 3) -> list[float]:
    """Seconds of `update_weights` with a fresh copy of the engine's weights (same values), `repeats` times: what
    a full-weight step would pay for its sync, to set beside a LoRA run's `update_lora` seconds on one machine."""
    out = []
    for _ in range(repeats):
        copy = jax.block_until_ready(jax.tree.map(jnp.copy, llm.get_params()))
        start = time.perf_counter()
        llm.update_weights(copy)
        jax.block_until_ready(llm.get_params())
        out.append(time.perf_counter() - start)
    return out


def define_flags() -> None:
    """The script's flags, defined when it runs (not on import: the tests import it beside the launchers, whose
    flags share names such as --model and --max_tokens)."""
    flags.DEFINE_string("model", "smollm2-135m", "model name or path (as LLM(model=...))")
    flags.DEFINE_integer("steps", 10, "rollout + update rounds")
    flags.DEFINE_integer("problems", 8, "problems per step")
    flags.DEFINE_integer("group", 4, "samples per problem (GRPO's group)")
    flags.DEFINE_integer("max_tokens", 4, "completion tokens per sample")
    flags.DEFINE_integer("inner_steps", 2, "optax updates per rollout batch")
    flags.DEFINE_float("learning_rate", 1e-5, "Adam learning rate")
    flags.DEFINE_float("temperature", 1.0, "sampling temperature")
    flags.DEFINE_float("kl_beta", 0.02, "KL penalty weight")
    flags.DEFINE_integer("seed", 0, "problem and sampling seed")
    flags.DEFINE_integer("lora_rank", 0, "> 0: LoRA-only training of a rank-R adapter (base weights frozen)")
    flags.DEFINE_float("lora_alpha", None, "the adapter's alpha (scaling alpha / rank); default 2 x rank")
    flags.DEFINE_bool("batch_invariant", False, "LLM(batch_invariant=True): the first inner step's ratio is exactly 1")
    flags.DEFINE_string("out", None, "append one JSON line per step here (else stdout only)")


def main(argv) -> None:
    del argv
    from inference import LLM
    f = flags.FLAGS
    lora = dict(enable_lora=True, max_loras=1, max_lora_rank=f.lora_rank) if f.lora_rank else {}
    llm = LLM(f.model, kv_cache_memory_bytes=256 << 20, max_num_seqs=64, max_num_batched_tokens=512,
              batch_invariant=f.batch_invariant, **lora)

    def log(record: dict) -> None:
        line = json.dumps(record)
        print(line, flush=True)
        if f.out:
            with open(f.out, "a") as fh:
                fh.write(line + "\n")

    records = run(llm, steps=f.steps, problems_per_step=f.problems, group=f.group, max_tokens=f.max_tokens,
                  inner_steps=f.inner_steps, learning_rate=f.learning_rate, temperature=f.temperature, seed=f.seed,
                  grpo=GRPOConfig(kl_beta=f.kl_beta), lora_rank=f.lora_rank, lora_alpha=f.lora_alpha, log=log)
    if f.lora_rank:  # the sync a full-weight run would pay, in this process, beside update_lora's
        log(dict(update_lora_s=[r["sync_s"] for r in records], update_weights_s=full_sync_seconds(llm)))


if __name__ == "__main__":
    define_flags()
    app.run(main)
