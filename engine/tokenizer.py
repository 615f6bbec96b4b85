"""A checkpoint's tokenizer: encoding, the chat template, and incremental detokenization.
`Tokenizer` wraps transformers' tokenizer (which imports torch where it is installed); its
`spec()` is what a process without transformers encodes prompts with
(`engine.tokenizer_spec.SpecTokenizer`: the router)."""

from __future__ import annotations

import functools
import json
import random
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.loader import Checkpoint


@functools.cache
def _byte_level_chars() -> dict[str, int]:
    """The byte-level BPE alphabet: the printable character standing for each byte (bytes
    that print as themselves keep their character; the others take 256 onwards, in order)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
            *range(ord("\u00ae"), ord("\u00ff") + 1)]
    out, extra = {chr(b): b for b in keep}, 0
    for b in range(256):
        if b not in keep:
            out[chr(256 + extra)] = b
            extra += 1
    return out


def _byte_level_decoder(state: bytes) -> bool | None:
    """Whether a fast tokenizer's decoder (its JSON state) turns tokens into text as
    byte-level BPE does: ByteLevel alone, or after byte fallback, fusing and "\u2581" read
    as a space (as transformers builds it from a GGUF file in some versions). True when it
    has byte fallback, False when not, None when it is not byte-level."""
    d = json.loads(state)
    parts = d.get("decoders", []) if d.get("type") == "Sequence" else [d]
    if not parts or parts[-1].get("type") != "ByteLevel":
        return None
    for p in parts[:-1]:
        kind = p.get("type")
        if kind == "Replace" and p.get("pattern") == {"String": "\u2581"} and \
                p.get("content") == " ":
            continue
        if kind not in ("ByteFallback", "Fuse"):
            return None
    return any(p.get("type") == "ByteFallback" for p in parts)


@dataclass(frozen=True)
class TokenizerSpec:
    """What prompt encoding needs of a checkpoint's tokenizer, as plain picklable data: the
    fast tokenizer's JSON, the chat template, the special tokens the template reads by name
    (bos_token, eos_token, ...), every special token's string (shielded in chat content) and
    the end-of-sequence id. `Tokenizer.spec` exports it, `SpecTokenizer` encodes with it."""

    backend: str
    chat_template: str | None
    template_tokens: dict  # as transformers' special_tokens_map gives them
    specials: tuple[str, ...]
    eos_token_id: int | None


_DECODE_PROBE = "Hello , world ! It 's a test . Don 't stop ? Yes : no ; maybe - fine ."


class ChatEncoding:
    """Chat prompts to token ids, shielded: what the transformers-built `Tokenizer` and the
    spec-built one (`engine.tokenizer_spec.SpecTokenizer`) share. A subclass renders the chat
    template (`_render`), encodes text without added special tokens (`_encode`) and names its
    special tokens' strings (`_specials`)."""

    def _render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        raise NotImplementedError

    def _encode(self, text: str, split_special: bool = False) -> list[int]:
        """Ids of `text` with no special tokens added; `split_special`: a special token's
        string in it is tokenized as plain text."""
        raise NotImplementedError

    def _specials(self) -> list[str]:
        raise NotImplementedError

    def apply_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                   specials_in_content: bool = False) -> list[int]:
        """Token ids of `messages` rendered with the model's chat template. A special token's
        string inside a message's content is tokenized as plain text, so content cannot forge
        a turn; `specials_in_content=True` reads it as the token (trusted callers)."""
        shields: dict[str, str] = {}
        if not specials_in_content:
            messages, shields = self._shield(messages)
        text = self._render(messages, add_generation_prompt)
        if not shields:
            return self._encode(text)
        ids: list[int] = []
        for part in re.split(f"([{''.join(shields)}])", text):
            if part in shields:  # a special token's string from content, as plain text
                ids += self._encode(shields[part], split_special=True)
            elif part:
                ids += self._encode(part)
        return ids

    def _shield(self, messages: list[dict]) -> tuple[list[dict], dict[str, str]]:
        """`messages` with each special token's string in their content replaced by a
        private-use character found in no content, and those characters' strings."""
        specials = sorted(set(self._specials()), key=len, reverse=True)
        contents = [m["content"] for m in messages if isinstance(m.get("content"), str)]
        found = [t for t in specials if any(t in c for c in contents)]
        if not found:
            return messages, {}
        used = set("".join(contents))
        free = (chr(c) for c in range(0xF0000, 0x10FFFE) if chr(c) not in used)
        marks = {t: next(free) for t in found}
        pattern = re.compile("|".join(re.escape(t) for t in found))
        out = [{**m, "content": pattern.sub(lambda x: marks[x.group(0)], m["content"])}
               if isinstance(m.get("content"), str) else m for m in messages]
        return out, {mark: t for t, mark in marks.items()}


