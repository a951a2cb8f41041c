"""ferryman.tiny: the locally built tiny Qwen2 model, its tokenizer and chat template."""

from __future__ import annotations

import json

import pytest

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

from ferryman.tiny import (  # noqa: E402
    MARKER_FILE,
    SPECIAL_TOKENS,
    TAG_TOKENS,
    build_tiny_model,
    min_vocab_size,
    tiny_corpus,
)

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Add two integers.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
        },
    }
]

CONVERSATION = [
    {"role": "system", "content": "You are a careful calculator."},
    {"role": "user", "content": "What is 3 plus 4?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"type": "function", "function": {"name": "calculator", "arguments": {"a": 3, "b": 4}}}],
    },
    {"role": "tool", "content": "7"},
    {
        "role": "assistant",
        "content": "Let me check twice.",
        "tool_calls": [
            {"type": "function", "function": {"name": "calculator", "arguments": '{"a": 4, "b": 3}'}},
            {"name": "calculator", "arguments": {"a": 3, "b": 4}},
        ],
    },
    {"role": "tool", "content": "7"},
    {"role": "tool", "content": '{"result": 7}'},
    {"role": "assistant", "content": "The answer is 7."},
    {"role": "user", "content": "Repeat the digit 5."},
    {"role": "assistant", "content": "5"},
]


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="session")
def tok(tiny_dir):
    return transformers.AutoTokenizer.from_pretrained(tiny_dir)


@pytest.fixture(scope="session")
def model(tiny_dir):
    return transformers.AutoModelForCausalLM.from_pretrained(tiny_dir).eval()


def render(tok, messages, tools=None, gen=False) -> str:
    return tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=gen)


def test_loads_back(tiny_dir, tok, model):
    cfg = model.config
    assert cfg.model_type == "qwen2"
    assert cfg.vocab_size == len(tok) == 160
    assert cfg.hidden_size == 64 and cfg.num_hidden_layers == 2
    assert cfg.num_attention_heads == 4 and cfg.num_key_value_heads == 2
    assert cfg.max_position_embeddings == 512
    assert cfg.tie_word_embeddings
    assert model.dtype == torch.float32
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    assert cfg.eos_token_id == tok.eos_token_id == model.generation_config.eos_token_id
    assert cfg.pad_token_id == tok.pad_token_id == model.generation_config.pad_token_id
    assert tok.chat_template
    assert (tiny_dir / "generation_config.json").is_file()
    info = json.loads((tiny_dir / MARKER_FILE).read_text())
    assert info["args"]["vocab_size"] == 160 and info["args"]["seed"] == 0


def test_digits_are_single_tokens(tok):
    digit_ids = []
    for d in "0123456789":
        ids = tok.encode(d, add_special_tokens=False)
        assert len(ids) == 1, (d, ids)
        digit_ids.append(ids[0])
    assert len(set(digit_ids)) == 10
    # inside text, numbers split digit by digit and reuse the same ids
    ids = tok.encode("Repeat the digit 7. What is 123 plus 45?", add_special_tokens=False)
    for d in "712345":
        assert digit_ids[int(d)] in ids
    assert tok.encode("2024", add_special_tokens=False) == [digit_ids[i] for i in (2, 0, 2, 4)]
    assert tok.decode(tok.encode("What is 3 plus 4?", add_special_tokens=False)) == "What is 3 plus 4?"


def test_special_and_tag_tokens(tok):
    for i, t in enumerate(SPECIAL_TOKENS):
        assert tok.convert_tokens_to_ids(t) == i
    for t in TAG_TOKENS:
        ids = tok.encode(t, add_special_tokens=False)
        assert len(ids) == 1 and ids[0] >= 160 - len(TAG_TOKENS)
    text = '<tool_call>\n{"name": "calculator", "arguments": {"a": 1}}\n</tool_call><|im_end|>'
    ids = tok.encode(text, add_special_tokens=False)
    assert ids[-1] == tok.eos_token_id
    # the tags survive skip_special_tokens (as in Qwen2.5), the ChatML specials do not
    assert tok.decode(ids, skip_special_tokens=True) == text.removesuffix("<|im_end|>")
    assert tok.decode(ids) == text


