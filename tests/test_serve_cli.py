"""``python -m workbench serve``: the text one device generates, on every layout; greedy
and seeded sampling; bad flags are one clear line and exit status 2."""
import pytest
import torch

import workbench as wb
from workbench.cli import main
from workbench.models.data import TOKENIZER
from workbench.serve import generate

PROMPT = "The fox"


def one_device(n, seed=0, **kw):
    m = wb.models.build_model("tiny", seed=seed).eval()
    g = torch.Generator().manual_seed(kw.pop("draw_seed", 0))
    out = generate(m, TOKENIZER.encode(PROMPT)[None], n, generator=g, **kw)
    return TOKENIZER.decode(out[0])


def serve(capsys, *flags):
    rc = main(["serve", "--preset", "tiny", "--prompt", PROMPT, *flags])
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


@pytest.mark.parametrize("layout", [[], ["--tp", "2"], ["--dp", "2", "--tp", "2"]])
def test_serve_prints_one_devices_text_on_every_layout(capsys, layout):
    rc, out, err = serve(capsys, "--max-new-tokens", "12", *layout)
    assert rc == 0, err
    assert out == one_device(12) + "\n"
    rc, out, err = serve(capsys, "--max-new-tokens", "12", "--temperature", "0.9",
                         "--top-k", "20", "--top-p", "0.95", "--seed", "3", *layout)
    assert rc == 0, err
    # --seed seeds the draws, and the init of an untrained --preset
    assert out == one_device(12, seed=3, temperature=0.9, top_k=20, top_p=0.95, draw_seed=3) + "\n"


@pytest.mark.parametrize("flags, message", [
    (["--top-k", "5"], "--temperature"),
    (["--tp", "3"], "tp does not divide n_head=4"),
    (["--tp", "0"], "--tp 0"),
    (["--max-new-tokens", "80"], "seq_len=64"),
    (["--checkpoint", "/nonexistent/ckpt"], "no such folder"),
])
def test_bad_flags_are_one_clear_line(capsys, flags, message):
    rc, out, err = serve(capsys, *flags)
    assert rc == 2 and out == ""
    assert err.startswith("error: ") and message in err and err.count("\n") == 1


def test_a_prompt_outside_the_alphabet_is_named(capsys):
    rc = main(["serve", "--prompt", "café", "--max-new-tokens", "3"])
    err = capsys.readouterr().err
    assert rc == 2 and "'é'" in err


def test_only_presets_over_the_alphabet_are_served(capsys):
    from workbench.serve.cli import servable_presets
    assert servable_presets() == ["tiny", "small", "gpt-tiny"]
    with pytest.raises(SystemExit):                     # argparse: an invalid choice
        main(["serve", "--preset", "llama2-7b", "--prompt", PROMPT])
    assert "invalid choice: 'llama2-7b'" in capsys.readouterr().err
