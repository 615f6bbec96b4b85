"""Incremental detokenization: the text deltas, whatever ids arrive per call, add up to what
decoding one token at a time (two decodes a call, the window moved to each read point)
gives, and never end inside a character."""

import random

import pytest

from engine.loader import Detokenizer


def reference_stream(tok, prompt: list[int], out: list[int]) -> list[str]:
    """Per token: decode ids[prefix:read] and ids[prefix:], emit the difference once the
    text does not end inside a character, then move prefix to read."""
    prefix, read, ids, deltas = max(0, len(prompt) - 4), len(prompt), list(prompt), []
    for t in out:
        ids.append(t)
        before, text = tok.decode(ids[prefix:read]), tok.decode(ids[prefix:])
        if len(text) <= len(before) or text.endswith("\ufffd"):
            continue
        prefix, read = read, len(ids)
        deltas.append(text[len(before):])
    return deltas


def stream(tok, prompt: list[int], out: list[int], chunks: list[int]) -> list[str]:
    d, ids, deltas, i = Detokenizer(tok, prompt), list(prompt), [], 0
    for n in chunks:
        ids.extend(out[i : i + n])
        i += n
        deltas.append(d.step(ids))
    assert i == len(out)
    return deltas


def chunking(rng: random.Random, n: int) -> list[int]:
    sizes = []
    while n:
        sizes.append(min(n, rng.randint(1, 8)))
        n -= sizes[-1]
    return sizes


TEXTS = ["The quick brown fox jumps over the lazy dog. " * 3,
         "Ünïcödé, emoji 🎉🚀 and 中文 text; numbers 12345, code `x = f(y)`.\n\n  Indented.",
         "   leading spaces, tabs\tand \"quotes\" - 'single' — dashes…"]


@pytest.mark.parametrize("text", TEXTS)
def test_deltas_add_up_whatever_the_chunks(smol_engine, text):
    tok = smol_engine.tokenizer
    ids = tok.encode(text)
    prompt, out = ids[:6], ids[6:]
    want = "".join(reference_stream(tok, prompt, out))
    assert want == tok.decode(out)
    rng = random.Random(len(text))
    for chunks in ([1] * len(out), [len(out)], chunking(rng, len(out)), chunking(rng, len(out))):
        got = stream(tok, prompt, out, chunks)
        assert "".join(got) == want, chunks
        assert not any(d.endswith("\ufffd") for d in got)


def test_random_ids_with_broken_characters(smol_engine):
    """Random ids, byte tokens among them (characters split or never completed): the same
    text as the token-by-token reference at every chunking."""
    tok = smol_engine.tokenizer
    rng = random.Random(7)
    vocab = smol_engine.config.model.vocab_size
    # Byte-level tokens of the first 256 ids carry partial UTF-8 sequences.
    for trial in range(20):
        prompt = [rng.randrange(256, vocab) for _ in range(5)]
        out = [rng.randrange(0, 256) if rng.random() < 0.4 else rng.randrange(256, vocab)
               for _ in range(40)]
        want = "".join(reference_stream(tok, prompt, out))
        for chunks in ([1] * len(out), chunking(rng, len(out))):
            assert "".join(stream(tok, prompt, out, chunks)) == want, (trial, chunks)


def test_one_decode_per_call_on_short_windows(smol_engine):
    """Token by token, a call decodes once while its window is short (the second decode only
    after the window moves), so about WINDOW + 1 decodes per WINDOW tokens at most."""
    tok = smol_engine.tokenizer
    calls = []

    class Counting:
        def decode(self, ids):
            calls.append(len(ids))
            return tok.decode(ids)

    ids = tok.encode("Counting decodes over a plain English sentence of some length here, "
                     "then another clause, and one more after it to make the stream long.")
    d, cur = Detokenizer(Counting(), ids[:6]), list(ids[:6])
    for t in ids[6:]:
        cur.append(t)
        d.step(cur)
    n = len(ids) - 6
    assert n >= 10
    assert len(calls) <= n * (Detokenizer.WINDOW + 1) / Detokenizer.WINDOW + 2
    assert len(calls) < 2 * n


