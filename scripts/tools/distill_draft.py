"""Distil a layer-pruned draft model toward its target, save it (safetensors), and measure acceptance before/after.

    python scripts/tools/distill_draft.py --out=/tmp/pagejax-draft.safetensors --json
    python -c 'from inference import LLM; LLM(speculative_method="draft", \
        speculative_model="/tmp/pagejax-draft.safetensors")'

Why distil: a draft made by dropping layers (`inference.spec_decode.draft.prune_layers`) keeps the target's embeddings
and head but its residual stream now skips most of the computation, so it agrees with the target less often than it
could. A few hundred optax steps of cross-entropy against the *target's* next-token distributions (its top-k
probabilities, renormalised: KL to the target up to a constant) on text the target itself generated teach the
kept layers to stand in for the dropped ones. Only the layers and the final norm train; the embedding (tied to the
LM head in SmolLM2) stays frozen and is not saved: the draft file holds the trained tensors and names its base
model and kept layers in its metadata, and the loader takes the rest from the base.

Acceptance is measured in the engine (greedy speculative decoding with the draft, k drafts per step, on held-out
prompts the target continues), plus two cheap offline numbers on held-out target text: how often the draft's argmax
equals the target's, and the expected acceptance of a sampled draft at temperature 1, mean sum(min(p, q)).
With --json the last line printed is one JSON object with all of it.
"""

from __future__ import annotations

import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import app, flags
from flax import nnx

from inference import LLM, SamplingParams
from inference.spec_decode.draft import PagedDraftProposer, decoder_weights, parse_layers, prune_layers, save_draft
from inference.engine.llm_engine import Engine
from inference.engine.config import SchedulerConfig
from models.decoder import build_decoder

FLAGS = flags.FLAGS
flags.DEFINE_string("target", "smollm2-135m", "Target model: preset, .gguf file or HF folder.")
flags.DEFINE_string("layers", "0:30:3,29", "Target layers the draft keeps (indices and start:stop:step slices).")
flags.DEFINE_string("out", "/tmp/pagejax-draft.safetensors", "Where to write the distilled draft (.safetensors).")
flags.DEFINE_integer("num_prompts", 48, "Training prompts; the target writes one continuation each.")
flags.DEFINE_integer("gen_len", 96, "Tokens the target generates per training prompt.")
flags.DEFINE_float("temperature", 0.8, "Sampling temperature of the training text.")
flags.DEFINE_integer("seq_len", 128, "Training sequences are cut / padded to this many tokens (prompt included).")
flags.DEFINE_integer("steps", 200, "Optimizer steps.")
flags.DEFINE_integer("batch", 4, "Sequences per step.")
flags.DEFINE_float("lr", 3e-4, "AdamW learning rate (cosine decay after min(10, steps / 4) warm-up steps).")
flags.DEFINE_integer("top_k", 32, "Target probabilities kept per position (renormalised).")
flags.DEFINE_integer("eval_prompts", 8, "Held-out prompts for the acceptance measurements.")
flags.DEFINE_integer("eval_len", 48, "Tokens generated per held-out prompt in the engine measurement.")
flags.DEFINE_integer("k", 4, "Drafts per step in the engine measurement.")
flags.DEFINE_integer("seed", 0, "Seed for prompts, sampling and batches.")
flags.DEFINE_boolean("json", False, "Print one JSON object as the last line.")
flags.DEFINE_integer("kv_cache_mb", 256, "KV cache budget of the target (MiB).")
flags.DEFINE_string("data_cache", None, "An .npz file for the target text and distributions: written on the first run,"
                    " read (instead of generating) when it exists, so several drafts can train on the same data.")

TOPICS = ["the ocean", "a city at night", "photosynthesis", "the French revolution", "prime numbers", "a lost cat",
          "how bread rises", "volcanoes", "the moon landing", "a rainy day", "machine learning", "chess openings",
          "honey bees", "the water cycle", "a mountain hike", "friendship", "black holes", "recycling",
          "the printing press", "a birthday party", "electric cars", "the human heart", "autumn leaves", "pyramids",
          "coffee", "the internet", "dinosaurs", "a train journey", "gravity", "jazz music", "the desert",
          "sleep", "rainbows", "a small bakery", "ancient Rome", "snowflakes"]
TEMPLATES = ["Write a short story about {}.", "Explain {} to a child.", "Give three facts about {}.",
             "Write a poem about {}.", "What is interesting about {}?", "Describe {} in a few sentences."]


