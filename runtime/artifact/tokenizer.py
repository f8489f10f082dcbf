"""Tokenizer: a byte-level BPE tokenizer in the Hugging Face layout, its chat template, and
streaming decode.

A tokenizer directory holds `tokenizer.json` (the `tokenizers` model: vocabulary, merges, added
tokens) and `tokenizer_config.json` (`eos_token`, `bos_token`, `pad_token`, optional
`mask_token`, and `chat_template`, a Jinja2 string; a `chat_template.jinja` file next to it is
read when the config has none, as newer `transformers` saves it).

Invariants:
- `decode(encode(text)) == text` for any text when the tokenizer is byte-level (every byte is in
  the initial alphabet, no normalizer), which is how `train_bpe_tokenizer` builds it.
- Special tokens (`<|endoftext|>`, `<|im_start|>`, `<|im_end|>`, `<|mask|>`) are added tokens:
  `encode` always matches them as single ids; `decode(skip_special=True)` drops them.
- `eos_token_ids` holds the configured `eos_token` plus `<|im_end|>` when the vocabulary has it,
  so a chat turn ends generation whichever one the checkpoint names.
- `IncrementalDecoder` emits, after each token, text whose concatenation is always a prefix of
  `decode(all ids so far)`, equal to it whenever that decode does not end in an incomplete UTF-8
  character; `flush()` emits the rest. It streams with `tokenizers`' own `DecodeStream`.
- Chat templates render in Jinja2's immutable sandbox: a template is data from a checkpoint and
  must not reach Python objects beyond the messages it is given.
- Training is deterministic: the same texts and vocab size give byte-identical files.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from metrale.runtime.errors import CheckpointError, ConfigError

log = logging.getLogger(__name__)

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
MASK = "<|mask|>"
SPECIAL_TOKENS: tuple[str, ...] = (ENDOFTEXT, IM_START, IM_END, MASK)

# Qwen-style ChatML. Written with string concatenation only, so trim_blocks/lstrip_blocks (which
# Hugging Face enables when rendering) cannot change the whitespace it produces.
CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

def _token_content(value: Any, field: str, source: Path) -> str | None:
    """A special-token entry of tokenizer_config.json: null, a string, or an AddedToken dict."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    raise CheckpointError(
        f"{source}: `{field}` must be null, a string or an object with `content`, got {value!r}"
    )