def test_byte_table_decodes_as_the_tokenizer(smol_engine):
    """SmolLM2's tokenizer is byte-level BPE: `Tokenizer.decode` joins each id's bytes, and
    gives what the fast tokenizer and transformers give (special tokens skipped, broken
    characters replaced) on random windows and on text split anywhere."""
    tok = smol_engine.tokenizer
    table = tok._byte_table()
    assert table and len(table) >= smol_engine.config.model.vocab_size
    fast = tok.hf.backend_tokenizer
    rng = random.Random(11)
    special = list(tok.hf.all_special_ids)
    windows = [[rng.randrange(len(table)) for _ in range(rng.randint(1, 10))]
               for _ in range(3000)]
    windows += [w + [s] + w for s in special for w in windows[:20]]
    ids = tok.encode("".join(TEXTS))
    windows += [ids[a : a + n] for a in range(len(ids)) for n in (1, 3, 7)]
    for w in windows:
        assert tok.decode(w) == fast.decode(w, skip_special_tokens=True), w
    for w in windows[:300]:
        assert tok.decode(w) == tok.hf.decode(w, skip_special_tokens=True), w


def test_byte_table_refused_when_it_decodes_otherwise(smol_engine, monkeypatch):
    """A table that decodes any probe differently is not used: a byte alphabet with two
    bytes swapped is refused, and decoding goes through the tokenizer, unchanged."""
    import engine.tokenizer as loader

    chars = dict(loader._byte_level_chars())
    chars["a"], chars["e"] = chars["e"], chars["a"]
    monkeypatch.setattr(loader, "_byte_level_chars", lambda: chars)
    tok = loader.Tokenizer(smol_engine.tokenizer.hf)
    assert tok._byte_table() is False and tok._bytes is False
    ids = tok.encode("a plain sentence with a and e in it")
    assert tok.decode(ids) == smol_engine.tokenizer.decode(ids) == \
        tok.hf.decode(ids, skip_special_tokens=True)


