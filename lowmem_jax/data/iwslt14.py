"""IWSLT'14 German-English (TED talks) as a manual-download TFDS builder, cleaned as fairseq does.

TFDS has no IWSLT'14 builder, so :class:`Iwslt14DeEn` (``iwslt14_de_en``) reads the official
release from a *manual* directory (nothing is downloaded, here or in tests). Put either the
release archive ``de-en.tgz`` or its extracted folder ``de-en/`` (or the files themselves) in the
manual directory, then prepare once::

    from lowmem_jax.data.iwslt14 import load_iwslt14, prepare_iwslt14
    prepare_iwslt14("~/iwslt14_manual", data_dir="~/tensorflow_datasets")
    train = load_iwslt14("train", data_dir="~/tensorflow_datasets")  # [(de, en), ...]

Needed files (from ``de-en.tgz``): ``train.tags.de-en.{de,en}`` and the XML files
``IWSLT14.TED.{dev2010,tst2010,tst2011,tst2012}.de-en.{de,en}.xml`` plus, when present,
``IWSLT14.TEDX.dev2012.de-en.{de,en}.xml``.

Cleaning follows fairseq's ``examples/translation/prepare-iwslt14.sh`` except for Moses
tokenization (texts stay untokenized; a subword model handles them, see ``tokenizer.py``):

* train: metadata lines (starting with ``<url``, ``<talkid``, ``<keywords``, ``<speaker``,
  ``<reviewer``, ``<translator``, ``<doc``, ``</doc``) are dropped; ``<title>`` and
  ``<description>`` lines keep their text with the tags removed, as fairseq's ``sed`` does;
  then Moses ``clean-corpus-n`` (whitespace tokens, keep 1..175 tokens per side and a length
  ratio <= 1.5) and lowercasing;
* validation: every 23rd pair of the cleaned train set (1-based pair numbers 23, 46, ...);
  train: the other pairs;
* test: the ``<seg id=...>`` contents of dev2010, TEDX.dev2012 (when present), tst2010, tst2011
  and tst2012, concatenated in this (fairseq's) order, with ``’`` -> ``'``, lowercased, not
  length-filtered. With TEDX.dev2012 the real release gives fairseq's 6,750 test pairs.

Whitespace is collapsed to single spaces everywhere. Example order is kept (``disable_shuffling``),
so the test pairs keep the order of the lines of fairseq's test files.

Features: ``{"de": Text, "en": Text}``; splits ``train`` / ``validation`` / ``test``. Loaders here
return ``list[tuple[str, str]]`` of ``(de, en)`` pairs; :func:`load_ted_multi_de_en` gives the
same format from the ready-made TFDS ``ted_multi_translate`` (read only, never downloaded).
"""

from __future__ import annotations

import os
import re
import tarfile
import warnings
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import tensorflow_datasets as tfds

__all__ = [
    "Iwslt14DeEn",
    "SPLITS",
    "ARCHIVE_NAME",
    "clean_train_pairs",
    "read_xml_segments",
    "read_release",
    "prepare_iwslt14",
    "load_iwslt14",
    "load_ted_multi_de_en",
]

SPLITS = ("train", "validation", "test")
ARCHIVE_NAME = "de-en.tgz"
TRAIN_FILES = ("train.tags.de-en.de", "train.tags.de-en.en")
# Test sets in fairseq's order; the TEDX one is optional.
TEST_SETS = (
    ("IWSLT14.TED.dev2010", True),
    ("IWSLT14.TEDX.dev2012", False),
    ("IWSLT14.TED.tst2010", True),
    ("IWSLT14.TED.tst2011", True),
    ("IWSLT14.TED.tst2012", True),
)
MIN_LEN, MAX_LEN, MAX_RATIO = 1, 175, 1.5
VALID_EVERY = 23