class Tokenizer(ChatEncoding):
    """transformers tokenizer plus the chat template and incremental detokenization helpers."""

    def __init__(self, hf_tokenizer):
        self.hf = hf_tokenizer
        # Decoding runs once per generated token (twice, for the text delta): call the fast
        # tokenizer directly when it decodes exactly as transformers does (no clean-up pass on
        # top; checked on text that clean-up would change, so any version's rule is honored).
        self._fast_decode = None
        fast = getattr(hf_tokenizer, "backend_tokenizer", None)
        if fast is not None:
            try:
                ids = hf_tokenizer.encode(_DECODE_PROBE, add_special_tokens=False)
                same = fast.decode(ids, skip_special_tokens=True) == \
                    hf_tokenizer.decode(ids, skip_special_tokens=True)
            except Exception:  # noqa: BLE001 - any oddity: keep transformers' decode
                same = False
            self._fast_decode = fast.decode if same else None
        # Token id -> bytes, for byte-level BPE tokenizers: built on the first decode
        # (`_byte_table`); False where the fast tokenizer decodes otherwise.
        self._bytes: list[bytes] | bool | None = None if self._fast_decode else False

    @classmethod
    def load(cls, ckpt: Checkpoint) -> Tokenizer:
        from engine.loader import Source

        return Source(ckpt).tokenizer()

    @property
    def eos_token_id(self) -> int | None:
        return self.hf.eos_token_id

    def encode(self, text: str) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=True))

    def decode(self, ids: list[int]) -> str:
        text = self.decode_joined(ids)
        if text is not None:
            return text
        if self._fast_decode is not None:
            return self._fast_decode(ids, skip_special_tokens=True)
        return self.hf.decode(ids, skip_special_tokens=True)

    def decode_joined(self, ids: list[int]) -> str | None:
        """The text of ids from the byte table: their bytes joined and read as UTF-8, bad bytes
        replaced. None without a table or for an id it lacks. Where the text of a holds no U+FFFD,
        text(a + b) = text(a) + text(b), so `Detokenizer` decodes only new ids."""
        table = self._bytes if self._bytes is not None else self._byte_table()
        if not table:
            return None
        try:
            parts = [table[i] for i in ids]
        except IndexError:  # an id past the tokenizer's vocabulary
            return None
        if None in parts:
            return None
        return b"".join(parts).decode("utf-8", "replace")

    def _byte_table(self) -> list[bytes | None] | bool:
        """Each token id's bytes where the tokenizer decodes by byte-level BPE, so the detokenizer
        can skip a tokenizer call; None for a token outside the byte alphabet (such windows go
        through the tokenizer). Kept only if the decoder is byte-level and the table decodes probe
        windows exactly as the tokenizer does; False otherwise."""
        self._bytes = False
        fast = self.hf.backend_tokenizer
        try:
            fallback = _byte_level_decoder(fast.decoder.__getstate__())
            vocab = fast.get_vocab(with_added_tokens=True)
            added = fast.get_added_tokens_decoder()
        except Exception:  # noqa: BLE001 - an older tokenizers: keep its decode
            return False
        if fallback is None:
            return False
        chars = _byte_level_chars()
        table: list[bytes | None] = [b""] * (max(vocab.values()) + 1)
        for token, i in vocab.items():
            if i in added and added[i].special:
                continue  # skipped when decoding
            if fallback and re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", token):
                table[i] = None
                continue
            try:
                table[i] = bytes([chars[c] for c in token])
            except KeyError:
                table[i] = None
        rng = random.Random(0)
        probes = [[i] for i in added] + [[rng.randrange(len(table)) for _ in range(n % 8 + 1)]
                                         for n in range(512)]
        for ids in probes:
            parts = [table[i] for i in ids]
            if None not in parts and b"".join(parts).decode("utf-8", "replace") != \
                    fast.decode(ids, skip_special_tokens=True):
                return False
        # Published only once checked (until then a decode in another thread goes through
        # the tokenizer).
        self._bytes = table
        return table

    def _render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        return self.hf.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                           tokenize=False)

    def _encode(self, text: str, split_special: bool = False) -> list[int]:
        kw = {"split_special_tokens": True} if split_special else {}
        return list(self.hf.encode(text, add_special_tokens=False, **kw))

    def _specials(self) -> list[str]:
        return [t.content for t in self.hf.added_tokens_decoder.values()
                if t.special and t.content]

    def spec(self) -> TokenizerSpec:
        """This tokenizer as plain data, for a process that tokenizes without transformers
        (`engine.tokenizer_spec.SpecTokenizer`)."""
        try:
            template = self.hf.get_chat_template()
        except ValueError:  # the checkpoint has no chat template
            template = None
        return TokenizerSpec(self.hf.backend_tokenizer.to_str(), template,
                             dict(self.hf.special_tokens_map), tuple(self._specials()),
                             self.hf.eos_token_id)


