"""Tests for text.detokenizer, on small tokenizers trained in-process (no downloads)."""

from __future__ import annotations

import json
import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from pdserve.text.detokenizer import IncrementalDetokenizer, StopStringMatcher

CORPUS = [
    "Hello world, the café is naïve. Ünïcödé façade résumé, crème brûlée.",
    "日本語のテキストです。中文文本测试。한국어 텍스트입니다.",
    "Emoji: 😀 😃 🎉 👍🏽 ❤️ and more 😀🎉 in a row.",
    "The quick brown fox jumps over the lazy dog. 1234567890!",
] * 4
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>"]


def _wrap(tok: Tokenizer) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )


def byte_level_tokenizer() -> PreTrainedTokenizerFast:
    """GPT-2 / Llama-3 style: byte-level BPE, merges may split multi-byte characters."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=500,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    hf = _wrap(tok)
    hf.add_tokens(["<tool>"])  # a non-special added token
    return hf


def metaspace_tokenizer(llama_decoder: bool) -> PreTrainedTokenizerFast:
    """SentencePiece style: "▁" marks spaces, unknown characters fall back to <0xNN> tokens.

    `llama_decoder` picks the Llama-2 decoder chain (Replace, ByteFallback, Fuse, Strip) over
    the Metaspace decoder; both strip the leading space of the first token.
    """
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=SPECIAL_TOKENS, show_progress=False
    )
    tok.train_from_iterator(CORPUS, trainer)
    spec = json.loads(tok.to_str())  # add the 256 byte tokens and turn byte fallback on
    vocab = spec["model"]["vocab"]
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    spec["model"].update(byte_fallback=True, unk_token="<unk>")
    tok = Tokenizer.from_str(json.dumps(spec))
    if llama_decoder:
        steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
        tok.decoder = decoders.Sequence([*steps, decoders.Strip(" ", 1, 0)])
    else:
        metaspace = decoders.Metaspace(replacement="▁", prepend_scheme="always")
        tok.decoder = decoders.Sequence([decoders.ByteFallback(), metaspace])
    return _wrap(tok)


@pytest.fixture(scope="module", params=["byte_level", "llama", "metaspace"])
def tokenizer(request: pytest.FixtureRequest) -> PreTrainedTokenizerFast:
    if request.param == "byte_level":
        return byte_level_tokenizer()
    return metaspace_tokenizer(llama_decoder=request.param == "llama")


def _stream(
    tokenizer: PreTrainedTokenizerFast, ids: list[int], chunks: list[int], skip: bool
) -> tuple[list[str], str]:
    """Feeds `ids` in chunks of the given sizes; returns the pieces (flush last) and the text."""
    detok = IncrementalDetokenizer(tokenizer, [1, 5, 7], skip_special_tokens=skip)
    pieces, start = [], 0
    for size in chunks:
        pieces.append(detok.add(ids[start : start + size]))
        start += size
    pieces.append(detok.flush())
    return pieces, detok.text


def _random_chunks(rng: random.Random, n: int) -> list[int]:
    chunks = []
    while n > 0:
        chunks.append(min(n, rng.choice([1, 1, 1, 1, 2, 3, 5])))
        n -= chunks[-1]
    return chunks


def _random_ids(rng: random.Random, tokenizer: PreTrainedTokenizerFast) -> list[int]:
    """Random vocabulary ids mixed with encoded multi-byte text, which splits characters."""
    ids: list[int] = []
    for _ in range(rng.randint(0, 8)):
        if rng.random() < 0.5:
            ids += [rng.randrange(len(tokenizer)) for _ in range(rng.randint(1, 6))]
        else:
            text = "".join(rng.choice("aé 日本🦄😀ö\n") for _ in range(rng.randint(1, 6)))
            ids += tokenizer.encode(text, add_special_tokens=False)
    return ids


@pytest.mark.parametrize("skip", [True, False])
def test_random_streams_match_full_decode(tokenizer: PreTrainedTokenizerFast, skip: bool) -> None:
    rng = random.Random(1234)
    for _ in range(1000):
        ids = _random_ids(rng, tokenizer)
        pieces, text = _stream(tokenizer, ids, _random_chunks(rng, len(ids)), skip)
        full = tokenizer.decode(ids, skip_special_tokens=skip)
        assert "".join(pieces) == text == full, tokenizer.convert_ids_to_tokens(ids)
        offset = 0
        for piece in pieces:  # a U+FFFD is only emitted where the full decode has one
            for i, char in enumerate(piece):
                assert char != "\ufffd" or full[offset + i] == "\ufffd"
            offset += len(piece)


def test_byte_level_text_is_emitted_as_soon_as_it_is_complete() -> None:
    tokenizer = byte_level_tokenizer()
    rng = random.Random(7)
    for _ in range(200):
        ids = _random_ids(rng, tokenizer)
        detok = IncrementalDetokenizer(tokenizer, [])
        for n, token_id in enumerate(ids, 1):
            detok.add([token_id])
            so_far = tokenizer.decode(ids[:n], skip_special_tokens=True)
            if not so_far.endswith("\ufffd"):
                assert detok.text == so_far


@pytest.mark.parametrize("text", ["A🦄B", "🦄🐍 x", "ok 漢字ß!"])
def test_split_characters_are_emitted_whole(
    tokenizer: PreTrainedTokenizerFast, text: str
) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids), "no character spans tokens"
    pieces, _ = _stream(tokenizer, ids, [1] * len(ids), skip=True)
    assert "".join(pieces) == tokenizer.decode(ids) == text
    assert not any("\ufffd" in piece for piece in pieces)
    for char in text:
        assert any(char in piece for piece in pieces)


def test_held_invalid_tail_is_released_by_flush() -> None:
    tokenizer = byte_level_tokenizer()
    lead_byte = tokenizer.convert_tokens_to_ids("â")  # byte 0xE2 starts a 3-byte character
    ids = tokenizer.encode("ok", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [])
    assert detok.add(ids) == "ok"
    assert detok.add([lead_byte]) == ""
    assert detok.add([lead_byte]) == ""  # still an (invalid) tail ending in U+FFFD
    assert detok.flush() == "\ufffd\ufffd"
    assert detok.text == tokenizer.decode(ids + [lead_byte, lead_byte])


def test_sentencepiece_leading_space() -> None:
    tokenizer = metaspace_tokenizer(llama_decoder=True)
    ids = tokenizer.encode("Hello world the", add_special_tokens=False)
    assert tokenizer.convert_ids_to_tokens(ids)[0].startswith("▁")
    eos = tokenizer.eos_token_id
    pieces, _ = _stream(tokenizer, [ids[0], eos, *ids[1:]], [1] * (len(ids) + 1), skip=True)
    assert pieces[0] == "Hello"  # like decode(): the first token loses its leading space
    assert pieces[1] == ""  # the skipped EOS
    assert "".join(pieces[2:]) == " world the"


def test_special_tokens_are_kept_when_not_skipped() -> None:
    tokenizer = byte_level_tokenizer()
    ids = [*tokenizer.encode("hi", add_special_tokens=False), tokenizer.eos_token_id]
    assert _stream(tokenizer, ids, [1] * len(ids), skip=False)[1] == "hi</s>"
    assert _stream(tokenizer, ids, [1] * len(ids), skip=True)[1] == "hi"


def _feed_all(stop: list[str], chunks: list[str]) -> list[tuple[str, bool]]:
    matcher = StopStringMatcher(stop)
    return [matcher.feed(chunk) for chunk in chunks]


def test_stop_split_across_chunks() -> None:
    results = _feed_all(["STOP"], ["abc ST", "O", "P and more", "x"])
    assert results == [("abc ", False), ("", False), ("", True), ("", True)]


def test_stop_not_a_prefix_after_all() -> None:
    matcher = StopStringMatcher(["</answer>"])
    assert matcher.feed("x </ans") == ("x ", False)  # no premature emission
    assert matcher.feed("wer") == ("", False)
    assert matcher.feed("s") == ("</answers", False)
    assert matcher.flush() == ""


def test_earliest_stop_wins() -> None:
    assert _feed_all(["world", "lo"], ["hello world"]) == [("hel", True)]
    results = _feed_all(["world", "lo"], ["hel", "l", "o world"])
    assert results == [("he", False), ("l", False), ("", True)]


def test_overlapping_stop() -> None:
    assert _feed_all(["ab"], ["a", "a", "b"]) == [("", False), ("a", False), ("", True)]
    assert _feed_all(["ab"], ["aab"]) == [("a", True)]


def test_earlier_starting_stop_is_awaited() -> None:
    assert _feed_all(["ab", "xaby"], ["xab", "z"]) == [("", False), ("x", True)]
    assert _feed_all(["ab", "xaby"], ["xab", "y"]) == [("", False), ("", True)]
    matcher = StopStringMatcher(["ab", "xaby"])
    assert matcher.feed("xab") == ("", False)
    assert matcher.flush() == "x"  # generation ended: the "ab" match stands


def test_flush_without_stop() -> None:
    matcher = StopStringMatcher(["<|end|>"])
    assert matcher.feed("result <|e") == ("result ", False)
    assert matcher.flush() == "<|e"
    assert StopStringMatcher([]).feed("anything") == ("anything", False)
    assert StopStringMatcher(["", "z"]).feed("ab") == ("ab", False)  # "" is ignored


def _naive(text: str, stop: list[str]) -> tuple[int, bool]:
    """How much of `text` may be emitted, and whether it stopped, by brute force."""
    for i in range(len(text)):
        if any(text.startswith(s, i) for s in stop):
            return i, True
        if any(s.startswith(text[i:]) for s in stop):
            return i, False
    return len(text), False


def test_stop_matcher_against_naive_reference() -> None:
    rng = random.Random(99)
    for _ in range(3000):
        stop = ["".join(rng.choices("abc", k=rng.randint(1, 4))) for _ in range(rng.randint(0, 3))]
        text = "".join(rng.choices("abcd", k=rng.randint(0, 16)))
        cuts = sorted(rng.sample(range(len(text) + 1), rng.randint(0, len(text))))
        chunks = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)])]
        matcher, emitted = StopStringMatcher(stop), ""
        for n, chunk in enumerate(chunks):
            piece, stopped = matcher.feed(chunk)
            emitted += piece
            safe, naive_stopped = _naive("".join(chunks[: n + 1]), stop)
            assert (emitted, stopped) == (text[:safe], naive_stopped), (stop, chunks)
        emitted += matcher.flush()
        starts = [text.find(s) for s in stop if s in text]
        assert emitted == text[: min(starts, default=len(text))], (stop, chunks)