# Metadata lines of ``train.tags`` files, dropped (fairseq's grep -v's for IWSLT'14 and '17).
DROP_TAGS = ("url", "talkid", "keywords", "speaker", "reviewer", "translator", "doc")
# Tags whose text fairseq keeps (it strips the tags with sed).
KEEP_TEXT_TAGS = ("title", "description")
_TAG_LINE = re.compile(r"^\s*<\s*/?\s*([A-Za-z]+)\b")
_SEG = re.compile(r'<seg\s+id\s*=\s*"?\s*\d+\s*"?\s*>(.*?)</seg>', re.DOTALL)

MANUAL_DOWNLOAD_INSTRUCTIONS = f"""\
Download the IWSLT 2014 German-English release ``{ARCHIVE_NAME}`` (the file fairseq's
examples/translation/prepare-iwslt14.sh fetches, from the IWSLT 2014 evaluation campaign
page / WIT3 "2014-01" texts de/en) and put it in the manual directory, either as the archive
``{ARCHIVE_NAME}`` or extracted (a ``de-en/`` folder, or its files directly). Needed:
{", ".join(TRAIN_FILES)} and IWSLT14.TED.{{dev2010,tst2010,tst2011,tst2012}}.de-en.{{de,en}}.xml
(IWSLT14.TEDX.dev2012.de-en.{{de,en}}.xml too, for fairseq's 6,750-pair test set).
"""


def _normalize(text: str) -> str:
    return " ".join(text.split())


def _train_text(lines: Iterable[str]) -> list[str]:
    """Drops metadata tag lines of a ``train.tags`` file; keeps title/description text."""
    out = []
    for line in lines:
        match = _TAG_LINE.match(line)
        tag = match.group(1).lower() if match else None
        if tag in DROP_TAGS:
            continue
        if tag in KEEP_TEXT_TAGS:
            line = re.sub(rf"</?\s*{tag}\s*>", "", line, flags=re.IGNORECASE)
        out.append(line)
    return out


def clean_train_pairs(de_lines: Sequence[str], en_lines: Sequence[str]) -> list[tuple[str, str]]:
    """Raw ``train.tags`` lines -> cleaned, lowercased ``(de, en)`` pairs (see module docstring).

    Raises:
      ValueError: if the two files do not have the same number of lines once tag lines are
        dropped (they would not be parallel).
    """
    de, en = _train_text(de_lines), _train_text(en_lines)
    if len(de) != len(en):
        raise ValueError(
            f"train files are not parallel after dropping tag lines: {len(de)} German lines, "
            f"{len(en)} English lines"
        )
    pairs = []
    for d, e in zip(de, en, strict=True):
        d, e = _normalize(d), _normalize(e)
        nd, ne = len(d.split()), len(e.split())
        if not (MIN_LEN <= nd <= MAX_LEN and MIN_LEN <= ne <= MAX_LEN):
            continue  # also drops empty lines
        if nd / ne > MAX_RATIO or ne / nd > MAX_RATIO:
            continue
        pairs.append((d.lower(), e.lower()))
    return pairs


def read_xml_segments(text: str) -> list[str]:
    """The ``<seg id="N"> ... </seg>`` contents of an IWSLT XML file, cleaned and lowercased."""
    return [_normalize(m.group(1).replace("\u2019", "'")).lower() for m in _SEG.finditer(text)]


def _find_release(manual_dir: Path) -> tuple[dict[str, str], str]:
    """Returns ``({file name: text}, where)`` for the needed files of the release."""
    wanted = list(TRAIN_FILES) + [
        f"{name}.de-en.{lang}.xml" for name, _ in TEST_SETS for lang in ("de", "en")
    ]
    archive = manual_dir / ARCHIVE_NAME
    if archive.is_file():
        texts = {}
        with tarfile.open(archive, "r:*") as tar:
            for member in tar.getmembers():
                base = os.path.basename(member.name)
                if member.isfile() and base in wanted and base not in texts:
                    handle = tar.extractfile(member)
                    assert handle is not None
                    texts[base] = handle.read().decode("utf-8")
        return texts, str(archive)
    for folder in (manual_dir / "de-en", manual_dir):
        if (folder / TRAIN_FILES[0]).is_file():
            texts = {
                name: (folder / name).read_text(encoding="utf-8")
                for name in wanted
                if (folder / name).is_file()
            }
            return texts, str(folder)
    raise FileNotFoundError(
        f"No IWSLT'14 de-en release in manual_dir={manual_dir}: expected {ARCHIVE_NAME}, a "
        f"de-en/ folder or the extracted files there.\n{MANUAL_DOWNLOAD_INSTRUCTIONS}"
    )


