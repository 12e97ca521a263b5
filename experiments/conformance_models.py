"""The conformance suite's models: code nobody on this project wrote, and models written
here the way Flax users commonly write them.

* ``gpt2`` -- Hugging Face ``transformers``' ``FlaxGPT2LMHeadModule`` (Linen, dropout), built
  from a config (no weights, nothing downloaded). ``transformers`` 4.46.x: the last line with
  Flax models (5.0 removed them); a test-only dependency (``pip install "transformers<4.47"``,
  about 10 s here). Chosen as the most used published Flax transformer.
* ``bert`` (masked LM; its layers take their flags positionally), ``bart`` (encoder-decoder),
  ``llama`` and ``mistral`` (grouped-query attention, rotary positions; Mistral's sliding
  window), ``opt``, ``vit`` (images): more of the same
  family, each from a tiny config, dropout on where the model has it. Not T5: transformers
  4.46's Flax T5 calls ``jnp.clip(a_max=...)``, which JAX 0.10 no longer takes.
* ``linen_resnet`` -- a ResNet-18 (basic blocks [2, 2, 2, 2], widths 32..256) with BatchNorm.
* ``linen_lm_scan`` -- a decoder-only LM, dropout, its blocks applied with ``nn.scan``.
* ``nnx_scan`` -- NNX scan over layers: blocks created with ``nnx.vmap`` over split RNG streams
  (a dropout key per layer), applied with ``nnx.scan``.
* ``nnx_cnn`` -- an NNX CNN with BatchNorm.

Each is a :func:`lowmem_jax.custom_workload` (what the planner takes); :func:`subject` configures
and initialises it for one plan through the public API (``plan.configure_model``, the model's
``init``; NNX through ``lm.split_nnx``).
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
    """A model configured by a plan as ``make_train_step`` takes it, and a batch."""

    params: dict
    model_state: dict
    loss_fn: Callable
    batch: dict


def subject(work: lm.workloads.Workload, plan: lm.Plan) -> Subject:
    """``work``'s model configured by ``plan`` (``plan.configure_model``), initialised, and its
    loss: what a user does by hand before ``wrap_optimizer`` / ``TrainState.create``."""
    model = plan.configure_model(work.model)
    variables = dict(work.init(model, jax.random.key(0), _BATCHES[work.name]))
    params = variables.pop("params")
    return Subject(params, variables, work.loss(model), _BATCHES[work.name])


# The batches the cells run on (the workloads keep their shapes).
_BATCHES: dict[str, dict] = {}


def _linen_workload(name, model, batch, init, loss) -> lm.workloads.Workload:
    _BATCHES[name] = batch
    return lm.custom_workload(name, model, batch, loss=loss, init=init, optimizer=optax.adam(1e-3))


def _nnx_workload(name, module, batch, loss) -> lm.workloads.Workload:
    _BATCHES[name] = batch
    return lm.custom_workload(name, module, batch, loss=loss, optimizer=optax.adam(1e-3))


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


def _gpt2_model():
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
    return FlaxGPT2LMHeadModule(config)


def _gpt2_init(model, rng, batch):
    ids = batch["tokens"][:1]
    return model.init(rng, ids, jnp.ones_like(ids), jnp.broadcast_to(jnp.arange(SEQ), ids.shape))


def _gpt2_loss(model):
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

    return loss_fn


def gpt2() -> lm.workloads.Workload:
    return _linen_workload("gpt2", _gpt2_model(), _tokens(), _gpt2_init, _gpt2_loss)


# --- bert, t5, llama, vit: more of transformers' Flax family ------------------------------------
# Tiny configs (nothing downloaded); dropout on where the model has it, as a user trains.


def _transformers_module(family: str, module: str, config: str, **fields):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a config, no weights: nothing to fetch
    import importlib

    import transformers

    models = importlib.import_module(f"transformers.models.{family}.modeling_flax_{family}")
    return getattr(models, module)(getattr(transformers, config)(**fields))


def _masked(tokens, rate: float = 0.15):
    """BERT's masked-LM batch: ``mask`` marks the positions predicted (a fixed draw)."""
    mask = jax.random.bernoulli(jax.random.key(2), rate, tokens.shape)
    return {"tokens": tokens, "mask": mask}