def test_corpus_contents():
    corpus = tiny_corpus(["a very particular extra line"])
    text = "\n".join(corpus)
    for phrase in ("Repeat the digit 7.", "What is 3 plus 4?", "The answer is", '"name": "calculator"'):
        assert phrase in text
    assert corpus[-1] == "a very particular extra line"
    assert tiny_corpus() == tiny_corpus()


def test_template_plain_chat(tok):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say 3."}]
    assert render(tok, msgs, gen=True) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nSay 3.<|im_end|>\n<|im_start|>assistant\n"
    )
    assert render(tok, msgs[1:]) == "<|im_start|>user\nSay 3.<|im_end|>\n"


def test_template_tools_calls_and_responses(tok):
    text = render(tok, CONVERSATION[:8], tools=TOOLS)
    # the tools block is the system turn, with the given system prompt first
    assert text.startswith("<|im_start|>system\nYou are a careful calculator.\n\n# Tools\n")
    assert "<tools>\n" + json.dumps(TOOLS[0]) + "\n</tools>" in text
    assert "To call one, answer with:\n<tool_call>\n" in text
    assert text.count("<|im_start|>system") == 1
    # first assistant turn: no content, one call (dict arguments rendered as JSON)
    assert (
        '<|im_start|>assistant\n<tool_call>\n{"name": "calculator", "arguments": {"a": 3, "b": 4}}\n'
        "</tool_call><|im_end|>\n" in text
    )
    # second: content, then two calls on their own lines (string arguments kept verbatim)
    assert (
        "<|im_start|>assistant\nLet me check twice.\n"
        '<tool_call>\n{"name": "calculator", "arguments": {"a": 4, "b": 3}}\n</tool_call>\n'
        '<tool_call>\n{"name": "calculator", "arguments": {"a": 3, "b": 4}}\n</tool_call><|im_end|>\n' in text
    )
    # a single tool response, and two consecutive ones sharing one user turn
    assert "<|im_start|>user\n<tool_response>\n7\n</tool_response><|im_end|>\n" in text
    assert (
        "<|im_start|>user\n<tool_response>\n7\n</tool_response>\n"
        '<tool_response>\n{"result": 7}\n</tool_response><|im_end|>\n<|im_start|>assistant\nThe answer is 7.' in text
    )
    # default system prompt when tools come without a system message
    assert render(tok, CONVERSATION[1:2], tools=TOOLS).startswith(
        "<|im_start|>system\nYou are a helpful assistant.\n\n# Tools"
    )
    # the rendered text tokenizes with the tags and specials as single tokens
    ids = tok.encode(text, add_special_tokens=False)
    assert ids.count(tok.convert_tokens_to_ids("<tool_call>")) == 4  # 3 calls + the instructions
    assert len(ids) < 512
    assert ids.count(tok.convert_tokens_to_ids("<tool_response>")) == 3


def test_template_generation_prompt_after_tools(tok):
    text = render(tok, CONVERSATION[:7], tools=TOOLS, gen=True)
    assert text.endswith('{"result": 7}\n</tool_response><|im_end|>\n<|im_start|>assistant\n')


@pytest.mark.parametrize("tools", [None, TOOLS])
def test_template_prefix_property(tok, tools):
    rendered = [render(tok, CONVERSATION[:k], tools=tools) for k in range(1, len(CONVERSATION) + 1)]
    for k in range(len(rendered) - 1):
        assert rendered[k + 1].startswith(rendered[k]), f"messages[:{k + 1}] is not a prefix of messages[:{k + 2}]"
    # the generation prompt is a prefix of the rendering that includes the assistant reply
    for k, msg in enumerate(CONVERSATION):
        if msg["role"] == "assistant" and k > 0:
            prompt = render(tok, CONVERSATION[:k], tools=tools, gen=True)
            assert rendered[k].startswith(prompt), f"generation prompt before message {k}"
    # and it holds at the token level too (the agent loop appends token deltas)
    ids = [tok.encode(r, add_special_tokens=False) for r in rendered]
    for k in range(len(ids) - 1):
        assert ids[k + 1][: len(ids[k])] == ids[k]