def read_release(manual_dir: str | os.PathLike) -> dict[str, list[tuple[str, str]]]:
    """Reads and cleans the release: ``{"train", "validation", "test"}`` -> ``(de, en)`` pairs.

    Raises:
      FileNotFoundError: if ``manual_dir`` holds no release or misses a needed file.
    """
    manual_dir = Path(manual_dir).expanduser()
    if not manual_dir.is_dir():
        raise FileNotFoundError(
            f"manual_dir={manual_dir} does not exist.\n{MANUAL_DOWNLOAD_INSTRUCTIONS}"
        )
    texts, where = _find_release(manual_dir)
    required = list(TRAIN_FILES) + [
        f"{name}.de-en.{lang}.xml" for name, req in TEST_SETS if req for lang in ("de", "en")
    ]
    missing = [name for name in required if name not in texts]
    if missing:
        raise FileNotFoundError(
            f"The IWSLT'14 release in {where} misses {missing}.\n{MANUAL_DOWNLOAD_INSTRUCTIONS}"
        )
    cleaned = clean_train_pairs(
        texts[TRAIN_FILES[0]].splitlines(), texts[TRAIN_FILES[1]].splitlines()
    )
    valid = [p for i, p in enumerate(cleaned, start=1) if i % VALID_EVERY == 0]
    train = [p for i, p in enumerate(cleaned, start=1) if i % VALID_EVERY != 0]
    test: list[tuple[str, str]] = []
    for name, _ in TEST_SETS:
        de_name, en_name = f"{name}.de-en.de.xml", f"{name}.de-en.en.xml"
        if de_name not in texts and en_name not in texts:  # the optional TEDX set
            warnings.warn(
                f"{name} is not in {where}: the test split will miss it and differ from "
                "fairseq's 6,750-pair test set",
                stacklevel=2,
            )
            continue
        de, en = read_xml_segments(texts[de_name]), read_xml_segments(texts[en_name])
        if len(de) != len(en):
            raise ValueError(f"{name}: {len(de)} German and {len(en)} English segments")
        test.extend(zip(de, en, strict=True))
    return {"train": train, "validation": valid, "test": test}


class Iwslt14DeEn(tfds.core.GeneratorBasedBuilder):
    """IWSLT'14 German-English, fairseq cleaning; ``{"de": Text, "en": Text}``."""

    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES = {"1.0.0": "fairseq prepare-iwslt14.sh cleaning, without Moses tokenization."}
    MANUAL_DOWNLOAD_INSTRUCTIONS = MANUAL_DOWNLOAD_INSTRUCTIONS

    def _info(self) -> tfds.core.DatasetInfo:
        return tfds.core.DatasetInfo(
            builder=self,
            description="IWSLT'14 German-English TED talks, cleaned as fairseq does.",
            features=tfds.features.FeaturesDict(
                {"de": tfds.features.Text(), "en": tfds.features.Text()}
            ),
            supervised_keys=("de", "en"),
            homepage="https://wit3.fbk.eu/2014-01",
            disable_shuffling=True,
        )

    def _split_generators(self, dl_manager: tfds.download.DownloadManager) -> dict[str, Any]:
        splits = read_release(dl_manager.manual_dir)
        return {name: self._generate_examples(splits[name]) for name in SPLITS}

    def _generate_examples(
        self, pairs: list[tuple[str, str]]
    ) -> Iterator[tuple[int, dict[str, str]]]:
        for i, (de, en) in enumerate(pairs):
            yield i, {"de": de, "en": en}


