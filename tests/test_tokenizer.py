"""Tests for metrale.runtime.artifact.tokenizer: training, round trips, streaming decode, chat template."""

import json

import pytest
from pydoc_data.topics import topics

from metrale.runtime.errors import CheckpointError, ConfigError
from metrale.runtime.artifact.tokenizer import IncrementalDecoder, Tokenizer, train_bpe_tokenizer

# ~40 KB of real English prose from the language reference, in a fixed order.
TEXTS = [topics[k] for k in sorted(topics)[:10]]
MULTIBYTE = "café crème, 日本語のテキスト, emoji 🎉👍🏽 and ZWJ 👩‍💻 done"


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("tok")
    train_bpe_tokenizer(TEXTS, 512, out)
    return out


@pytest.fixture(scope="module")
def tok(tok_dir):
    return Tokenizer.from_dir(tok_dir)


def test_training_writes_hf_layout_and_is_deterministic(tok_dir, tmp_path):
    assert {p.name for p in tok_dir.iterdir()} == {
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
    }
    again = tmp_path / "again"
    train_bpe_tokenizer(iter(TEXTS), 512, again)  # a one-shot iterator works too
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        assert (again / name).read_bytes() == (tok_dir / name).read_bytes(), name
    cfg = json.loads((tok_dir / "tokenizer_config.json").read_text())
    assert cfg["eos_token"] == "<|endoftext|>" and cfg["bos_token"] is None
    assert "<|im_start|>" in cfg["chat_template"]


def test_vocab_and_special_ids(tok):
    assert tok.vocab_size == 512
    # The trainer puts the special tokens first, in the order given.
    assert tok.token_id("<|endoftext|>") == 0
    assert tok.token_id("<|im_start|>") == 1
    assert tok.token_id("<|im_end|>") == 2
    assert tok.mask_token_id == tok.token_id("<|mask|>") == 3
    assert tok.eos_token_ids == frozenset({0, 2})
    assert tok.pad_token_id == 0 and tok.bos_token_id is None
    with pytest.raises(ConfigError, match="'<\\|nope\\|>' is not in the vocabulary"):
        tok.token_id("<|nope|>")


@pytest.mark.parametrize(
    "text",
    ["The quick brown fox.\n  def f(x): return x * 2", "é", "日本", "🎉", MULTIBYTE, ""],
)
def test_round_trip(tok, text):
    ids = tok.encode(text)
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text


def test_merges_compress_trained_text(tok):
    # A phrase frequent in the training text takes fewer tokens than its bytes.
    phrase = "the expression"
    assert len(tok.encode(phrase)) < len(phrase.encode())


def test_special_tokens_encode_as_single_ids_and_are_skipped(tok):
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    assert tok.decode(ids) == "user\nhi"
    assert tok.decode(ids, skip_special=False) == "<|im_start|>user\nhi<|im_end|>"


def test_multibyte_characters_span_tokens(tok):
    # With 512 tokens, the emoji (4 UTF-8 bytes) cannot be one token: decoding a lone piece
    # gives U+FFFD, which is what the incremental decoder must hold back.
    ids = tok.encode("🎉")
    assert len(ids) > 1
    assert tok.decode(ids[:1]).endswith("\ufffd")


def test_incremental_decoder_matches_full_decode_at_every_step(tok):
    text = "<|im_start|>assistant\n" + MULTIBYTE + " résumé 😀<|im_end|>"
    ids = tok.encode(text)
    dec = IncrementalDecoder(tok)
    got = ""
    held_back_steps = 0
    for n, tid in enumerate(ids, start=1):
        got += dec.feed(tid)
        full = tok.decode(ids[:n])
        if full.endswith("\ufffd"):
            held_back_steps += 1
            assert full.startswith(got) and len(got) < len(full)
        else:
            assert got == full, n
    got += dec.flush()
    assert got == tok.decode(ids) == text.replace("<|im_start|>", "").replace("<|im_end|>", "")
    assert held_back_steps > 0  # the text really exercised split characters


def test_incremental_decoder_over_long_random_streams_decodes_nothing_itself(tok):
    """Random ids (split characters, specials, spaces), streams of every length: the deltas
    are the full decode at every step that ends on a whole character, a prefix of it at the
    others, and the stream decodes through `decode_stream` alone (a whole `decode` only at a
    flush that finds text held back)."""
    import random

    calls = [0]

    class Counting:
        def decode(self, ids, skip):
            calls[0] += 1
            return tok.decode(ids, skip)

        def decode_stream(self, skip):
            return tok.decode_stream(skip)

    rng = random.Random(0)
    vocab = tok.vocab_size
    for trial in range(40):
        ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 120))]
        dec, got, calls[0] = IncrementalDecoder(Counting()), "", 0
        for n, tid in enumerate(ids, start=1):
            got += dec.feed(tid)
            full = tok.decode(ids[:n])
            assert full.startswith(got), (trial, n)
            if not full.endswith("\ufffd"):
                assert got == full, (trial, n)
        assert calls[0] == 0
        assert got + dec.flush() == tok.decode(ids) and calls[0] <= 1


