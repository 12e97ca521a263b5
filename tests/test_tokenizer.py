import pytest

from lowmem_jax.data.tokenizer import (
    BOS_ID,
    EOS_ID,
    FIRST_PIECE_ID,
    PAD_ID,
    UNK_ID,
    Tokenizer,
    train_tokenizer,
)

CORPUS = [
    "das ist ein kleiner test .",
    "this is a small test .",
    "wir gehen nach hause , sagte er .",
    "we go home , he said .",
    "die katze schläft auf dem sofa .",
    "the cat sleeps on the sofa .",
] * 10


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return train_tokenizer(CORPUS, 60, tmp_path_factory.mktemp("tok") / "joint.model")


def test_special_ids_are_fixed(model_path):
    tok = Tokenizer.load(model_path)
    assert (PAD_ID, BOS_ID, EOS_ID, UNK_ID, FIRST_PIECE_ID) == (0, 1, 2, 3, 4)
    pieces = [tok.id_to_piece(i) for i in range(4)]
    assert pieces == ["<pad>", "<s>", "</s>", "<unk>"]
    assert tok.vocab_size == 60


def test_encode_decode_round_trip_and_unknowns(model_path):
    tok = Tokenizer.load(model_path)
    for text in ["die katze schläft .", "we go home , he said ."]:
        ids = tok.encode(text)
        assert all(FIRST_PIECE_ID <= i < tok.vocab_size for i in ids)
        assert tok.decode(ids) == text
    assert UNK_ID in tok.encode("xyz")  # characters never seen in training
    assert tok.encode_batch(["das ist", "the cat"]) == [
        tok.encode("das ist"),
        tok.encode("the cat"),
    ]


def test_decode_skips_pad_bos_and_stops_at_eos(model_path):
    tok = Tokenizer.load(model_path)
    ids = tok.encode("the cat")
    assert tok.decode([BOS_ID, *ids, EOS_ID, *tok.encode("sofa"), PAD_ID]) == "the cat"


def test_training_is_deterministic(model_path, tmp_path):
    again = train_tokenizer(CORPUS, 60, tmp_path / "again.model")
    assert again.read_bytes() == model_path.read_bytes()
    unigram = train_tokenizer(CORPUS, 40, tmp_path / "u.model", model_type="unigram")
    assert Tokenizer.load(unigram).decode(Tokenizer.load(unigram).encode("the cat")) == "the cat"


def test_errors_name_the_parameter(tmp_path):
    with pytest.raises(ValueError, match="model_type"):
        train_tokenizer(CORPUS, 60, tmp_path / "m.model", model_type="wordpiece")
    with pytest.raises(ValueError, match="vocab_size"):
        train_tokenizer(CORPUS, 4, tmp_path / "m.model")
    with pytest.raises(ValueError, match="vocab_size"):
        train_tokenizer(CORPUS, 5000, tmp_path / "m.model")  # too large for the corpus
    with pytest.raises(ValueError, match="sentences"):
        train_tokenizer(["", "  "], 60, tmp_path / "m.model")
    with pytest.raises(FileNotFoundError, match="path"):
        Tokenizer.load(tmp_path / "missing.model")