def test_generation(tok, model):
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "Repeat the digit 7."}], add_generation_prompt=True, tokenize=False
    )
    enc = tok(prompt, return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=6, do_sample=False)
        logits = model(**enc).logits
    assert out.shape == (1, enc["input_ids"].shape[1] + 6) or out[0, -1] == tok.eos_token_id
    assert logits.shape == (1, enc["input_ids"].shape[1], 160)
    assert torch.isfinite(logits).all()
    # the first generated token is the argmax of the last position
    assert out[0, enc["input_ids"].shape[1]].item() == logits[0, -1].argmax().item()
    assert isinstance(tok.decode(out[0]), str)


def test_idempotent_deterministic_and_rebuilt(tiny_dir, tmp_path):
    marker = tiny_dir / MARKER_FILE
    weights = tiny_dir / "model.safetensors"
    before = (marker.stat().st_mtime_ns, weights.stat().st_mtime_ns)
    assert build_tiny_model(tiny_dir) == tiny_dir
    assert (marker.stat().st_mtime_ns, weights.stat().st_mtime_ns) == before

    same = build_tiny_model(tmp_path / "same")
    for name in ("model.safetensors", "tokenizer.json", "config.json", "chat_template.jinja"):
        assert (same / name).read_bytes() == (tiny_dir / name).read_bytes(), name
    other = build_tiny_model(tmp_path / "other", seed=1)
    assert (other / "model.safetensors").read_bytes() != weights.read_bytes()
    assert (other / "tokenizer.json").read_bytes() == (tiny_dir / "tokenizer.json").read_bytes()

    # other arguments in the same directory: rebuilt in place
    rebuilt = build_tiny_model(tmp_path / "same", hidden_size=32, num_layers=1, extra_corpus=["zebra zebra zebra"])
    cfg = transformers.AutoConfig.from_pretrained(rebuilt)
    assert (cfg.hidden_size, cfg.num_hidden_layers) == (32, 1)
    assert json.loads((rebuilt / MARKER_FILE).read_text())["args"]["hidden_size"] == 32
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no leftovers


def test_refuses_foreign_directory_and_bad_args(tmp_path):
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError):
        build_tiny_model(foreign)
    assert (foreign / "notes.txt").read_text() == "mine"
    with pytest.raises(ValueError, match="vocab_size"):
        build_tiny_model(tmp_path / "small", vocab_size=min_vocab_size() - 1)
    with pytest.raises(ValueError, match="num_kv_heads"):
        build_tiny_model(tmp_path / "heads", num_heads=4, num_kv_heads=3)
    # an existing empty directory is fine
    empty = tmp_path / "empty"
    empty.mkdir()
    assert (build_tiny_model(empty, hidden_size=32, num_layers=1) / "config.json").is_file()


def test_init_std_controls_greedy_variety(tmp_path, tok):
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "Say 4."}], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    varied = transformers.AutoModelForCausalLM.from_pretrained(build_tiny_model(tmp_path / "v", init_std=0.2))
    with torch.no_grad():
        out = varied.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)[0, len(prompt) :]
    assert len(set(out.tolist())) > 2
    with pytest.raises(ValueError, match="init_std"):
        build_tiny_model(tmp_path / "bad", init_std=0.0)


# ----------------------------------------------------------------------------- shape presets


def test_presets_match_the_config_literal():
    import typing

    from ferryman.config import TinyPreset
    from ferryman.tiny import SHAPE_PRESETS

    assert set(typing.get_args(TinyPreset)) == set(SHAPE_PRESETS)


