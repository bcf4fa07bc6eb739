"""The command line (issue 26, item 3): ``qlinear quantize|convert|eval|info``, ``python -m qlinear`` and ``optimum-cli
qlinear``, run in subprocesses on a tiny Llama with a word-level tokenizer built from gensim's Lee corpus (the help
and error cases call ``qlinear.cli.main`` in this process).  Each command's result is checked against the same work
done in this process."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import torch

import qlinear
from qlinear import QLinearConfig, QuantLinear
from qlinear.cli import main, parser
from qlinear.evaluation import calibration_texts, perplexity
from qlinear.formats import get_format

transformers = pytest.importorskip("transformers")
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

pytestmark = pytest.mark.slow


def _run(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "qlinear", *map(str, args)], capture_output=True, text=True, cwd=cwd)


def _run_here(capsys, *args) -> tuple[int, str, str]:
    """``(exit status, stdout, stderr)`` of ``qlinear.cli.main`` in this process (``python -m qlinear`` exits with
    what it returns; argparse's errors and ``--help`` raise SystemExit): the subprocess tests above cover the entry
    points, these the commands' own handling without the cost of an interpreter each."""
    try:
        code = main([str(a) for a in args])
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture(scope="module")
def float_ckpt(tmp_path_factory):
    """(folder of a tiny float Llama + tokenizer, text file of 40 news articles)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, PreTrainedTokenizerFast

    root = tmp_path_factory.mktemp("cli")
    texts = calibration_texts(40)
    words = sorted({w for t in texts for w in t.split()})
    tk = Tokenizer(models.WordLevel({w: i for i, w in enumerate(["[UNK]"] + words)}, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="[UNK]", eos_token="[UNK]").save_pretrained(root / "fp")
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=len(words) + 1)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(root / "fp")
    (root / "text.txt").write_text("\n\n".join(texts))
    return root / "fp", root / "text.txt"


def test_help_documents_every_option(capsys):
    subs = parser()._subparsers._group_actions[0].choices
    assert set(subs) == {"quantize", "convert", "eval", "info"}
    for name, p in subs.items():
        for action in p._actions:
            assert action.help, (name, action.dest)
        code, out, _ = _run_here(capsys, name, "--help")
        assert code == 0
        assert all(o in out for a in p._actions for o in a.option_strings), out
    out = _run("--help")
    assert out.returncode == 0 and all(name in out.stdout for name in subs), out.stdout


def test_quantize_eval_info_match_the_library(float_ckpt, tmp_path):
    fp, text = float_ckpt
    out = _run("quantize", fp, tmp_path / "q", "--bits", "3", "--group-size", "32", "--option", "iters=2",
               "--no-progress")
    assert out.returncode == 0, out.stderr[-3000:]
    config = QLinearConfig("bcq", bits=3, group_size=32, iters=2)
    ref = AutoModelForCausalLM.from_pretrained(fp)
    qlinear.replace_linear(ref, config, progress=False)
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "q")
    tokens = torch.randint(0, 100, (1, 12))
    with torch.no_grad():
        assert torch.equal(saved(tokens).logits, ref(tokens).logits)
    layers = [m for m in saved.modules() if isinstance(m, QuantLinear)]
    bits = sum(m.bits_per_weight * m.in_features * m.out_features for m in layers) / sum(
        m.in_features * m.out_features for m in layers)
    assert f"{len(layers)} quantized layers" in out.stdout and f"{bits:.4f} stored bits per weight" in out.stdout
    assert json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]["quant_method"] == "qlinear"

    out = _run("eval", tmp_path / "q", "--text", text, "--max-tokens", "1024", "--window", "128")
    assert out.returncode == 0, out.stderr[-3000:]
    want = perplexity(saved, AutoTokenizer.from_pretrained(tmp_path / "q"), text.read_text(), max_tokens=1024,
                      window=128)
    assert re.search(r"perplexity ([\d.]+) over 8 windows of 128 tokens", out.stdout).group(1) == f"{want:.4f}"

    out = subprocess.run(["optimum-cli", "qlinear", "info", tmp_path / "q"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [r for r in out.stdout.splitlines() if r.startswith("| model.")]
    assert [r.split(" | ")[0][2:] for r in rows] == [n for n, m in saved.named_modules() if isinstance(m, QuantLinear)]
    assert all(f"| {m.bits_per_weight:.3f} |" in r for r, m in zip(rows, layers))


def test_quantize_with_calibration_text(float_ckpt, tmp_path, capsys):
    fp, text = float_ckpt
    out = _run("quantize", fp, tmp_path / "q", "--option", "method=gptq", "--option", "act_order=true",
               "--calibration", text, "--calibration-samples", "8", "--calibration-length", "64", "--no-progress")
    assert out.returncode == 0, out.stderr[-3000:]
    q = AutoModelForCausalLM.from_pretrained(tmp_path / "q").model.layers[0].mlp.down_proj
    assert q.config.method == "gptq" and q.config.act_order and "perm" in q.buffer_specs
    # the same, then the scales distilled from the float model: codes kept, scales moved
    code, _, err = _run_here(capsys, "quantize", fp, tmp_path / "ft", "--option", "method=gptq", "--option",
                             "act_order=true", "--calibration", text, "--calibration-samples", "8",
                             "--calibration-length", "64", "--finetune-steps", "3", "--no-progress")
    assert code == 0, err[-3000:]
    ft = AutoModelForCausalLM.from_pretrained(tmp_path / "ft").model.layers[0].mlp.down_proj
    a, b = q.canonical(), ft.canonical()
    assert all(torch.equal(a[k], b[k]) for k in a if k != "scales") and not torch.equal(a["scales"], b["scales"])


def test_quantize_lm_head_bits_quantizes_the_output_layer_per_row(float_ckpt, tmp_path, capsys):
    fp, _ = float_ckpt
    code, _, err = _run_here(capsys, "quantize", fp, tmp_path / "q", "--lm-head-bits", "8", "--skip", "lm_head",
                             "--skip", "*.down_proj", "--no-progress")
    assert code == 0, err[-3000:]
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "q")
    head = saved.lm_head
    assert isinstance(head, QuantLinear) and (head.config.bits, head.config.group_size) == (8, -1)
    assert not isinstance(saved.model.layers[0].mlp.down_proj, QuantLinear)  # the other skips kept
    head8 = QLinearConfig("bcq", bits=8, group_size=-1, init="uniform", iters=0)
    ref = qlinear.replace_linear(AutoModelForCausalLM.from_pretrained(fp), QLinearConfig(
        "bcq", modules_to_not_convert=["*.down_proj"], per_module={"lm_head": head8}), progress=False)
    tokens = torch.randint(0, 100, (1, 12))
    with torch.no_grad():
        assert torch.equal(saved(tokens).logits, ref(tokens).logits)
    assert _run_here(capsys, "quantize", fp, tmp_path / "bad", "--lm-head-bits", "4")[0] == 2  # 8 only


def test_quantize_skip_adds_to_lm_head(float_ckpt, tmp_path, capsys):
    """A --skip pattern keeps its modules float as well as lm_head (it once replaced the default and quantized the
    output layer at the main format's bits)."""
    fp, _ = float_ckpt
    code, _, err = _run_here(capsys, "quantize", fp, tmp_path / "q", "--skip", "*.o_proj", "--no-progress")
    assert code == 0, err[-3000:]
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "q")
    assert not isinstance(saved.lm_head, QuantLinear)
    assert not isinstance(saved.model.layers[0].self_attn.o_proj, QuantLinear)
    assert isinstance(saved.model.layers[0].self_attn.q_proj, QuantLinear)


def test_finetune_without_calibration_distils_on_the_models_own_samples(float_ckpt, tmp_path, capsys):
    fp, _ = float_ckpt
    for out, extra in (("q", ()), ("ft", ("--finetune-steps", "3", "--calibration-samples", "4",
                                          "--calibration-length", "16"))):
        code, _, err = _run_here(capsys, "quantize", fp, tmp_path / out, "--no-progress", *extra)
        assert code == 0, err[-3000:]
    q, ft = (AutoModelForCausalLM.from_pretrained(tmp_path / d).model.layers[0].mlp.down_proj for d in ("q", "ft"))
    tunable = get_format(q.format).TUNABLE
    a, b = q.canonical(), ft.canonical()
    assert all(torch.equal(a[k], b[k]) for k in a if k not in tunable)
    assert any(not torch.equal(a[k], b[k]) for k in a if k in tunable)


@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_convert_eval_info_read_gptq_and_awq_checkpoints(float_ckpt, tmp_path, capsys, method):
    fp, text = float_ckpt
    model = AutoModelForCausalLM.from_pretrained(fp)
    qlinear.replace_linear(model, QLinearConfig("bcq", bits=4, group_size=32, init="uniform", iters=0),
                           progress=False)
    getattr(qlinear, f"save_{method}")(model, tmp_path / method)
    AutoTokenizer.from_pretrained(fp).save_pretrained(tmp_path / method)
    want = getattr(qlinear, f"load_{method}")(tmp_path / method, dtype=torch.float32)

    code, out, err = _run_here(capsys, "convert", tmp_path / method, tmp_path / "q", "--dtype", "float32")
    assert code == 0, err[-3000:]
    assert f"({method.upper()}) -> {tmp_path / 'q'}" in out and "14 quantized layers" in out
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "q")
    tokens = torch.randint(0, 100, (1, 12))
    with torch.no_grad():
        assert torch.equal(saved(tokens).logits, want(tokens).logits)
    assert AutoTokenizer.from_pretrained(tmp_path / "q").vocab == AutoTokenizer.from_pretrained(fp).vocab

    code, out, err = _run_here(capsys, "eval", tmp_path / method, "--text", text, "--max-tokens", "512", "--window",
                               "128")
    assert code == 0, err[-3000:]
    ppl = perplexity(want, AutoTokenizer.from_pretrained(fp), text.read_text(), max_tokens=512, window=128)
    assert re.search(r"perplexity ([\d.]+) over 4 windows", out).group(1) == f"{ppl:.4f}"
    code, out, err = _run_here(capsys, "info", tmp_path / method)
    assert code == 0 and len([r for r in out.splitlines() if r.startswith("| model.")]) == 14, err[-3000:]

    if method == "awq":  # this vocabulary (2671 words) does not fit AWQ's 8 columns per word
        return
    qlinear.replace_linear(model, QLinearConfig("bcq", bits=4, group_size=32, init="uniform", iters=0,
                                                modules_to_not_convert=[]), progress=False)  # lm_head too
    qlinear.save_gptq(model, tmp_path / "lm_head")  # GPTQModel's lm_head=True: the output layer stays quantized
    want = qlinear.load_gptq(tmp_path / "lm_head", dtype=torch.float32)
    code, out, err = _run_here(capsys, "convert", tmp_path / "lm_head", tmp_path / "q2", "--dtype", "float32")
    assert code == 0 and "15 quantized layers" in out, err[-3000:]
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "q2")
    assert isinstance(saved.lm_head, QuantLinear) and not saved.config.tie_word_embeddings
    with torch.no_grad():
        assert torch.equal(saved(tokens).logits, want(tokens).logits)