class Tokenizer:
    """A `tokenizers.Tokenizer` plus the special tokens and chat template of its config."""

    def __init__(self, backend: Any, config: Mapping[str, Any], source: str = "<memory>") -> None:
        src = Path(source)
        self._tok = backend
        self.source = source
        self.eos_token = _token_content(config.get("eos_token"), "eos_token", src)
        self.bos_token = _token_content(config.get("bos_token"), "bos_token", src)
        self.pad_token = _token_content(config.get("pad_token"), "pad_token", src)
        mask = _token_content(config.get("mask_token"), "mask_token", src)
        template = config.get("chat_template")
        if isinstance(template, list):
            # Hugging Face's multi-template form: [{"name": ..., "template": ...}, ...].
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
            template = named.get("default")
        if template is not None and not isinstance(template, str):
            raise CheckpointError(f"{source}: `chat_template` must be a string, got {template!r}")
        self.chat_template: str | None = template

        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        eos: set[int] = set()
        if self.eos_token is not None:
            eos_id = backend.token_to_id(self.eos_token)
            if eos_id is None:
                raise CheckpointError(
                    f"{source}: eos_token {self.eos_token!r} is not in the tokenizer's vocabulary"
                )
            eos.add(eos_id)
        im_end = backend.token_to_id(IM_END)
        if im_end is not None:
            eos.add(im_end)
        self.eos_token_ids: frozenset[int] = frozenset(eos)
        self.mask_token_id: int | None = backend.token_to_id(mask if mask is not None else MASK)
        self.bos_token_id: int | None = (
            backend.token_to_id(self.bos_token) if self.bos_token is not None else None
        )
        self.pad_token_id: int | None = (
            backend.token_to_id(self.pad_token) if self.pad_token is not None else None
        )
        self._template = None  # compiled lazily: most users never render a chat

    @classmethod
    def from_dir(cls, path: str | os.PathLike[str]) -> Tokenizer:
        """Load `tokenizer.json` + `tokenizer_config.json` from `path`."""
        from tokenizers import Tokenizer as Backend

        root = Path(path)
        tok_file, cfg_file = root / "tokenizer.json", root / "tokenizer_config.json"
        for f in (tok_file, cfg_file):
            if not f.is_file():
                raise CheckpointError(f"{f}: tokenizer file is missing")
        try:
            backend = Backend.from_file(str(tok_file))
        except Exception as e:  # the Rust side raises a plain Exception for every parse error
            raise CheckpointError(f"{tok_file}: not a valid tokenizers file ({e})") from e
        try:
            config = json.loads(cfg_file.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
            raise CheckpointError(f"{cfg_file}: not valid JSON ({e})") from None
        if not isinstance(config, dict):
            raise CheckpointError(
                f"{cfg_file}: must hold a JSON object, got {type(config).__name__}"
            )
        jinja_file = root / "chat_template.jinja"
        if config.get("chat_template") is None and jinja_file.is_file():
            try:
                config["chat_template"] = jinja_file.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as e:
                raise CheckpointError(f"{jinja_file}: cannot be read as text ({e})") from None
        return cls(backend, config, source=str(cfg_file))

    @property
    def backend(self) -> Any:
        """The `tokenizers.Tokenizer` itself (its vocabulary, for grammars)."""
        return self._tok

    def encode(self, text: str, add_special: bool = False) -> list[int]:
        """Token ids of `text`; special-token strings in it always map to their single ids.
        `add_special` runs the tokenizer's post-processor (e.g. a BOS), if it has one."""
        return self._tok.encode(text, add_special_tokens=add_special).ids

    def decode(self, ids: Sequence[int], skip_special: bool = True) -> str:
        """Text of `ids`; bytes that do not form complete UTF-8 characters become U+FFFD."""
        return self._tok.decode(list(ids), skip_special_tokens=skip_special)

    def decode_stream(self, skip_special: bool = True) -> Callable[[int], str | None]:
        """A fresh streaming decode (`tokenizers.decoders.DecodeStream`): called with each id in
        turn, it returns the text that id completes, or None while a character is incomplete."""
        from tokenizers.decoders import DecodeStream

        stream, backend = DecodeStream(skip_special_tokens=skip_special), self._tok
        return lambda token_id: stream.step(backend, token_id)

    def token_id(self, token: str) -> int:
        """Id of one vocabulary entry (e.g. "<|im_end|>"); ConfigError when it has none."""
        tid = self._tok.token_to_id(token)
        if tid is None:
            raise ConfigError(f"token {token!r} is not in the vocabulary of {self.source}")
        return tid

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True
    ) -> str:
        """Render a conversation (`[{"role": str, "content": str}, ...]`) as prompt text."""
        if self.chat_template is None:
            raise ConfigError(f"{self.source} has no `chat_template`; cannot render messages")
        if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
            raise ConfigError(f"messages must be a non-empty list of objects, got {messages!r}")
        for i, m in enumerate(messages):
            if not isinstance(m, Mapping):
                raise ConfigError(f"messages[{i}] must be an object, got {m!r}")
            for key in ("role", "content"):
                if not isinstance(m.get(key), str):
                    raise ConfigError(
                        f"messages[{i}] needs a string `{key}`, got {m.get(key)!r}"
                    )
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        if self._template is None:

            def raise_exception(message: str) -> None:
                raise ConfigError(f"chat template of {self.source}: {message}")

            env = ImmutableSandboxedEnvironment(
                trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
            )
            env.globals["raise_exception"] = raise_exception
            try:
                self._template = env.from_string(self.chat_template)
            except jinja2.TemplateError as e:
                raise CheckpointError(f"{self.source}: chat_template does not parse ({e})") from e
        try:
            return self._template.render(
                messages=[dict(m) for m in messages],
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
            )
        except jinja2.TemplateError as e:
            raise ConfigError(f"chat template of {self.source} failed to render: {e}") from e