def bert() -> lm.workloads.Workload:
    model = _transformers_module(
        "bert", "FlaxBertForMaskedLMModule", "BertConfig", vocab_size=VOCAB, hidden_size=WIDTH,
        num_hidden_layers=4, num_attention_heads=4, intermediate_size=4 * WIDTH,
        max_position_embeddings=SEQ,
    )  # fmt: skip

    def init(model, rng, batch):
        return model.init(rng, batch["tokens"][:1], jnp.ones_like(batch["tokens"][:1]),
                          jnp.zeros_like(batch["tokens"][:1]),
                          jnp.broadcast_to(jnp.arange(SEQ), (1, SEQ)), None)  # fmt: skip

    def loss(model):
        def loss_fn(params, model_state, batch, rng):
            ids, mask = batch["tokens"], batch["mask"]
            masked = jnp.where(mask, 0, ids)  # the [MASK] id: 0 in this tiny vocabulary
            logits = model.apply({"params": params}, masked, jnp.ones_like(ids),
                                 jnp.zeros_like(ids),
                                 jnp.broadcast_to(jnp.arange(ids.shape[1]), ids.shape), None,
                                 deterministic=False, rngs={"dropout": rng}).logits  # fmt: skip
            token = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), ids)
            count = mask.sum().astype(jnp.float32)  # the masked positions: microbatches weigh it
            loss = (token * mask).sum() / jnp.maximum(count, 1.0)
            return loss, (model_state, {"loss": loss, "count": count})

        return loss_fn

    return _linen_workload("bert", model, _masked(_tokens()["tokens"]), init, loss)


def bart() -> lm.workloads.Workload:
    model = _transformers_module(
        "bart", "FlaxBartForConditionalGenerationModule", "BartConfig", vocab_size=VOCAB,
        d_model=WIDTH, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=4 * WIDTH, decoder_ffn_dim=4 * WIDTH,
        max_position_embeddings=SEQ,
    )  # fmt: skip
    half = SEQ // 2

    def call(model, variables, source, decoder_in, **kw):
        positions = jnp.broadcast_to(jnp.arange(half), source.shape)
        return model.apply(variables, source, jnp.ones_like(source), decoder_in,
                           jnp.ones_like(decoder_in), positions, positions, **kw)  # fmt: skip

    def init(model, rng, batch):
        ids = batch["tokens"][:1]
        positions = jnp.broadcast_to(jnp.arange(half), (1, half))
        return model.init(rng, ids[:, :half], jnp.ones((1, half), jnp.int32), ids[:, half:],
                          jnp.ones((1, half), jnp.int32), positions, positions)  # fmt: skip

    def loss(model):
        def loss_fn(params, model_state, batch, rng):
            ids = batch["tokens"]  # the first half the source, the second the target
            source, target = ids[:, :half], ids[:, half:]
            decoder_in = jnp.pad(target[:, :-1], ((0, 0), (1, 0)))  # shifted right, start 0
            out = call(model, {"params": params}, source, decoder_in, deterministic=False,
                       rngs={"dropout": rng})  # fmt: skip
            loss = optax.softmax_cross_entropy_with_integer_labels(
                out.logits.astype(jnp.float32), target
            ).mean()
            count = jnp.float32(target.size)  # every target token: the same in each microbatch
            return loss, (model_state, {"loss": loss, "count": count})

        return loss_fn

    return _linen_workload("bart", model, _tokens(), init, loss)


def _causal_lm(name: str, family: str, module: str, config: str, **fields):
    """A transformers causal LM called ``(ids, attention mask, positions)``, dropout on."""
    model = _transformers_module(family, module, config, vocab_size=VOCAB, **fields)

    def call(model, variables, ids, **kw):
        positions = jnp.broadcast_to(jnp.arange(ids.shape[1]), ids.shape)
        return model.apply(variables, ids, jnp.ones_like(ids), positions, **kw)

    def init(model, rng, batch):
        ids = batch["tokens"][:1]
        positions = jnp.broadcast_to(jnp.arange(SEQ), ids.shape)
        return model.init(rng, ids, jnp.ones_like(ids), positions)

    def loss(model):
        def loss_fn(params, model_state, batch, rng):
            out = call(model, {"params": params}, batch["tokens"], deterministic=False,
                       rngs={"dropout": rng})  # fmt: skip
            loss = _lm_loss(out.logits, batch["tokens"])
            count = jnp.float32(batch["tokens"][:, 1:].size)  # predicted tokens, from shapes
            return loss, (model_state, {"loss": loss, "count": count})

        return loss_fn

    return _linen_workload(name, model, _tokens(), init, loss)


def llama() -> lm.workloads.Workload:
    # Its rotary table needs max_position_embeddings >= 2 x the head size (transformers 4.46).
    return _causal_lm(
        "llama", "llama", "FlaxLlamaForCausalLMModule", "LlamaConfig", hidden_size=WIDTH,
        intermediate_size=688, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=4 * SEQ,
    )  # fmt: skip