class Detokenizer:
    """Turns a growing list of token ids into text deltas, never splitting a UTF-8 character.

    The text of ids[read:] is what ids[prefix:] decodes to past the text of ids[prefix:read] (a
    few tokens of context so spaces decode right); past WINDOW tokens the window moves up to the
    last read point. With a byte table and a window of whole characters, only new ids are decoded
    (`_step_joined`)."""

    WINDOW = 4

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int]):
        self.tok = tokenizer
        # Start a few tokens back, so the first generated token decodes with its context.
        self.prefix = max(0, len(prompt_ids) - 4)
        self.read = len(prompt_ids)
        self._read_text: str | None = None  # ids[prefix:read] decoded, once known
        # The tokenizer's byte-table decode (`Tokenizer.decode_joined`), if it has one...
        self._joined = getattr(tokenizer, "decode_joined", None)
        # ...and whether _read_text came from it with no U+FFFD: its bytes are whole
        # characters, so the window's text is _read_text then the new ids' text alone.
        self._clean = False

    def step(self, ids: list[int]) -> str:
        """The text that ids (the request's whole id list, grown since the last call) add;
        "" while the last of them ends inside a character."""
        if self._read_text is None:
            got = self._joined(ids[self.prefix : self.read]) if self._joined else None
            self._clean = got is not None and "\ufffd" not in got
            self._read_text = got if got is not None else \
                self.tok.decode(ids[self.prefix : self.read])
        before = self._read_text
        end = len(ids)
        if self._clean:
            new = self._joined(ids[self.read : end])
            if new is not None:
                return self._step_joined(ids, before, new)
        self._clean = False
        text = self.tok.decode(ids[self.prefix : end])
        # Several new ids whose last ends inside a character: the text up to the last id
        # that ends a character goes out now, as it would have one id at a time (a request
        # that stops here keeps it).
        while text.endswith("\ufffd") and end - 1 > self.read:
            end -= 1
            text = self.tok.decode(ids[self.prefix : end])
        if len(text) <= len(before) or text.endswith("\ufffd"):
            return ""
        if end - self.prefix > self.WINDOW:
            self.prefix, self._read_text = self.read, None
        else:
            self._read_text = text
        self.read = end
        return text[len(before) :]

    def _step_joined(self, ids: list[int], before: str, new: str) -> str:
        """`step` where the window's text is `before` (whole characters) then `new`, the
        new ids' text from the byte table: what `step` gives, from one decode of the new
        ids instead of the window's (two when the window moved, as it does every call
        that brings more than WINDOW ids)."""
        end = len(ids)
        while new.endswith("\ufffd") and end - 1 > self.read:
            end -= 1
            new = self._joined(ids[self.read : end])
        if not new or new.endswith("\ufffd"):
            return ""
        if end - self.prefix > self.WINDOW:
            # The moved window ids[read:end] decodes to `new`, as it would alone.
            self.prefix, self._read_text = self.read, new
        else:
            self._read_text = before + new
        self._clean = "\ufffd" not in new
        self.read = end
        return new
