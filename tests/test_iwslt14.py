import tarfile

import pytest
import tensorflow_datasets as tfds

from lowmem_jax.data.iwslt14 import (
    Iwslt14DeEn,
    clean_train_pairs,
    load_iwslt14,
    load_ted_multi_de_en,
    prepare_iwslt14,
    read_release,
    read_xml_segments,
)

N_GOOD = 50  # good training pairs in the fake release -> 48 train + 2 validation (23rd, 46th)


def _train_lines(lang: str) -> list[str]:
    head = [
        "<url>http://www.ted.com/talks/x.html</url>",
        "<keywords>talks, science</keywords>",
        "<speaker>Jane Doe</speaker>",
        "<talkid>1</talkid>",
        f"<title>Title {lang.upper()}</title>",
        f"<description>About {lang} Talk</description>",
        '<reviewer href="http://x">R</reviewer>',
        "<translator></translator>",
    ]
    body = [f"Sentence  {i} In {lang.upper()} ." for i in range(N_GOOD)]
    too_long = " ".join(["w"] * 176)
    bad_ratio = "a b c d" if lang == "de" else "a b c d e f g"  # 7 / 4 > 1.5
    body[5:5] = [too_long if lang == "de" else "short line", bad_ratio, "   "]
    return head + body + ["</doc>"]


def _xml(name: str, lang: str, n: int) -> str:
    segs = "\n".join(
        f'<seg id="{i}"> {name} {lang.upper()} Seg\u2019s {i} </seg>' for i in range(n)
    )
    return (
        f'<?xml version="1.0" encoding="UTF-8"?>\n<mteval>\n<srcset setid="{name}">\n'
        f'<doc docid="1" genre="lectures">\n<url>http://x</url>\n<talkid>1</talkid>\n'
        f"{segs}\n</doc>\n</srcset>\n</mteval>\n"
    )


TEST_SIZES = {
    "IWSLT14.TED.dev2010": 3,
    "IWSLT14.TEDX.dev2012": 2,
    "IWSLT14.TED.tst2010": 4,
    "IWSLT14.TED.tst2011": 1,
    "IWSLT14.TED.tst2012": 2,
}


def _write_release(folder):
    folder.mkdir(parents=True)
    for lang in ("de", "en"):
        (folder / f"train.tags.de-en.{lang}").write_text("\n".join(_train_lines(lang)) + "\n")
        for name, n in TEST_SIZES.items():
            (folder / f"{name}.de-en.{lang}.xml").write_text(_xml(name, lang, n))
    return folder


@pytest.fixture
def release_dir(tmp_path):
    return _write_release(tmp_path / "manual" / "de-en").parent


@pytest.fixture
def release_tgz(tmp_path):
    folder = _write_release(tmp_path / "staging" / "de-en")
    manual = tmp_path / "manual_tgz"
    manual.mkdir()
    with tarfile.open(manual / "de-en.tgz", "w:gz") as tar:
        tar.add(folder, arcname="de-en")
    return manual


def _expected_good(i: int) -> tuple[str, str]:
    return (f"sentence {i} in de .", f"sentence {i} in en .")


def test_cleaning_drops_tags_filters_lengths_and_ratio_and_lowercases(release_dir):
    splits = read_release(release_dir)
    cleaned = [("title de", "title en"), ("about de talk", "about en talk")]
    cleaned += [_expected_good(i) for i in range(N_GOOD)]
    # every 23rd cleaned pair (1-based) is validation, the rest train, order kept
    assert splits["validation"] == [cleaned[22], cleaned[45]]
    assert splits["train"] == [p for i, p in enumerate(cleaned, 1) if i % 23]
    joined = " ".join(de + " " + en for de, en in splits["train"] + splits["validation"])
    assert "<" not in joined and "jane" not in joined and "http" not in joined
    assert "w w w" not in joined and "a b c d" not in joined


def test_test_split_concatenates_xml_segments_in_fairseq_order(release_dir):
    test = read_release(release_dir)["test"]
    assert len(test) == sum(TEST_SIZES.values())
    assert test[0] == ("iwslt14.ted.dev2010 de seg's 0", "iwslt14.ted.dev2010 en seg's 0")
    assert test[3][0].startswith("iwslt14.tedx.dev2012 de")
    assert test[-1] == ("iwslt14.ted.tst2012 de seg's 1", "iwslt14.ted.tst2012 en seg's 1")