def make_prompts(llm: LLM, count: int, seed: int) -> list[list[int]]:
    """Chat prompts on varied topics for a model with a tokenizer; random token ids for a test preset."""
    rng = np.random.default_rng(seed)
    if llm.tokenizer is None:
        return [rng.integers(1, llm.config.vocab_size, 8).tolist() for _ in range(count)]
    prompts = []
    for _ in range(count):
        text = TEMPLATES[rng.integers(len(TEMPLATES))].format(TOPICS[rng.integers(len(TOPICS))])
        prompts.append(llm.tokenizer.encode(llm.tokenizer.apply_chat_template([{"role": "user", "content": text}])))
    return prompts


def target_text(llm: LLM, prompts: list[list[int]], gen_len: int, temperature: float, seed: int) -> list[list[int]]:
    params = [SamplingParams(temperature=temperature, seed=seed + i, max_tokens=gen_len) for i in range(len(prompts))]
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    return [p + list(o.outputs[0].token_ids) for p, o in zip(prompts, outs)]


def pad(seqs: list[list[int]], prompt_lens: list[int], length: int) -> tuple[np.ndarray, np.ndarray]:
    """Token ids [N, length] (cut or zero-padded) and the mask of the positions that predict a *generated* token
    [N, length]. Prompt positions are left out: a chat template repeats the same system prompt in every example, and
    predicting it would inflate agreement and spend training on text the draft never proposes."""
    tokens = np.zeros((len(seqs), length), np.int32)
    mask = np.zeros((len(seqs), length), np.float32)
    for i, (s, p) in enumerate(zip(seqs, prompt_lens)):
        s = s[:length]
        tokens[i, :len(s)] = s
        mask[i, max(p - 1, 0):len(s) - 1] = 1.0
    return tokens, mask


def target_topk(target, tokens: np.ndarray, top_k: int, batch: int) -> tuple[np.ndarray, np.ndarray]:
    """The target's top-k next-token ids and renormalised probabilities at every position: [N, L, k] each."""
    fn = jax.jit(lambda t: jax.lax.top_k(jax.nn.softmax(target.forward(t), axis=-1), top_k))
    ids, probs = [], []
    for i in range(0, len(tokens), batch):
        p, k = fn(jnp.asarray(tokens[i:i + batch]))
        ids.append(np.asarray(k))
        probs.append(np.asarray(p / p.sum(-1, keepdims=True)))
    return np.concatenate(ids), np.concatenate(probs)


TRAINABLE = nnx.All(nnx.Param, nnx.Not(nnx.PathContains("embed")))