@pytest.mark.parametrize(
    "preset,cls,expect",
    [
        # numbers of the released config.json files (hidden, MLP, heads, kv heads, tied, head_dim)
        ("qwen2.5-0.5b", "Qwen2ForCausalLM", (896, 4864, 14, 2, True, 64)),
        # (qwen3-1.7b: test_cli_tiny_model_preset)
    ],
)
def test_preset_shrunk_to_one_layer_has_the_real_width(tmp_path, preset, cls, expect):
    """Built with one layer (the real width, so a CPU can hold it): the saved config has the
    preset's numbers, the model loads back as the right class, and the vocabulary is the tiny one."""
    path = build_tiny_model(tmp_path / preset, preset=preset, num_layers=1)
    cfg = transformers.AutoConfig.from_pretrained(path)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    got = (cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.tie_word_embeddings, head_dim)
    assert got == expect
    assert cfg.num_hidden_layers == 1
    assert cfg.rope_parameters["rope_theta"] == 1e6
    model = transformers.AutoModelForCausalLM.from_pretrained(path)
    assert type(model).__name__ == cls
    tok = transformers.AutoTokenizer.from_pretrained(path)
    assert model.get_input_embeddings().weight.shape == (len(tok), expect[0])
    out = model(torch.tensor([tok.encode("Count up from 3.")])).logits
    assert out.shape[-1] == len(tok) and torch.isfinite(out).all()
    marker = json.loads((path / MARKER_FILE).read_text())["args"]
    assert marker["preset"] == preset and marker["num_layers"] == 1
    assert build_tiny_model(tmp_path / preset, preset=preset, num_layers=1) == path  # reused as is


def test_full_7b_preset_numbers_without_allocating(tmp_path):
    """The whole 7B shape is checked on the meta device (no memory): untied LM head, 28 layers,
    and the parameter count of Qwen2.5-7B less its vocabulary."""
    from ferryman.tiny import SHAPE_PRESETS, _preset_config

    shape = SHAPE_PRESETS["qwen2.5-7b"]
    args = {"preset": "qwen2.5-7b", "num_layers": shape.num_layers, "init_std": 0.02}
    cfg = _preset_config(args, n_vocab=160, max_positions=shape.max_positions, ids={})
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    n = sum(p.numel() for p in model.parameters())
    # Qwen2.5-7B has 7.61e9 parameters, 2 x 152064 x 3584 of them embeddings and LM head
    assert n - 2 * 160 * 3584 == pytest.approx(7_615_616_512 - 2 * 152064 * 3584, abs=0)
    assert not cfg.tie_word_embeddings


def test_preset_refuses_a_width_and_unknown_names(tmp_path):
    with pytest.raises(ValueError, match="fixes hidden_size"):
        build_tiny_model(tmp_path / "x", preset="qwen2.5-0.5b", hidden_size=64)
    with pytest.raises(ValueError, match="unknown preset 'qwen9'"):
        build_tiny_model(tmp_path / "x", preset="qwen9")
    assert not (tmp_path / "x").exists()


def test_model_config_preset_fields():
    from ferryman.config import ConfigError, load_config

    cfg, _ = load_config(None, ["model.tiny_preset=qwen2.5-0.5b", "model.tiny_num_layers=1", "model.tiny_dtype=bfloat16"])
    assert cfg.model.tiny_build_kwargs(3) == {
        "vocab_size": 160, "init_std": 0.02, "seed": 3, "preset": "qwen2.5-0.5b", "dtype": "bfloat16", "num_layers": 1,
    }
    with pytest.raises(ConfigError, match="model: .*tiny_hidden_size"):
        load_config(None, ["model.tiny_preset=qwen2.5-0.5b", "model.tiny_hidden_size=128"])
    with pytest.raises(ConfigError, match="model.tiny_preset"):
        load_config(None, ["model.tiny_preset=qwen9"])


def test_cli_tiny_model_preset(tmp_path, capsys):
    from ferryman.cli import main

    assert main(["tiny-model", str(tmp_path / "m"), "--preset", "qwen3-1.7b", "--num-layers", "1", "--dtype", "bfloat16"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["preset"] == "qwen3-1.7b" and out["vocab_size"] == 160
    cfg = transformers.AutoConfig.from_pretrained(tmp_path / "m")
    got = (cfg.model_type, cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim)
    assert got == ("qwen3", 2048, 6144, 16, 8, 128) and cfg.num_hidden_layers == 1 and cfg.tie_word_embeddings
    assert cfg.dtype in (torch.bfloat16, "bfloat16")
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "m")
    assert type(model).__name__ == "Qwen3ForCausalLM" and model.dtype == torch.bfloat16
    # a width with a preset is refused with one line, not a traceback
    assert main(["tiny-model", str(tmp_path / "x"), "--preset", "qwen3-0.6b", "--hidden-size", "64"]) == 2
    assert "fixes hidden_size" in capsys.readouterr().err
