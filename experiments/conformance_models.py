"""The conformance suite's models (issue 37): code nobody on this project wrote, and models written
here the way Flax users commonly write them. Each is a :class:`Subject` maker taking a ``Plan``.

* ``gpt2`` -- Hugging Face ``transformers``' ``FlaxGPT2LMHeadModule`` (Linen, dropout), built
  from a config (no weights, nothing downloaded). ``transformers`` 4.46.x: the last line with
  Flax models (5.0 removed them); a test-only dependency (``pip install "transformers<4.47"``,
  about 10 s here). Chosen as the most used published Flax transformer.
* ``linen_resnet`` -- a ResNet-18 (basic blocks [2, 2, 2, 2], widths 32..256) with BatchNorm.
* ``linen_lm_scan`` -- a decoder-only LM, dropout, its blocks applied with ``nn.scan``.
* ``nnx_scan`` -- NNX scan over layers: blocks created with ``nnx.vmap`` over split RNG streams
  (a dropout key per layer), applied with ``nnx.scan``.
* ``nnx_cnn`` -- an NNX CNN with BatchNorm.

Only the public API is used: ``plan.configure_model``, ``lm.split_nnx``, the loss functions.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax import nnx

import lowmem_jax as lm

VOCAB, SEQ, WIDTH = 4096, 64, 256


@dataclasses.dataclass
class Subject:
    """A configured model as ``make_train_step`` takes it, with a batch and its block class."""

    params: dict
    model_state: dict
    loss_fn: Callable
    batch: dict


def _tokens(batch: int = 8) -> dict:
    tokens = jax.random.randint(jax.random.key(1), (batch, SEQ), 0, VOCAB)
    return {"tokens": tokens}


def _images(batch: int = 16) -> dict:
    image = jax.random.normal(jax.random.key(1), (batch, 32, 32, 3))
    return {"image": image, "label": jnp.arange(batch) % 10}


def _lm_loss(logits, tokens):
    logits = logits[:, :-1].astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


# --- gpt2: transformers' Flax GPT-2 ------------------------------------------------------------


def gpt2(plan: lm.Plan) -> Subject:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a config, no weights: nothing to fetch
    from transformers import GPT2Config
    from transformers.models.gpt2.modeling_flax_gpt2 import FlaxGPT2LMHeadModule

    config = GPT2Config(
        vocab_size=VOCAB,
        n_positions=SEQ,
        n_embd=WIDTH,
        n_layer=4,
        n_head=4,
        tie_word_embeddings=True,
    )
    model = plan.configure_model(FlaxGPT2LMHeadModule(config))
    batch = _tokens()
    positions = jnp.broadcast_to(jnp.arange(SEQ), batch["tokens"].shape)
    mask = jnp.ones_like(batch["tokens"])
    params = model.init(jax.random.key(0), batch["tokens"][:1], mask[:1], positions[:1])["params"]

    def loss_fn(params, model_state, batch, rng):
        ids = batch["tokens"]  # a microbatch's, under microbatching
        out = model.apply(
            {"params": params},
            ids,
            jnp.ones_like(ids),
            jnp.broadcast_to(jnp.arange(ids.shape[1]), ids.shape),
            deterministic=False,
            rngs={"dropout": rng},
        )
        loss = _lm_loss(out.logits, batch["tokens"])
        return loss, (model_state, {"loss": loss})

    return Subject(params, {}, loss_fn, batch)


# --- linen_resnet: ResNet-18 with BatchNorm -----------------------------------------------------


class BasicBlock(nn.Module):
    filters: int
    strides: int = 1

    @nn.compact
    def __call__(self, x, train: bool = True):
        y = nn.Conv(self.filters, (3, 3), self.strides, use_bias=False)(x)
        y = nn.relu(nn.BatchNorm(use_running_average=not train)(y))
        y = nn.BatchNorm(use_running_average=not train)(
            nn.Conv(self.filters, (3, 3), use_bias=False)(y)
        )
        if x.shape != y.shape:
            x = nn.Conv(self.filters, (1, 1), self.strides, use_bias=False)(x)
            x = nn.BatchNorm(use_running_average=not train)(x)
        return nn.relu(x + y)


class ResNet18(nn.Module):
    width: int = 32

    @nn.compact
    def __call__(self, x, train: bool = True):
        x = nn.relu(nn.BatchNorm(use_running_average=not train)(nn.Conv(self.width, (3, 3))(x)))
        for stage in range(4):
            for block in range(2):
                strides = 2 if stage > 0 and block == 0 else 1
                x = BasicBlock(self.width * 2**stage, strides)(x, train=train)
        return nn.Dense(10)(x.mean((1, 2)))


def linen_resnet(plan: lm.Plan) -> Subject:
    model = plan.configure_model(ResNet18())
    batch = _images()
    variables = model.init(jax.random.key(0), batch["image"][:2], train=False)
    params = variables.pop("params")
    return Subject(params, dict(variables), lm.classifier_loss_fn(model), batch)


# --- linen_lm_scan: a Linen LM whose blocks are applied with nn.scan -----------------------------


class DecoderBlock(nn.Module):
    rate: float = 0.1

    @nn.compact
    def __call__(self, x, _):
        mask = nn.make_causal_mask(jnp.ones(x.shape[:2]))
        y = nn.SelfAttention(4, dropout_rate=self.rate, deterministic=False)(
            nn.LayerNorm()(x), mask
        )
        x = x + nn.Dropout(self.rate, deterministic=False)(y)
        y = nn.Dense(WIDTH)(nn.gelu(nn.Dense(4 * WIDTH)(nn.LayerNorm()(x))))
        return x + nn.Dropout(self.rate, deterministic=False)(y), None


class ScanLM(nn.Module):
    layers: int = 4

    @nn.compact
    def __call__(self, tokens):
        embed = nn.Embed(VOCAB, WIDTH)
        x = embed(tokens) + self.param("position", nn.initializers.normal(0.02), (SEQ, WIDTH))
        blocks = nn.scan(
            DecoderBlock,
            variable_axes={"params": 0},
            split_rngs={"params": True, "dropout": True},
            length=self.layers,
        )
        x, _ = blocks()(x, None)
        return embed.attend(nn.LayerNorm()(x))


def linen_lm_scan(plan: lm.Plan) -> Subject:
    model = plan.configure_model(ScanLM())
    batch = _tokens()
    params = model.init(
        {"params": jax.random.key(0), "dropout": jax.random.key(1)}, batch["tokens"][:1]
    )["params"]

    def loss_fn(params, model_state, batch, rng):
        logits = model.apply({"params": params}, batch["tokens"], rngs={"dropout": rng})
        loss = _lm_loss(logits, batch["tokens"])
        return loss, (model_state, {"loss": loss})

    return Subject(params, {}, loss_fn, batch)


# --- nnx_scan: NNX scan over layers with per-layer RNG streams -----------------------------------


class MLPBlock(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.norm = nnx.LayerNorm(WIDTH, rngs=rngs)
        self.up = nnx.Linear(WIDTH, 4 * WIDTH, rngs=rngs)
        self.down = nnx.Linear(4 * WIDTH, WIDTH, rngs=rngs)
        self.dropout = nnx.Dropout(0.1, rngs=rngs)

    def __call__(self, x):
        return x + self.dropout(self.down(nnx.gelu(self.up(self.norm(x)))))


class NNXScanLM(nnx.Module):
    def __init__(self, layers: int, rngs: nnx.Rngs):
        self.embed = nnx.Embed(VOCAB, WIDTH, rngs=rngs)

        @nnx.split_rngs(splits=layers)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def create(rngs):
            return MLPBlock(rngs)

        self.blocks = create(rngs)
        self.norm = nnx.LayerNorm(WIDTH, rngs=rngs)

    def __call__(self, tokens):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def forward(x, block):
            return block(x)

        return self.embed.attend(self.norm(forward(self.embed(tokens), self.blocks)))


def _nnx_lm_loss(model, batch):
    return _lm_loss(model(batch["tokens"]), batch["tokens"])


def nnx_scan(plan: lm.Plan) -> Subject:
    split = lm.split_nnx(plan.configure_model(NNXScanLM(4, nnx.Rngs(0))), _nnx_lm_loss)
    return Subject(split.params, split.model_state, split.loss_fn, _tokens())


# --- nnx_cnn: an NNX CNN with BatchNorm ----------------------------------------------------------


class ConvBlock(nnx.Module):
    def __init__(self, cin: int, cout: int, rngs: nnx.Rngs):
        self.conv = nnx.Conv(cin, cout, (3, 3), use_bias=False, rngs=rngs)
        self.norm = nnx.BatchNorm(cout, rngs=rngs)
        self.down = nnx.Conv(cout, cout, (3, 3), strides=2, use_bias=False, rngs=rngs)

    def __call__(self, x):
        return self.down(nnx.relu(self.norm(self.conv(x))))


class NNXCNN(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        widths = (3, 32, 64, 128, 256)
        self.blocks = nnx.List(
            [ConvBlock(a, b, rngs) for a, b in zip(widths, widths[1:], strict=False)]
        )
        self.head = nnx.Linear(widths[-1], 10, rngs=rngs)

    def __call__(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean((1, 2)))


def _nnx_classifier_loss(model, batch):
    logits = model(batch["image"]).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()


def nnx_cnn(plan: lm.Plan) -> Subject:
    split = lm.split_nnx(plan.configure_model(NNXCNN(nnx.Rngs(0))), _nnx_classifier_loss)
    return Subject(split.params, split.model_state, split.loss_fn, _images())


#: name -> (maker, the block class remat wraps, where the code comes from)
MODELS: dict[str, tuple[Callable[[lm.Plan], Subject], str, str]] = {
    "gpt2": (gpt2, "FlaxGPT2Block", "transformers 4.46 FlaxGPT2LMHeadModule (Hugging Face)"),
    "linen_resnet": (linen_resnet, "BasicBlock", "written here: Linen ResNet-18, BatchNorm"),
    "linen_lm_scan": (linen_lm_scan, "DecoderBlock", "written here: Linen LM, dropout, nn.scan"),
    "nnx_scan": (nnx_scan, "MLPBlock", "written here: NNX nnx.vmap + nnx.scan, split RNG streams"),
    "nnx_cnn": (nnx_cnn, "ConvBlock", "written here: NNX CNN, BatchNorm"),
}