def test_optional_tedx_set_and_missing_files(release_dir):
    folder = release_dir / "de-en"
    for lang in ("de", "en"):
        (folder / f"IWSLT14.TEDX.dev2012.de-en.{lang}.xml").unlink()
    with pytest.warns(UserWarning, match="TEDX.dev2012"):
        assert len(read_release(release_dir)["test"]) == sum(TEST_SIZES.values()) - 2
    (folder / "IWSLT14.TED.tst2011.de-en.en.xml").unlink()
    with pytest.raises(FileNotFoundError, match="tst2011"):
        read_release(release_dir)


@pytest.mark.parametrize("kind", ["folder", "tgz"])
def test_builder_prepares_and_reads_splits(kind, release_dir, release_tgz, tmp_path):
    manual = release_dir if kind == "folder" else release_tgz
    data_dir = str(tmp_path / f"tfds_{kind}")
    builder = prepare_iwslt14(manual, data_dir=data_dir)
    assert isinstance(builder, Iwslt14DeEn) and builder.name == "iwslt14_de_en"
    expected = read_release(release_dir)
    for split in ("train", "validation", "test"):
        assert load_iwslt14(split, data_dir=data_dir) == expected[split]
    assert builder.info.splits["train"].num_examples == len(expected["train"])
    assert load_iwslt14("train[:3]", data_dir=data_dir) == expected["train"][:3]


def test_missing_manual_dir_and_unprepared_data_are_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="de-en.tgz"):
        prepare_iwslt14(tmp_path / "nope", data_dir=str(tmp_path / "d"))
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "readme.txt").write_text("x")
    with pytest.raises(FileNotFoundError, match="de-en.tgz"):
        prepare_iwslt14(tmp_path / "junk", data_dir=str(tmp_path / "d"))
    with pytest.raises(FileNotFoundError, match="prepare_iwslt14"):
        load_iwslt14("train", data_dir=str(tmp_path / "empty"))
    with pytest.raises(ValueError, match="allowed base splits"):
        load_iwslt14("dev", data_dir=str(tmp_path / "empty"))


def test_unparallel_train_files_are_an_error():
    with pytest.raises(ValueError, match="not parallel"):
        clean_train_pairs(["a", "b"], ["a"])


def test_read_xml_segments_handles_ids_and_apostrophes():
    text = '<doc>\n<seg id="1">  Hello   World\u2019s </seg>\n<seg id="2">Bye</seg>\n</doc>'
    assert read_xml_segments(text) == ["hello world's", "bye"]


def test_ted_multi_pairs_keep_de_en_examples_only():
    def ex(langs, texts):
        return {"translations": {"language": langs, "translation": texts}}

    examples = [
        ex([b"de", b"en", b"fr"], [b"Hallo", b"Hi", b"S"]),
        ex(["fr", "en"], ["Salut", "Hi"]),
        ex(["en", "de"], ["A  B", "C"]),
    ]
    with tfds.testing.mock_data(as_data_source_fn=lambda *a, **k: examples):
        pairs = load_ted_multi_de_en("train")
    assert pairs == [("hallo", "hi"), ("c", "a b")]


def test_ted_multi_missing_is_an_error_that_says_how_to_prepare(tmp_path):
    with pytest.raises(FileNotFoundError, match="download_and_prepare"):
        load_ted_multi_de_en("train", data_dir=str(tmp_path))


def test_load_works_with_tfds_mock_data():
    with tfds.testing.mock_data(num_examples=4):
        pairs = load_iwslt14("validation")
    assert len(pairs) == 4 and all(isinstance(x, str) for pair in pairs for x in pair)


def test_pipeline_prepare_tokenize_batch(release_tgz, tmp_path):
    from lowmem_jax.data.token_batching import TokenBatcher, TokenBudget
    from lowmem_jax.data.tokenizer import Tokenizer, train_tokenizer

    data_dir = str(tmp_path / "tfds")
    prepare_iwslt14(release_tgz, data_dir=data_dir)
    train = load_iwslt14("train", data_dir=data_dir)
    model = train_tokenizer([s for pair in train for s in pair], 40, tmp_path / "joint.model")
    tok = Tokenizer.load(model)
    src = tok.encode_batch([de for de, _ in train])
    tgt = tok.encode_batch([en for _, en in train])
    batcher = TokenBatcher(src, tgt, TokenBudget(64, length_multiple=8), seed=0)
    batches = list(batcher.epoch(0))
    assert sum(int((b["tgt_out"] == 2).sum()) for b in batches) == len(train)
    assert all(b["src"].size <= 64 and b["tgt_in"].shape == b["tgt_out"].shape for b in batches)