class IncrementalDecoder:
    """Turns a stream of token ids into text deltas, holding back partial UTF-8 characters.

    Byte-level BPE splits one character (é, 日, an emoji) across tokens, so decoding one token
    alone gives U+FFFD. `tokenizers`' `DecodeStream` holds such ids until their character is
    whole and then returns exactly the text the full decode adds, in amortized constant time an
    id. `flush` emits what it still holds (an incomplete character as U+FFFD, as `decode` gives
    it): the full decode past what was emitted. `deferred`: the text is wanted only at the end
    (a request neither streamed nor cut at stop strings): `feed` keeps the id, and `flush`
    decodes them all at once.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = True, deferred: bool = False) -> None:
        self._tok = tokenizer
        self._skip = skip_special
        self._deferred = deferred
        self._start()

    def _start(self) -> None:
        self._ids: list[int] = []
        self._emitted = 0  # characters of decode(ids) emitted
        self._held = False  # the last ids' text is not out yet
        self._step = None if self._deferred else self._tok.decode_stream(self._skip)

    def feed(self, token_id: int) -> str:
        """Add one id; return the newly completed text (possibly "")."""
        self._ids.append(token_id)
        if self._deferred:
            return ""
        text = self._step(token_id)
        if text is None:
            self._held = True
            return ""
        self._held = False
        self._emitted += len(text)
        return text

    def flush(self) -> str:
        """Emit whatever is held back (an incomplete character decodes as U+FFFD); the next id
        starts afresh."""
        text = ""
        if self._deferred or self._held:
            text = self._tok.decode(self._ids, self._skip)[self._emitted:]
        self._start()
        return text


def train_bpe_tokenizer(
    texts: Iterable[str], vocab_size: int, out_dir: str | os.PathLike[str]
) -> Tokenizer:
    """Train a byte-level BPE on `texts`, write it to `out_dir` in the Hugging Face layout
    (tokenizer.json, tokenizer_config.json with the ChatML template, special_tokens_map.json),
    and return it loaded from there. The vocabulary holds the 256 byte symbols, the special
    tokens, and merges up to `vocab_size` (fewer when the texts run out of pairs)."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, pre_tokenizers, processors, trainers

    floor = 256 + len(SPECIAL_TOKENS)
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < floor:
        raise ConfigError(
            f"vocab_size must be an integer of at least {floor} (256 bytes + "
            f"{len(SPECIAL_TOKENS)} special tokens), got {vocab_size!r}"
        )
    backend = Backend(models.BPE())
    # No normalizer: any byte string must round-trip exactly.
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),  # ids 0..3, in this order
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes: nothing is unknown
        show_progress=False,
    )
    backend.train_from_iterator(texts, trainer)

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    backend.save(str(out / "tokenizer.json"))
    specials = {"eos_token": ENDOFTEXT, "pad_token": ENDOFTEXT, "mask_token": MASK}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        **specials,
        "additional_special_tokens": [IM_START, IM_END],
        "model_max_length": 131072,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHATML_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(
        json.dumps(config, indent=2) + "\n", encoding="utf-8"
    )
    special_map = {**specials, "additional_special_tokens": [IM_START, IM_END]}
    (out / "special_tokens_map.json").write_text(
        json.dumps(special_map, indent=2) + "\n", encoding="utf-8"
    )
    log.info("trained a byte-level BPE of %d tokens into %s", backend.get_vocab_size(), out)
    return Tokenizer.from_dir(out)