def test_no_byte_table_for_other_decoders():
    """A tokenizer whose decoder is not byte-level (WordPiece here) keeps its own decode."""
    from tokenizers import Tokenizer as Raw
    from tokenizers import decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "hello": 1, "world": 2, "##s": 3}
    raw = Raw(models.WordPiece(vocab, unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    raw.decoder = decoders.WordPiece()
    from engine.loader import Tokenizer

    tok = Tokenizer(PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="[UNK]"))
    assert tok._byte_table() is False
    assert tok.decode([1, 2, 3]) == "hello worlds"


def test_byte_level_decoders_recognized():
    """ByteLevel alone, or the sequence transformers builds from a GGUF file in some versions
    (byte fallback, fuse, "\u2581" as a space, then ByteLevel); anything else is not."""
    from engine.tokenizer import _byte_level_decoder

    bl = '{"type":"ByteLevel","add_prefix_space":true,"trim_offsets":true,"use_regex":true}'
    seq = ('{"type":"Sequence","decoders":[{"type":"ByteFallback"},{"type":"Fuse"},'
           '{"type":"Replace","pattern":{"String":"\u2581"},"content":" "},' + bl + ']}')
    assert _byte_level_decoder(bl.encode()) is False
    assert _byte_level_decoder(seq.encode()) is True
    assert _byte_level_decoder(('{"type":"Sequence","decoders":[{"type":"Fuse"},' + bl + ']}')
                               .encode()) is False
    for other in ('{"type":"Sequence","decoders":[{"type":"Strip","content":" ","start":1,'
                  '"stop":0},' + bl + ']}',
                  '{"type":"Sequence","decoders":[{"type":"Replace","pattern":{"String":"_"},'
                  '"content":" "},' + bl + ']}',
                  '{"type":"Sequence","decoders":[' + bl + ',{"type":"Fuse"}]}',
                  '{"type":"Sequence","decoders":[]}',
                  '{"type":"WordPiece","prefix":"##","cleanup":true}'):
        assert _byte_level_decoder(other.encode()) is None, other


def test_windows_outside_the_table_go_through_the_tokenizer(smol_engine):
    """A token the table leaves out (None: outside the byte alphabet, or byte fallback) and
    an id past the vocabulary: that window is decoded by the tokenizer, the others by the
    table, all as the tokenizer decodes them."""
    from engine.loader import Tokenizer

    tok = Tokenizer(smol_engine.tokenizer.hf)
    table = tok._byte_table()
    fast = tok.hf.backend_tokenizer
    ids = tok.encode("some words around the token left out of the table")
    table[ids[3]] = None
    calls = []
    tok._fast_decode = lambda w, **kw: calls.append(list(w)) or fast.decode(w, **kw)
    for w in (ids, ids[:3], ids[3:5], [ids[0], len(table) + 5, ids[1]]):
        assert tok.decode(w) == fast.decode(w, skip_special_tokens=True), w
    assert calls == [ids, ids[3:5], [ids[0], len(table) + 5, ids[1]]]


class Generic:
    """A tokenizer without the byte-table decode: the detokenizer's generic path."""

    def __init__(self, tok, calls=None):
        self.tok, self.calls = tok, calls

    def decode(self, ids):
        if self.calls is not None:
            self.calls.append(len(ids))
        return self.tok.decode(ids)


def test_joined_path_gives_the_generic_deltas(smol_engine):
    """With the byte table the detokenizer decodes only new ids; call by call it gives what
    the generic path gives, on text, on random ids with broken characters, and across a
    token the table lacks (that call and the next go the generic way)."""
    tok = smol_engine.tokenizer
    assert tok._byte_table()
    rng = random.Random(3)
    vocab = smol_engine.config.model.vocab_size
    cases = [tok.encode(t) for t in TEXTS]
    for _ in range(30):
        cases.append([rng.randrange(0, 256) if rng.random() < 0.3 else rng.randrange(256, vocab)
                      for _ in range(48)])
    ufffd = tok.encode("a \ufffd b")  # a real U+FFFD in the text: never "clean"
    cases.append(cases[0][:10] + ufffd + cases[0][10:])
    for ids in cases:
        prompt, out = ids[:6], ids[6:]
        for chunks in ([1] * len(out), [4] * (len(out) // 4) + [len(out) % 4],
                       chunking(rng, len(out))):
            chunks = [c for c in chunks if c]
            assert stream(tok, prompt, out, chunks) == stream(Generic(tok), prompt, out, chunks)
    from engine.loader import Tokenizer

    lacking = Tokenizer(tok.hf)
    ids = cases[0]
    lacking._byte_table()[ids[12]] = None
    for chunks in ([1] * (len(ids) - 6), [3] * ((len(ids) - 6) // 3) + [(len(ids) - 6) % 3]):
        chunks = [c for c in chunks if c]
        assert stream(lacking, ids[:6], ids[6:], chunks) == \
            stream(Generic(tok), ids[:6], ids[6:], chunks)


def test_one_short_decode_per_call_with_the_byte_table(smol_engine):
    """Four ids a call (a K=3 step): the generic path decodes twice a call (the window moves
    every call), the byte table once, and only the new ids."""
    tok = smol_engine.tokenizer
    ids = tok.encode("Counting decodes over a plain English sentence of some length here, "
                     "then another clause, and one more after it to make the stream long." * 2)
    calls: list[int] = []

    class Joined(Generic):
        def decode_joined(self, w):
            calls.append(len(w))
            return self.tok.decode_joined(w)

    for kind, counted in ((Generic(tok, calls), True), (Joined(tok), False)):
        calls.clear()
        d, cur = Detokenizer(kind, ids[:6]), list(ids[:6])
        steps = 0
        for i in range(6, len(ids) - 3, 4):
            cur.extend(ids[i : i + 4])
            d.step(cur)
            steps += 1
        assert steps >= 8
        if counted:
            assert len(calls) >= 2 * steps - 1
        else:
            assert len(calls) == steps + 1  # the first call's window, then one a call
            assert max(calls[1:]) == 4
