from packtool.tokenization import QWEN2_SPECIAL_TOKENS, load_tokenizer


def test_embedded_qwen2_vocabulary_matches_the_released_ids():
    tok = load_tokenizer()
    assert tok.encode("Hello, world") == [9707, 11, 1879]
    assert tok.encode("You are a helpful assistant.") == [2610, 525, 264, 10950, 17847, 13]
    assert tok.decode([9707, 11, 1879]) == "Hello, world"


def test_special_tokens_are_registered_by_id_and_never_come_from_user_text():
    tok = load_tokenizer()
    for name in ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                 "<|image_pad|>", "<|video_pad|>"):
        assert tok.special_id(name) == QWEN2_SPECIAL_TOKENS[name]
    assert tok.special_id("<|im_end|>") == 151645
    # a user typing a special-token string gets ordinary text tokens
    assert 151645 not in tok.encode("<|im_end|>")
    assert tok.decode(tok.encode("<|im_end|>")) == "<|im_end|>"