def test_incremental_decoder_deferred_decodes_once_at_the_end(tok):
    ids = tok.encode("café 日本 🎉 friend")
    dec = IncrementalDecoder(tok, deferred=True)
    assert [dec.feed(t) for t in ids] == [""] * len(ids)
    assert dec.flush() == tok.decode(ids) and dec.flush() == ""


def test_incremental_decoder_flush_emits_incomplete_tail(tok):
    ids = tok.encode("ab🎉")
    dec = IncrementalDecoder(tok)
    out = "".join(dec.feed(t) for t in ids[:-1])
    assert out == "ab"
    assert dec.flush() == tok.decode(ids[:-1])[2:]  # the partial emoji as U+FFFD
    assert dec.flush() == ""


def test_chat_template_two_messages(tok):
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Say hi."},
    ]
    expected = (
        "<|im_start|>system\nYou are terse.<|im_end|>\n"
        "<|im_start|>user\nSay hi.<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert tok.apply_chat_template(messages) == expected
    no_gen = tok.apply_chat_template(messages, add_generation_prompt=False)
    assert no_gen == expected[: -len("<|im_start|>assistant\n")]
    ids = tok.encode(expected)
    assert ids.count(1) == 3 and ids.count(2) == 2


@pytest.mark.parametrize(
    "messages, match",
    [
        ([{"content": "hi"}], "messages\\[0\\] needs a string `role`"),
        ([{"role": "user"}], "messages\\[0\\] needs a string `content`"),
        ([{"role": "user", "content": 3}], "needs a string `content`, got 3"),
        (["hi"], "messages\\[0\\] must be an object"),
        ([], "non-empty list"),
        ("hi", "non-empty list"),
    ],
)
def test_chat_template_refuses_bad_messages(tok, messages, match):
    with pytest.raises(ConfigError, match=match):
        tok.apply_chat_template(messages)


def test_chat_template_is_sandboxed(tok_dir, tmp_path):
    for name in ("tokenizer.json", "special_tokens_map.json"):
        (tmp_path / name).write_bytes((tok_dir / name).read_bytes())
    cfg = json.loads((tok_dir / "tokenizer_config.json").read_text())
    cfg["chat_template"] = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="failed to render"):
        Tokenizer.from_dir(tmp_path).apply_chat_template([{"role": "user", "content": "x"}])
    cfg["chat_template"] = "{{ raise_exception('no system role') }}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="no system role"):
        Tokenizer.from_dir(tmp_path).apply_chat_template([{"role": "user", "content": "x"}])


def test_chat_template_jinja_file_is_read(tok_dir, tmp_path):
    for name in ("tokenizer.json",):
        (tmp_path / name).write_bytes((tok_dir / name).read_bytes())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    (tmp_path / "chat_template.jinja").write_text(
        "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"
    )
    t = Tokenizer.from_dir(tmp_path)
    assert t.apply_chat_template([{"role": "user", "content": "q"}]) == "[user]q"
    assert t.eos_token_ids == frozenset({2})


def test_from_dir_refusals(tok_dir, tmp_path):
    with pytest.raises(CheckpointError, match="tokenizer.json: tokenizer file is missing"):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    (tmp_path / "tokenizer_config.json").write_text("{}")
    with pytest.raises(CheckpointError, match="tokenizer.json: not a valid tokenizers file"):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_bytes((tok_dir / "tokenizer.json").read_bytes())
    (tmp_path / "tokenizer_config.json").write_text("[1, 2")
    with pytest.raises(CheckpointError, match="tokenizer_config.json: not valid JSON"):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text('{"eos_token": "<|absent|>"}')
    with pytest.raises(CheckpointError, match="eos_token '<\\|absent\\|>' is not in the"):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text('{"eos_token": 7}')
    with pytest.raises(CheckpointError, match="`eos_token` must be null, a string"):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text('{"eos_token": {"content": "<|im_end|>"}}')
    t = Tokenizer.from_dir(tmp_path)
    assert t.eos_token_ids == frozenset({2})
    with pytest.raises(ConfigError, match="has no `chat_template`"):
        t.apply_chat_template([{"role": "user", "content": "x"}])


def test_train_refuses_tiny_vocab(tmp_path):
    with pytest.raises(ConfigError, match="vocab_size must be an integer of at least 260"):
        train_bpe_tokenizer(TEXTS, 100, tmp_path)