def _without_tokenizer(src, dst):
    dst.mkdir()
    for name in ("config.json", "model.safetensors"):
        (dst / name).write_bytes((src / name).read_bytes())
    return dst


def test_quantize_needs_no_tokenizer_without_calibration(float_ckpt, tmp_path, capsys):
    code, out, err = _run_here(capsys, "quantize", _without_tokenizer(float_ckpt[0], tmp_path / "fp"), tmp_path / "q",
                               "--bits", "4", "--group-size", "32", "--no-progress")
    assert code == 0 and "(no tokenizer)" in out, err[-3000:]
    assert not (tmp_path / "q" / "tokenizer.json").exists()
    assert any(isinstance(m, QuantLinear) for m in AutoModelForCausalLM.from_pretrained(tmp_path / "q").modules())


@pytest.mark.parametrize("args, code, message", [
    (["quantize", "missing", "out"], 2, "is not a transformers checkpoint folder"),
    (["quantize", "{fp}", "out", "--option", "bits"], 2, "expected KEY=VALUE"),
    (["quantize", "{fp}", "out", "--bits", "9"], 1, "qlinear: error: BCQ bits must be in 1..8, got 9"),
    (["quantize", "{fp}", "out", "--option", "colour=red"], 1, "qlinear: error: .*colour"),
    (["quantize", "{fp}", "out", "--option", "bits=3"], 2, "bits has its own option: use --bits"),
    (["quantize", "{fp}", "out", "--option", "group-size=32"], 2, "group_size has its own option: use --group-size"),
    (["quantize", "{notok}", "out", "--calibration", "{text}"], 1, "qlinear: error: --calibration texts need the "
                                                                   "tokenizer of"),
    (["eval", "{fp}", "--text", "nothing.txt"], 2, "no such text file"),
    (["info", "{fp}"], 1, "qlinear: error: .* has no qlinear layers"),
    (["convert", "{fp}", "out"], 1, "qlinear: error: .* is not a GPTQ or AWQ checkpoint"),
    (["info", "{damaged}"], 1, "qlinear: error: .*(header|deserializ)"),
    (["quantize", "{fp}", "out", "--finetune-steps", "3", "--calibration-length", "4"], 2, "at least 5"),
])
def test_errors_exit_with_a_message_and_no_traceback(float_ckpt, tmp_path, monkeypatch, capsys, args, code, message):
    monkeypatch.chdir(tmp_path)
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    (damaged / "config.json").write_text((float_ckpt[0] / "config.json").read_text())
    (damaged / "model.safetensors").write_bytes((float_ckpt[0] / "model.safetensors").read_bytes()[:100])
    notok = _without_tokenizer(float_ckpt[0], tmp_path / "notok")
    got, _, err = _run_here(capsys, *[a.format(fp=float_ckpt[0], damaged=damaged, notok=notok, text=float_ckpt[1])
                                      for a in args])  # uncaught: fails
    assert got == code and re.search(message, err), err
    assert not (tmp_path / "out").exists()


def test_an_error_exits_the_interpreter_with_its_status(tmp_path):
    out = _run("quantize", "missing", "out", cwd=tmp_path)
    assert out.returncode == 2 and "is not a transformers checkpoint folder" in out.stderr
    assert "Traceback" not in out.stderr and not (tmp_path / "out").exists()