def mistral() -> lm.workloads.Workload:
    return _causal_lm(
        "mistral", "mistral", "FlaxMistralForCausalLMModule", "MistralConfig",
        hidden_size=WIDTH, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=4 * SEQ, sliding_window=SEQ // 2,
    )  # fmt: skip


def opt() -> lm.workloads.Workload:
    return _causal_lm(
        "opt", "opt", "FlaxOPTForCausalLMModule", "OPTConfig", hidden_size=WIDTH,
        ffn_dim=4 * WIDTH, num_hidden_layers=4, num_attention_heads=4,
        max_position_embeddings=SEQ, word_embed_proj_dim=WIDTH,
    )  # fmt: skip


def vit() -> lm.workloads.Workload:
    model = _transformers_module(
        "vit", "FlaxViTForImageClassificationModule", "ViTConfig", image_size=32, patch_size=4,
        num_channels=3, hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
        intermediate_size=512, num_labels=10,
    )  # fmt: skip

    def init(model, rng, batch):
        return model.init(rng, batch["image"][:1])

    def loss(model):
        def loss_fn(params, model_state, batch, rng):
            logits = model.apply({"params": params}, batch["image"], deterministic=False,
                                 rngs={"dropout": rng}).logits  # fmt: skip
            loss = optax.softmax_cross_entropy_with_integer_labels(
                logits.astype(jnp.float32), batch["label"]
            ).mean()
            count = jnp.float32(batch["label"].shape[0])  # examples, from shapes
            return loss, (model_state, {"loss": loss, "count": count})

        return loss_fn

    return _linen_workload("vit", model, _images(), init, loss)


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


def linen_resnet() -> lm.workloads.Workload:
    def init(model, rng, batch):
        return model.init(rng, batch["image"][:2], train=False)

    return _linen_workload("linen_resnet", ResNet18(), _images(), init, lm.classifier_loss_fn)


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


def linen_lm_scan() -> lm.workloads.Workload:
    def init(model, rng, batch):
        return model.init({"params": rng, "dropout": jax.random.key(1)}, batch["tokens"][:1])

    def loss(model):
        def loss_fn(params, model_state, batch, rng):
            logits = model.apply({"params": params}, batch["tokens"], rngs={"dropout": rng})
            value = _lm_loss(logits, batch["tokens"])
            return value, (model_state, {"loss": value})

        return loss_fn

    return _linen_workload("linen_lm_scan", ScanLM(), _tokens(), init, loss)


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


def nnx_scan() -> lm.workloads.Workload:
    return _nnx_workload("nnx_scan", NNXScanLM(4, nnx.Rngs(0)), _tokens(), _nnx_lm_loss)


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


def nnx_cnn() -> lm.workloads.Workload:
    return _nnx_workload("nnx_cnn", NNXCNN(nnx.Rngs(0)), _images(), _nnx_classifier_loss)


#: name -> (its workload, the block class a user would name, where the code comes from)
MODELS: dict[str, tuple[Callable[[], lm.workloads.Workload], str, str]] = {
    "gpt2": (gpt2, "FlaxGPT2Block", "transformers 4.46 FlaxGPT2LMHeadModule (Hugging Face)"),
    "bert": (bert, "FlaxBertLayer", "transformers 4.46 FlaxBertForMaskedLMModule (Hugging Face)"),
    "bart": (
        bart,
        "FlaxBartEncoderLayer",
        "transformers 4.46 FlaxBartForConditionalGenerationModule (Hugging Face)",
    ),
    "llama": (
        llama,
        "FlaxLlamaDecoderLayer",
        "transformers 4.46 FlaxLlamaForCausalLMModule (Hugging Face)",
    ),
    "mistral": (
        mistral,
        "FlaxMistralDecoderLayer",
        "transformers 4.46 FlaxMistralForCausalLMModule (Hugging Face)",
    ),
    "opt": (
        opt,
        "FlaxOPTDecoderLayer",
        "transformers 4.46 FlaxOPTForCausalLMModule (Hugging Face)",
    ),
    "vit": (
        vit,
        "FlaxViTLayer",
        "transformers 4.46 FlaxViTForImageClassificationModule (Hugging Face)",
    ),
    "linen_resnet": (linen_resnet, "BasicBlock", "written here: Linen ResNet-18, BatchNorm"),
    "linen_lm_scan": (linen_lm_scan, "DecoderBlock", "written here: Linen LM, dropout, nn.scan"),
    "nnx_scan": (nnx_scan, "MLPBlock", "written here: NNX nnx.vmap + nnx.scan, split RNG streams"),
    "nnx_cnn": (nnx_cnn, "ConvBlock", "written here: NNX CNN, BatchNorm"),
}