def prepare_iwslt14(manual_dir: str | os.PathLike, data_dir: str | None = None) -> Iwslt14DeEn:
    """Prepares ``iwslt14_de_en`` (ArrayRecord files) in ``data_dir`` from ``manual_dir``.

    Raises:
      FileNotFoundError: if ``manual_dir`` does not exist or holds no complete release.
    """
    manual = Path(manual_dir).expanduser()
    if not manual.is_dir() or not any(manual.iterdir()):
        raise FileNotFoundError(
            f"manual_dir={manual} does not exist or is empty.\n{MANUAL_DOWNLOAD_INSTRUCTIONS}"
        )
    builder = Iwslt14DeEn(data_dir=data_dir, file_format="array_record")
    builder.download_and_prepare(download_config=tfds.download.DownloadConfig(manual_dir=manual))
    return builder


def _check_split(split: str) -> None:
    for part in split.split("+"):
        base = part.split("[")[0].strip()
        if base not in SPLITS:
            raise ValueError(f"Unknown split={split!r}; allowed base splits: {list(SPLITS)}")


def _to_str(value: Any) -> str:
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


def load_iwslt14(split: str, data_dir: str | None = None) -> list[tuple[str, str]]:
    """Reads a prepared split (``train`` / ``validation`` / ``test``, TFDS slicing allowed).

    Returns ``[(de, en), ...]`` in the release order.

    Raises:
      ValueError: for an unknown split.
      FileNotFoundError: if ``iwslt14_de_en`` is not prepared in ``data_dir``; says how.
    """
    _check_split(split)
    try:
        source = Iwslt14DeEn(data_dir=data_dir, file_format="array_record").as_data_source(
            split=split
        )
    except Exception as err:  # TFDS raises several types for "not prepared"
        raise FileNotFoundError(
            f"iwslt14_de_en is not prepared in data_dir={data_dir or '~/tensorflow_datasets'} "
            f'({err}). Prepare it once with: python -c "from lowmem_jax.data.iwslt14 import '
            f"prepare_iwslt14; prepare_iwslt14('MANUAL_DIR', data_dir=...)\" where MANUAL_DIR "
            f"holds {ARCHIVE_NAME}.\n{MANUAL_DOWNLOAD_INSTRUCTIONS}"
        ) from err
    out = []
    for i in range(len(source)):  # one at a time: mocked sources break on __getitems__
        example = source[i]
        out.append((_to_str(example["de"]), _to_str(example["en"])))
    return out


def load_ted_multi_de_en(
    split: str, data_dir: str | None = None, *, lowercase: bool = True
) -> list[tuple[str, str]]:
    """``(de, en)`` pairs of TFDS ``ted_multi_translate`` (talks having both languages).

    The alternative to IWSLT'14 that TFDS prepares itself. Its texts come tokenized (``it 's``),
    unlike :func:`load_iwslt14`'s; whitespace is collapsed and, by default, text lowercased.

    Raises:
      ValueError: for an unknown split.
      FileNotFoundError: if ``ted_multi_translate`` is not prepared in ``data_dir``; says how.
    """
    _check_split(split)
    try:
        source = tfds.data_source(
            "ted_multi_translate", split=split, data_dir=data_dir, download=False
        )
    except Exception as err:  # TFDS raises several types for "not prepared"
        raise FileNotFoundError(
            f"ted_multi_translate is not prepared in data_dir="
            f"{data_dir or '~/tensorflow_datasets'} ({err}). Prepare it once with: "
            'pip install tensorflow-cpu && python -c "import tensorflow_datasets as tfds; '
            "tfds.builder('ted_multi_translate', file_format='array_record')"
            '.download_and_prepare()"'
        ) from err
    out = []
    for i in range(len(source)):
        translations = source[i]["translations"]
        langs = [_to_str(x) for x in translations["language"]]
        if "de" not in langs or "en" not in langs:
            continue
        texts = [_to_str(x) for x in translations["translation"]]
        de, en = _normalize(texts[langs.index("de")]), _normalize(texts[langs.index("en")])
        out.append((de.lower(), en.lower()) if lowercase else (de, en))
    return out
