"""Interim text by local agreement (app/live/agreement.py): what is sent is never taken back,
and the deltas join to the completed transcript, whatever the decodes say."""

from __future__ import annotations

import random

from app.live.agreement import Agreement, aligned_tail, key, words


def run(interims: list[str], final: str) -> tuple[list[str], str, list[str]]:
    """Deltas (interim ones first), the transcript, and the text shown after each delta."""
    a = Agreement()
    deltas = [d for d in (a.interim(h) for h in interims) if d]
    shown = []
    text = ""
    for d in deltas:
        text += d
        shown.append(text)
    last, transcript = a.final(final)
    if last:
        deltas.append(last)
    return deltas, transcript, shown


def test_two_decodes_that_agree_send_their_common_prefix() -> None:
    a = Agreement()
    assert a.interim(" The quick brown") == ""  # nothing to agree with yet
    assert a.interim(" The quick brown fox jumps") == "The quick brown"
    assert a.interim(" The quick brown fox jumped over") == " fox"
    delta, transcript = a.final(" The quick brown fox jumped over the lazy dog.")
    assert delta == " jumped over the lazy dog."
    assert transcript == "The quick brown fox jumped over the lazy dog."


def test_agreement_ignores_case_and_punctuation_but_keeps_what_was_sent() -> None:
    deltas, transcript, _ = run([" Hello world", " hello, world and"], " Hello world, and more.")
    assert deltas[0] == "hello, world"  # sent in the newer decode's spelling
    assert transcript == "hello, world and more."
    assert "".join(deltas) == transcript


def test_a_final_that_starts_with_the_sent_words_is_the_transcript() -> None:
    _deltas, transcript, _ = run([" one two three", " one two three four"],
                                " one two three four five six")
    assert transcript == "one two three four five six"


def test_the_final_decode_dropping_a_sent_word_does_not_take_it_back() -> None:
    deltas, transcript, _ = run([" I think that we", " I think that we should"],
                                " I think we should go.")
    assert transcript.startswith("I think that we")
    assert transcript == "I think that we should go."
    assert "".join(deltas) == transcript


def test_a_respelled_sent_word_is_not_repeated() -> None:
    # sent "colour scheme"; the final says "color scheme is nice": the substitution is aligned
    _deltas, transcript, _ = run([" the colour scheme", " the colour scheme is"],
                                " the color scheme is nice")
    assert transcript == "the colour scheme is nice"


def test_a_final_with_nothing_new_or_nothing_at_all_keeps_the_sent_text() -> None:
    assert run([" a b c", " a b c"], " a b c")[1] == "a b c"
    deltas, transcript, _ = run([" a b c", " a b c"], "")
    assert transcript == "a b c" and "".join(deltas) == transcript
    assert run([], "")[1] == ""
    assert run([], " Hi.") == (["Hi."], "Hi.", [])


def test_aligned_tail() -> None:
    assert aligned_tail([], words(" x y")) == [" x", " y"]
    assert aligned_tail(words(" a b"), words(" a b c")) == [" c"]
    assert aligned_tail(words(" a b c d"), words(" a b x y z")) == [" z"]  # c d ~ x y
    assert aligned_tail(words(" a b c"), words(" a b")) == []
    assert aligned_tail(words(" a c"), words(" a b c d")) == [" d"]  # b inserted inside
    assert key("Hello,") == key("hello") and key("-") == "-"


def test_cjk_characters_are_words() -> None:
    assert words("我们今天") == ["我", "们", "今", "天"]
    deltas, transcript, _ = run(["我们今", "我们今天"], "我们今天好")
    assert transcript == "我们今天好" and "".join(deltas) == transcript


def _perturb(rng: random.Random, ws: list[str]) -> list[str]:
    out = list(ws)
    for _ in range(rng.randint(0, 3)):
        op = rng.choice("dirc")
        i = rng.randrange(len(out) + 1)
        if op == "d" and out:
            out.pop(min(i, len(out) - 1))
        elif op == "i":
            out.insert(i, rng.choice([" um", " the", " X", " ,"]))
        elif op == "r" and out:
            out[min(i, len(out) - 1)] = rng.choice([" Foo", " bar.", " baz"])
        elif op == "c" and out:
            j = min(i, len(out) - 1)
            out[j] = out[j].upper() + rng.choice(["", ",", "."])
    return out


def test_adversarial_decode_sequences_never_contradict_and_always_join() -> None:
    """Random growing hypotheses with drops, insertions, substitutions and re-spellings (and a
    final that may disagree with everything): every delta extends the shown text, the deltas
    join to the transcript, and the transcript starts with whatever was shown."""
    rng = random.Random(34)
    vocab = [f" w{k}" for k in range(12)]
    for _ in range(3000):
        truth = [rng.choice(vocab) for _ in range(rng.randint(0, 14))]
        interims = []
        for n in range(1, len(truth) + 1, rng.randint(1, 3)):
            hyp = truth[:n] if rng.random() < 0.6 else _perturb(rng, truth[:n])
            interims.append("".join(hyp))
        final_words = truth if rng.random() < 0.5 else _perturb(rng, truth)
        if rng.random() < 0.1:
            final_words = [rng.choice(vocab) for _ in range(rng.randint(0, 5))]
        final = "".join(final_words)
        deltas, transcript, shown = run(interims, final)
        assert "".join(deltas) == transcript
        assert all(transcript.startswith(s) for s in shown)
        assert not transcript.startswith(" ")
        assert all(d for d in deltas)
        if shown and [key(w) for w in words(final)][:len(words(shown[-1]))] == \
                [key(w) for w in words(shown[-1])]:
            # the final extends what was shown: the transcript is the final decode
            assert [key(w) for w in words(transcript)] == [key(w) for w in words(final)]


def test_a_decode_of_nearly_the_same_audio_is_no_second_opinion() -> None:
    """Two reads of ~1 s of "Montreal" both said "Montreal. Montreal." (an early final 0.12 s
    after an interim): they agree with each other, not with the speech. A decode confirms the
    one before it only after MIN_NEW_AUDIO_S more audio; closer, it replaces that one's tail."""
    a = Agreement()
    assert a.interim(" Montreal. Montreal.", 1.04) == ""
    assert a.interim(" Montreal. Montreal.", 1.16) == ""  # 0.12 s on: nothing sent
    assert a.interim(" Montreal, uh", 1.9) == "Montreal,"  # agrees with the 1.16 s read
    delta, transcript = a.final(" Montreal, uh, uh.")
    assert transcript == "Montreal, uh, uh." and delta == " uh, uh."
    b = Agreement()  # without lengths (or far enough apart) agreement is as before
    assert b.interim(" Montreal. Montreal.") == ""
    assert b.interim(" Montreal. Montreal.") == "Montreal. Montreal."
