"""A joint subword tokenizer (SentencePiece) for translation, with fixed special ids.

fairseq's IWSLT'14 recipe learns one joint BPE (10K merges) on both languages; here a single
SentencePiece model (BPE by default, or unigram) is trained on the German and English training
sentences together and shared by source and target (fairseq's per-side dictionaries of
~8,848 / 6,632 types are the subsets of that joint vocabulary each side uses).

Special ids, the same as ``synthetic.py`` and the models' default ``pad_id``:

- ``PAD_ID = 0`` (padding, never produced by :meth:`Tokenizer.encode`);
- ``BOS_ID = 1`` (begins the decoder input), ``EOS_ID = 2`` (ends source and target);
- ``UNK_ID = 3`` (unknown pieces); subword pieces start at ``FIRST_PIECE_ID = 4``.

:meth:`Tokenizer.encode` returns the pieces only; ``token_batching.py`` adds BOS/EOS. Training is
deterministic given the sentences and the arguments (one thread, fixed seed, no sampling).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from pathlib import Path

__all__ = [
    "PAD_ID",
    "BOS_ID",
    "EOS_ID",
    "UNK_ID",
    "FIRST_PIECE_ID",
    "MODEL_TYPES",
    "Tokenizer",
    "train_tokenizer",
]

PAD_ID, BOS_ID, EOS_ID, UNK_ID = 0, 1, 2, 3
FIRST_PIECE_ID = 4
MODEL_TYPES = ("bpe", "unigram")


def train_tokenizer(
    sentences: Iterable[str],
    vocab_size: int = 10000,
    path: str | os.PathLike = "tokenizer.model",
    *,
    model_type: str = "bpe",
    character_coverage: float = 1.0,
    seed: int = 0,
) -> Path:
    """Trains a SentencePiece model on ``sentences`` and saves it to ``path``; returns the path.

    ``vocab_size`` counts everything, the 4 special ids included. Pass the sentences of both
    languages for a joint vocabulary (e.g. ``[s for pair in train for s in pair]``).

    Raises:
      ValueError: for an unknown ``model_type`` (allowed: ``bpe``, ``unigram``), ``vocab_size``
        <= ``FIRST_PIECE_ID``, no non-empty sentence, or a vocabulary too large for the corpus
        (SentencePiece's message is kept).
    """
    import sentencepiece as spm

    if model_type not in MODEL_TYPES:
        raise ValueError(f"Unknown model_type={model_type!r}; allowed values: {list(MODEL_TYPES)}")
    if vocab_size <= FIRST_PIECE_ID:
        raise ValueError(f"vocab_size must be > {FIRST_PIECE_ID} (4 special ids), got {vocab_size}")
    sentences = [s for s in sentences if s.strip()]
    if not sentences:
        raise ValueError("sentences must contain at least one non-empty sentence")
    spm.set_random_generator_seed(seed)
    model = _BytesSink()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(sentences),
            model_writer=model,
            vocab_size=vocab_size,
            model_type=model_type,
            character_coverage=character_coverage,
            pad_id=PAD_ID,
            bos_id=BOS_ID,
            eos_id=EOS_ID,
            unk_id=UNK_ID,
            input_sentence_size=0,  # use every sentence: no random sampling
            shuffle_input_sentence=False,
            max_sentence_length=1 << 16,
            num_threads=1,
            minloglevel=2,
        )
    except RuntimeError as err:
        raise ValueError(f"SentencePiece training failed (vocab_size={vocab_size}): {err}") from err
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(model.data)
    return path


class _BytesSink:
    """Receives the serialized model from ``SentencePieceTrainer.train(model_writer=...)``."""

    def __init__(self) -> None:
        self.data = b""

    def write(self, data: bytes) -> None:
        self.data += data


class Tokenizer:
    """A trained SentencePiece model: ``text -> list[int]`` and back (ids as in module doc)."""

    def __init__(self, model_proto: bytes) -> None:
        import sentencepiece as spm

        self._sp = spm.SentencePieceProcessor(model_proto=model_proto)
        specials = (self._sp.pad_id(), self._sp.bos_id(), self._sp.eos_id(), self._sp.unk_id())
        if specials != (PAD_ID, BOS_ID, EOS_ID, UNK_ID):
            raise ValueError(
                f"model has special ids (pad, bos, eos, unk) = {specials}, expected "
                f"{(PAD_ID, BOS_ID, EOS_ID, UNK_ID)}; train it with train_tokenizer"
            )

    @classmethod
    def load(cls, path: str | os.PathLike) -> Tokenizer:
        """Loads a model saved by :func:`train_tokenizer`.

        Raises:
          FileNotFoundError: if ``path`` does not exist.
        """
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"No tokenizer model at path={path}; train_tokenizer saves one")
        return cls(path.read_bytes())

    @property
    def vocab_size(self) -> int:
        """Number of ids, special ids included (embedding tables need this many rows)."""
        return self._sp.get_piece_size()

    def encode(self, text: str) -> list[int]:
        """``text`` -> piece ids (no BOS/EOS; ids in ``[UNK_ID, vocab_size)``)."""
        return self._sp.encode(text, out_type=int)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """:meth:`encode` of each text."""
        return self._sp.encode(list(texts), out_type=int)

    def decode(self, ids: Iterable[int]) -> str:
        """Piece ids -> text, up to the first EOS; PAD and BOS ids are skipped."""
        pieces = []
        for i in ids:
            i = int(i)
            if i == EOS_ID:
                break
            if i not in (PAD_ID, BOS_ID):
                pieces.append(i)
        return self._sp.decode(pieces)

    def id_to_piece(self, i: int) -> str:
        """The subword string of id ``i`` (``<pad>``, ``<s>``, ``</s>``, ``<unk>`` for 0..3)."""
        return self._sp.id_to_piece(int(i))