def train(draft, tokens, ids, probs, mask, *, steps: int, batch: int, lr: float, seed: int) -> list[float]:
    """AdamW on the draft's layers and final norm: cross-entropy to the target's top-k distribution."""
    warmup = min(10, steps // 4)
    schedule = optax.warmup_cosine_decay_schedule(0.0, lr, warmup, max(steps, warmup + 1))
    opt = nnx.Optimizer(draft, optax.adamw(schedule, weight_decay=0.0), wrt=TRAINABLE)

    @nnx.jit
    def step(model, opt, t, i, p, m):
        def loss_fn(model):
            logp = jax.nn.log_softmax(model.forward(t), axis=-1)
            ce = -(p * jnp.take_along_axis(logp, i, axis=-1)).sum(-1)
            return (ce * m).sum() / jnp.maximum(m.sum(), 1.0)

        loss, grads = nnx.value_and_grad(loss_fn, argnums=nnx.DiffState(0, TRAINABLE))(model)
        opt.update(model, grads)
        return loss

    rng = np.random.default_rng(seed)
    losses = []
    for i in range(steps):
        b = rng.choice(len(tokens), size=min(batch, len(tokens)), replace=False)
        losses.append(float(step(draft, opt, tokens[b], ids[b], probs[b], mask[b])))
        if i % 25 == 0 or i == steps - 1:
            print(f"step {i}: loss {losses[-1]:.3f}", file=sys.stderr, flush=True)
    return losses


def offline_agreement(target, draft, tokens: np.ndarray, mask: np.ndarray) -> dict[str, float]:
    """On held-out target text: P(draft argmax == target argmax) and mean sum_v min(p, q) at temperature 1."""
    fn = jax.jit(lambda t: (jax.nn.softmax(target.forward(t), -1), jax.nn.softmax(draft.forward(t), -1)))
    same, overlap, count = 0.0, 0.0, 0.0
    for i in range(len(tokens)):
        q, p = fn(jnp.asarray(tokens[i:i + 1]))
        m = mask[i:i + 1]
        same += float(((q.argmax(-1) == p.argmax(-1)) * m).sum())
        overlap += float((jnp.minimum(p, q).sum(-1) * m).sum())
        count += float(m.sum())
    return {"greedy_agreement": same / count, "expected_acceptance_t1": overlap / count}


def engine_acceptance(llm: LLM, draft, prompts: list[list[int]], k: int, max_tokens: int) -> dict[str, float]:
    """Greedy speculative decoding with `draft` on the target's runner: acceptance rate and tokens per pass."""
    proposer = PagedDraftProposer(draft, k=k, num_pages=llm.runner.num_pages, page_size=llm.runner.page_size)
    engine = Engine(llm.runner, llm.tokenizer, SchedulerConfig(max_num_seqs=len(prompts), max_num_batched_tokens=512,
                                                               max_model_len=llm.engine.max_model_len),
                    proposer=proposer)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    while engine.has_unfinished_requests():
        engine.step()
    llm.engine.reset_prefix_cache()  # this engine wrote into pages the LLM's own prefix cache may list
    summary = engine.metrics_summary()
    return {"acceptance_rate": summary["spec_acceptance_rate"], "tokens_per_pass": summary["spec_tokens_per_pass"]}


def main(argv: list[str]) -> None:
    del argv
    t0 = time.perf_counter()
    # A small KV budget (the texts are short): the engine measurement adds a draft cache of the same page count.
    llm = LLM(FLAGS.target, max_num_seqs=max(FLAGS.num_prompts, FLAGS.eval_prompts), max_num_batched_tokens=1024,
              kv_cache_memory_bytes=FLAGS.kv_cache_mb << 20)
    target = nnx.merge(llm.runner.graphdef, llm.runner.params)
    keep = parse_layers(FLAGS.layers, llm.config.num_layers)
    config, weights = prune_layers(llm.runner.config, decoder_weights(target), keep)
    prompts = make_prompts(llm, FLAGS.num_prompts + FLAGS.eval_prompts, FLAGS.seed)
    eval_prompts = prompts[FLAGS.num_prompts:]
    if FLAGS.data_cache and os.path.exists(FLAGS.data_cache):
        with np.load(FLAGS.data_cache) as data:
            tokens, mask, ids, probs = data["tokens"], data["mask"], data["ids"], data["probs"]
        for i, p in enumerate(prompts):  # the same prompts (same seed): leave their positions out, as `pad` does
            mask[i, :max(len(p) - 1, 0)] = 0.0
    else:
        text = target_text(llm, prompts, FLAGS.gen_len, FLAGS.temperature, FLAGS.seed)
        tokens, mask = pad(text, [len(p) for p in prompts], FLAGS.seq_len)
        ids, probs = target_topk(target, tokens[:FLAGS.num_prompts], FLAGS.top_k, FLAGS.batch)
        if FLAGS.data_cache:
            np.savez(FLAGS.data_cache, tokens=tokens, mask=mask, ids=ids, probs=probs)
    train_tokens, train_mask = tokens[:FLAGS.num_prompts], mask[:FLAGS.num_prompts]
    eval_tokens, eval_mask = tokens[FLAGS.num_prompts:], mask[FLAGS.num_prompts:]
    data_s = time.perf_counter() - t0
    print(f"target text and distributions: {len(tokens)} sequences in {data_s:.0f} s", file=sys.stderr)

    draft = build_decoder(config, weights)
    result = {"target": FLAGS.target, "layers": keep, "steps": FLAGS.steps, "data_s": data_s,
              "before": {**offline_agreement(target, draft, eval_tokens, eval_mask),
                         **engine_acceptance(llm, draft, eval_prompts, FLAGS.k, FLAGS.eval_len)}}
    print(f"before: {result['before']}", file=sys.stderr)
    t1 = time.perf_counter()
    losses = train(draft, train_tokens, ids, probs, train_mask, steps=FLAGS.steps, batch=FLAGS.batch, lr=FLAGS.lr,
                   seed=FLAGS.seed)
    result["train_s"] = time.perf_counter() - t1
    result["loss_first"], result["loss_last"] = losses[0], float(np.mean(losses[-10:]))
    print(f"trained {FLAGS.steps} steps in {result['train_s']:.0f} s: loss {losses[0]:.3f} -> "
          f"{result['loss_last']:.3f}", file=sys.stderr)
    trained = {n: w for n, w in decoder_weights(draft).items() if n != "embed"}
    save_draft(FLAGS.out, FLAGS.target, keep, trained)
    result["out"] = FLAGS.out
    result["after"] = {**offline_agreement(target, draft, eval_tokens, eval_mask),
                       **engine_acceptance(llm, draft, eval_prompts, FLAGS.k, FLAGS.eval_len)}
    print(f"after: {result['after']}", file=sys.stderr)
    if FLAGS.json:
        print(json.dumps(result))


if __name__ == "__main__":
    app.run(main)
